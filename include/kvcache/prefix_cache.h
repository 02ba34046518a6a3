/// @file
/// The prefix cache of a kv_cache: what it is configured with, what it reports and what it counts.
///
/// With `kv_cache_params::prefix.enabled`, every full block of `block_size` tokens that a sequence decodes
/// from position 0 in order is published (at the engine's next step, once its rows are computed) under a
/// hash chained over the tokens before it. prefix_cache_i::prefix_attach gives a new sequence the cells of
/// the longest cached prefix of its prompt (shared, no copy), so the engine decodes only the rest. When a
/// sequence leaves its cells, published ones stay as cached cells that belong to no sequence: invisible
/// to every mask, evicted in policy order (deepest blocks of a chain first) only when a batch finds no
/// free cell. docs/prefix-cache.md has the guarantees and the engine loop.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include <kvcache/block_record.h>
#include <kvcache/block_store.h>
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

/// Highest priority of a prefix (prefix_cache_i::prefix_attach, prefix_set_priority); 0 is evicted first.
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
    /// Pins may hold at most this fraction of a stream's cells (prefix_cache_i::prefix_pin).
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

/// What the prefix cache did and holds (prefix_cache_i::get_prefix_stats()).
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

/// The prefix cache of a memory (kv_cache, kv_cache_iswa, memory_recurrent, memory_hybrid):
/// memory_i::prefix_cache() gives it when the memory was made with one (null otherwise). One coordinator
/// serves every kind of memory over its parts (design D35; docs/architecture.md, "The prefix wing"): a hit
/// needs every part's blocks, and what one part evicts the others let go too. docs/prefix-cache.md has the
/// rules.
class prefix_cache_i {
public:
    virtual ~prefix_cache_i() = default;
    /// Tokens of `tokens` that prefix_attach would give a sequence now: the longest cached prefix in
    /// whole blocks, at most tokens.size() - 1 (the engine still computes the last token's logits). With
    /// one stream per sequence, an attach gets less when its stream has no room for the copies. Changes
    /// nothing but the lookup counters. `key` separates namespaces (model revision, adapter, tenant):
    /// only blocks published under the same key match. Throws kvc::error for a token outside the
    /// vocabulary.
    virtual uint32_t prefix_lookup(std::span<const token_t> tokens, uint64_t key = 0) = 0;
    /// Makes the empty sequence seq_id hold the cells of the longest cached prefix of `tokens` (shared,
    /// not copied) at positions [0, n), as if it had decoded them, and returns n (what prefix_lookup
    /// returns; with tiers, what they bring back first counts too). With a sliding window the sequence
    /// holds only the window of n (and position n - 1); a recurrent memory resumes from a snapshot of its
    /// state at n. The engine then decodes tokens[n:] from position n; the blocks that decoding completes
    /// are published under `key` with `priority` (0-100: lower priorities are evicted first), and the
    /// blocks it reuses are raised to it. At most max_tokens are attached. Throws kvc::error, changing
    /// nothing, for a bad seq_id, a sequence that holds cells, a token outside the vocabulary or a
    /// priority above 100.
    virtual uint32_t prefix_attach(seq_id_t seq_id, std::span<const token_t> tokens, uint64_t key = 0,
                                   uint8_t priority = prefix_default_priority,
                                   uint32_t max_tokens = UINT32_MAX) = 0;
    /// Publishes now the blocks completed by the ubatches applied so far. A context's next() past its
    /// last ubatch does it, as do sequence operations and attaches.
    virtual void prefix_publish() = 0;
    /// What the prefix cache did and holds, over every part. It counts the cells of every stream: for
    /// reports, not for every step.
    virtual prefix_stats get_prefix_stats() const = 0;

    /// Whether prefix_pin, prefix_unpin and prefix_set_priority are served: they are a plain kv_cache's.
    virtual bool prefix_can_pin() const = 0;
    /// Pins the blocks of the longest cached prefix of `tokens` (in whole blocks, the whole prompt
    /// included) and returns the tokens pinned: no eviction takes them until as many prefix_unpin calls.
    /// Throws kvc::error, changing nothing, when the pinned cells would exceed
    /// prefix.max_pinned_fraction of the cache, or (unsupported) without prefix_can_pin() or with a
    /// sliding window.
    virtual uint32_t prefix_pin(std::span<const token_t> tokens, uint64_t key = 0) = 0;
    /// Undoes one prefix_pin of the same prefix: unpins the pinned blocks of the longest cached prefix of
    /// `tokens` and returns their tokens.
    virtual uint32_t prefix_unpin(std::span<const token_t> tokens, uint64_t key = 0) = 0;
    /// Sets the priority (0-100) of the blocks of the longest cached prefix of `tokens`; returns their
    /// tokens. A cached block moves to the newest end of its new priority's queue.
    virtual uint32_t prefix_set_priority(std::span<const token_t> tokens, uint64_t key, uint8_t priority) = 0;

    /// What the prefix cache did with each of its tiers (prefix.tiers.stores, in order; empty without).
    /// A memory of parts counts both parts' use of each store.
    virtual std::vector<prefix_tier_stats> get_tier_stats() const = 0;
    /// With prefix.tiers.async_writes: returns when every write queued so far is done (before reading
    /// the stores from elsewhere, or counters that must include them). Nothing otherwise.
    virtual void prefix_tier_drain() = 0;
    /// The layout of a plain kv_cache's blocks in a store: its K/V types, V layout, block size and own
    /// layers (model index, K and V widths); model_id names the model (block_layout::model_id). Throws
    /// kvc::error(unsupported) for other memories.
    virtual block_layout prefix_block_layout(uint64_t model_id) const = 0;
    /// Writes to `store` the cached blocks of the longest cached prefix of `tokens` (whole blocks, the
    /// whole prompt included) that it does not hold yet (one contains_many, one put_many), as block records
    /// of prefix_block_layout(model_id). Returns the blocks written. Store failures are the store's to
    /// count (a store made with throw_errors throws them). Changes no cell. A plain kv_cache's.
    virtual uint32_t prefix_store_blocks(block_store_i& store, uint64_t model_id,
                                         std::span<const token_t> tokens, uint64_t key = 0) = 0;
    /// Fetches from `store`, in one read_many, the blocks of `tokens` after its longest cached prefix, as
    /// far as they follow each other: each verified (layout, key, chain hash, parent, depth, the tokens
    /// themselves), its rows written into free cells of `stream` (evicting cached blocks of lower
    /// standing, as placement does; never the chain it extends) and published as a cached block under
    /// `key`. A miss, a value the store or the record check refuses, or no room ends the chain. Returns the
    /// tokens of `tokens` cached now, in whole blocks (a prefix_attach then gets them). Throws
    /// kvc::error for bad tokens or a bad stream; nothing changes then. A plain kv_cache's.
    virtual uint32_t prefix_fetch_blocks(block_store_i& store, uint64_t model_id,
                                         std::span<const token_t> tokens, uint64_t key = 0,
                                         uint32_t stream = 0) = 0;
};

}  // namespace kvc
