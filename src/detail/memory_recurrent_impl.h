// memory_recurrent internals shared by its two source files: the cell record and the own layers.
#pragma once

#include <kvcache/memory_recurrent.h>

#include "detail/reserved_memory.h"

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

// The rows of one state tensor: host memory reserved up front whose pages arrive when rows are first
// written and leave with release() (docs/memory.md), or all of an engine allocator's buffer at once.
class state_rows {
public:
    state_rows() = default;
    state_rows(size_t size, buffer_allocator* alloc) {
        if (alloc)
            buf_ = buffer(size, true, *alloc);  // zeroed: a fresh state reads zeros
        else
            mem_ = detail::reserved_memory(size);  // reads zeros until written
    }
    std::byte* data() const { return buf_.empty() ? mem_.data() : const_cast<std::byte*>(buf_.data()); }
    size_t size() const { return buf_.empty() ? mem_.size() : buf_.size(); }
    bool elastic() const { return buf_.empty(); }
    void clear() {
        if (elastic())
            mem_.release(0, mem_.size());
        else
            buf_.clear_bytes();
    }
    // Bytes [offset, offset + n) hold nothing needed: their whole pages go back (reads see zeros).
    void release(size_t offset, size_t n) {
        if (elastic()) mem_.release(offset, n);
    }

private:
    buffer buf_;
    detail::reserved_memory mem_;
};

struct memory_recurrent::layer {
    uint32_t il = 0;        // model layer index
    uint32_t n_embd_r = 0;  // 0: no r tensor
    uint32_t n_embd_s = 0;  // 0: no s tensor
    size_t row_r = 0;       // bytes of one r row
    size_t row_s = 0;
    state_rows r;  // [row_r * size * (1 + n_rs_seq)]: row of cell c in plane p at p * size + c
    state_rows s;  // [row_s * size * (1 + n_rs_seq)]
};

}  // namespace kvc
