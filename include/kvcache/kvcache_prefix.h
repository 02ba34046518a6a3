/// @file kvcache_prefix.h
/// @brief The C API of the prefix cache (docs/prefix-cache.md): a KV cache created with
/// kvc_kv_cache_params::prefix enabled keeps computed prompt prefixes for other sequences; a recurrent
/// memory (kvc_recurrent_params::prefix) keeps snapshots of states at block boundaries, a hybrid memory
/// (kvc_hybrid_params::prefix) both. Lookups, attaches, publishing and the counters work on all three;
/// pins and priorities of cached prefixes on KV caches. Included by kvcache.h, whose conventions apply;
/// include kvcache.h.
#ifndef KVCACHE_KVCACHE_PREFIX_H
#define KVCACHE_KVCACHE_PREFIX_H

#include <kvcache/kvcache.h>

#ifdef __cplusplus
extern "C" {
#endif

/// @brief What the prefix cache did and holds (the C++ kvc::prefix_stats).
typedef struct kvc_prefix_stats {
    uint64_t lookups;               ///< kvc_memory_prefix_lookup and kvc_memory_prefix_attach calls
    uint64_t tokens_looked_up;      ///< prompt tokens they were given
    uint64_t hit_tokens;            ///< tokens attaches gave a sequence without recomputation
    uint64_t published_blocks;      ///< blocks added to the index
    uint64_t evicted_blocks;        ///< blocks whose cells were freed for new tokens
    uint64_t unpublished_blocks;    ///< blocks taken out because a sequence edit changed their cells
    uint64_t bytes_copied;          ///< K/V bytes copied for edits of shared cells
    uint64_t event_errors;          ///< always 0 from C (a C callback cannot throw)
    uint32_t blocks;                ///< blocks in the index now
    uint32_t cached_cells;          ///< cells held by the index and by no sequence (evictable unless pinned)
    uint32_t shared_cells;          ///< cells held by the index and by sequences
    uint32_t pinned_cells;          ///< cells of pinned blocks
    uint32_t free_cells;            ///< empty cells
    uint64_t index_bytes;           ///< memory of the index
    uint64_t snapshots_saved;       ///< recurrent and hybrid: snapshots published
    uint64_t snapshots_dropped;     ///< recurrent and hybrid: snapshots evicted, superseded or made stale
    uint32_t snapshots;             ///< recurrent and hybrid: snapshots in the pool now
    uint32_t swa_blocks;            ///< iSWA: blocks in the sliding-window cache's index now
    uint64_t swa_published_blocks;  ///< iSWA: blocks the sliding-window cache kept
    uint64_t swa_evicted_blocks;    ///< iSWA: blocks the sliding-window cache evicted
    uint64_t tier_fetched_blocks;   ///< tiers: blocks attaches brought back from a store (kvcache_tiers.h)
    uint64_t tier_written_blocks;   ///< tiers: blocks written to a store (each store counts)
    /// completed blocks kvc_memory_seq_rm took before they were published: the engine did not move past
    /// the step that computed them (a failed step; or no kvc_memory_context_next() after the last ubatch
    /// nor kvc_memory_prefix_publish())
    uint64_t dropped_blocks;
} kvc_prefix_stats;

/// @brief How many of the tokens kvc_memory_prefix_attach() would give a sequence now: the longest
/// cached prefix in whole blocks, at most n_tokens - 1. Changes no sequence (it publishes what the
/// previous step computed and counts a lookup).
/// @param mem A memory with a prefix cache (a KV cache, an iSWA pair, a recurrent or a hybrid memory).
/// @param tokens [n_tokens] the prompt (may be NULL when n_tokens is 0).
/// @param n_tokens Its length (at most INT32_MAX).
/// @param key The namespace (model revision, adapter, tenant): only blocks published under it match.
/// @param out Receives the count.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL pointers or a count above INT32_MAX;
/// #KVC_ERR_UNSUPPORTED for a memory without a prefix cache.
KVC_API kvc_status kvc_memory_prefix_lookup(kvc_memory* mem, const int32_t* tokens, size_t n_tokens,
                                            uint64_t key, uint32_t* out) KVC_NOEXCEPT;

/// @brief Makes the empty sequence seq_id hold the cells of the longest cached prefix of the tokens
/// (shared, not copied) at positions [0, n), and returns n; decode the tokens from n on. The blocks that
/// decoding completes are published under key with the priority, and the blocks it reuses are raised to it.
/// @param mem A memory with a prefix cache (a KV cache, an iSWA pair, a recurrent or a hybrid memory).
/// @param seq_id The sequence (it must hold no cell).
/// @param tokens [n_tokens] the prompt (may be NULL when n_tokens is 0).
/// @param n_tokens Its length (at most INT32_MAX).
/// @param key The namespace (see kvc_memory_prefix_lookup()).
/// @param priority 0 to 100 (lower priorities are evicted first); 50 is the default of the C++ API.
/// @param out Receives n.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL pointers, a count above INT32_MAX, a token outside
/// the vocabulary, a priority above 100 or a sequence that is not empty; #KVC_ERR_OUT_OF_RANGE for a bad
/// sequence id; #KVC_ERR_UNSUPPORTED without a prefix cache. Nothing changes on an error.
KVC_API kvc_status kvc_memory_prefix_attach(kvc_memory* mem, int32_t seq_id, const int32_t* tokens,
                                            size_t n_tokens, uint64_t key, uint32_t priority,
                                            uint32_t* out) KVC_NOEXCEPT;

/// @brief Pins the blocks of the longest cached prefix of the tokens (whole blocks): no eviction takes
/// them until as many kvc_memory_prefix_unpin() calls.
/// @param mem A KV cache with a prefix cache.
/// @param tokens [n_tokens] the prefix (may be NULL when n_tokens is 0).
/// @param n_tokens Its length (at most INT32_MAX).
/// @param key The namespace.
/// @param out Receives the tokens pinned.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL pointers or when the pinned cells would exceed
/// prefix.max_pinned_fraction of the cache (nothing changes); #KVC_ERR_UNSUPPORTED without a prefix cache or
/// for a recurrent or hybrid memory (pins and priorities are a KV cache's).
KVC_API kvc_status kvc_memory_prefix_pin(kvc_memory* mem, const int32_t* tokens, size_t n_tokens,
                                         uint64_t key, uint32_t* out) KVC_NOEXCEPT;

/// @brief Undoes one kvc_memory_prefix_pin() of the same prefix.
/// @param mem A KV cache with a prefix cache.
/// @param tokens [n_tokens] the prefix (may be NULL when n_tokens is 0).
/// @param n_tokens Its length (at most INT32_MAX).
/// @param key The namespace.
/// @param out Receives the tokens unpinned.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL pointers; #KVC_ERR_UNSUPPORTED without a prefix cache
/// or for a recurrent or hybrid memory (pins and priorities are a KV cache's).
KVC_API kvc_status kvc_memory_prefix_unpin(kvc_memory* mem, const int32_t* tokens, size_t n_tokens,
                                           uint64_t key, uint32_t* out) KVC_NOEXCEPT;

/// @brief Sets the priority of the blocks of the longest cached prefix of the tokens.
/// @param mem A KV cache with a prefix cache.
/// @param tokens [n_tokens] the prefix (may be NULL when n_tokens is 0).
/// @param n_tokens Its length (at most INT32_MAX).
/// @param key The namespace.
/// @param priority 0 to 100.
/// @param out Receives the tokens of the blocks changed.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL pointers or a priority above 100;
/// #KVC_ERR_UNSUPPORTED without a prefix cache or for a
/// recurrent or hybrid memory (pins and priorities are a KV cache's).
KVC_API kvc_status kvc_memory_prefix_set_priority(kvc_memory* mem, const int32_t* tokens, size_t n_tokens,
                                                  uint64_t key, uint32_t priority,
                                                  uint32_t* out) KVC_NOEXCEPT;

/// @brief Publishes now the blocks completed by the ubatches applied so far (the next batch, lookup or
/// attach does it anyway); call it after computing them, e.g. before ending a request.
/// @param mem A memory with a prefix cache (a KV cache, an iSWA pair, a recurrent or a hybrid memory).
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL; #KVC_ERR_UNSUPPORTED without a prefix cache.
KVC_API kvc_status kvc_memory_prefix_publish(kvc_memory* mem) KVC_NOEXCEPT;

/// @brief The prefix cache's counters.
/// @param mem A memory with a prefix cache (a KV cache, an iSWA pair, a recurrent or a hybrid memory).
/// @param out Receives them.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL; #KVC_ERR_UNSUPPORTED without a prefix cache.
KVC_API kvc_status kvc_memory_get_prefix_stats(const kvc_memory* mem, kvc_prefix_stats* out) KVC_NOEXCEPT;

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // KVCACHE_KVCACHE_PREFIX_H
