/// @file
/// kv_storage: where a kv_cache's K/V bytes live, and every operation that moves them.
///
/// The cache decides (cells, positions, sequences); the storage moves bytes. Every byte of K/V a
/// kv_cache reads or writes goes through this interface: rows of a ubatch, row copies (between streams,
/// compaction), K-shift re-rotation, rows for state save and restore, views for attention. That seam is
/// where storage the engine owns (device tensors) and storage that grows on demand plug in.
///
/// Rows are addressed as an engine's set_rows addresses them: row = stream * kv_size + cell, the index
/// kv_cache_context::k_idxs reports. Layers are the cache's own layers, 0-based (not model indices).
///
/// Layout of one layer (E_k = n_head_kv * n_embd_head_k):
/// @verbatim
///   K      [E_k, kv_size, n_stream]    row r at r * k_row_bytes
///   V      like K with E_v, or transposed (v_trans): per stream a matrix [E_vmax channels][kv_size cells],
///          element (channel e, cell c) of stream s at s * kv_size * E_vmax + e * kv_size + c
/// @endverbatim
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include <kvcache/dtype.h>
#include <kvcache/executor.h>
#include <kvcache/io.h>
#include <kvcache/ops.h>
#include <kvcache/tensor.h>

namespace kvc {

/// The shape of one layer's rows.
struct kv_storage_layer {
    uint32_t n_head_kv = 1;      ///< KV heads
    uint32_t n_embd_head_k = 0;  ///< values per key head
    uint32_t n_embd_head_v = 0;  ///< values per value head
    rope_params rope{};          ///< how the keys were rotated (for shift_k)
};

/// Everything a storage is made from (checked by kv_cache before it makes one).
struct kv_storage_params {
    std::vector<kv_storage_layer> layers;   ///< the cache's own layers
    dtype type_k = dtype::f16;              ///< element type of keys
    dtype type_v = dtype::f16;              ///< element type of values
    bool v_trans = true;                    ///< transposed V (float types only)
    uint32_t kv_size = 0;                   ///< cells per stream
    uint32_t n_stream = 1;                  ///< streams
    buffer_allocator* allocator = nullptr;  ///< null: host memory
};

/// One row copy: every layer's K and V of row src go to row dst.
struct row_copy {
    uint64_t src = 0;  ///< source row
    uint64_t dst = 0;  ///< destination row
};

/// One pending shift: the key of row is re-rotated by delta positions.
struct row_shift {
    pos_t delta = 0;   ///< positions to rotate by
    uint64_t row = 0;  ///< the row
};

/// Which of a layer's two tensors.
enum class kv_part : uint8_t { k, v };

/// The K/V rows of a kv_cache (see the file comment).
class kv_storage {
public:
    virtual ~kv_storage() = default;

    /// The shape it was made with.
    const kv_storage_params& params() const { return params_; }
    size_t k_row_bytes(uint32_t li) const { return k_row_[li]; }  ///< bytes of one K row of layer li
    /// Bytes of one V row of layer li (transposed V: E_vmax elements, counted per cell).
    size_t v_row_bytes(uint32_t li) const { return v_row_[li]; }
    uint32_t e_k(uint32_t li) const;             ///< values per K row of layer li
    uint32_t e_v(uint32_t li) const;             ///< values per V row of layer li
    uint32_t e_vmax() const { return e_vmax_; }  ///< the widest V row (the channel count of transposed V)
    /// Bytes of layer li's K or V tensor.
    size_t bytes(kv_part part, uint32_t li) const;

    // -- rows of a ubatch --
    /// Writes token t's row of src to rows[t], converted to the stored type. src is [E, n_tokens] (or
    /// [head_dim, n_head, n_tokens]) of f32 or f16, contiguous; throws kvc::error otherwise.
    virtual void write(kv_part part, uint32_t li, const_tensor_view src, std::span<const uint64_t> rows) = 0;
    /// Every layer's K and V of each copy's source row to its destination row, in order.
    virtual void copy_rows(std::span<const row_copy> copies) = 0;
    /// Re-rotates the keys of every layer with RoPE by each shift's delta (shifts sorted by delta, so rows
    /// moved together share one rotation table); pieces run on ex.
    virtual void shift_k(std::span<const row_shift> shifts, const executor& ex) = 0;
    /// Zeroes every byte (elastic storage: returns every page to the system).
    virtual void clear() = 0;

    // -- memory on demand --
    /// Cells per stream that memory is committed in: set_committed gets multiples of it (or kv_size).
    /// 0 when the storage's memory is not elastic (all of it allocated at creation).
    virtual uint32_t commit_granule() const = 0;
    /// Only cells [0, n_cells) of stream hold data now: the memory of the cells above may go back to
    /// the system, and they read as zeros when written again. Growth needs no call before it (elastic
    /// memory arrives when a row is first written), but the cache makes one, so storage that tracks
    /// growth (an engine's) learns of it before rows are written.
    virtual void set_committed(uint32_t stream, uint32_t n_cells) = 0;

    // -- state I/O (llama.cpp's payload order) --
    /// Writes layer li's K rows in order; a row with a non-zero delta (deltas empty: none) is written
    /// rotated by it, the stored row unchanged.
    virtual void save_k(io_write_i& io, uint32_t li, std::span<const uint64_t> rows,
                        std::span<const pos_t> deltas) const = 0;
    /// Writes layer li's V rows in order; transposed V channel by channel ([E_v][rows]).
    virtual void save_v(io_write_i& io, uint32_t li, std::span<const uint64_t> rows) const = 0;
    /// Stores layer li's rows from src, laid out as save_k / save_v write them.
    virtual void load(kv_part part, uint32_t li, std::span<const uint64_t> rows, const std::byte* src) = 0;
    /// A stored row decoded to f32 (E values; transposed V gathered), for tests and inspection.
    virtual void read_row(kv_part part, uint32_t li, uint64_t row, std::span<float> out) const = 0;

    // -- views for attention --
    /// Layer li's first n_kv cells of streams [s0, s0 + ns), as kv_cache_context::get_k describes.
    virtual tensor_view view(kv_part part, uint32_t li, uint32_t s0, uint32_t ns, uint32_t n_kv) = 0;
    /// Element index of (channel e, row) in transposed V, as an engine scatters values.
    uint64_t v_trans_index(uint64_t row, uint32_t e) const;

protected:
    /// Computes the row sizes every storage shares.
    explicit kv_storage(kv_storage_params params);

    kv_storage_params params_;   ///< the shape
    std::vector<size_t> k_row_;  ///< bytes of a K row, per layer
    std::vector<size_t> v_row_;  ///< bytes of a V row, per layer
    uint32_t e_vmax_ = 0;        ///< the widest V row, in values
};

/// Storage in host memory, elastic: address space for every cell is reserved at creation, and memory
/// arrives as rows are first written and goes back to the system with set_committed (views never move).
/// With the params' allocator instead: one buffer per layer and part, allocated and zeroed at creation.
std::unique_ptr<kv_storage> make_host_kv_storage(kv_storage_params params);

}  // namespace kvc
