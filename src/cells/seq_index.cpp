// seq_index: the sorted (position, cell) pairs of one sequence (src/cells/kv_cells_tables.h).
#include <algorithm>
#include <cassert>
#include <iterator>
#include <limits>

#include "cells/kv_cells_tables.h"

namespace kvc::detail {

const seq_index::entry* seq_index::lower_bound(int64_t p) const {
    if (p > std::numeric_limits<pos_t>::max()) return end();
    if (p < 0) p = 0;
    return std::lower_bound(begin(), end(), entry{static_cast<pos_t>(p), 0});
}

void seq_index::insert(entry e) {
    if (empty()) {
        clear();
        v_.push_back(e);
    } else if (v_.back() < e) {
        v_.push_back(e);  // decoding: the new position is the largest
    } else if (head_ > 0 && e < *begin()) {
        v_[--head_] = e;
    } else {
        v_.insert(v_.begin() + (std::lower_bound(begin(), end(), e) - v_.data()), e);
    }
}

void seq_index::erase(entry e) {
    const entry* it = std::lower_bound(begin(), end(), e);
    assert(it != end() && *it == e);
    const auto at = static_cast<size_t>(it - begin());
    erase(at, at + 1);
}

void seq_index::erase(size_t first, size_t last) {
    if (first == last) return;
    if (last == size()) {
        v_.resize(head_ + first);
    } else if (first == 0) {
        head_ += last;  // drop the front in O(1); compact once the dead part dominates
        if (head_ >= 64 && 2 * head_ >= v_.size()) {
            v_.erase(v_.begin(), v_.begin() + static_cast<ptrdiff_t>(head_));
            head_ = 0;
        }
    } else {
        const auto base = v_.begin() + static_cast<ptrdiff_t>(head_);
        v_.erase(base + static_cast<ptrdiff_t>(first), base + static_cast<ptrdiff_t>(last));
    }
    if (empty()) clear();
}

void seq_index::merge(std::span<const entry> sorted) {
    if (sorted.empty()) return;
    if (empty() || v_.back() < sorted.front()) {
        v_.insert(v_.end(), sorted.begin(), sorted.end());
        return;
    }
    std::vector<entry> out;
    out.reserve(size() + sorted.size());
    std::merge(begin(), end(), sorted.begin(), sorted.end(), std::back_inserter(out));
    v_ = std::move(out);
    head_ = 0;
}

void seq_indexes::cover(seq_id_t lo, seq_id_t hi, uint32_t n_seq_max) {
    const auto l = static_cast<size_t>(lo), h = static_cast<size_t>(hi) + 1;
    const size_t n = v_.size();
    if (l >= base_ && h <= base_ + n) return;
    size_t first = l, last = h;
    if (n > 0) {  // at least double, towards the side that grows
        first = std::min(first, base_);
        last = std::max(last, base_ + n);
        const size_t want = std::max(last - first, 2 * n);
        if (first < base_)
            first = last > want ? last - want : 0;
        else
            last = std::min<size_t>(first + want, std::max<size_t>(n_seq_max, last));
    }
    std::vector<seq_index> grown(last - first);  // may throw: before any change
    for (size_t k = 0; k < n; ++k) grown[base_ - first + k] = std::move(v_[k]);
    v_ = std::move(grown);
    base_ = first;
}

}  // namespace kvc::detail
