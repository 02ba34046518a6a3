/// @file
/// What a KV cache state payload holds, read without a cache (for `kvcache inspect` and tools): streams,
/// each sequence's positions and cells, bytes per layer and element type. The payload is the layout
/// kv_cache::state_write writes (spec kv-core §7); it does not say whether cells carry M-RoPE extensions,
/// so the caller tells (mrope), or summarize_kv_state_any tries both.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include <kvcache/dtype.h>
#include <kvcache/types.h>

namespace kvc {

/// What a KV cache state payload holds (summarize_kv_state).
struct state_summary {
    /// One sequence of a stream.
    struct sequence {
        seq_id_t seq = 0;      ///< its id
        uint32_t n_cells = 0;  ///< cells holding it
        /// smallest position
        pos_t pos_min = -1, pos_max = -1;  ///< largest position
    };
    /// the i-th layer of the payload (payloads do not record model indices)
    struct layer {
        /// K element type
        dtype type_k = dtype::f32, type_v = dtype::f32;  ///< V element type
        /// K bytes, summed over streams
        uint64_t k_bytes = 0, v_bytes = 0;  ///< V bytes, summed over streams
    };
    /// One stream of the payload.
    struct stream {
        uint32_t n_cells = 0;        ///< cells in the payload
        std::vector<sequence> seqs;  ///< ascending id
    };
    std::vector<stream> streams;  ///< in payload order
    std::vector<layer> layers;    ///< in payload order
    bool v_trans = false;         ///< V stored transposed
    bool mrope = false;           ///< cells carry (x, y) extensions
    uint64_t bytes = 0;           ///< of the payload

    /// Bytes of K plus V data per element type, e.g. {f16: 123}; a type appears once.
    std::vector<std::pair<dtype, uint64_t>> bytes_per_type() const;
};

/// Parses a whole payload; throws kvc::error(corrupt_data) naming the byte when it is malformed or has
/// trailing bytes.
state_summary summarize_kv_state(std::span<const uint8_t> payload, bool mrope);
/// Tries without and then with M-RoPE extensions; the first error if neither parses.
state_summary summarize_kv_state_any(std::span<const uint8_t> payload);

}  // namespace kvc
