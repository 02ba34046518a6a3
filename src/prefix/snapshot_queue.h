// The eviction order of a recurrent memory's snapshots (src/memory_recurrent_prefix.cpp, design D33).
//
// Snapshots, not blocks, are what a recurrent prefix cache spends memory on, and one on an inner block of
// a chain (a prompt's end under a sequence still decoding) is as evictable as one on a leaf: its block
// stays in the index while deeper snapshots hang from it. So snapshots have their own queues, by level
// (lowest first) and oldest first within one:
//   - the rolling snapshots of live sequences go first: the sequence holds that state itself, and the
//     snapshot serves only once it ends (then it is kept like the others);
//   - then the priority of the snapshot's block (0-100) and, with the SLRU policy, its segment (a
//     snapshot hit since it was published is protected, above the probation of its priority; the
//     protected ones are bounded, the oldest of the lowest priority going back to probation).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include <kvcache/prefix_cache.h>

namespace kvc::detail {

class snapshot_queue {
public:
    static constexpr uint32_t none = UINT32_MAX;

    // n_slots: the pool; max_protected: protected snapshots at most (SLRU; 0 with LRU).
    snapshot_queue(uint32_t n_slots, evict_policy policy, uint32_t max_protected);

    bool queued(uint32_t slot) const { return level_[slot] != unqueued; }
    bool rolling(uint32_t slot) const { return level_[slot] == 0; }
    // A published snapshot: the newest of its priority's probation, or the next to go of it (`first`: a
    // kind of snapshot that is seldom resumed from).
    void push(uint32_t slot, uint8_t priority, bool first = false);
    // A live sequence's rolling snapshot: the newest of the rolling ones.
    void push_rolling(uint32_t slot);
    // An attach resumed from it: the newest of its level again (LRU), or of its protected level (SLRU).
    void hit(uint32_t slot);
    // A sequence that resumed from it or published it went on to a deeper snapshot, and no other
    // continuation hangs from its block: the next to go of its priority's probation.
    void demote(uint32_t slot);
    // Its block's priority changed: the newest of the new level.
    void set_priority(uint32_t slot, uint8_t priority);
    void erase(uint32_t slot);
    // The snapshot to evict next; none if no snapshot is queued.
    uint32_t front() const;
    void clear();
    size_t bytes() const;

private:
    // level 0: rolling; then 1 + 2 x priority + segment
    static constexpr uint32_t n_levels = 1 + 2 * (prefix_max_priority + 1);
    static uint32_t level_of(uint8_t priority, uint32_t segment) {
        return 1 + 2 * uint32_t{std::min(priority, prefix_max_priority)} + segment;
    }
    static bool is_protected(uint32_t level) { return level > 0 && level % 2 == 0; }
    static constexpr uint16_t unqueued = UINT16_MAX;
    struct queue {
        uint32_t head = none;
        uint32_t tail = none;
    };
    // The lowest non-empty level >= from (of protected levels only), or n_levels.
    uint32_t next_level(uint32_t from, bool protected_only) const;
    void link_back(uint32_t slot, uint32_t level);
    void link_front(uint32_t slot, uint32_t level);
    void unlink(uint32_t slot);
    void bound_protected();

    evict_policy policy_;
    uint32_t max_protected_;
    uint32_t n_protected_ = 0;
    std::vector<uint32_t> prev_, next_;
    std::vector<uint16_t> level_;  // unqueued: not in a queue
    std::array<queue, n_levels> levels_{};
    std::array<uint64_t, (n_levels + 63) / 64> nonempty_{};  // bit l: levels_[l] has snapshots
};

}  // namespace kvc::detail
