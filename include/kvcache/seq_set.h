/// @file
/// seq_set: the sequences one cell belongs to.
///
/// llama.cpp uses a fixed 256-bit bitset; kvcache has no compile-time cap on sequences. Ids below 64
/// live in one inline machine word (the common case costs what a std::bitset<64> costs); higher ids go
/// to a heap-allocated window of words covering only the ids the set holds (a cell of sequence 60000
/// costs one word, not 938): it grows on demand, moves to a new id range when its ids are all gone, and
/// is never shrunk by erase(), so that a cell reused by the same high sequence does not allocate again.
///
/// 16 bytes per set. Iteration is in ascending id order.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <string>
#include <utility>

#include <kvcache/types.h>

namespace kvc {

/// The sequences one cell belongs to: a set of sequence ids, without a cap on the ids.
class seq_set {
public:
    seq_set() = default;                           ///< the empty set
    seq_set(std::initializer_list<seq_id_t> ids);  ///< the set of `ids`
    seq_set(const seq_set& other);                 ///< a copy
    /// Takes other's ids; other is left empty.
    seq_set(seq_set&& other) noexcept : lo_(other.lo_), hi_(other.hi_) {
        other.lo_ = 0;
        other.hi_ = nullptr;
    }
    seq_set& operator=(const seq_set& other);      ///< copies other's ids
    seq_set& operator=(seq_set&& other) noexcept;  ///< takes other's ids; other is left empty
    ~seq_set() { delete[] hi_; }                   ///< frees the heap words, if any

    // -- queries --
    /// Whether id is in the set (false for a negative id).
    bool contains(seq_id_t id) const {
        if (static_cast<uint32_t>(id) < 64) return (lo_ >> id) & 1u;
        return id >= 0 && contains_high(id);
    }
    /// No sequence.
    bool empty() const { return lo_ == 0 && (hi_ == nullptr || high_empty()); }
    size_t size() const;                            ///< number of sequences
    seq_id_t first() const;                         ///< smallest id; -1 when empty
    bool is_only(seq_id_t id) const;                ///< the set is exactly {id}
    bool intersects(const seq_set& other) const;    ///< some id is in both sets
    bool is_subset_of(const seq_set& other) const;  ///< every id of this set is in other
    bool operator==(const seq_set& other) const;    ///< the same ids

    // -- mutations (throw kvc::error on a negative id) --
    /// Adds id (no effect if present).
    void insert(seq_id_t id) {
        if (static_cast<uint32_t>(id) < 64) {
            lo_ |= uint64_t{1} << id;
            return;
        }
        if (hi_ && id > 0) {  // inside the window: no allocation
            const size_t k = static_cast<size_t>(id) / 64 - static_cast<size_t>(hi_[1]);
            if (k < hi_[0]) {
                hi_[header + k] |= bit(id);
                return;
            }
        }
        insert_high(id);
    }
    /// Removes id (no effect if absent); never frees memory.
    void erase(seq_id_t id) {
        if (static_cast<uint32_t>(id) < 64) {
            lo_ &= ~(uint64_t{1} << id);
            return;
        }
        if (hi_ && id > 0) {
            const size_t k = static_cast<size_t>(id) / 64 - static_cast<size_t>(hi_[1]);
            if (k < hi_[0]) hi_[header + k] &= ~bit(id);
        }
    }
    /// Removes every id; never frees memory.
    void clear() {
        lo_ = 0;
        if (hi_) clear_high();
    }
    seq_set& operator|=(const seq_set& other);  ///< add other's ids
    seq_set& operator&=(const seq_set& other);  ///< keep only the ids also in other
    seq_set& operator-=(const seq_set& other);  ///< remove other's ids

    // -- iteration (ascending ids) --
    /// Forward iterator over the ids of a set, ascending; valid while the set is not modified.
    class iterator {
    public:
        using iterator_category = std::forward_iterator_tag;  ///< a forward iterator
        using value_type = seq_id_t;                          ///< a sequence id
        using difference_type = std::ptrdiff_t;               ///< distance between iterators
        using pointer = const seq_id_t*;                      ///< standard iterator trait
        using reference = seq_id_t;                           ///< ids are returned by value

        iterator() = default;                       ///< a singular iterator
        seq_id_t operator*() const { return id_; }  ///< the current id
        /// To the next larger id (or end()).
        iterator& operator++() {
            id_ = set_->next_from(id_ + 1);
            return *this;
        }
        /// Post-increment.
        iterator operator++(int) {
            iterator it = *this;
            ++*this;
            return it;
        }
        bool operator==(const iterator& other) const { return id_ == other.id_; }  ///< the same position

    private:
        friend class seq_set;
        iterator(const seq_set* set, seq_id_t id) : set_(set), id_(id) {}
        const seq_set* set_ = nullptr;
        seq_id_t id_ = -1;  // -1 = end
    };
    iterator begin() const { return iterator(this, next_from(0)); }  ///< the smallest id
    iterator end() const { return iterator(this, -1); }              ///< past the largest id

    /// Smallest id >= from, or -1 when none.
    seq_id_t next_from(seq_id_t from) const {
        const uint32_t f = from < 0 ? 0 : static_cast<uint32_t>(from);
        if (f < 64) {
            const uint64_t bits = lo_ & (~uint64_t{0} << f);
            if (bits) return static_cast<seq_id_t>(std::countr_zero(bits));
            from = 64;
        }
        return hi_ ? next_from_high(from) : -1;
    }

    /// "{0, 3, 70}" for messages and pictures.
    std::string to_string() const;

private:
    static uint64_t bit(seq_id_t id) { return uint64_t{1} << (id % 64); }
    // The heap window: hi_[0] = its length n in words, hi_[1] = its first word b (>= 1); hi_[header + k]
    // holds ids [64 (b + k), 64 (b + k) + 64) for k < n. Word 0 (ids below 64) is lo_.
    static constexpr size_t header = 2;
    size_t high_words() const { return hi_ ? static_cast<size_t>(hi_[0]) : 0; }
    // Slot of word w in the window; >= high_words() when outside (unsigned wrap below the first word).
    size_t high_slot(size_t w) const { return w - (hi_ ? static_cast<size_t>(hi_[1]) : 1); }
    bool contains_high(seq_id_t id) const {
        if (!hi_) return false;
        const size_t k = static_cast<size_t>(id) / 64 - static_cast<size_t>(hi_[1]);
        return k < hi_[0] && (hi_[header + k] & bit(id));
    }
    seq_id_t next_from_high(seq_id_t from) const;  // from >= 64, hi_ not null
    bool high_empty() const;
    void clear_high();
    void insert_high(seq_id_t id);
    // Makes the window cover words [first, last) (1 <= first < last), keeping its ids.
    void cover(size_t first, size_t last);
    // [first, last) words of the window holding an id; first == last when none.
    std::pair<size_t, size_t> high_span() const;
    uint64_t word(size_t w) const {
        if (w == 0) return lo_;
        const size_t k = high_slot(w);
        return k < high_words() ? hi_[header + k] : 0;
    }

    uint64_t lo_ = 0;         // ids [0, 64)
    uint64_t* hi_ = nullptr;  // the window of words for ids >= 64, or null
};

}  // namespace kvc
