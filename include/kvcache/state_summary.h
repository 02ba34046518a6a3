/// @file
/// What a state payload holds, read without a memory (for `kvcache inspect` and tools).
///
/// A KV cache payload (kv_cache::state_write, design/kv-cache.md §7): streams, each sequence's positions and
/// cells, bytes per layer and element type. It does not say whether cells carry M-RoPE extensions, so the
/// caller tells (mrope), or summarize_kv_state_any tries both.
///
/// A recurrent payload (memory_recurrent::state_write, design/recurrent.md §4.9): cells with their
/// position and sequences, then the r tensors and the s tensors of the layers that have them. It does not
/// say where the r tensors end, so the caller may pass the memory's state_layout() (a session file holds
/// it); without it the split is known only when every layer has both tensors.
///
/// A composite memory's payload is its parts' payloads back to back (summarize_memory_state):
/// kv_cache_iswa writes its base cache's KV payload then its SWA cache's, memory_hybrid its attention
/// part's (a KV payload or an iSWA pair) then its recurrent part's; with state_seq_flag_partial_only
/// only the last part (SWA, recurrent). The *_prefix parsers read one part at the front of a span.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <kvcache/dtype.h>
#include <kvcache/io.h>
#include <kvcache/memory.h>
#include <kvcache/types.h>

namespace kvc {

/// What a KV cache state payload holds (summarize_kv_state).
struct state_summary {
    /// One sequence of a stream.
    struct sequence {
        seq_id_t seq = 0;      ///< its id
        uint32_t n_cells = 0;  ///< cells holding it
        pos_t pos_min = -1;    ///< smallest position
        pos_t pos_max = -1;    ///< largest position
    };
    /// the i-th layer of the payload (payloads do not record model indices)
    struct layer {
        dtype type_k = dtype::f32;  ///< K element type
        dtype type_v = dtype::f32;  ///< V element type
        uint64_t k_bytes = 0;       ///< K bytes, summed over streams
        uint64_t v_bytes = 0;       ///< V bytes, summed over streams
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
/// Parses the KV payload at the front of bytes, which may go on after it (a composite memory's next
/// part); the summary's bytes is what it consumed. Errors as summarize_kv_state, trailing bytes aside.
state_summary summarize_kv_state_prefix(std::span<const uint8_t> bytes, bool mrope);

/// What a recurrent memory's state payload holds (summarize_recurrent_state).
struct recurrent_state_summary {
    /// One cell of the payload.
    struct cell {
        pos_t pos = -1;                ///< position of the last token folded into its state
        std::vector<seq_id_t> seqs{};  ///< sequences sharing it (payload order); none: a sequence's own state
    };
    /// A sequence with a state (whole-memory payloads list them; a sequence's own state does not).
    struct sequence {
        seq_id_t seq = 0;   ///< its id
        uint32_t cell = 0;  ///< index into cells
        pos_t pos = -1;     ///< the cell's position
    };
    /// Which state a tensor holds.
    enum class kind : uint8_t {
        r,       ///< conv / token-shift state
        s,       ///< SSM / WKV state
        unknown  ///< the payload alone cannot tell (see split)
    };
    /// How the r/s split of the tensors was found.
    enum class split : uint8_t {
        layout,      ///< from the layout the caller passed
        all_layers,  ///< 2 x n_layer tensors: every layer has both
        unknown      ///< neither: every tensor's kind is unknown
    };
    /// One tensor: the rows of every cell for one layer.
    struct tensor {
        kind k = kind::unknown;   ///< r or s
        int32_t il = -1;          ///< model layer, -1 when unknown
        dtype type = dtype::f32;  ///< element type
        uint64_t row_bytes = 0;   ///< bytes per cell
        uint64_t bytes = 0;       ///< row_bytes x cells
    };
    std::vector<cell> cells;          ///< in payload order (a whole memory's restore compacts them to 0..n-1)
    std::vector<sequence> seqs;       ///< ascending id
    uint32_t n_layer = 0;             ///< model layers, with or without state
    std::vector<tensor> tensors;      ///< payload order: r tensors by ascending layer, then s tensors
    split rs_split = split::unknown;  ///< how tensors[i].k was found
    uint64_t bytes = 0;               ///< of the payload

    /// Bytes of r plus s data per element type, e.g. {f32: 123}; a type appears once.
    std::vector<std::pair<dtype, uint64_t>> bytes_per_type() const;
};

/// Parses a whole recurrent payload; throws kvc::error(corrupt_data) naming the byte when it is malformed
/// or has trailing bytes (transposed s rows, s_trans != 0, are not read: no memory writes them). layout:
/// the writer's state_layout() ("recurrent n_layer=... layers=..."), or empty; when given it names each
/// tensor's kind and layer, and a payload that disagrees with it is an error.
recurrent_state_summary summarize_recurrent_state(std::span<const uint8_t> payload,
                                                  std::string_view layout = {});
/// Parses the recurrent payload at the front of bytes, which may go on after it; the summary's bytes is
/// what it consumed. With a layout it reads the tensors the layout names; without one it reads tensors
/// while bytes remain, up to 2 x n_layer (the payload does not say how many follow). Errors as
/// summarize_recurrent_state, trailing bytes aside.
recurrent_state_summary summarize_recurrent_state_prefix(std::span<const uint8_t> bytes,
                                                         std::string_view layout = {});

/// What a memory's state payload holds, part by part (summarize_memory_state): one part for a kv_cache
/// or a memory_recurrent, the parts of a composite memory in payload order.
struct memory_state_summary {
    /// The memory that wrote the payload.
    enum class memory : uint8_t {
        kv,          ///< kv_cache: one part, "kv"
        recurrent,   ///< memory_recurrent: one part, "recurrent"
        iswa,        ///< kv_cache_iswa: "base" then "swa" (partial only: "swa")
        hybrid,      ///< memory_hybrid over a kv_cache: "attn" then "recr" (partial only: "recr")
        hybrid_iswa  ///< memory_hybrid over a kv_cache_iswa: "base", "swa", "recr" (partial only: "recr")
    };
    /// One part: a KV cache's payload or a recurrent memory's.
    struct part {
        std::string name;     ///< "kv", "recurrent", "base", "swa", "attn" or "recr"
        uint64_t offset = 0;  ///< its first byte in the payload
        std::variant<state_summary, recurrent_state_summary> summary;  ///< what it holds

        /// The KV summary, or nullptr for a recurrent part.
        const state_summary* kv() const { return std::get_if<state_summary>(&summary); }
        /// The recurrent summary, or nullptr for a KV part.
        const recurrent_state_summary* recurrent() const {
            return std::get_if<recurrent_state_summary>(&summary);
        }
        /// Bytes of the part.
        uint64_t bytes() const {
            return std::visit([](const auto& p) { return p.bytes; }, summary);
        }
    };
    memory kind = memory::kv;   ///< what wrote it
    bool partial_only = false;  ///< a composite's last part alone (state_seq_flag_partial_only)
    bool guessed = false;       ///< no layout: kind is the first composition that reads every byte
    std::vector<part> parts;    ///< in payload order
    uint64_t bytes = 0;         ///< of the payload
};

/// The name of a memory kind as inspect prints it: "kv", "recurrent", "iswa", "hybrid", "hybrid_iswa".
std::string_view to_string(memory_state_summary::memory kind);

/// Parses a whole payload part by part. layout: the writer's state_layout() ("kv ...", "recurrent ...",
/// "iswa base=... swa=...", "hybrid attn=... recr=..."; a session file holds it) and flags the state
/// flags it was written with (session_info::state_flags): they say which parts follow, and an M-RoPE KV
/// part (n_pos > 1). Without a layout (buffers, 'ggsq' files, raw payloads) the compositions are tried in
/// order — KV, recurrent, KV + KV (iswa), KV + recurrent (hybrid), KV + KV + recurrent (hybrid with
/// iSWA attention), each with its KV parts read without and then with M-RoPE cells — and the first that
/// reads every byte wins (guessed); a partial-only state reads as its one part. Throws
/// kvc::error(corrupt_data) naming the byte, counted from the start of the payload (and the part, for a
/// composite) when the payload is malformed; without a layout, the error of the composition that got
/// furthest (the earlier one on a tie; for each, its reading without M-RoPE cells), and
/// kvc::error(unsupported) when the layout is none of the four.
memory_state_summary summarize_memory_state(std::span<const uint8_t> payload, std::string_view layout = {},
                                            state_seq_flags flags = 0);
/// The same, reading a payload of `size` bytes from `payload` as it comes (one pass, so the layout is
/// needed: kvc::error(invalid_argument) without one): tensor data is skipped through a small buffer, so
/// what is held is the summary and a constant (`kvcache inspect` of a zstd session file). Reads exactly
/// `size` bytes when the payload is well formed; errors as above.
memory_state_summary summarize_memory_state(io_read_i& payload, uint64_t size, std::string_view layout,
                                            state_seq_flags flags = 0);

}  // namespace kvc
