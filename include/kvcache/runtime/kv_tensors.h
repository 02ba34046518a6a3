/// @file
/// kv_tensors: the runtime's own K/V tensors, for caches whose storage the engine owns
/// (kv_storage_engine.h). The runtime plays the engine: it runs the row operations kvcache hands it,
/// writes each ubatch's rows at the context's k_idxs / v_idxs and attends over these tensors, as a
/// GPU engine would over device tensors. Host memory, laid out as kv_storage.h describes, so that the
/// cache == recompute suite proves the operations are complete and in the right order.
#pragma once

// Layer guard: this header belongs to the runtime library (kvcache_runtime).
#if defined(KVC_LAYER_CORE) || defined(KVC_LAYER_CAPI)
#error "kvcache layers: a runtime header (<kvcache/runtime/...>) included from the core library or the C API"
#endif

#include <cstdint>
#include <span>
#include <vector>

#include <kvcache/kv_storage_engine.h>
#include <kvcache/tensor.h>

namespace kvc {

/// K/V tensors per model layer, owned by the engine (here the runtime). Pass it as kv_cache_params::engine
/// (and the same object as runtime_params::tensors); it must outlive the cache.
class kv_tensors final : public kv_storage_engine {
public:
    // -- kv_storage_engine --
    /// Allocates the layers' tensors, zeroed; throws kvc::error for a layer it already holds.
    void allocate(const kv_storage& storage, std::span<const uint32_t> layers) override;
    void run(const kv_op& op) override;  ///< zero, copy or shift rows of the op's layers
    /// Rows of layer il in the state payload layout.
    void read_rows(uint32_t il, kv_part part, std::span<const uint64_t> rows, std::byte* dst) override;
    /// Rows of layer il from the state payload layout.
    void write_rows(uint32_t il, kv_part part, std::span<const uint64_t> rows, const std::byte* src) override;

    // -- the engine's own use --
    /// Whether model layer il has tensors here.
    bool has_layer(uint32_t il) const { return il < layers_.size() && layers_[il].rows > 0; }
    /// Writes a ubatch's rows of layer il, as ggml's set_rows: src is [n_tokens][E] f32; K and plain V
    /// go to rows idxs[t] (kv_cache_context::k_idxs / v_idxs); transposed V element (t, e) goes to element
    /// idxs[t * E_vmax + e] (v_idxs), zero for the padding channels e >= E. Converted to the stored type.
    void set_rows(uint32_t il, kv_part part, std::span<const float> src, std::span<const int64_t> idxs);
    /// The first n_kv cells of streams [s0, s0 + ns) of layer il, shaped as kv_cache_context::get_k / get_v
    /// shape them.
    tensor_view view(uint32_t il, kv_part part, uint32_t s0, uint32_t ns, uint32_t n_kv);
    /// Operations run so far, by kind (zero, copy, shift): what the tests check reached the engine.
    uint64_t n_ops(kv_op_kind kind) const { return n_ops_[static_cast<size_t>(kind)]; }

private:
    struct layer {
        uint64_t rows = 0;  // kv_size * n_stream; 0: not a layer of ours
        uint32_t kv_size = 0, e_k = 0, e_v = 0, e_vmax = 0;
        uint32_t n_head_kv = 0, head_k = 0, head_v = 0;
        size_t k_row = 0, v_row = 0;  // bytes, as kv_storage's
        dtype type_k = dtype::f16, type_v = dtype::f16;
        bool v_trans = false;
        rope_params rope{};
        buffer k, v;
    };
    layer& at(uint32_t il);
    // element index of (channel e, row) in transposed V
    static uint64_t v_trans_index(const layer& l, uint64_t row, uint32_t e) {
        return row / l.kv_size * l.kv_size * l.e_vmax + uint64_t{e} * l.kv_size + row % l.kv_size;
    }

    std::vector<layer> layers_;  // by model index
    uint64_t n_ops_[3] = {};
};

}  // namespace kvc
