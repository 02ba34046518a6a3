// The test peer of memory_recurrent: places a hand-made ubatch, or dry-runs a list of them, without a
// context (an engine goes through init_batch / init_ubatches and the context's apply()).
#pragma once

#include <span>

#include <kvcache/memory_recurrent.h>

namespace kvc {

struct memory_recurrent_test_access {
    static rs_slot find_slot(memory_recurrent& m, const ubatch& ub) { return m.find_slot(ub); }
    static void prepare(memory_recurrent& m, std::span<const ubatch> ubs) { m.prepare(ubs); }
};

}  // namespace kvc
