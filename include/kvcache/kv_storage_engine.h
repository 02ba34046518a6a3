/// @file
/// Engine-owned K/V storage: the engine keeps the K/V tensors (on any device) and kvcache keeps no K/V
/// byte. kvcache still decides everything (cells, positions, masks, the prefix cache, state formats); each
/// time it would move rows it hands the engine the operation instead, in the order the operations must
/// run (docs/engine-owned-storage.md).
///
/// The engine implements kv_storage_engine and passes it as kv_cache_params::engine. Its tensors have the
/// layout of kv_storage.h (per layer K [E_k, kv_size, n_stream], V the same or transposed), zeroed at
/// creation; rows are addressed as there: row = stream * kv_size + cell. What reaches the engine:
/// @verbatim
///   allocate     once per kv_cache (an iSWA memory: base cache, then SWA cache): its layers and shape
///   run(op)      zero / copy / shift, synchronously, as the cache edits its cells (init_update's apply,
///                seq_cp, prefix_attach, clear, ...); later operations and reads assume it is done
///   read_rows    rows for a state save, laid out as the state payload holds them
///   write_rows   rows of a state restore, laid out the same way
/// @endverbatim
/// The rows of a ubatch are not an operation: after apply() the engine writes the layer's K and V at
/// kv_cache_context::k_idxs() / v_idxs(), as ggml's set_rows does, and attends over its own tensors
/// (cpy_k, cpy_v, get_k and get_v throw: kvcache has no bytes to write or view).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include <kvcache/kv_storage.h>

namespace kvc {

/// What an engine does to its K/V tensors.
enum class kv_op_kind : uint8_t {
    /// Zero every K and V row of the op's layers (kv_cache::clear(true)).
    zero,
    /// For each copy, the K and V rows src to dst in each of the op's layers. No copy reads a row another
    /// copy of the same op writes: they may run in any order, or as one gather and scatter.
    copy,
    /// For each shift, decode the key row, rotate it by delta positions with the layer's RoPE
    /// (ops::make_rope_table(n_embd_head_k, delta, rope, false) and ops::apply_rope, per head) and encode
    /// it again, in each of the op's layers (those whose keys carry RoPE). Each row appears once.
    shift,
};

/// One operation on the engine's K/V tensors; its spans are valid during kv_storage_engine::run only.
struct kv_op {
    kv_op_kind kind = kv_op_kind::zero;  ///< what to do
    std::span<const uint32_t> layers;    ///< the model layers (indices of kv_cache_params::layers) it covers
    std::span<const row_copy> copies;    ///< copy: the row pairs
    std::span<const row_shift> shifts;   ///< shift: the rows and their deltas, sorted by delta
};

/// The engine's side of engine-owned storage (see the file comment). kvcache calls it from the thread
/// that calls into the memory, one call at a time. run and write_rows must not fail: the cells are
/// already edited when they are called (an engine that loses its device has lost the memory too).
class kv_storage_engine {
public:
    virtual ~kv_storage_engine() = default;

    /// A kv_cache made its storage: the layers (model indices, in the storage's layer order: layer li of
    /// `storage` is layers[li]) live in the engine's tensors, shaped as `storage` says (kv_storage.h:
    /// bytes(part, li), k_row_bytes(li), v_row_bytes(li), e_vmax(), params()) and zeroed, because attention
    /// reads never-written cells (masked) and must not meet NaNs. The engine may have allocated them
    /// before; this tells it the shape kvcache assumes. May throw (the cache is then not made). kvcache
    /// never frees anything: the engine frees its tensors after the memory is destroyed, or when the
    /// memory's creation fails after an allocate (an iSWA memory whose second cache is refused).
    virtual void allocate(const kv_storage& storage, std::span<const uint32_t> layers) = 0;
    /// Runs one operation on the tensors (kv_op_kind). An engine may queue it on its device stream, as
    /// long as later operations, ubatch writes and read_rows see its result.
    virtual void run(const kv_op& op) = 0;
    /// Copies the rows of model layer il into dst, laid out as the state payload holds them: K or plain V
    /// rows back to back (k_row_bytes / v_row_bytes each); transposed V channel-major, E_v channels of
    /// rows.size() elements each. May throw (the save fails, the memory is unchanged).
    virtual void read_rows(uint32_t il, kv_part part, std::span<const uint64_t> rows, std::byte* dst) = 0;
    /// Stores the rows of model layer il from src, laid out as read_rows writes them (state restores).
    virtual void write_rows(uint32_t il, kv_part part, std::span<const uint64_t> rows,
                            const std::byte* src) = 0;
};

/// Storage whose bytes the engine owns: every operation goes to `engine` (borrowed: it outlives the
/// storage). layer_ids are the model indices of the storage's layers. Calls engine.allocate before it
/// returns.
std::unique_ptr<kv_storage> make_engine_kv_storage(kv_storage_params params, std::vector<uint32_t> layer_ids,
                                                   kv_storage_engine& engine);

}  // namespace kvc
