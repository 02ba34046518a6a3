// Helpers shared by the tests of composite memories: a batch of runs of tokens, its context, whole states.
#pragma once

#include <tuple>
#include <vector>

#include <kvcache/batch.h>
#include <kvcache/memory.h>
#include <kvcache/state.h>

namespace kvc::test {

using run = std::tuple<seq_id_t, pos_t, uint32_t>;  // a sequence, its first position, the token count

// init_batch of the runs laid out in one batch (the last token an output): the context, failed when the
// batch does not fit.
inline memory_context_ptr init_runs(memory_i& mem, uint32_t n_seq_max, const std::vector<run>& runs,
                                    uint32_t n_ubatch) {
    uint32_t n = 0;
    for (const auto& r : runs) n += std::get<2>(r);
    batch_storage b = batch::init(static_cast<int32_t>(n), 0, 1);
    for (const auto& [s, p0, count] : runs)
        for (uint32_t i = 0; i < count; ++i) {
            const seq_id_t ids[] = {s};
            b.add(static_cast<token_t>(i), p0 + static_cast<pos_t>(i), ids, false);
        }
    b.set_output(static_cast<int32_t>(n) - 1, true);
    batch_allocr a;
    a.init(b.view(), positions_of(mem), {.n_seq_max = n_seq_max});
    return mem.init_batch(a, n_ubatch, false);
}

// The memory's whole state.
inline std::vector<uint8_t> whole(const memory_i& m) {
    return state_seq_get_data(m, seq_all);
}

}  // namespace kvc::test
