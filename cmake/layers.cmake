# The layers of kvcache and how the build enforces them (included by the top-level CMakeLists.txt and by
# tests/layers/include_order.cmake).
#
#   core     libkvcache (target kvcache): types, dtype, tensor, batch, memories, state, session
#   runtime  libkvcache_runtime (target kvcache_runtime, kvcache::runtime): GGUF, models, kernels, thread
#            pool, tiny model, reference; links the core
#   redis    libkvcache_redis (target kvcache_redis, kvcache::redis): the Redis block store on hiredis; on the
#            public headers of the core only, and the core never sees it (its headers refuse
#            KVC_LAYER_CORE and KVC_LAYER_CAPI), so the core does not depend on hiredis; its C constructor
#            (src/redis/capi, redis/kvcache_redis.h) is built on the public C API: it hands the C++ store to
#            kvc_block_store_from_callbacks, so the C API never sees hiredis either
#   capi     the C API (src/capi, headers kvcache.h): compiled into libkvcache, on the public C++ API only
#   python   the Python module (python/src): on the public headers of the core and the runtime only
#
# A layer may use the layers below it, never one above: the core never sees a runtime header (the guard
# in every include/kvcache/runtime/ header refuses KVC_LAYER_CORE and KVC_LAYER_CAPI) and does not link
# the runtime; the C API and the runtime see only include/kvcache/ (no src/, so none of the core's private
# folders, KVC_PRIVATE_DIRS). The
# tests in tests/layers/ prove each rule by building targets that break it.

# Puts a target in a layer: the definition its guards check and the include folders it may see.
function(kvc_layer target layer)
  if(layer STREQUAL "core")
    target_compile_definitions(${target} PRIVATE KVC_LAYER_CORE)
    target_include_directories(${target} PRIVATE ${PROJECT_SOURCE_DIR}/include ${PROJECT_BINARY_DIR}/include
                                                 ${PROJECT_SOURCE_DIR}/src)
  elseif(layer STREQUAL "runtime")
    target_compile_definitions(${target} PRIVATE KVC_LAYER_RUNTIME)
    target_include_directories(${target} PRIVATE ${PROJECT_SOURCE_DIR}/include ${PROJECT_BINARY_DIR}/include)
  elseif(layer STREQUAL "redis")
    target_compile_definitions(${target} PRIVATE KVC_LAYER_REDIS)
    target_include_directories(${target} PRIVATE ${PROJECT_SOURCE_DIR}/include ${PROJECT_BINARY_DIR}/include)
  elseif(layer STREQUAL "capi")
    target_compile_definitions(${target} PRIVATE KVC_LAYER_CAPI)
    target_include_directories(${target} PRIVATE ${PROJECT_SOURCE_DIR}/include ${PROJECT_BINARY_DIR}/include)
  elseif(layer STREQUAL "python")
    target_compile_definitions(${target} PRIVATE KVC_LAYER_PYTHON)
    target_include_directories(${target} PRIVATE ${PROJECT_SOURCE_DIR}/include ${PROJECT_BINARY_DIR}/include)
  else()
    message(FATAL_ERROR "kvc_layer: unknown layer '${layer}' (core, runtime, redis, capi, python)")
  endif()
endfunction()

# The order inside the public headers, lowest first (tests/layers/include_order.cmake): a header, and the
# source of the same name in src/, includes only headers of its own rank or a lower one. So batch.h /
# batch.cpp never include memory.h, and memory.h never includes state.h. Every public header has a rank.
set(KVC_INCLUDE_RANKS
  "0 types.h version.h"
  "1 dtype.h seq_set.h io.h executor.h prefix_cache.h prefix_tiers.h memory_budget.h limits.h block_record.h block_store.h disk_store.h"
  "2 tensor.h ops.h kv_storage.h kv_storage_engine.h"
  "3 kv_cells.h batch.h"
  "4 memory.h"
  "5 kv_cache.h memory_recurrent.h recurrent_engine.h memory_pair.h kv_cache_iswa.h memory_hybrid.h"
  "6 state.h state_summary.h session.h"
  "7 runtime/gguf.h runtime/kv_tensors.h runtime/thread_pool.h runtime/tiny_model.h runtime/runtime.h runtime/reference_recurrent.h redis/redis_store.h"
  "8 kvcache.h kvcache_state.h kvcache_prefix.h kvcache_engine.h kvcache_tiers.h redis/kvcache_redis.h"
)
# Sources whose header has another name.
set(KVC_SOURCE_HEADERS
  "ops_rope.cpp ops.h"
  "kv_cache_context.cpp kv_cache.h"
  "kv_cache_prefix.cpp kv_cache.h"
  "kv_cache_tier.cpp kv_cache.h"
  "memory_recurrent_prefix.cpp memory_recurrent.h"
  "memory_recurrent_tier.cpp memory_recurrent.h"
)
# The core's private folders of src/, by subsystem: only the core's own sources include them. Each has a
# rank below (what its sources may include): the dtype kernels know element types only, the cell tables
# the cells, and the prefix index (blocks, chains, eviction queues, ghosts, snapshot queues) and the tiers
# (block records to and from stores) know no memory: the memories use them, never the reverse. detail/
# holds the memories' own internals.
set(KVC_PRIVATE_DIRS detail dtype cells prefix tiers)
# The highest rank each folder of src/ may include (sources without a header of their own).
set(KVC_SOURCE_RANKS
  "src 6"
  "src/dtype 1"
  "src/cells 3"
  "src/prefix 1"
  "src/tiers 1"
  "src/detail 6"
  "src/runtime 7"
  "src/redis 7"
  "src/redis/capi 8"
  "src/capi 8"
)
