// The demo of a recurrent or hybrid model (mamba, jamba): cmd_demo_recurrent.cpp.
#pragma once

#include <cstdint>
#include <string>

#include <kvcache/dtype.h>
#include <kvcache/runtime/runtime.h>

namespace kvc::cli {

/// What `kvcache demo` passes on for a mamba or jamba model.
struct recurrent_demo_options {
    uint32_t seqs = 4;          ///< parallel sequences
    uint32_t ctx = 1024;        ///< cells of the hybrid's KV cache
    uint32_t threads = 0;       ///< 0: all cores
    dtype type_k = dtype::f16;  ///< the hybrid's K type
    dtype type_v = dtype::f16;  ///< the hybrid's V type
    bool v_trans = true;        ///< the hybrid's V layout
    bool unified = true;        ///< the hybrid's streams
    std::string session;        ///< where the session file is kept
};

/// Runs the phases, checking each against reference_recurrent; 0 when every difference is within the
/// tolerance, 1 otherwise.
int run_recurrent_demo(const model& m, const recurrent_demo_options& o);

}  // namespace kvc::cli
