// One own layer of a kv_cache: its model index and shape (its bytes live in the cache's kv_storage, at
// the same index).
#pragma once

#include <kvcache/kv_cache.h>

namespace kvc {

struct kv_cache::layer {
    uint32_t il = 0;  // model layer index
    layer_desc desc;
};

}  // namespace kvc
