#include "detail/prefix_index.h"

#include <algorithm>
#include <cassert>
#include <cstring>

#include <xxhash.h>

namespace kvc::detail {

prefix_index::prefix_index(uint32_t block_size, uint32_t n_stream) : bs_(block_size), queues_(n_stream) {
    slots_.assign(64, none);
}

uint64_t prefix_index::hash_of(uint64_t seed, std::span<const token_t> toks) const {
    return XXH3_64bits_withSeed(toks.data(), toks.size_bytes(), seed);
}

// -- table --

void prefix_index::table_insert(uint32_t id) {
    if (2 * (uint64_t{n_live_} + 1) > slots_.size()) grow();
    const size_t mask = slots_.size() - 1;
    size_t i = blocks_[id].hash & mask;
    while (slots_[i] != none) i = (i + 1) & mask;
    slots_[i] = id;
    ++n_live_;
}

// Linear probing without tombstones: after emptying a slot, move back every later entry of the run that
// would no longer be reachable from its home slot.
void prefix_index::table_erase(uint32_t id) {
    const size_t mask = slots_.size() - 1;
    size_t i = blocks_[id].hash & mask;
    while (slots_[i] != id) {
        assert(slots_[i] != none);
        i = (i + 1) & mask;
    }
    slots_[i] = none;
    for (size_t j = (i + 1) & mask; slots_[j] != none; j = (j + 1) & mask) {
        const size_t home = blocks_[slots_[j]].hash & mask;
        // slot j's entry may move to the hole at i unless its home lies cyclically in (i, j]
        const bool stays = i <= j ? (home > i && home <= j) : (home > i || home <= j);
        if (stays) continue;
        slots_[i] = slots_[j];
        slots_[j] = none;
        i = j;
    }
    --n_live_;
}

void prefix_index::grow() {
    std::vector<uint32_t> old(slots_.size() * 2, none);
    old.swap(slots_);
    const size_t mask = slots_.size() - 1;
    for (uint32_t id : old) {
        if (id == none) continue;
        size_t i = blocks_[id].hash & mask;
        while (slots_[i] != none) i = (i + 1) & mask;
        slots_[i] = id;
    }
}

uint32_t prefix_index::find(uint32_t parent, uint64_t key, std::span<const token_t> toks) const {
    assert(toks.size() == bs_);
    const uint64_t seed = seed_of(parent, key);
    const uint64_t h = hash_of(seed, toks);
    const size_t mask = slots_.size() - 1;
    for (size_t i = h & mask; slots_[i] != none; i = (i + 1) & mask) {
        const uint32_t id = slots_[i];
        const block& b = blocks_[id];
        // the hash only finds candidates: the parent (a root's key) and the tokens prove the match
        if (b.hash == h && b.parent == parent && b.seed == seed &&
            std::memcmp(tokens(id).data(), toks.data(), toks.size_bytes()) == 0)
            return id;
    }
    return none;
}

void prefix_index::match(uint64_t key, std::span<const token_t> toks, std::vector<uint32_t>& out) const {
    const size_t n = toks.size() / bs_;
    if (n == 0) return;
    std::vector<uint64_t> h(n);
    uint64_t seed = key;
    for (size_t j = 0; j < n; ++j) seed = h[j] = hash_of(seed, toks.subspan(j * bs_, bs_));
    const size_t mask = slots_.size() - 1;
    constexpr size_t ahead = 4;
    for (size_t j = 0; j < std::min(n, ahead); ++j) __builtin_prefetch(&slots_[h[j] & mask]);
    uint32_t parent = none;
    seed = key;
    for (size_t j = 0; j < n; ++j) {
        if (j + ahead < n) __builtin_prefetch(&slots_[h[j + ahead] & mask]);
        if (j + 1 < n) {  // the next block's candidates: their records and tokens
            const uint32_t c = slots_[h[j + 1] & mask];
            if (c != none) {
                __builtin_prefetch(&blocks_[c]);
                __builtin_prefetch(tokens_.data() + size_t{c} * bs_);
            }
        }
        const std::span<const token_t> t = toks.subspan(j * bs_, bs_);
        uint32_t found = none;
        for (size_t i = h[j] & mask; slots_[i] != none; i = (i + 1) & mask) {
            const uint32_t id = slots_[i];
            const block& b = blocks_[id];
            if (b.hash == h[j] && b.parent == parent && b.seed == seed &&
                std::memcmp(tokens(id).data(), t.data(), t.size_bytes()) == 0) {
                found = id;
                break;
            }
        }
        if (found == none) return;
        out.push_back(found);
        parent = found;
        seed = h[j];
    }
}

uint32_t prefix_index::add(uint32_t parent, uint64_t key, std::span<const token_t> toks,
                           std::span<const uint32_t> cells, uint32_t stream) {
    assert(toks.size() == bs_ && cells.size() == bs_ && stream < queues_.size());
    uint32_t id;
    if (!free_ids_.empty()) {
        id = free_ids_.back();
        free_ids_.pop_back();
    } else {
        id = static_cast<uint32_t>(blocks_.size());
        blocks_.emplace_back();
        tokens_.resize(tokens_.size() + bs_);
        cells_.resize(cells_.size() + bs_);
    }
    block& b = blocks_[id];
    b = block{};
    b.seed = seed_of(parent, key);
    b.hash = hash_of(b.seed, toks);
    b.parent = parent;
    b.held = bs_;
    b.depth = parent == none ? 0 : blocks_[parent].depth + 1;
    b.stream = stream;
    b.st = state::held;
    std::copy(toks.begin(), toks.end(), tokens_.begin() + static_cast<ptrdiff_t>(size_t{id} * bs_));
    std::copy(cells.begin(), cells.end(), cells_.begin() + static_cast<ptrdiff_t>(size_t{id} * bs_));
    if (parent != none) ++blocks_[parent].n_children;
    table_insert(id);
    return id;
}

// -- queue --

void prefix_index::push_back(uint32_t id) {
    queue& q = queues_[blocks_[id].stream];
    block& b = blocks_[id];
    b.prev = q.tail;
    b.next = none;
    (q.tail == none ? q.head : blocks_[q.tail].next) = id;
    q.tail = id;
    b.st = state::queued;
}

void prefix_index::push_front(uint32_t id) {
    queue& q = queues_[blocks_[id].stream];
    block& b = blocks_[id];
    b.next = q.head;
    b.prev = none;
    (q.head == none ? q.tail : blocks_[q.head].prev) = id;
    q.head = id;
    b.st = state::queued;
}

void prefix_index::unlink(uint32_t id) {
    queue& q = queues_[blocks_[id].stream];
    block& b = blocks_[id];
    (b.prev == none ? q.head : blocks_[b.prev].next) = b.next;
    (b.next == none ? q.tail : blocks_[b.next].prev) = b.prev;
    b.prev = b.next = none;
}

void prefix_index::acquire(uint32_t id) {
    block& b = blocks_[id];
    assert(b.held < bs_);
    if (b.held++ > 0) return;
    if (b.st == state::queued) unlink(id);
    b.st = state::held;
}

void prefix_index::release(uint32_t id) {
    block& b = blocks_[id];
    assert(b.held > 0 && b.st == state::held);
    if (--b.held > 0) return;
    if (b.n_children > 0)
        b.st = state::waiting;
    else
        push_back(id);
}

void prefix_index::requeue(std::span<const uint32_t> ids) {
    for (uint32_t id : ids)
        if (blocks_[id].st == state::queued) {
            unlink(id);
            push_back(id);
        }
}

bool prefix_index::plan_eviction(uint32_t stream, uint32_t n, std::vector<uint32_t>& out) const {
    // Walk the queue oldest first; a waiting parent whose children all go in the plan goes right after
    // them (it was released no later than they were).
    std::vector<std::pair<uint32_t, uint32_t>> left;  // (waiting parent, children not yet planned)
    std::vector<uint32_t> ready;
    const size_t start = out.size();
    uint64_t got = 0;
    uint32_t cur = queues_[stream].head;
    while (got < n) {
        uint32_t id;
        if (!ready.empty()) {
            id = ready.back();
            ready.pop_back();
        } else if (cur != none) {
            id = cur;
            cur = blocks_[cur].next;
        } else {
            out.resize(start);
            return false;
        }
        out.push_back(id);
        got += bs_;
        const uint32_t p = blocks_[id].parent;
        if (p == none || blocks_[p].st != state::waiting) continue;
        auto it = std::find_if(left.begin(), left.end(), [p](const auto& e) { return e.first == p; });
        if (it == left.end()) it = left.insert(left.end(), {p, blocks_[p].n_children});
        if (--it->second == 0) ready.push_back(p);
    }
    return true;
}

// -- removal --

void prefix_index::free_record(uint32_t id) {
    blocks_[id] = block{};
    free_ids_.push_back(id);
}

void prefix_index::child_gone(uint32_t parent) {
    while (parent != none) {
        block& p = blocks_[parent];
        assert(p.n_children > 0);
        if (--p.n_children > 0) return;
        if (p.st == state::waiting) {
            push_front(parent);
            return;
        }
        if (p.st != state::dead) return;
        const uint32_t up = p.parent;
        free_record(parent);
        parent = up;
    }
}

void prefix_index::remove(uint32_t id) {
    block& b = blocks_[id];
    assert(b.st != state::unused && b.st != state::dead);
    if (b.st == state::queued) unlink(id);
    table_erase(id);
    const uint32_t parent = b.parent;
    if (b.n_children > 0) {
        b.st = state::dead;  // its children must never verify against a block reusing this id
        b.held = 0;
        return;
    }
    free_record(id);
    child_gone(parent);
}

void prefix_index::clear() {
    blocks_.clear();
    tokens_.clear();
    cells_.clear();
    free_ids_.clear();
    slots_.assign(64, none);
    n_live_ = 0;
    for (queue& q : queues_) q = queue{};
}

size_t prefix_index::bytes() const {
    return blocks_.capacity() * sizeof(block) + tokens_.capacity() * sizeof(token_t) +
           cells_.capacity() * sizeof(uint32_t) + free_ids_.capacity() * sizeof(uint32_t) +
           slots_.capacity() * sizeof(uint32_t);
}

}  // namespace kvc::detail
