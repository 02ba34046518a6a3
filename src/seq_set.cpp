#include <algorithm>
#include <cassert>
#include <cstring>
#include <new>

#include <fmt/format.h>
#include <kvcache/seq_set.h>

namespace kvc {

seq_set::seq_set(std::initializer_list<seq_id_t> ids) {
    for (seq_id_t id : ids) insert(id);
}

seq_set::seq_set(const seq_set& other) : lo_(other.lo_) {
    if (other.hi_ && !other.high_empty()) {
        const size_t n = other.capacity_words();
        hi_ = new uint64_t[n];
        std::memcpy(hi_, other.hi_, n * sizeof(uint64_t));  // hi_[0] (the capacity) included
    }
}

seq_set& seq_set::operator=(const seq_set& other) {
    if (this == &other) return *this;
    lo_ = other.lo_;
    if (hi_) std::fill(hi_ + 1, hi_ + capacity_words(), uint64_t{0});  // keep the allocation for reuse
    if (other.hi_ && !other.high_empty()) {
        const size_t n = other.capacity_words();
        uint64_t* words = reserve_words(n);
        std::memcpy(words + 1, other.hi_ + 1, (n - 1) * sizeof(uint64_t));
    }
    return *this;
}

seq_set& seq_set::operator=(seq_set&& other) noexcept {
    if (this == &other) return *this;
    delete[] hi_;
    lo_ = other.lo_;
    hi_ = other.hi_;
    other.lo_ = 0;
    other.hi_ = nullptr;
    return *this;
}

uint64_t* seq_set::reserve_words(size_t words) {
    const size_t cap = capacity_words();
    if (words <= cap) return hi_;
    const size_t new_cap = std::max(words, 2 * cap);
    auto* p = new uint64_t[new_cap]();
    p[0] = new_cap;
    if (hi_) std::memcpy(p + 1, hi_ + 1, (cap - 1) * sizeof(uint64_t));
    delete[] hi_;
    hi_ = p;
    return p;
}

void seq_set::insert_high(seq_id_t id) {
    if (id < 0) throw error(errc::out_of_range, fmt::format("seq_set: negative sequence id {}", id));
    const size_t w = static_cast<size_t>(id) / 64;
    reserve_words(w + 1)[w] |= bit(id);
}

bool seq_set::high_empty() const {
    for (size_t w = 1; w < capacity_words(); ++w)
        if (hi_[w]) return false;
    return true;
}

void seq_set::clear() {
    lo_ = 0;
    if (hi_) std::fill(hi_ + 1, hi_ + capacity_words(), uint64_t{0});
}

size_t seq_set::size() const {
    size_t n = static_cast<size_t>(std::popcount(lo_));
    for (size_t w = 1; w < capacity_words(); ++w) n += static_cast<size_t>(std::popcount(hi_[w]));
    return n;
}

seq_id_t seq_set::next_from(seq_id_t from) const {
    if (from < 0) from = 0;
    const size_t cap = capacity_words();
    size_t w = static_cast<size_t>(from) / 64;
    if (w >= cap) return -1;
    uint64_t bits = word(w) & (~uint64_t{0} << (from % 64));
    while (true) {
        if (bits) return static_cast<seq_id_t>(w * 64 + static_cast<size_t>(std::countr_zero(bits)));
        if (++w >= cap) return -1;
        bits = hi_[w];
    }
}

seq_id_t seq_set::first() const {
    if (lo_) return static_cast<seq_id_t>(std::countr_zero(lo_));
    return next_from(64);
}

bool seq_set::is_only(seq_id_t id) const {
    if (id < 0) return false;
    if (id < 64) return lo_ == (uint64_t{1} << id) && (hi_ == nullptr || high_empty());
    if (lo_ != 0 || !contains_high(id)) return false;
    const size_t wid = static_cast<size_t>(id) / 64;
    for (size_t w = 1; w < capacity_words(); ++w)
        if (hi_[w] != (w == wid ? bit(id) : 0)) return false;
    return true;
}

bool seq_set::intersects(const seq_set& other) const {
    if (lo_ & other.lo_) return true;
    const size_t n = std::min(capacity_words(), other.capacity_words());
    for (size_t w = 1; w < n; ++w)
        if (hi_[w] & other.hi_[w]) return true;
    return false;
}

bool seq_set::is_subset_of(const seq_set& other) const {
    const size_t n = capacity_words();
    for (size_t w = 0; w < n; ++w)
        if (word(w) & ~other.word(w)) return false;
    return true;
}

bool seq_set::operator==(const seq_set& other) const {
    const size_t n = std::max(capacity_words(), other.capacity_words());
    for (size_t w = 0; w < n; ++w)
        if (word(w) != other.word(w)) return false;
    return true;
}

seq_set& seq_set::operator|=(const seq_set& other) {
    lo_ |= other.lo_;
    const size_t n = other.capacity_words();
    if (n > 1 && !other.high_empty()) {
        uint64_t* words = reserve_words(n);
        for (size_t w = 1; w < n; ++w) words[w] |= other.hi_[w];
    }
    return *this;
}

seq_set& seq_set::operator&=(const seq_set& other) {
    lo_ &= other.lo_;
    for (size_t w = 1; w < capacity_words(); ++w) hi_[w] &= other.word(w);
    return *this;
}

seq_set& seq_set::operator-=(const seq_set& other) {
    lo_ &= ~other.lo_;
    const size_t n = std::min(capacity_words(), other.capacity_words());
    for (size_t w = 1; w < n; ++w) hi_[w] &= ~other.hi_[w];
    return *this;
}

std::string seq_set::to_string() const {
    std::string s = "{";
    for (seq_id_t id : *this) {
        if (s.size() > 1) s += ", ";
        s += std::to_string(id);
    }
    s += "}";
    return s;
}

}  // namespace kvc
