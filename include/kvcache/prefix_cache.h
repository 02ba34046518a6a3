/// @file
/// The prefix cache of a kv_cache: what it is configured with and what it counts.
///
/// With `kv_cache_params::prefix.enabled`, every full block of `block_size` tokens that a sequence decodes
/// from position 0 in order is published (at the engine's next step, once its rows are computed) under a
/// hash chained over the tokens before it. kv_cache::prefix_attach gives a new sequence the cells of the
/// longest cached prefix of its prompt (shared, no copy), so the engine decodes only the rest. When a
/// sequence leaves its cells, published ones stay as cached cells that belong to no sequence: invisible
/// to every mask, evicted (least recently released first, deepest blocks of a chain first) only when a
/// batch finds no free cell. docs/prefix-cache.md has the guarantees and the engine loop.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvc {

/// How a kv_cache keeps prompt prefixes for reuse.
struct prefix_cache_params {
    bool enabled = false;      ///< keep and index published blocks
    uint32_t block_size = 16;  ///< tokens per block: reuse comes in whole blocks
};

/// What the prefix cache did and holds (kv_cache::prefix_stats()).
struct prefix_stats {
    uint64_t lookups = 0;             ///< prefix_lookup and prefix_attach calls
    uint64_t tokens_looked_up = 0;    ///< prompt tokens they were given
    uint64_t hit_tokens = 0;          ///< tokens prefix_attach gave a sequence without recomputation
    uint64_t published_blocks = 0;    ///< blocks added to the index
    uint64_t evicted_blocks = 0;      ///< blocks whose cells were freed for new tokens
    uint64_t unpublished_blocks = 0;  ///< blocks taken out because a sequence edit changed their cells
    uint32_t blocks = 0;              ///< blocks in the index now
    uint32_t cached_cells = 0;        ///< cells held by the index and by no sequence (evictable)
    uint32_t shared_cells = 0;        ///< cells held by the index and by sequences
    uint32_t free_cells = 0;          ///< empty cells
    /// Memory of the index: block records, their tokens and cells, the hash table, the per-cell owner
    /// map and the sequences' trackers.
    size_t index_bytes = 0;
};

}  // namespace kvc
