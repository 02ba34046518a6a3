/// @file
/// The prefix cache of a kv_cache: what it is configured with, what it reports and what it counts.
///
/// With `kv_cache_params::prefix.enabled`, every full block of `block_size` tokens that a sequence decodes
/// from position 0 in order is published (at the engine's next step, once its rows are computed) under a
/// hash chained over the tokens before it. kv_cache::prefix_attach gives a new sequence the cells of the
/// longest cached prefix of its prompt (shared, no copy), so the engine decodes only the rest. When a
/// sequence leaves its cells, published ones stay as cached cells that belong to no sequence: invisible
/// to every mask, evicted in policy order (deepest blocks of a chain first) only when a batch finds no
/// free cell. docs/prefix-cache.md has the guarantees and the engine loop.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include <kvcache/prefix_tiers.h>
#include <kvcache/types.h>

namespace kvc {

/// Which cached blocks go first when a batch needs room. Lower priorities always go before higher ones;
/// the policy orders blocks of one priority.
enum class evict_policy : uint8_t {
    lru,   ///< least recently released first
    slru,  ///< segmented LRU: blocks never hit since publishing go before blocks hit at least once
    /// SLRU whose evicted blocks leave ghosts (their hashes, twice the cache's blocks): a block published
    /// again while its ghost is remembered is protected as if hit, and the protected bound (starting at
    /// protected_fraction) moves to where evicted blocks come back. For long reuse distances (chats whose
    /// next turn comes after many other prompts). A recurrent memory's snapshots follow SLRU under it.
    adaptive,
};

/// Highest priority of a prefix (kv_cache::prefix_attach, prefix_set_priority); 0 is evicted first.
inline constexpr uint8_t prefix_max_priority = 100;
/// Priority of blocks published by a sequence attached without one.
inline constexpr uint8_t prefix_default_priority = 50;
/// Throws kvc::error(invalid_argument) "what: priority P above 100" when priority > prefix_max_priority.
void check_prefix_priority(uint32_t priority, const char* what);

/// Which index of a memory an event's block is in: memories made of parts keep one per part, and a hit
/// needs the blocks of every part (docs/prefix-cache.md, "Events").
enum class prefix_part : uint8_t {
    /// K/V blocks of full attention: a kv_cache's, the base cache of a kv_cache_iswa, the attention
    /// part of a memory_hybrid (its base cache when that part is an iSWA pair)
    kv,
    /// K/V blocks of sliding-window layers in the SWA cache of a kv_cache_iswa (also as a hybrid's
    /// attention part): kept only while they lie in the window of a boundary they may serve
    swa,
    /// a recurrent memory's blocks (memory_recurrent, a hybrid's recurrent part): the chains that lead to
    /// snapshots of states; stored when first published, removed when they lead to no snapshot any more
    snapshot,
};

/// What happened to the index (kv_cache_params::prefix.on_event), in the spirit of vLLM's KV events: a
/// router that follows them knows which prompt prefixes an engine holds.
struct prefix_event {
    /// What happened.
    enum class kind : uint8_t {
        stored,   ///< a block was published
        removed,  ///< a block left the index (evicted, or its cells were edited)
        cleared,  ///< every block left the index (clear(), a whole-memory state restore)
    };
    kind type = kind::stored;  ///< what happened
    /// The block's chain hash: XXH3-64 of its tokens (as int32 little-endian) seeded with parent_hash.
    uint64_t hash = 0;
    uint64_t parent_hash = 0;  ///< the previous block's hash; for the first block of a chain, its key
    uint32_t depth = 0;        ///< the block covers positions [depth * block_size, (depth + 1) * block_size)
    std::span<const token_t> tokens{};   ///< the block's tokens (valid during the call; empty for cleared)
    prefix_part part = prefix_part::kv;  ///< the index the block is in (cleared: the index that emptied)
};

/// How a kv_cache keeps prompt prefixes for reuse.
struct prefix_cache_params {
    bool enabled = false;      ///< keep and index published blocks
    uint32_t block_size = 16;  ///< tokens per block: reuse comes in whole blocks (divides kv_size)
    evict_policy policy = evict_policy::lru;  ///< the order of blocks of one priority
    /// SLRU: the protected segment holds at most this fraction of a stream's blocks.
    float protected_fraction = 0.8f;
    /// Pins may hold at most this fraction of a stream's cells (kv_cache::prefix_pin).
    float max_pinned_fraction = 0.5f;
    int32_t n_vocab = 0;  ///< > 0: prompt tokens must be in [0, n_vocab); 0: only non-negative
    /// Recurrent memories: besides the end of every prompt and of every sequence, keep a snapshot every
    /// this many blocks of a sequence (0: only those). docs/prefix-cache.md, "Recurrent memories".
    uint32_t snapshot_interval = 64;
    /// Recurrent memories: snapshots the pool holds at most (each is one sequence's state in every
    /// layer; memory_recurrent::snapshot_bytes()). 0: 4 x n_seq_max.
    uint32_t max_snapshots = 0;
    /// Called synchronously for every block stored and removed and when the index empties, in every
    /// part of the memory (prefix_event::part says which). It must not call back into the cache; an
    /// exception it throws is caught and counted (event_errors).
    std::function<void(const prefix_event&)> on_event{};
    /// Stores below memory that blocks (recurrent memories: snapshots) are written to and fetched back
    /// from (kvcache/prefix_tiers.h, docs/tiers.md). Not with a sliding window (kv_cache, kv_cache_iswa).
    prefix_tier_params tiers{};
};

/// What the prefix cache did and holds (kv_cache::get_prefix_stats()).
struct prefix_stats {
    uint64_t lookups = 0;             ///< prefix_lookup and prefix_attach calls
    uint64_t tokens_looked_up = 0;    ///< prompt tokens they were given
    uint64_t hit_tokens = 0;          ///< tokens prefix_attach gave a sequence without recomputation
    uint64_t published_blocks = 0;    ///< blocks added to the index
    uint64_t evicted_blocks = 0;      ///< blocks whose cells were freed for new tokens
    uint64_t unpublished_blocks = 0;  ///< blocks taken out because a sequence edit changed their cells
    /// Completed blocks seq_rm took before they were published: the engine did not move past the step
    /// that computed them (a failed step; or no next() after the last ubatch nor prefix_publish()).
    uint64_t dropped_blocks = 0;
    uint64_t bytes_copied = 0;          ///< K/V bytes attaches and edits of shared cells copied
    uint64_t event_errors = 0;          ///< exceptions thrown by on_event (caught)
    uint64_t snapshots_saved = 0;       ///< recurrent: snapshots published (state at a block boundary)
    uint64_t snapshots_dropped = 0;     ///< recurrent: snapshots evicted, superseded or made stale
    uint64_t swa_published_blocks = 0;  ///< iSWA: blocks the SWA cache kept (those in some window)
    uint64_t swa_evicted_blocks = 0;    ///< iSWA: blocks the SWA cache evicted
    uint64_t tier_fetched_blocks = 0;   ///< tiers: blocks attaches brought back from a store
    uint64_t tier_written_blocks = 0;   ///< tiers: blocks written to a store (each store counts)
    uint32_t blocks = 0;                ///< blocks in the index now
    uint32_t cached_cells = 0;  ///< cells held by the index and by no sequence (evictable unless pinned)
    uint32_t shared_cells = 0;  ///< cells held by the index and by sequences
    uint32_t pinned_cells = 0;  ///< cells of pinned blocks
    uint32_t free_cells = 0;    ///< empty cells
    uint32_t snapshots = 0;     ///< recurrent: snapshots in the pool now (published or being written)
    uint32_t swa_blocks = 0;    ///< iSWA: blocks in the SWA cache's index now
    /// Memory of the index: block records, their tokens and cells, the hash table, the per-cell owner
    /// map and the sequences' trackers.
    size_t index_bytes = 0;
};

/// The prefix cache of any memory (kv_cache, kv_cache_iswa, memory_recurrent, memory_hybrid), for code
/// that serves any of them (the C API, Python, `kvcache replay`, `kvcache sim`): memory_i::prefix_cache()
/// gives it when the memory has one. Each class documents its own rules; without a prefix cache the calls
/// throw kvc::error(unsupported), except prefix_enabled, prefix_publish (nothing to do) and
/// get_prefix_stats (zeros).
class prefix_cache_i {
public:
    virtual ~prefix_cache_i() = default;
    /// Whether the memory was made with a prefix cache.
    virtual bool prefix_enabled() const = 0;
    /// Tokens of `tokens` that prefix_attach would give a sequence now.
    virtual uint32_t prefix_lookup(std::span<const token_t> tokens, uint64_t key) = 0;
    /// Gives the empty sequence seq_id the longest cached prefix of `tokens` (at most max_tokens) and
    /// returns its length; the engine decodes the rest.
    virtual uint32_t prefix_attach(seq_id_t seq_id, std::span<const token_t> tokens, uint64_t key,
                                   uint8_t priority, uint32_t max_tokens) = 0;
    /// Publishes what the last step computed.
    virtual void prefix_publish() = 0;
    /// What the prefix cache did and holds.
    virtual prefix_stats get_prefix_stats() const = 0;
    /// Whether the memory pins prefixes and sets their priorities (a kv_cache; its prefix_pin may still
    /// refuse, e.g. with a sliding window).
    virtual bool prefix_can_pin() const { return false; }
    /// Pins the blocks of the longest cached prefix of `tokens`; returns the tokens pinned (kv_cache).
    /// Memories that cannot pin throw kvc::error(unsupported): a cache with a sliding window, recurrent
    /// snapshots.
    virtual uint32_t prefix_pin(std::span<const token_t> tokens, uint64_t key);
    /// Undoes one prefix_pin of the same prefix; returns the tokens unpinned (kv_cache; see prefix_pin).
    virtual uint32_t prefix_unpin(std::span<const token_t> tokens, uint64_t key);
    /// Sets the priority of the blocks of the longest cached prefix of `tokens`; returns their tokens
    /// (kv_cache; see prefix_pin).
    virtual uint32_t prefix_set_priority(std::span<const token_t> tokens, uint64_t key, uint8_t priority);
    /// What the prefix cache did with each of its tiers (prefix.tiers.stores, in order; empty without).
    virtual std::vector<prefix_tier_stats> get_tier_stats() const { return {}; }
    /// With prefix.tiers.async_writes: returns when every write queued so far is done. Nothing otherwise.
    virtual void prefix_tier_drain() {}
};

}  // namespace kvc
