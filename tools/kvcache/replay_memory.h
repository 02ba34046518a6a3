// The memory of a `kvcache replay` run, built from the script's `memory` line (docs/op-scripts.md):
// type=kv (with model=: the model's layers and runtime), iswa, hybrid or recurrent.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <kvcache/kv_cache.h>
#include <kvcache/memory.h>
#include <kvcache/memory_recurrent.h>
#include <kvcache/runtime/runtime.h>

#include "replay_script.h"

namespace kvc::cli {

/// A part of the memory that `show` counts and `cells` lists: an attention cache or the recurrent state.
struct replay_part {
    std::string name;                        ///< the `cells part=` name: kv, base, swa or rs
    std::string used_label;                  ///< its count in `show`: used, used_swa or used_rs
    const kv_cache* kv = nullptr;            ///< the attention cache, or
    const memory_recurrent* recr = nullptr;  ///< the recurrent state
    uint32_t used() const;                   ///< cells in use (every stream)
};

/// What a `memory` line builds. Members are destroyed bottom up: the runtime before the memory and model
/// it refers to.
struct replay_memory {
    std::unique_ptr<model> mdl;      ///< model=: the model the runtime runs
    std::unique_ptr<memory_i> mem;   ///< the memory every op works on
    std::unique_ptr<runtime> rt;     ///< model=: decode runs the forward pass
    std::vector<replay_part> parts;  ///< the first is what `cells` lists without part=
    uint32_t n_layer = 0;            ///< model layers of the memory
    uint32_t n_seq_max = 1;          ///< sequence ids [0, n_seq_max)
    uint32_t n_ubatch = 512;         ///< tokens per ubatch
};

/// Builds the memory of a `memory` line (w[0] == "memory") and prints `memory ok ...`. A bad key or value,
/// or a configuration the memory refuses, is a script_error.
replay_memory make_replay_memory(const words& w);

}  // namespace kvc::cli
