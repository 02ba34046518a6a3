#include <algorithm>
#include <bit>
#include <cassert>
#include <iterator>
#include <limits>
#include <map>

#include <fmt/format.h>
#include <kvcache/kv_cells.h>

#include "cells/kv_cells_tables.h"

namespace kvc {

namespace {

constexpr uint64_t all_bits = ~uint64_t{0};

uint64_t bit(uint32_t i) {
    return uint64_t{1} << (i % 64);
}

}  // namespace

kv_cells::kv_cells() : t_(std::make_unique<tables>()) {}

kv_cells::kv_cells(const kv_cells& other)
    : n_seq_max_(other.n_seq_max_),
      pos_(other.pos_),
      ext_(other.ext_),
      shift_(other.shift_),
      seq_(other.seq_),
      n_used_(other.n_used_),
      has_shift_(other.has_shift_),
      t_(std::make_unique<tables>(*other.t_)) {}

kv_cells& kv_cells::operator=(const kv_cells& other) {
    if (this != &other) *this = kv_cells(other);
    return *this;
}

kv_cells::kv_cells(kv_cells&&) noexcept = default;
kv_cells& kv_cells::operator=(kv_cells&&) noexcept = default;
kv_cells::~kv_cells() = default;

kv_cells::kv_cells(uint32_t n_cells, uint32_t n_seq_max)
    : n_seq_max_(n_seq_max), t_(std::make_unique<tables>()) {
    if (n_seq_max < 1) throw error(errc::invalid_argument, "kv_cells: n_seq_max must be at least 1, got 0");
    resize(n_cells);
}

void kv_cells::resize(uint32_t n) {
    pos_.assign(n, pos_none);
    ext_.assign(n, cell_ext{});
    shift_.assign(n, 0);
    seq_.assign(n, seq_set{});
    const size_t words = (static_cast<size_t>(n) + 63) / 64;
    t_->used.assign(words, 0);
    t_->any_used.assign((words + 63) / 64, 0);
    t_->any_free.assign((words + 63) / 64, 0);
    t_->held.assign(words, 0);
    reset();
}

void kv_cells::reset() {
    std::fill(pos_.begin(), pos_.end(), pos_none);
    std::fill(ext_.begin(), ext_.end(), cell_ext{});
    std::fill(shift_.begin(), shift_.end(), 0);
    for (seq_set& s : seq_) s.clear();
    std::fill(t_->used.begin(), t_->used.end(), 0);
    std::fill(t_->any_used.begin(), t_->any_used.end(), 0);
    std::fill(t_->any_free.begin(), t_->any_free.end(), 0);
    for (size_t w = 0; w < t_->used.size(); ++w) t_->any_free[w / 64] |= uint64_t{1} << (w % 64);
    for (auto& index : t_->seq_pos.all()) index.clear();
    std::fill(t_->held.begin(), t_->held.end(), 0);
    t_->released.clear();
    n_used_ = 0;
    has_shift_ = false;
}

void kv_cells::reset_shift() {
    std::fill(shift_.begin(), shift_.end(), 0);
    has_shift_ = false;
}

// -- checks --

uint32_t kv_cells::check(uint32_t i) const {
    if (i >= pos_.size())
        throw error(errc::out_of_range, fmt::format("kv_cells: cell {} outside [0, {})", i, pos_.size()));
    return i;
}

void kv_cells::check_seq(seq_id_t s, const char* what) const {
    if (s < 0 || static_cast<uint32_t>(s) >= n_seq_max_)
        throw error(errc::out_of_range,
                    fmt::format("kv_cells::{}: seq_id {} not in [0, {})", what, s, n_seq_max_));
}

void kv_cells::check_used(uint32_t i, const char* what) const {
    if (pos_[check(i)] == pos_none)
        throw error(errc::invalid_state, fmt::format("kv_cells::{}: cell {} is empty", what, i));
}

// -- occupancy words --

void kv_cells::mark_used(uint32_t i) {
    const size_t w = i / 64;
    t_->used[w] |= bit(i);
    t_->any_used[w / 64] |= uint64_t{1} << (w % 64);
    const uint32_t n = size();
    const uint64_t valid = (w + 1) * 64 <= n ? all_bits : (uint64_t{1} << (n % 64)) - 1;
    if (t_->used[w] == valid) t_->any_free[w / 64] &= ~(uint64_t{1} << (w % 64));
    ++n_used_;
}

void kv_cells::mark_free(uint32_t i) {
    const size_t w = i / 64;
    t_->used[w] &= ~bit(i);
    t_->any_free[w / 64] |= uint64_t{1} << (w % 64);
    if (t_->used[w] == 0) t_->any_used[w / 64] &= ~(uint64_t{1} << (w % 64));
    --n_used_;
}

uint32_t kv_cells::next_used(uint32_t from) const {
    const uint32_t n = size();
    if (from >= n) return n;
    size_t w = from / 64;
    const uint64_t here = t_->used[w] & (all_bits << (from % 64));
    if (here) return static_cast<uint32_t>(w * 64 + static_cast<size_t>(std::countr_zero(here)));
    // next word with a used cell, through the summary
    for (size_t next = w + 1; next < t_->used.size();) {
        const uint64_t s = t_->any_used[next / 64] & (all_bits << (next % 64));
        if (s) {
            w = (next / 64) * 64 + static_cast<size_t>(std::countr_zero(s));
            return static_cast<uint32_t>(w * 64 + static_cast<size_t>(std::countr_zero(t_->used[w])));
        }
        next = (next / 64 + 1) * 64;
    }
    return n;
}

uint32_t kv_cells::next_free(uint32_t from) const {
    const uint32_t n = size();
    if (from >= n) return n;
    size_t w = from / 64;
    // bits past the end of the last word read as free; the final min() clips them
    const uint64_t here = ~t_->used[w] & (all_bits << (from % 64));
    if (here) return std::min(n, static_cast<uint32_t>(w * 64 + static_cast<size_t>(std::countr_zero(here))));
    for (size_t next = w + 1; next < t_->used.size();) {
        const uint64_t s = t_->any_free[next / 64] & (all_bits << (next % 64));
        if (s) {
            w = (next / 64) * 64 + static_cast<size_t>(std::countr_zero(s));
            return std::min(
                n, static_cast<uint32_t>(w * 64 + static_cast<size_t>(std::countr_zero(~t_->used[w]))));
        }
        next = (next / 64 + 1) * 64;
    }
    return n;
}

uint32_t kv_cells::used_min() const {
    const uint32_t i = next_used(0);
    return i == size() ? 0 : i;
}

uint32_t kv_cells::used_max_p1() const {
    for (size_t sw = t_->any_used.size(); sw-- > 0;) {
        if (!t_->any_used[sw]) continue;
        const size_t w = sw * 64 + 63 - static_cast<size_t>(std::countl_zero(t_->any_used[sw]));
        return static_cast<uint32_t>(w * 64 + 64 - static_cast<size_t>(std::countl_zero(t_->used[w])));
    }
    return 0;
}

void kv_cells::used_cells(std::vector<uint32_t>& out) const {
    for (uint32_t i = next_used(0); i < size(); i = next_used(i + 1)) out.push_back(i);
}

bool kv_cells::find_free(uint32_t n, uint32_t hint, std::vector<uint32_t>& out) const {
    if (n == 0) return true;
    if (n > size() - n_used_) return false;
    if (hint >= size()) hint = 0;
    const size_t start = out.size();
    for (uint32_t i = next_free(hint); i < size() && out.size() - start < n; i = next_free(i + 1))
        out.push_back(i);
    for (uint32_t i = next_free(0); i < hint && out.size() - start < n; i = next_free(i + 1))
        out.push_back(i);
    return true;  // enough empty cells exist, so both passes found n
}

std::optional<uint32_t> kv_cells::find_contiguous(uint32_t n, uint32_t hint) const {
    const uint32_t sz = size();
    if (n == 0 || n > sz - n_used_)
        return n == 0 ? std::optional<uint32_t>(std::min(hint, sz)) : std::nullopt;
    if (hint >= sz) hint = 0;
    // Alternate between the next empty cell and the next used one: each jump skips whole words.
    const auto search = [&](uint32_t from, uint32_t stop) -> std::optional<uint32_t> {
        for (uint32_t p = next_free(from); p < stop; p = next_free(p)) {
            const uint32_t u = next_used(p);
            if (u - p >= n) return p;
            if (u >= sz) break;
            p = u;
        }
        return std::nullopt;
    };
    if (auto p = search(hint, sz)) return p;
    if (hint > 0) return search(0, hint);  // runs starting before the hint
    return std::nullopt;
}

// -- per-sequence index --

void kv_cells::index_add(uint32_t i) {
    for (seq_id_t s : seq_[i]) t_->seq_pos.get(s, n_seq_max_).insert({pos_[i], i});
}

void kv_cells::index_remove(uint32_t i) {
    for (seq_id_t s : seq_[i]) t_->seq_pos[s].erase({pos_[i], i});
}

std::pair<kv_cells::entry*, kv_cells::entry*> kv_cells::range(seq_id_t s, pos_t p0, pos_t p1) {
    detail::seq_index* index = t_->seq_pos.find(s);
    if (!index) return {nullptr, nullptr};  // s holds no cell here
    auto* lo = index->lower_bound(p0);
    auto* hi = p1 < 0 ? index->end() : index->lower_bound(p1);
    return {lo, std::max(lo, hi)};  // p1 <= p0: empty
}

pos_t kv_cells::seq_pos_min(seq_id_t s) const {
    check_seq(s, "seq_pos_min");
    const detail::seq_index& index = t_->seq_pos.at(s);
    return index.empty() ? pos_none : index.begin()->first;
}

pos_t kv_cells::seq_pos_max(seq_id_t s) const {
    check_seq(s, "seq_pos_max");
    const detail::seq_index& index = t_->seq_pos.at(s);
    return index.empty() ? pos_none : (index.end() - 1)->first;
}

uint32_t kv_cells::seq_pos_count(seq_id_t s, pos_t p) const {
    check_seq(s, "seq_pos_count");
    const detail::seq_index& index = t_->seq_pos.at(s);
    return static_cast<uint32_t>(index.lower_bound(int64_t{p} + 1) - index.lower_bound(p));
}

uint32_t kv_cells::seq_n_cells(seq_id_t s) const {
    check_seq(s, "seq_n_cells");
    return static_cast<uint32_t>(t_->seq_pos.at(s).size());
}

void kv_cells::seq_cells(seq_id_t s, pos_t p0, pos_t p1, std::vector<uint32_t>& out) const {
    for (const auto& e : seq_entries(s, p0, p1)) out.push_back(e.second);
}

std::span<const std::pair<pos_t, uint32_t>> kv_cells::seq_entries(seq_id_t s, pos_t p0, pos_t p1) const {
    check_seq(s, "seq_entries");
    const detail::seq_index& index = t_->seq_pos.at(s);
    const auto* lo = index.lower_bound(p0);
    const auto* hi = p1 < 0 ? index.end() : index.lower_bound(p1);
    return {lo, std::max(lo, hi)};
}

seq_id_t kv_cells::seq_get(uint32_t i) const {
    const seq_set& s = seq_[check(i)];
    if (s.size() != 1)
        throw error(
            errc::invalid_state,
            fmt::format("kv_cells::seq_get: cell {} holds {} sequences, not exactly one", i, s.size()));
    return s.first();
}

// -- mutations --

void kv_cells::make_empty(uint32_t i) {
    pos_[i] = pos_none;
    ext_[i] = cell_ext{};
    shift_[i] = 0;
    seq_[i].clear();
    mark_free(i);
}

bool kv_cells::held(uint32_t i) const {
    return (t_->held[i / 64] >> (i % 64)) & 1;
}

bool kv_cells::drop(uint32_t i) {
    if (!held(i)) {
        make_empty(i);
        return true;
    }
    seq_[i].clear();
    t_->released.push_back(i);
    return false;
}

void kv_cells::check_not_held(uint32_t i, const char* what) const {
    if (held(i))
        throw error(errc::invalid_state,
                    fmt::format("kv_cells::{}: cell {} is held by the prefix cache", what, i));
}

bool kv_cells::is_held(uint32_t i) const {
    return held(check(i));
}

void kv_cells::hold(uint32_t i, uint32_t holder) {
    check_used(i, "hold");
    if (held(i)) throw error(errc::invalid_state, fmt::format("kv_cells::hold: cell {} is already held", i));
    if (!(ext_[i] == cell_ext{}))
        throw error(errc::invalid_state, fmt::format("kv_cells::hold: cell {} has an M-RoPE extension", i));
    t_->held[i / 64] |= bit(i);
    ext_[i].x = static_cast<pos_t>(holder);  // the slot of the extension it does not have
}

uint32_t kv_cells::holder(uint32_t i) const {
    if (!held(check(i)))
        throw error(errc::invalid_state, fmt::format("kv_cells::holder: cell {} is not held", i));
    return static_cast<uint32_t>(ext_[i].x);
}

cell_ext kv_cells::ext_get(uint32_t i) const {
    return held(check(i)) ? cell_ext{} : ext_[i];
}

bool kv_cells::unhold(uint32_t i) {
    if (!held(check(i)))
        throw error(errc::invalid_state, fmt::format("kv_cells::unhold: cell {} is not held", i));
    t_->held[i / 64] &= ~bit(i);
    ext_[i] = cell_ext{};
    if (!seq_[i].empty()) return false;
    make_empty(i);
    return true;
}

std::span<const uint32_t> kv_cells::released() const {
    return t_->released;
}

void kv_cells::truncate_released(size_t n) {
    if (n < t_->released.size()) t_->released.resize(n);
}

void kv_cells::clear_released() {
    t_->released.clear();
}

void kv_cells::pos_set(uint32_t i, pos_t p) {
    check(i);
    if (p < 0) throw error(errc::invalid_argument, fmt::format("kv_cells::pos_set: negative position {}", p));
    if (pos_[i] != pos_none)
        throw error(errc::invalid_state,
                    fmt::format("kv_cells::pos_set: cell {} is in use (position {})", i, pos_[i]));
    pos_[i] = p;
    mark_used(i);
}

void kv_cells::ext_set(uint32_t i, cell_ext e) {
    check_not_held(check(i), "ext_set");  // its slot holds the holder
    ext_[i] = e;
}

void kv_cells::seq_add(uint32_t i, seq_id_t s) {
    check_used(i, "seq_add");
    check_seq(s, "seq_add");
    if (seq_[i].contains(s))
        throw error(errc::invalid_state,
                    fmt::format("kv_cells::seq_add: cell {} already holds seq {}", i, s));
    t_->seq_pos.get(s, n_seq_max_).insert({pos_[i], i});  // first: it may allocate; the cell is unchanged
    seq_[i].insert(s);
}

void kv_cells::fill(std::span<const uint32_t> cells, std::span<const pos_t> pos,
                    std::span<const cell_ext> ext, seq_id_t s) {
    check_seq(s, "fill");
    if (pos.size() != cells.size() || (!ext.empty() && ext.size() != cells.size()))
        throw error(errc::invalid_argument,
                    fmt::format("kv_cells::fill: {} cells, {} positions, {} extensions", cells.size(),
                                pos.size(), ext.size()));
    for (size_t j = 0; j < cells.size(); ++j) {
        if (pos_[check(cells[j])] != pos_none)
            throw error(errc::invalid_state, fmt::format("kv_cells::fill: cell {} is in use", cells[j]));
        if (pos[j] < 0)
            throw error(errc::invalid_argument, fmt::format("kv_cells::fill: negative position {}", pos[j]));
    }
    t_->scratch.clear();
    t_->scratch.reserve(cells.size());  // allocations before the first change: a failed fill changes nothing
    detail::seq_index& index = t_->seq_pos.get(s, n_seq_max_);
    for (size_t j = 0; j < cells.size(); ++j) {
        const uint32_t i = cells[j];
        if (pos_[i] != pos_none) {  // given twice: undo the cells filled so far
            for (size_t k = 0; k < j; ++k) make_empty(cells[k]);
            throw error(errc::invalid_argument, fmt::format("kv_cells::fill: cell {} given twice", i));
        }
        pos_[i] = pos[j];
        if (!ext.empty()) ext_[i] = ext[j];
        seq_[i].insert(s);
        mark_used(i);
        t_->scratch.emplace_back(pos[j], i);
    }
    if (!std::is_sorted(t_->scratch.begin(), t_->scratch.end()))
        std::sort(t_->scratch.begin(), t_->scratch.end());
    try {
        index.merge(t_->scratch);  // all or nothing
    } catch (...) {
        for (uint32_t i : cells) make_empty(i);
        throw;
    }
}

bool kv_cells::seq_move(uint32_t from, uint32_t to, seq_id_t s) {
    check_used(from, "seq_move");
    check_used(to, "seq_move");
    check_seq(s, "seq_move");
    if (!seq_[from].contains(s) || seq_[to].contains(s) || pos_[from] != pos_[to])
        throw error(
            errc::invalid_state,
            fmt::format("kv_cells::seq_move: seq {} must hold cell {} and not cell {}, at one position", s,
                        from, to));
    seq_[to].insert(s);  // first: it may allocate; nothing else changed yet
    detail::seq_index& index = t_->seq_pos[s];
    auto* e = index.lower_bound(pos_[from]);
    while (e->second != from) ++e;  // present: s holds `from`
    e->second = to;
    // entries are sorted by (position, cell): only neighbours at the same position can be out of order
    for (; e + 1 != index.end() && e[1] < e[0]; ++e) std::swap(e[0], e[1]);
    for (; e != index.begin() && e[0] < e[-1]; --e) std::swap(e[0], e[-1]);
    seq_[from].erase(s);
    if (!seq_[from].empty()) return false;
    return drop(from);
}

bool kv_cells::seq_rm(uint32_t i, seq_id_t s) {
    check_used(i, "seq_rm");
    check_seq(s, "seq_rm");
    if (!seq_[i].contains(s))
        throw error(errc::invalid_state, fmt::format("kv_cells::seq_rm: cell {} does not hold seq {}", i, s));
    seq_[i].erase(s);
    t_->seq_pos[s].erase({pos_[i], i});
    if (!seq_[i].empty()) return false;
    return drop(i);
}

bool kv_cells::seq_keep(uint32_t i, seq_id_t s) {
    check(i);
    check_seq(s, "seq_keep");
    if (seq_[i].contains(s)) {
        for (seq_id_t other : seq_[i])
            if (other != s) t_->seq_pos[other].erase({pos_[i], i});
        seq_[i].clear();
        seq_[i].insert(s);
        return false;
    }
    if (seq_[i].empty()) return false;  // empty cell, or used with no sequence: left as is (as upstream)
    index_remove(i);
    return drop(i);
}

void kv_cells::rm(uint32_t i) {
    check_used(i, "rm");
    index_remove(i);
    t_->held[i / 64] &= ~bit(i);
    make_empty(i);
}

bool kv_cells::pos_add(uint32_t i, pos_t d) {
    check_used(i, "pos_add");
    check_not_held(i, "pos_add");
    const int64_t p = int64_t{pos_[i]} + d;
    const int64_t sh = int64_t{shift_[i]} + d;
    constexpr int64_t lim = std::numeric_limits<pos_t>::max();
    if (p > lim || sh > lim || sh < -lim)
        throw error(errc::out_of_range,
                    fmt::format("kv_cells::pos_add: cell {} at position {} shifted {} by {} "
                                "overflows",
                                i, pos_[i], shift_[i], d));
    index_remove(i);
    pos_[i] = static_cast<pos_t>(p);
    shift_[i] = static_cast<pos_t>(sh);
    has_shift_ = true;
    if (p < 0) {
        make_empty(i);
        return true;
    }
    index_add(i);
    return false;
}

void kv_cells::pos_div(uint32_t i, int d) {
    check_used(i, "pos_div");
    check_not_held(i, "pos_div");
    if (d < 1)
        throw error(errc::invalid_argument, fmt::format("kv_cells::pos_div: divisor {} must be >= 1", d));
    const pos_t new_pos = pos_[i] / d;
    const int64_t sh = int64_t{shift_[i]} + new_pos - pos_[i];  // new - old (design D1): K rotates to new_pos
    if (sh < -int64_t{std::numeric_limits<pos_t>::max()})
        throw error(errc::out_of_range,
                    fmt::format("kv_cells::pos_div: cell {} pending shift {} overflows", i, sh));
    index_remove(i);
    pos_[i] = new_pos;
    shift_[i] = static_cast<pos_t>(sh);
    has_shift_ = true;
    index_add(i);
}

void kv_cells::mv(uint32_t src, uint32_t dst) {
    check_used(src, "mv");
    check(dst);
    if (pos_[dst] != pos_none)
        throw error(errc::invalid_state, fmt::format("kv_cells::mv: destination cell {} is in use", dst));
    index_remove(src);
    pos_[dst] = pos_[src];
    ext_[dst] = ext_[src];
    shift_[dst] = shift_[src];
    seq_[dst] = seq_[src];
    mark_used(dst);
    index_add(dst);
    if (held(src)) {  // the holder follows the cell (kv_cache::compact tells the prefix cache)
        t_->held[src / 64] &= ~bit(src);
        t_->held[dst / 64] |= bit(dst);
    }
    make_empty(src);
}

// -- sequence operations --

uint32_t kv_cells::seq_rm_range(seq_id_t s, pos_t p0, pos_t p1) {
    uint32_t lowest = size();
    if (s == seq_all) {
        // Every cell in the range goes, whatever its sequences: in each index that is one slice.
        for (detail::seq_index& index : t_->seq_pos.all()) {
            auto* lo = index.lower_bound(p0);
            auto* hi = p1 < 0 ? index.end() : std::max(lo, index.lower_bound(p1));
            index.erase(static_cast<size_t>(lo - index.begin()), static_cast<size_t>(hi - index.begin()));
        }
        const int64_t hi = p1 < 0 ? std::numeric_limits<int64_t>::max() : p1;
        for (uint32_t i = next_used(0); i < size(); i = next_used(i + 1)) {
            if (pos_[i] < std::max<pos_t>(p0, 0) || pos_[i] >= hi) continue;
            if (held(i) && seq_[i].empty()) continue;  // cached: belongs to no sequence
            if (drop(i)) lowest = std::min(lowest, i);
        }
        return lowest;
    }
    check_seq(s, "seq_rm_range");
    auto [lo, hi] = range(s, p0, p1);
    if (lo == hi) return lowest;
    for (const auto* e = lo; e < hi; ++e) {
        const uint32_t i = e->second;
        seq_[i].erase(s);
        if (seq_[i].empty() && drop(i)) lowest = std::min(lowest, i);
    }
    detail::seq_index& index = t_->seq_pos[s];
    index.erase(static_cast<size_t>(lo - index.begin()), static_cast<size_t>(hi - index.begin()));
    return lowest;
}

void kv_cells::seq_cp_range(seq_id_t src, seq_id_t dst, pos_t p0, pos_t p1) {
    check_seq(src, "seq_cp_range");
    check_seq(dst, "seq_cp_range");
    if (src == dst) return;
    t_->scratch.clear();
    auto [lo, hi] = range(src, p0, p1);
    if (lo == hi) return;
    // may grow the table of indexes; [lo, hi) stays valid: an index moves with its buffer of entries
    detail::seq_index& to = t_->seq_pos.get(dst, n_seq_max_);
    for (const auto* e = lo; e < hi; ++e) {
        if (seq_[e->second].contains(dst)) continue;  // idempotent
        seq_[e->second].insert(dst);
        t_->scratch.push_back(*e);
    }
    to.merge(t_->scratch);
}

uint32_t kv_cells::seq_keep_all(seq_id_t s) {
    check_seq(s, "seq_keep_all");
    uint32_t lowest = size();
    for (uint32_t i = next_used(0); i < size(); i = next_used(i + 1)) {
        seq_set& seqs = seq_[i];
        if (seqs.contains(s)) {
            if (seqs.size() > 1) {
                seqs.clear();
                seqs.insert(s);
            }
        } else if (!seqs.empty()) {  // a used cell with no sequence is left alone (as upstream)
            if (drop(i)) lowest = std::min(lowest, i);
        }
    }
    const std::span<detail::seq_index> all = t_->seq_pos.all();
    for (size_t k = 0; k < all.size(); ++k)
        if (t_->seq_pos.base() + static_cast<seq_id_t>(k) != s)
            all[k].clear();  // no other sequence holds any cell now
    return lowest;
}

void kv_cells::reorder(seq_id_t s, size_t lo, size_t hi) {
    detail::seq_index& index = t_->seq_pos[s];
    auto* b = index.begin();
    const size_t n = index.size();
    const bool left_ok = lo == 0 || lo == hi || !(b[lo] < b[lo - 1]);
    const bool right_ok = hi == n || lo == hi || !(b[hi] < b[hi - 1]);
    if (!left_ok || !right_ok) std::sort(b, index.end());
}

void kv_cells::apply_moves() {
    // Entries of other sequences for cells that moved: group by sequence, locate every entry while the
    // index is still sorted, rewrite, re-sort, drop removed cells (position -1 sorts first).
    std::sort(t_->moves.begin(), t_->moves.end(),
              [](const tables::move& a, const tables::move& b) { return a.seq < b.seq; });
    std::vector<entry*> at;
    for (size_t k = 0; k < t_->moves.size();) {
        const seq_id_t q = t_->moves[k].seq;
        detail::seq_index& index = t_->seq_pos[q];
        const size_t group = k;
        at.clear();
        for (; k < t_->moves.size() && t_->moves[k].seq == q; ++k) {
            auto* e = std::lower_bound(index.begin(), index.end(), t_->moves[k].old_entry);
            assert(e != index.end() && *e == t_->moves[k].old_entry);
            at.push_back(e);
        }
        size_t removed = 0;
        for (size_t j = 0; j < at.size(); ++j) {
            const int64_t np = t_->moves[group + j].new_pos;
            at[j]->first = np < 0 ? pos_none : static_cast<pos_t>(np);
            removed += np < 0;
        }
        std::sort(index.begin(), index.end());
        index.erase(0, removed);
    }
    t_->moves.clear();
}

uint32_t kv_cells::seq_add_range(seq_id_t s, pos_t p0, pos_t p1, pos_t d) {
    check_seq(s, "seq_add_range");
    uint32_t lowest = size();
    if (d == 0) return lowest;
    auto [lo, hi] = range(s, p0, p1);
    if (lo == hi) return lowest;
    constexpr int64_t lim = std::numeric_limits<pos_t>::max();
    for (const auto* e = lo; e < hi; ++e) {  // all or nothing: check every cell before moving any
        const uint32_t i = e->second;
        check_not_held(i, "seq_add_range");
        const int64_t sh = int64_t{shift_[i]} + d;
        if (int64_t{pos_[i]} + d > lim || sh > lim || sh < -lim)
            throw error(errc::out_of_range,
                        fmt::format("seq_add: seq {} cell {} at position {} (pending shift {}) moved by {} "
                                    "overflows int32",
                                    s, i, pos_[i], shift_[i], d));
    }
    has_shift_ = true;
    size_t gone = 0;  // moved below 0: a prefix of the slice, as every position moves by the same d
    for (auto* e = lo; e < hi; ++e) {
        const uint32_t i = e->second;
        const int64_t np = int64_t{pos_[i]} + d;
        for (seq_id_t q : seq_[i])
            if (q != s) t_->moves.push_back({q, *e, np});
        e->first = static_cast<pos_t>(np < 0 ? pos_none : np);
        if (np < 0) {
            make_empty(i);
            lowest = std::min(lowest, i);
            ++gone;
        } else {
            pos_[i] = static_cast<pos_t>(np);
            shift_[i] += d;
        }
    }
    detail::seq_index& index = t_->seq_pos[s];
    const auto first = static_cast<size_t>(lo - index.begin()),
               last = static_cast<size_t>(hi - index.begin());
    index.erase(first, first + gone);
    reorder(s, first, last - gone);
    apply_moves();
    return lowest;
}

void kv_cells::seq_div_range(seq_id_t s, pos_t p0, pos_t p1, int d) {
    check_seq(s, "seq_div_range");
    if (d < 1) throw error(errc::invalid_argument, fmt::format("seq_div: divisor {} must be >= 1", d));
    if (d == 1) return;
    auto [lo, hi] = range(s, p0, p1);
    if (lo == hi) return;
    for (const auto* e = lo; e < hi; ++e) {  // all or nothing
        const uint32_t i = e->second;
        check_not_held(i, "seq_div_range");
        if (int64_t{shift_[i]} + pos_[i] / d - pos_[i] < -int64_t{std::numeric_limits<pos_t>::max()})
            throw error(
                errc::out_of_range,
                fmt::format("seq_div: seq {} cell {} pending shift {} overflows int32", s, i, shift_[i]));
    }
    has_shift_ = true;
    for (auto* e = lo; e < hi; ++e) {
        const uint32_t i = e->second;
        const pos_t np = pos_[i] / d;
        for (seq_id_t q : seq_[i])
            if (q != s) t_->moves.push_back({q, *e, np});
        shift_[i] += np - pos_[i];  // new - old (design D1)
        pos_[i] = np;
        e->first = np;
    }
    detail::seq_index& index = t_->seq_pos[s];
    const auto first = static_cast<size_t>(lo - index.begin()),
               last = static_cast<size_t>(hi - index.begin());
    std::sort(lo, hi);  // equal quotients may reorder by cell index
    reorder(s, first, last);
    apply_moves();
}

// -- snapshots --

cells_snapshot kv_cells::cp(uint32_t i, uint32_t n) const {
    if (uint64_t{i} + n > size())
        throw error(errc::out_of_range,
                    fmt::format("kv_cells::cp: cells [{}, {}) outside [0, {})", i, uint64_t{i} + n, size()));
    cells_snapshot snap;
    snap.pos.assign(pos_.begin() + i, pos_.begin() + i + n);
    snap.ext.assign(ext_.begin() + i, ext_.begin() + i + n);
    snap.shift.assign(shift_.begin() + i, shift_.begin() + i + n);
    snap.seq.assign(seq_.begin() + i, seq_.begin() + i + n);
    return snap;
}

cells_snapshot kv_cells::cp(std::span<const uint32_t> idxs) const {
    cells_snapshot snap;
    snap.pos.reserve(idxs.size());
    snap.ext.reserve(idxs.size());
    snap.shift.reserve(idxs.size());
    snap.seq.reserve(idxs.size());
    for (uint32_t i : idxs) {
        check(i);
        snap.pos.push_back(pos_[i]);
        snap.ext.push_back(ext_[i]);
        snap.shift.push_back(shift_[i]);
        snap.seq.push_back(seq_[i]);
    }
    return snap;
}

namespace {

void check_snapshot(const cells_snapshot& snap, uint32_t n_seq_max) {
    const size_t n = snap.pos.size();
    if (snap.ext.size() != n || snap.shift.size() != n || snap.seq.size() != n)
        throw error(
            errc::invalid_argument,
            fmt::format("kv_cells::set: snapshot arrays differ in length (pos {}, ext {}, shift {}, seq {})",
                        n, snap.ext.size(), snap.shift.size(), snap.seq.size()));
    for (size_t j = 0; j < n; ++j) {
        if (snap.pos[j] < pos_none)
            throw error(errc::invalid_argument,
                        fmt::format("kv_cells::set: snapshot entry {} has position {}", j, snap.pos[j]));
        if (snap.pos[j] == pos_none && !snap.seq[j].empty())
            throw error(errc::invalid_argument,
                        fmt::format("kv_cells::set: snapshot entry {} is empty but holds sequences {}", j,
                                    snap.seq[j].to_string()));
        const seq_id_t last = snap.seq[j].next_from(static_cast<seq_id_t>(n_seq_max));
        if (last >= 0)
            throw error(errc::out_of_range,
                        fmt::format("kv_cells::set: snapshot entry {} holds seq {} not in [0, {})", j, last,
                                    n_seq_max));
    }
}

}  // namespace

void kv_cells::restore(uint32_t t, const cells_snapshot& snap, size_t j) {
    const bool was_used = pos_[t] != pos_none;
    if (was_used) index_remove(t);
    pos_[t] = snap.pos[j];
    ext_[t] = snap.ext[j];
    shift_[t] = snap.shift[j];
    seq_[t] = snap.seq[j];
    const bool now_used = pos_[t] != pos_none;
    if (was_used && !now_used) mark_free(t);
    if (!was_used && now_used) mark_used(t);
    if (now_used) index_add(t);
    if (shift_[t] != 0) has_shift_ = true;
}

void kv_cells::set(uint32_t i, const cells_snapshot& snap) {
    check_snapshot(snap, n_seq_max_);
    if (uint64_t{i} + snap.size() > size())
        throw error(errc::out_of_range, fmt::format("kv_cells::set: cells [{}, {}) outside [0, {})", i,
                                                    uint64_t{i} + snap.size(), size()));
    for (size_t j = snap.size(); j-- > 0;) restore(i + static_cast<uint32_t>(j), snap, j);  // as below
}

void kv_cells::set(std::span<const uint32_t> idxs, const cells_snapshot& snap) {
    check_snapshot(snap, n_seq_max_);
    if (idxs.size() != snap.size())
        throw error(
            errc::invalid_argument,
            fmt::format("kv_cells::set: {} indices for a snapshot of {} cells", idxs.size(), snap.size()));
    for (uint32_t i : idxs) check(i);
    // Last cell first: a trial placement appended its tokens to the sequences' position indexes, and
    // taking them out from the end costs O(1) each instead of a move of the rest of the index each.
    for (size_t j = idxs.size(); j-- > 0;) restore(idxs[j], snap, j);
}

// -- inspection --

std::string kv_cells::picture() const {
    std::string s(size(), '.');
    for (uint32_t i = 0; i < size(); ++i) {
        if (pos_[i] == pos_none) continue;
        const size_t n = seq_[i].size();
        if (n == 0)
            s[i] = held(i) ? '+' : '?';
        else if (n > 1)
            s[i] = 'M';
        else {
            const seq_id_t id = seq_[i].first();
            s[i] = id < 10 ? static_cast<char>('0' + id) : id < 36 ? static_cast<char>('a' + id - 10) : '*';
        }
    }
    return s;
}

void kv_cells::validate() const {
    const auto fail = [](const std::string& what) {
        throw error(errc::invalid_state, "kv_cells::validate: " + what);
    };
    uint32_t used = 0;
    std::map<seq_id_t, std::vector<entry>> index;  // what each sequence's index must hold
    for (uint32_t i = 0; i < size(); ++i) {
        const bool u = pos_[i] != pos_none;
        used += u;
        if (((t_->used[i / 64] >> (i % 64)) & 1) != u) fail(fmt::format("used bit of cell {} is wrong", i));
        if (pos_[i] < pos_none) fail(fmt::format("cell {} has position {}", i, pos_[i]));
        if (!u && (!seq_[i].empty() || shift_[i] != 0 || !(ext_[i] == cell_ext{})))
            fail(fmt::format("empty cell {} keeps sequences, shift or extension", i));
        if (shift_[i] != 0 && !has_shift_) fail(fmt::format("cell {} has a shift but has_shift is false", i));
        if (held(i) && !u) fail(fmt::format("empty cell {} is held", i));
        for (seq_id_t s : seq_[i]) {
            if (static_cast<uint32_t>(s) >= n_seq_max_) fail(fmt::format("cell {} holds seq {}", i, s));
            index[s].emplace_back(pos_[i], i);
        }
    }
    if (used != n_used_) fail(fmt::format("used count {} but {} cells are used", n_used_, used));
    for (auto& [s, want] : index) {
        std::sort(want.begin(), want.end());
        const detail::seq_index* have = t_->seq_pos.find(s);
        if (!have || !std::equal(want.begin(), want.end(), have->begin(), have->end()))
            fail(fmt::format("index of seq {} disagrees with the cells", s));
    }
    const std::span<const detail::seq_index> all = std::as_const(t_->seq_pos).all();
    for (size_t k = 0; k < all.size(); ++k) {
        const seq_id_t s = t_->seq_pos.base() + static_cast<seq_id_t>(k);
        if (!all[k].empty() && !index.count(s))
            fail(fmt::format("index of seq {} lists cells it does not hold", s));
    }
    for (size_t w = 0; w < t_->used.size(); ++w) {
        const uint32_t n = size();
        const uint64_t valid = (w + 1) * 64 <= n ? all_bits : (uint64_t{1} << (n % 64)) - 1;
        if (t_->used[w] & ~valid) fail(fmt::format("word {} has bits past the end", w));
        const bool any_u = (t_->any_used[w / 64] >> (w % 64)) & 1;
        const bool any_f = (t_->any_free[w / 64] >> (w % 64)) & 1;
        if (any_u != (t_->used[w] != 0)) fail(fmt::format("used summary of word {} is wrong", w));
        if (any_f != (t_->used[w] != valid)) fail(fmt::format("free summary of word {} is wrong", w));
    }
}

}  // namespace kvc
