/// @file kvcache_engine.h
/// @brief The C API of engine-owned storage: the engine keeps the K/V tensors (on any device) and runs the
/// row operations kvcache hands it; kvcache keeps no K/V byte (the C++ kvc::kv_storage_engine).
///
/// Included by kvcache.h. Set kvc_kv_cache_params::engine (also inside kvc_iswa_params and
/// kvc_hybrid_params) to a ::kvc_storage_engine. The engine's tensors have kvcache's layout: per layer,
/// K is [E_k, kv_size, n_stream] (row = stream * kv_size + cell, k_row_bytes each), V the same or, with
/// v_trans, per stream a matrix [E_vmax channels][kv_size cells]. Then:
/// - the creation calls `allocate` once per KV cache (an iSWA memory: the full-attention cache, then the
///   sliding-window one) with its layers and shape; the tensors must be zeroed;
/// - after kvc_memory_context_apply() of a batch ubatch, the engine writes each layer's K and V at
///   kvc_memory_k_idxs() / kvc_memory_v_idxs() (ggml's set_rows) and attends over its tensors with
///   kvcache's mask: kvc_memory_cpy_k(), kvc_memory_cpy_v(), kvc_memory_get_k() and kvc_memory_get_v()
///   fail with #KVC_ERR_UNSUPPORTED;
/// - whenever kvcache moves rows (an update's K-shift and compaction, a copy into another stream, a prefix
///   attach, a clear), it calls `run` with the operation, before the call that caused it returns;
/// - state saves read rows through `read_rows`, restores write them through `write_rows`, in the state
///   payload's layout, so state bytes are those of a memory that owns its storage.
/// docs/engine-owned-storage.md shows a ggml and a CUDA engine doing it.
#ifndef KVCACHE_KVCACHE_ENGINE_H
#define KVCACHE_KVCACHE_ENGINE_H

#include <kvcache/kvcache.h>

#ifdef __cplusplus
extern "C" {
#endif

/// @brief Which of a layer's two tensors.
typedef enum kvc_kv_part {
    KVC_KV_PART_K = 0,  ///< the keys
    KVC_KV_PART_V = 1,  ///< the values
} kvc_kv_part;

/// @brief What the engine does to its tensors (kvc_storage_op::kind).
typedef enum kvc_storage_op_kind {
    KVC_STORAGE_OP_ZERO = 0,  ///< zero every K and V row of the op's layers
    /// for each copy, the K and V rows src to dst in each of the op's layers; no copy reads a row another
    /// copy of the op writes (any order, or one gather and scatter, is right)
    KVC_STORAGE_OP_COPY = 1,
    /// for each shift, decode the key row, rotate it by delta positions with the layer's RoPE (what
    /// ggml_rope_ext does with the layer's parameters, positions = delta, no magnitude scaling) and encode
    /// it again, in each of the op's layers (those with RoPE); each row appears once
    KVC_STORAGE_OP_SHIFT = 2,
} kvc_storage_op_kind;

/// @brief A row copy of a #KVC_STORAGE_OP_COPY.
typedef struct kvc_row_copy {
    uint64_t src;  ///< source row (stream * kv_size + cell)
    uint64_t dst;  ///< destination row
} kvc_row_copy;

/// @brief A key row to rotate, of a #KVC_STORAGE_OP_SHIFT.
typedef struct kvc_row_shift {
    int32_t delta;  ///< positions to rotate by
    uint64_t row;   ///< the row (stream * kv_size + cell)
} kvc_row_shift;

/// @brief One operation on the engine's tensors; its arrays are valid during kvc_storage_engine::run only.
typedef struct kvc_storage_op {
    kvc_storage_op_kind kind;     ///< what to do
    const uint32_t* layers;       ///< [n_layers] model layers it covers
    size_t n_layers;              ///< entries of layers
    const kvc_row_copy* copies;   ///< [n_copies] with #KVC_STORAGE_OP_COPY (else NULL)
    size_t n_copies;              ///< entries of copies
    const kvc_row_shift* shifts;  ///< [n_shifts] with #KVC_STORAGE_OP_SHIFT, sorted by delta (else NULL)
    size_t n_shifts;              ///< entries of shifts
} kvc_storage_op;

/// @brief The shape of one KV cache's tensors, as kvcache lays them out (kvc_storage_engine::allocate).
/// Layer i's K tensor is kv_size * n_stream * k_row_bytes[i] bytes, its V tensor kv_size * n_stream *
/// v_row_bytes[i] bytes.
typedef struct kvc_storage_shape {
    const uint32_t* layers;     ///< [n_layers] the model layers of the cache
    size_t n_layers;            ///< entries of layers
    kvc_type type_k;            ///< element type of keys
    kvc_type type_v;            ///< element type of values
    bool v_trans;               ///< V transposed: per stream [e_vmax channels][kv_size cells]
    uint32_t kv_size;           ///< cells per stream
    uint32_t n_stream;          ///< streams
    uint32_t e_vmax;            ///< values of the widest V row (the channels of transposed V)
    const size_t* k_row_bytes;  ///< [n_layers] bytes of a K row
    const size_t* v_row_bytes;  ///< [n_layers] bytes of a V row (transposed: e_vmax elements per cell)
} kvc_storage_shape;

/// @brief An engine that owns the K/V tensors: four callbacks, all required, called from the thread that
/// calls into the memory, one at a time; they must not call into the same memory. Copied at creation;
/// user_data must outlive the memory.
struct kvc_storage_engine {
    /// A KV cache of the memory is being made: allocate (or check) zeroed tensors of this shape for its
    /// layers. Return false to refuse: the creation fails with #KVC_ERR_OUT_OF_MEMORY. kvcache never
    /// frees anything: free the tensors after kvc_memory_free(), or when the creation fails after an
    /// allocate (an iSWA memory whose second cache is refused).
    bool (*allocate)(const kvc_storage_shape* shape, void* user_data);
    /// Run one operation (::kvc_storage_op_kind), or queue it on the device stream so that later
    /// operations, ubatch writes and read_rows see it. Must not fail: the cells are already edited.
    void (*run)(const kvc_storage_op* op, void* user_data);
    /// Copy rows of model layer il into dst, as the state payload holds them: K or plain V rows back to
    /// back; transposed V channel-major (E_v channels of n_rows elements). Return false on failure: the
    /// save fails with #KVC_ERR_IO and the memory is unchanged.
    bool (*read_rows)(uint32_t il, kvc_kv_part part, const uint64_t* rows, size_t n_rows, void* dst,
                      void* user_data);
    /// Store rows of model layer il from src, laid out as read_rows writes them (state restores). Must
    /// not fail.
    void (*write_rows)(uint32_t il, kvc_kv_part part, const uint64_t* rows, size_t n_rows, const void* src,
                       void* user_data);
    void* user_data;  ///< passed to every callback
};

/// @brief The rows the current ubatch's keys go to, in the KV cache holding layer il: one per token,
/// stream * kv_size + cell (set_rows indices).
/// @param ctx A batch context whose current ubatch is applied.
/// @param il Model index of a layer with K/V.
/// @param dst [n] indices.
/// @param n Elements of dst: kvc_memory_context_n_tokens().
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL pointers or a wrong n; #KVC_ERR_OUT_OF_RANGE for a
/// layer without K/V; #KVC_ERR_INVALID_STATE before apply or without a current ubatch;
/// #KVC_ERR_UNSUPPORTED for a memory without K/V.
KVC_API kvc_status kvc_memory_k_idxs(const kvc_memory_context* ctx, uint32_t il, int64_t* dst,
                                     size_t n) KVC_NOEXCEPT;

/// @brief Elements of kvc_memory_v_idxs(): n_tokens, or n_tokens * e_vmax with transposed V.
/// @param ctx A batch context whose current ubatch is applied.
/// @param il Model index of a layer with K/V.
/// @return The count, or a negative ::kvc_status (as kvc_memory_k_idxs()).
KVC_API int64_t kvc_memory_v_idxs_elements(const kvc_memory_context* ctx, uint32_t il) KVC_NOEXCEPT;

/// @brief Where the current ubatch's values go: rows as kvc_memory_k_idxs(), or with transposed V the
/// element index of every (token, channel): dst[t * e_vmax + e] for channels e < e_vmax (the channels past
/// the layer's E_v are padding: write 0 there).
/// @param ctx A batch context whose current ubatch is applied.
/// @param il Model index of a layer with K/V.
/// @param dst [n] indices.
/// @param n Elements of dst: kvc_memory_v_idxs_elements().
/// @return As kvc_memory_k_idxs().
KVC_API kvc_status kvc_memory_v_idxs(const kvc_memory_context* ctx, uint32_t il, int64_t* dst,
                                     size_t n) KVC_NOEXCEPT;

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // KVCACHE_KVCACHE_ENGINE_H
