#include "prefix/snapshot_queue.h"

#include <algorithm>
#include <cassert>

namespace kvc::detail {

snapshot_queue::snapshot_queue(uint32_t n_slots, evict_policy policy, uint32_t max_protected)
    : policy_(policy),
      max_protected_(policy == evict_policy::slru ? max_protected : 0),
      prev_(n_slots, none),
      next_(n_slots, none),
      level_(n_slots, unqueued) {}

uint32_t snapshot_queue::next_level(uint32_t from, bool protected_only) const {
    for (uint32_t w = from / 64; w < nonempty_.size(); ++w) {
        uint64_t bits = nonempty_[w];
        if (w == from / 64) bits &= ~uint64_t{0} << (from % 64);
        if (protected_only) bits &= w == 0 ? 0x5555555555555554ull : 0x5555555555555555ull;  // even, > 0
        if (bits != 0) return w * 64 + static_cast<uint32_t>(__builtin_ctzll(bits));
    }
    return n_levels;
}

void snapshot_queue::link_back(uint32_t slot, uint32_t level) {
    queue& q = levels_[level];
    prev_[slot] = q.tail;
    next_[slot] = none;
    (q.tail == none ? q.head : next_[q.tail]) = slot;
    q.tail = slot;
    level_[slot] = static_cast<uint16_t>(level);
    nonempty_[level / 64] |= uint64_t{1} << (level % 64);
    n_protected_ += is_protected(level);
}

void snapshot_queue::link_front(uint32_t slot, uint32_t level) {
    queue& q = levels_[level];
    next_[slot] = q.head;
    prev_[slot] = none;
    (q.head == none ? q.tail : prev_[q.head]) = slot;
    q.head = slot;
    level_[slot] = static_cast<uint16_t>(level);
    nonempty_[level / 64] |= uint64_t{1} << (level % 64);
    n_protected_ += is_protected(level);
}

void snapshot_queue::unlink(uint32_t slot) {
    const uint32_t level = level_[slot];
    assert(level != unqueued);
    queue& q = levels_[level];
    (prev_[slot] == none ? q.head : next_[prev_[slot]]) = next_[slot];
    (next_[slot] == none ? q.tail : prev_[next_[slot]]) = prev_[slot];
    prev_[slot] = next_[slot] = none;
    level_[slot] = unqueued;
    if (q.head == none) nonempty_[level / 64] &= ~(uint64_t{1} << (level % 64));
    n_protected_ -= is_protected(level);
}

// The oldest protected snapshot of the lowest priority goes back to probation (as its newest).
void snapshot_queue::bound_protected() {
    while (n_protected_ > max_protected_) {
        const uint32_t l = next_level(0, /*protected_only=*/true);
        assert(l < n_levels);
        const uint32_t slot = levels_[l].head;
        unlink(slot);
        link_back(slot, l - 1);
    }
}

void snapshot_queue::push(uint32_t slot, uint8_t priority, bool first) {
    erase(slot);  // a rolling snapshot kept when its sequence ends
    if (first)
        link_front(slot, level_of(priority, 0));
    else
        link_back(slot, level_of(priority, 0));
}

void snapshot_queue::push_rolling(uint32_t slot) {
    assert(!queued(slot));
    link_back(slot, 0);
}

void snapshot_queue::hit(uint32_t slot) {
    const uint32_t level = level_[slot];
    if (level == 0) return;  // still rolling: its sequence decides
    unlink(slot);
    link_back(slot, policy_ == evict_policy::slru && !is_protected(level) ? level + 1 : level);
    bound_protected();
}

void snapshot_queue::demote(uint32_t slot) {
    const uint32_t level = level_[slot];
    if (level == 0) return;
    unlink(slot);
    link_front(slot, is_protected(level) ? level - 1 : level);
}

void snapshot_queue::set_priority(uint32_t slot, uint8_t priority) {
    const uint32_t level = level_[slot];
    if (level == 0) return;
    const uint32_t to = level_of(priority, is_protected(level));
    if (to == level) return;
    unlink(slot);
    link_back(slot, to);
}

void snapshot_queue::erase(uint32_t slot) {
    if (queued(slot)) unlink(slot);
}

uint32_t snapshot_queue::front() const {
    const uint32_t l = next_level(0, /*protected_only=*/false);
    return l < n_levels ? levels_[l].head : none;
}

void snapshot_queue::clear() {
    std::fill(prev_.begin(), prev_.end(), none);
    std::fill(next_.begin(), next_.end(), none);
    std::fill(level_.begin(), level_.end(), unqueued);
    levels_ = {};
    nonempty_ = {};
    n_protected_ = 0;
}

size_t snapshot_queue::bytes() const {
    return (prev_.capacity() + next_.capacity()) * sizeof(uint32_t) + level_.capacity() * sizeof(uint16_t) +
           sizeof(levels_) + sizeof(nonempty_);
}

}  // namespace kvc::detail
