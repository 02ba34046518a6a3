/// @file
/// Tiers below a prefix cache (docs/tiers.md): stores (block_store_i: a directory, Redis) that a kv_cache,
/// a memory_recurrent or a memory_hybrid writes blocks (or snapshots) to and brings them back from by
/// itself.
///
/// With `prefix_cache_params::tiers.stores` set, a block leaving memory (write_policy::on_evict) or every
/// block as it is published (write_policy::through) is written to each store that does not hold it yet,
/// and prefix_cache_i::prefix_attach asks the stores, in order, for the blocks of the prompt after what
/// memory holds, before it attaches: what they return goes into free cells of the sequence's stream as cached
/// blocks, verified on layout, position in the chain and tokens. A store is asked only when its measured
/// cost (prefix_tier_stats::est_latency_ns, est_ns_per_byte) is below the engine's cost of computing the
/// tokens it would return (prefill_ns_per_token). A failing store is a miss: the engine recomputes.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <kvcache/block_store.h>

namespace kvc {

/// When the prefix cache writes blocks to its tiers.
enum class tier_write : uint8_t {
    on_evict,  ///< when a block leaves memory to make room (the tiers hold what memory lost)
    through,   ///< when a block is published (the tiers hold everything; more writes, earlier sharing)
    never,     ///< never: the tiers are read only (another process fills them)
};

/// Most stores a prefix cache takes.
inline constexpr uint32_t prefix_max_tiers = 3;

/// Stores below a kv_cache's prefix cache (prefix_cache_params::tiers).
struct prefix_tier_params {
    /// Asked in this order (the fastest first, e.g. a disk, then Redis); at most prefix_max_tiers. Empty:
    /// no tiers. The cache shares them: several caches (and processes) may use one store.
    std::vector<std::shared_ptr<block_store_i>> stores;
    /// Names the model and how its keys were computed (block_layout::model_id): caches whose layouts
    /// differ never read each other's records.
    uint64_t model_id = 0;
    tier_write write = tier_write::on_evict;  ///< when blocks are written
    bool fetch = true;                        ///< whether prefix_attach asks the stores
    /// The engine's cost of computing one prompt token (prefill, ns): a store is asked for a chain only
    /// when its measured cost of returning it is lower. 0: always ask (no estimate).
    double prefill_ns_per_token = 0;
    /// While the cost model declines a store, one attach in this many asks it anyway, so that a store
    /// that became fast again is noticed (0: never).
    uint32_t probe_every = 64;
    /// Write from a thread of the cache's own, so that a step that evicts (or publishes) never waits for
    /// a store; records wait in a queue of at most max_queued_bytes (what does not fit is dropped and
    /// counted). false: a step writes before it returns (deterministic: tests, kvcache sim).
    bool async_writes = false;
    uint64_t max_queued_bytes = uint64_t{256} << 20;  ///< async_writes: the queue's bound (> 0)
};

/// What the prefix cache did with one of its stores (kv_cache::get_tier_stats).
struct prefix_tier_stats {
    std::string where;            ///< the store's describe()
    uint64_t fetches = 0;         ///< read_many calls of attaches
    uint64_t fetched_blocks = 0;  ///< blocks they brought back into memory
    uint64_t declined = 0;        ///< attaches that did not ask it: it would have cost more than computing
    uint64_t refused_blocks = 0;  ///< values it returned that were not the block asked for (chain ended)
    uint64_t written_blocks = 0;  ///< blocks written to it
    uint64_t dropped_blocks = 0;  ///< async_writes: blocks not written, the queue being full
    uint64_t errors = 0;          ///< calls that threw (counted, never passed on to the engine)
    double est_latency_ns = 0;    ///< the cost model: ns of a call, whatever it returns
    double est_ns_per_byte = 0;   ///< the cost model: ns per byte returned
    block_store_stats store;      ///< the store's own counters (shared with other users of the store)
};

}  // namespace kvc
