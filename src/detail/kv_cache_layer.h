// One own layer of a kv_cache: its shape and its K and V buffers.
#pragma once

#include <kvcache/kv_cache.h>

namespace kvc {

struct kv_cache::layer {
    uint32_t il = 0;  // model layer index
    layer_desc desc;
    uint32_t e_k = 0;  // n_head_kv * n_embd_head_k
    uint32_t e_v = 0;  // n_head_kv * n_embd_head_v
    size_t k_row = 0;  // bytes of one cell's K row
    size_t v_row = 0;  // bytes of one cell's V row (transposed V: E_vmax elements, counted per cell)
    buffer k;          // [k_row * kv_size * n_stream]
    buffer v;          // [v_row * kv_size * n_stream]
};

}  // namespace kvc
