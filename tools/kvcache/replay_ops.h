// The ops of `kvcache replay` defined outside cmd_replay.cpp (which holds the op table). A handler gets
// the run's memory and the words of its line, the op name first, their count already checked against the
// table.
#pragma once

#include <fmt/format.h>
#include <kvcache/types.h>

#include "replay_memory.h"
#include "replay_script.h"

namespace kvc::cli {

/// Runs a memory call; a rejection prints `<op> failed: <why>` and the script goes on.
template <class F>
void guarded(const char* op, F&& f) {
    try {
        f();
    } catch (const error& e) {
        fmt::print("{} failed: {}\n", op, e.what());
    }
}

// -- state (replay_state_ops.cpp) --

/// size SEQ [partial=0|1]: the bytes `save SEQ` would write.
void op_size(replay_memory& m, const words& w);
/// save SEQ FILE [format=buffer|session|zstd|ggsq] [partial=0|1]
void op_save(replay_memory& m, const words& w);
/// load SEQ FILE [partial=0|1]
void op_load(replay_memory& m, const words& w);
/// digest SEQ: a fingerprint of the state.
void op_digest(replay_memory& m, const words& w);

// -- prefix cache (replay_prefix_ops.cpp) --

/// lookup TOKENS [key=K]: the tokens an attach would reuse now.
void op_lookup(replay_memory& m, const words& w);
/// attach SEQ TOKENS [key=K] [priority=P]: the sequence holds the longest cached prefix.
void op_attach(replay_memory& m, const words& w);
/// pin TOKENS [key=K] and unpin TOKENS [key=K]
void op_pin(replay_memory& m, const words& w);
/// publish: the blocks the last decode completed.
void op_publish(replay_memory& m, const words& w);
/// pstats: the prefix cache's counters.
void op_pstats(replay_memory& m, const words& w);

}  // namespace kvc::cli
