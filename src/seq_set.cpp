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

namespace {

// A window of n words starting at word b, zeroed.
uint64_t* new_window(size_t n, size_t b) {
    auto* p = new uint64_t[2 + n]();
    p[0] = n;
    p[1] = b;
    return p;
}

}  // namespace

seq_set::seq_set(const seq_set& other) : lo_(other.lo_) {
    const auto [first, last] = other.high_span();
    if (first == last) return;
    hi_ = new_window(last - first, first);
    std::memcpy(hi_ + header, other.hi_ + header + other.high_slot(first), (last - first) * sizeof(uint64_t));
}

seq_set& seq_set::operator=(const seq_set& other) {
    if (this == &other) return *this;
    const auto [first, last] = other.high_span();
    if (first == last) {  // no high id: keep the allocation for reuse
        lo_ = other.lo_;
        if (hi_) clear_high();
        return *this;
    }
    if (high_words() < last - first) {
        uint64_t* p = new_window(last - first, first);  // may throw: before any change
        delete[] hi_;
        hi_ = p;
    }
    lo_ = other.lo_;
    clear_high();
    hi_[1] = first;
    std::memcpy(hi_ + header, other.hi_ + header + other.high_slot(first), (last - first) * sizeof(uint64_t));
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

std::pair<size_t, size_t> seq_set::high_span() const {
    const size_t n = high_words();
    size_t k0 = 0, k1 = n;
    while (k0 < n && hi_[header + k0] == 0) ++k0;
    if (k0 == n) return {0, 0};
    while (hi_[header + k1 - 1] == 0) --k1;
    const size_t b = static_cast<size_t>(hi_[1]);
    return {b + k0, b + k1};
}

void seq_set::cover(size_t first, size_t last) {
    const size_t n = high_words();
    if (n > 0 && high_slot(first) < n && high_slot(last - 1) < n) return;
    const auto [f, l] = high_span();
    if (f != l) {  // keep the ids held: the window grows to cover both, at least doubling
        first = std::min(first, f);
        last = std::max(last, l);
        const size_t want = std::max(last - first, 2 * n);
        if (first < f)
            first = last > want ? std::max<size_t>(1, last - want) : 1;  // grow downwards
        else
            last = first + want;
    }
    if (f == l && last - first <= n) {  // no id held: the allocation moves to the new range
        hi_[1] = first;
        return;
    }
    uint64_t* p = new_window(last - first, first);
    if (f != l)
        std::memcpy(p + header + (f - first), hi_ + header + high_slot(f), (l - f) * sizeof(uint64_t));
    delete[] hi_;
    hi_ = p;
}

void seq_set::insert_high(seq_id_t id) {
    if (id < 0) throw error(errc::out_of_range, fmt::format("seq_set: negative sequence id {}", id));
    const size_t w = static_cast<size_t>(id) / 64;
    cover(w, w + 1);
    hi_[header + high_slot(w)] |= bit(id);
}

bool seq_set::high_empty() const {
    for (size_t k = 0; k < high_words(); ++k)
        if (hi_[header + k]) return false;
    return true;
}

void seq_set::clear_high() {
    std::fill(hi_ + header, hi_ + header + high_words(), uint64_t{0});
}

size_t seq_set::size() const {
    size_t n = static_cast<size_t>(std::popcount(lo_));
    for (size_t k = 0; k < high_words(); ++k) n += static_cast<size_t>(std::popcount(hi_[header + k]));
    return n;
}

seq_id_t seq_set::next_from_high(seq_id_t from) const {
    const auto b = static_cast<size_t>(hi_[1]), n = static_cast<size_t>(hi_[0]);
    size_t w = static_cast<size_t>(from) / 64;
    uint64_t mask = ~uint64_t{0} << (from % 64);
    if (w < b) {  // from is before the window
        w = b;
        mask = ~uint64_t{0};
    }
    for (size_t k = w - b; k < n; ++k, mask = ~uint64_t{0})
        if (const uint64_t bits = hi_[header + k] & mask)
            return static_cast<seq_id_t>((b + k) * 64 + static_cast<size_t>(std::countr_zero(bits)));
    return -1;
}

seq_id_t seq_set::first() const {
    if (lo_) return static_cast<seq_id_t>(std::countr_zero(lo_));
    return next_from(64);
}

bool seq_set::is_only(seq_id_t id) const {
    if (id < 0) return false;
    if (id < 64) return lo_ == (uint64_t{1} << id) && high_empty();
    if (lo_ != 0 || !contains_high(id)) return false;
    const size_t kid = high_slot(static_cast<size_t>(id) / 64);
    for (size_t k = 0; k < high_words(); ++k)
        if (hi_[header + k] != (k == kid ? bit(id) : 0)) return false;
    return true;
}

bool seq_set::intersects(const seq_set& other) const {
    if (lo_ & other.lo_) return true;
    for (size_t k = 0; k < high_words(); ++k) {
        const uint64_t x = hi_[header + k];
        if (x && (x & other.word(hi_[1] + k))) return true;
    }
    return false;
}

bool seq_set::is_subset_of(const seq_set& other) const {
    if (lo_ & ~other.lo_) return false;
    for (size_t k = 0; k < high_words(); ++k) {
        const uint64_t x = hi_[header + k];
        if (x & ~other.word(hi_[1] + k)) return false;
    }
    return true;
}

bool seq_set::operator==(const seq_set& other) const {
    return is_subset_of(other) && other.is_subset_of(*this);
}

seq_set& seq_set::operator|=(const seq_set& other) {
    const auto [first, last] = other.high_span();
    if (first != last) {
        cover(first, last);  // may allocate: before any change
        for (size_t w = first; w < last; ++w) hi_[header + high_slot(w)] |= other.word(w);
    }
    lo_ |= other.lo_;
    return *this;
}

seq_set& seq_set::operator&=(const seq_set& other) {
    lo_ &= other.lo_;
    for (size_t k = 0; k < high_words(); ++k) hi_[header + k] &= other.word(hi_[1] + k);
    return *this;
}

seq_set& seq_set::operator-=(const seq_set& other) {
    lo_ &= ~other.lo_;
    for (size_t k = 0; k < high_words(); ++k) hi_[header + k] &= ~other.word(hi_[1] + k);
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
