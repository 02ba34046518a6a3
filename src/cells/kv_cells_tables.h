// The private tables of kv_cells: the occupancy bitmap by 64-cell words with summary levels, and the
// per-sequence position indexes (seq_index).
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include <kvcache/kv_cells.h>

namespace kvc {
namespace detail {

// The (position, cell) pairs of one sequence, sorted, in a vector whose front can be dropped in O(1)
// (a sliding window drops its oldest cells) and whose back grows in O(1) (decoding appends the
// largest position). Ends give min/max; a position range is a contiguous slice, so bulk operations
// work on slices instead of node by node.
class seq_index {
public:
    using entry = std::pair<pos_t, uint32_t>;

    bool empty() const { return head_ == v_.size(); }
    size_t size() const { return v_.size() - head_; }
    entry* begin() { return v_.data() + head_; }
    entry* end() { return v_.data() + v_.size(); }
    const entry* begin() const { return v_.data() + head_; }
    const entry* end() const { return v_.data() + v_.size(); }
    // First entry with position >= p (p may exceed int32: then end()).
    const entry* lower_bound(int64_t p) const;
    entry* lower_bound(int64_t p) { return begin() + (std::as_const(*this).lower_bound(p) - begin()); }

    void insert(entry e);
    void erase(entry e);                    // e must be present
    void erase(size_t first, size_t last);  // entries [first, last) counted from begin()
    void merge(std::span<const entry> sorted);
    void clear() {
        v_.clear();
        head_ = 0;
    }

private:
    std::vector<entry> v_;  // [head_, size) live, sorted
    size_t head_ = 0;
};

// The position indexes of the sequences one stream holds, by id, in a window of ids [base, base + n)
// that grows (at least doubling) to cover the ids added. A stream of one sequence among 65536 (one
// stream per sequence) keeps one index, not 65536; a stream shared by ids 0..n-1 keeps n, as a table
// by id would.
class seq_indexes {
public:
    // The index of s, or null when s is outside the window (then s holds no cell here).
    const seq_index* find(seq_id_t s) const {
        const size_t k = static_cast<size_t>(s) - base_;
        return k < v_.size() ? &v_[k] : nullptr;
    }
    seq_index* find(seq_id_t s) { return const_cast<seq_index*>(std::as_const(*this).find(s)); }
    // The index of s; an empty one when s is outside the window.
    const seq_index& at(seq_id_t s) const {
        const size_t k = static_cast<size_t>(s) - base_;
        return k < v_.size() ? v_[k] : none_;
    }
    // The index of s, which is in the window (s holds a cell, or cover() included it).
    seq_index& operator[](seq_id_t s) { return v_[static_cast<size_t>(s) - base_]; }
    // Grows the window to include ids [lo, hi] (0 <= lo <= hi < n_seq_max). May throw bad_alloc, and
    // then changes nothing.
    void cover(seq_id_t lo, seq_id_t hi, uint32_t n_seq_max);
    seq_index& get(seq_id_t s, uint32_t n_seq_max) {
        if (seq_index* index = find(s)) return *index;
        cover(s, s, n_seq_max);
        return (*this)[s];
    }

    seq_id_t base() const { return static_cast<seq_id_t>(base_); }
    std::span<seq_index> all() { return v_; }  // entry k: id base() + k
    std::span<const seq_index> all() const { return v_; }

private:
    std::vector<seq_index> v_;
    size_t base_ = 0;
    static inline const seq_index none_{};
};

}  // namespace detail

struct kv_cells::tables {
    // Occupancy by words: bit i of used[i / 64] = cell i used. Summaries over words: bit w of
    // any_used[w / 64] = used[w] != 0; bit w of any_free[w / 64] = word w has an empty cell.
    std::vector<uint64_t> used;
    std::vector<uint64_t> any_used;
    std::vector<uint64_t> any_free;

    detail::seq_indexes seq_pos;  // by sequence id, for the ids this stream has held

    std::vector<uint64_t> held;      // bit i: cell i is held by the prefix cache
    std::vector<uint32_t> released;  // held cells whose last sequence left (kv_cells::released())

    struct move {
        seq_id_t seq;
        entry old_entry;
        int64_t new_pos;
    };
    std::vector<move> moves;     // scratch of seq_add_range / seq_div_range
    std::vector<entry> scratch;  // scratch of seq_cp_range
};

}  // namespace kvc
