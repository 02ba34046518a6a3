// memory_recurrent internals shared by its two source files: the cell record and the own layers.
#pragma once

#include <kvcache/memory_recurrent.h>

namespace kvc {

// One storage cell (index = physical row of every tensor). Its sequences form a singly linked list
// through memory_recurrent::next_, starting at `first`, so that copying the cells (prepare's snapshot)
// is a flat copy and a swap touches only the members of the two cells.
struct memory_recurrent::cell_rec {
    pos_t pos = -1;       // position of the last token folded into the state (-1: free)
    int32_t src = -1;     // row holding the state (its own index between ubatches; -1: fresh, zero state)
    uint32_t rs_idx = 0;  // pending rollback: the logical state is plane rs_idx of row src
    uint32_t depth = 0;   // valid history planes beyond the logical one (rs_idx + depth <= n_rs_seq)
    uint32_t n_seq = 0;   // members; 0 = free cell
    seq_id_t first = -1;  // first member
};

struct memory_recurrent::layer {
    uint32_t il = 0;        // model layer index
    uint32_t n_embd_r = 0;  // 0: no r tensor
    uint32_t n_embd_s = 0;  // 0: no s tensor
    size_t row_r = 0;       // bytes of one r row
    size_t row_s = 0;
    buffer r;  // [row_r * size * (1 + n_rs_seq)]: row of cell c in plane p at p * size + c
    buffer s;  // [row_s * size * (1 + n_rs_seq)]
};

}  // namespace kvc
