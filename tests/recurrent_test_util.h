// Shared by the tests and fuzz targets of recurrent memories: content placed without a batch.
#pragma once

#include <kvcache/batch.h>
#include <kvcache/memory_recurrent.h>

#include "memory_recurrent_test_access.h"

namespace kvc::test {

// One block of n tokens of s from position p0, placed by find_slot (rows are left as they are).
inline void place(memory_recurrent& m, seq_id_t s, pos_t p0, uint32_t n) {
    ubatch u;
    u.equal_seqs = true;
    u.n_tokens = u.n_seq_tokens = n;
    u.n_seqs = u.n_seqs_unq = 1;
    u.seq_id_begin.push_back(0);
    for (uint32_t i = 0; i < n; ++i) {
        u.token.push_back(0);
        u.pos.push_back(p0 + static_cast<pos_t>(i));
        u.n_seq_id.push_back(1);
        u.seq_id_data.push_back(s);
        u.seq_id_begin.push_back(i + 1);
        u.output.push_back(0);
        u.batch_idx.push_back(static_cast<int32_t>(i));
    }
    u.seq_id_unq = {s};
    memory_recurrent_test_access::find_slot(m, u);
}

}  // namespace kvc::test
