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

}  // namespace detail

struct kv_cells::tables {
    // Occupancy by words: bit i of used[i / 64] = cell i used. Summaries over words: bit w of
    // any_used[w / 64] = used[w] != 0; bit w of any_free[w / 64] = word w has an empty cell.
    std::vector<uint64_t> used;
    std::vector<uint64_t> any_used;
    std::vector<uint64_t> any_free;

    std::vector<detail::seq_index> seq_pos;  // [n_seq_max]

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
