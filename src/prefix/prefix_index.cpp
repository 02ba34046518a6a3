#include "prefix/prefix_index.h"

#include <algorithm>
#include <cassert>
#include <cstring>
#include <limits>
#include <tuple>

#include <fmt/format.h>
#include <xxhash.h>

namespace kvc::detail {

namespace {
// The adaptive policy's ghosts: twice the blocks of every stream (grown as evictions come).
uint32_t ghost_capacity(evict_policy policy, uint32_t capacity, uint32_t n_stream) {
    if (policy != evict_policy::adaptive) return 0;
    return static_cast<uint32_t>(std::min<uint64_t>(UINT32_MAX, uint64_t{2} * capacity * n_stream));
}
}  // namespace

prefix_index::prefix_index(uint32_t block_size, uint32_t n_stream, evict_policy policy,
                           uint32_t max_protected, uint32_t capacity)
    : bs_(block_size),
      policy_(policy),
      max_protected_(max_protected),
      capacity_(capacity),
      ghosts_(ghost_capacity(policy, capacity, n_stream)),
      streams_(n_stream) {
    slots_.assign(64, none);
    for (stream_queues& q : streams_) {
        q.max_protected = max_protected_;
        q.bound = uint64_t{max_protected_} << 17;
    }
}

uint64_t prefix_index::chain_hash(uint64_t seed, std::span<const token_t> toks) {
    return XXH3_64bits_withSeed(toks.data(), toks.size_bytes(), seed);
}

// -- table --

void prefix_index::table_insert(uint32_t id) {
    if (2 * (uint64_t{n_live_} + 1) > slots_.size()) grow();
    const size_t mask = slots_.size() - 1;
    size_t i = at(id).hash & mask;
    while (slots_[i] != none) i = (i + 1) & mask;
    slots_[i] = id;
    ++n_live_;
}

// Linear probing without tombstones: after emptying a slot, move back every later entry of the run that
// would no longer be reachable from its home slot.
void prefix_index::table_erase(uint32_t id) {
    const size_t mask = slots_.size() - 1;
    size_t i = at(id).hash & mask;
    while (slots_[i] != id) {
        assert(slots_[i] != none);
        i = (i + 1) & mask;
    }
    slots_[i] = none;
    for (size_t j = (i + 1) & mask; slots_[j] != none; j = (j + 1) & mask) {
        const size_t home = at(slots_[j]).hash & mask;
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
        size_t i = at(id).hash & mask;
        while (slots_[i] != none) i = (i + 1) & mask;
        slots_[i] = id;
    }
}

// The hash only finds candidates: the parent (a root's key) and the tokens prove the match.
bool prefix_index::is(uint32_t id, uint64_t h, uint32_t parent, uint64_t key,
                      std::span<const token_t> toks) const {
    const block& b = at(id);
    return b.hash == h && b.parent == parent && (parent != none || root_key(id) == key) &&
           std::memcmp(tokens(id).data(), toks.data(), toks.size_bytes()) == 0;
}

uint32_t prefix_index::find(uint32_t parent, uint64_t key, std::span<const token_t> toks) const {
    assert(toks.size() == bs_);
    const uint64_t h = hash_of(seed_of(parent, key), toks);
    const size_t mask = slots_.size() - 1;
    for (size_t i = h & mask; slots_[i] != none; i = (i + 1) & mask)
        if (is(slots_[i], h, parent, key, toks)) return slots_[i];
    return none;
}

uint32_t prefix_index::find_hash(uint64_t h, uint64_t parent_hash, std::span<const token_t> toks) const {
    if (toks.size() != bs_) return none;
    const size_t mask = slots_.size() - 1;
    for (size_t i = h & mask; slots_[i] != none; i = (i + 1) & mask) {
        const uint32_t id = slots_[i];
        if (at(id).hash == h && seed(id) == parent_hash &&
            std::memcmp(tokens(id).data(), toks.data(), toks.size_bytes()) == 0)
            return id;
    }
    return none;
}

uint32_t prefix_index::find_any(uint64_t h) const {
    const size_t mask = slots_.size() - 1;
    for (size_t i = h & mask; slots_[i] != none; i = (i + 1) & mask)
        if (at(slots_[i]).hash == h) return slots_[i];
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
    for (size_t j = 0; j < n; ++j) {
        if (j + ahead < n) __builtin_prefetch(&slots_[h[j + ahead] & mask]);
        if (j + 1 < n) {  // the next block's candidates: their records and tokens
            const uint32_t c = slots_[h[j + 1] & mask];
            if (c != none) {
                __builtin_prefetch(&at(c));
                __builtin_prefetch(tokens(c).data());
            }
        }
        const std::span<const token_t> t = toks.subspan(j * bs_, bs_);
        uint32_t found = none;
        for (size_t i = h[j] & mask; slots_[i] != none && found == none; i = (i + 1) & mask)
            if (is(slots_[i], h[j], parent, key, t)) found = slots_[i];
        if (found == none) return;
        out.push_back(found);
        parent = found;
    }
}

void prefix_index::add_chunk() {
    chunk_data& c = chunks_.emplace_back();
    c.blocks = std::make_unique<block[]>(chunk);
    c.tokens = std::make_unique<token_t[]>(size_t{chunk} * bs_);
    c.cells = std::make_unique<uint32_t[]>(size_t{chunk} * bs_);
    c.keys = std::make_unique<uint64_t[]>(chunk);
}

uint32_t prefix_index::add(uint32_t parent, uint64_t key, std::span<const token_t> toks,
                           std::span<const uint32_t> cells, uint32_t stream, uint8_t priority, uint16_t held,
                           uint32_t root_depth) {
    assert(toks.size() == bs_ && cells.size() == bs_ && stream < streams_.size());
    uint32_t id;
    if (!free_ids_.empty()) {
        id = free_ids_.back();
        free_ids_.pop_back();
    } else {
        id = n_records_++;
        if (id / chunk == chunks_.size()) add_chunk();
    }
    block& b = rec(id);
    const uint32_t gen = b.gen;
    b = block{};
    b.gen = gen;
    b.hash = hash_of(seed_of(parent, key), toks);
    b.parent = parent;
    b.held = held;
    b.depth = parent == none ? root_depth : at(parent).depth + 1;
    b.stream = static_cast<uint16_t>(stream);
    b.priority = std::min(priority, prefix_max_priority);
    b.st = state::held;
    chunks_[id / chunk].keys[id % chunk] = parent == none ? key : key_of(parent);
    std::copy(toks.begin(), toks.end(), chunks_[id / chunk].tokens.get() + size_t{id % chunk} * bs_);
    std::copy(cells.begin(), cells.end(), chunks_[id / chunk].cells.get() + size_t{id % chunk} * bs_);
    if (parent != none) {
        block& p = rec(parent);
        ++p.n_children;
        // an evictable parent now waits for its child (a chain is never cut from its root)
        if (p.st == state::queued) {
            unlink(parent);
            p.st = state::waiting;
            streams_[p.stream].n_protected_waiting += p.segment;
        }
    }
    table_insert(id);
    if (policy_ == evict_policy::adaptive) {
        if (const auto g = ghosts_.take(b.hash)) {
            b.hit = 1;  // seen again: protected once let go
            learn(*g);
        }
    }
    if (held == 0) make_evictable(id);
    return id;
}

// -- queues --

uint32_t prefix_index::next_level(const stream_queues& q, uint32_t from, bool protected_only) {
    for (uint32_t w = from / 64; w < q.nonempty.size(); ++w) {
        uint64_t bits = q.nonempty[w];
        if (w == from / 64) bits &= ~uint64_t{0} << (from % 64);
        if (protected_only) bits &= 0xAAAAAAAAAAAAAAAAull;  // odd levels
        if (bits != 0) return w * 64 + static_cast<uint32_t>(__builtin_ctzll(bits));
    }
    return n_levels;
}

void prefix_index::push_back(uint32_t id) {
    block& b = rec(id);
    stream_queues& sq = streams_[b.stream];
    const uint32_t l = level_of(b);
    queue& q = sq.levels[l];
    b.prev = q.tail;
    b.next = none;
    (q.tail == none ? q.head : rec(q.tail).next) = id;
    q.tail = id;
    sq.nonempty[l / 64] |= uint64_t{1} << (l % 64);
    sq.n_protected += b.segment;
    b.st = state::queued;
}

void prefix_index::push_front(uint32_t id) {
    block& b = rec(id);
    stream_queues& sq = streams_[b.stream];
    const uint32_t l = level_of(b);
    queue& q = sq.levels[l];
    b.next = q.head;
    b.prev = none;
    (q.head == none ? q.tail : rec(q.head).prev) = id;
    q.head = id;
    sq.nonempty[l / 64] |= uint64_t{1} << (l % 64);
    sq.n_protected += b.segment;
    b.st = state::queued;
}

void prefix_index::unlink(uint32_t id) {
    block& b = rec(id);
    stream_queues& sq = streams_[b.stream];
    const uint32_t l = level_of(b);
    queue& q = sq.levels[l];
    (b.prev == none ? q.head : rec(b.prev).next) = b.next;
    (b.next == none ? q.tail : rec(b.next).prev) = b.prev;
    b.prev = b.next = none;
    if (q.head == none) sq.nonempty[l / 64] &= ~(uint64_t{1} << (l % 64));
    sq.n_protected -= b.segment;
}

// The oldest protected block of the lowest priority goes back to probation (as its newest block), with
// the protected blocks that wait for it alone, until the stream's protected blocks are within the bound.
void prefix_index::demote_protected(uint32_t stream) {
    stream_queues& sq = streams_[stream];
    while (sq.n_protected + sq.n_protected_waiting > sq.max_protected) {
        const uint32_t l = next_level(sq, 0, /*protected_only=*/true);
        if (l == n_levels) return;  // the rest waits for children: demoted with them
        const uint32_t id = sq.levels[l].head;
        unlink(id);
        rec(id).segment = 0;
        rec(id).hit = 0;  // back in protection only after another hit
        push_back(id);
        // the protected blocks that wait for it alone go with it: a chain is demoted whole
        for (uint32_t p = rec(id).parent; p != none; p = rec(p).parent) {
            block& b = rec(p);
            if (b.st != state::waiting || b.n_children != 1 || b.segment == 0 || b.stream != stream) break;
            b.segment = 0;
            b.hit = 0;
            --sq.n_protected_waiting;
        }
    }
}

// A ghost came back: a segment larger by `window` blocks would have kept it. So a recent ghost of a block
// never protected lowers the protected bound by a step (more room for probation), one of a protected
// block raises it: the bound settles where both segments' edges get as many returns (design D34).
void prefix_index::learn(const ghost_set::ghost& g) {
    stream_queues& sq = streams_[g.stream];
    const uint32_t window = std::max(1u, capacity_ / 16);
    if (sq.evicted[g.kind] - g.serial >= window) return;
    // a step per token: 1/256 of the capacity for 512 tokens of evidence, whatever the block size
    const uint64_t cap = uint64_t{capacity_} << 17, step = uint64_t{capacity_} * bs_;
    if (g.kind == 0)
        sq.bound -= std::min(step, sq.bound);
    else
        sq.bound = std::min(cap, sq.bound + step);
    sq.max_protected = static_cast<uint32_t>(sq.bound >> 17);
    demote_protected(g.stream);
}

void prefix_index::make_evictable(uint32_t id) {
    block& b = rec(id);
    if (policy_ != evict_policy::lru && b.hit) b.segment = b.seen = 1;  // stays until demoted
    if (b.n_children > 0) {
        b.st = state::waiting;
        streams_[b.stream].n_protected_waiting += b.segment;
        return;
    }
    push_back(id);
    if (b.segment) demote_protected(b.stream);
}

void prefix_index::make_held(uint32_t id) {
    block& b = rec(id);
    if (b.st == state::queued) unlink(id);
    if (b.st == state::waiting) streams_[b.stream].n_protected_waiting -= b.segment;
    b.st = state::held;
}

void prefix_index::acquire(uint32_t id) {
    block& b = rec(id);
    assert(b.held < bs_);
    if (b.held++ == 0 && b.pins == 0) make_held(id);
}

void prefix_index::release(uint32_t id) {
    block& b = rec(id);
    assert(b.held > 0 && b.st == state::held);
    if (--b.held == 0 && b.pins == 0) make_evictable(id);
}

void prefix_index::pin(uint32_t id) {
    block& b = rec(id);
    if (b.pins++ > 0) return;
    ++streams_[b.stream].n_pinned;
    if (b.held == 0) make_held(id);
}

void prefix_index::unpin(uint32_t id) {
    block& b = rec(id);
    assert(b.pins > 0);
    if (--b.pins > 0) return;
    --streams_[b.stream].n_pinned;
    if (b.held == 0) make_evictable(id);
}

void prefix_index::hit(uint32_t id) {
    rec(id).hit = 1;
}

void prefix_index::set_priority(uint32_t id, uint8_t priority) {
    block& b = rec(id);
    priority = std::min(priority, prefix_max_priority);
    if (b.priority == priority) return;
    const bool queued = b.st == state::queued;
    if (queued) unlink(id);
    b.priority = priority;
    if (queued) push_back(id);
}

void prefix_index::requeue(std::span<const uint32_t> ids) {
    for (uint32_t id : ids)
        if (rec(id).st == state::queued) {
            unlink(id);
            push_back(id);
        }
}

void prefix_index::to_front(uint32_t id) {
    if (rec(id).st != state::queued) return;
    unlink(id);
    push_front(id);
}

bool prefix_index::plan_eviction(uint32_t stream, uint32_t n, std::vector<uint32_t>& out,
                                 std::span<const uint32_t> keep) const {
    // Walk the levels lowest first, each queue oldest first. A waiting parent whose children all go in
    // the plan joins its level's queue then, as child_gone does: at the head (it goes next) after a child
    // of its level, at the tail (after the blocks queued there) after a child of another level.
    const stream_queues& sq = streams_[stream];
    // A block's place: (level, 0 joined at the head / 1 queued / 2 joined at the tail, order among them).
    using place = std::tuple<uint32_t, int, int64_t>;
    std::vector<std::pair<uint32_t, uint32_t>> left;  // (waiting parent, children not yet planned)
    std::vector<std::pair<place, uint32_t>> ready;    // parents joined in the plan
    int64_t joins = 0;
    const size_t start = out.size();
    uint64_t got = 0;
    uint32_t level = next_level(sq, 0);
    uint32_t cur = level < n_levels ? sq.levels[level].head : none;
    while (got < n) {
        const auto best = std::min_element(ready.begin(), ready.end());
        uint32_t id;
        if (best != ready.end() && (cur == none || best->first < place(level, 1, 0))) {
            id = best->second;
            ready.erase(best);
        } else if (cur != none) {
            id = cur;
            cur = at(cur).next;
            if (cur == none) {
                level = next_level(sq, level + 1);
                cur = level < n_levels ? sq.levels[level].head : none;
            }
        } else {
            out.resize(start);
            return false;
        }
        if (!keep.empty() && std::binary_search(keep.begin(), keep.end(), id)) continue;  // nor its parent
        out.push_back(id);
        got += bs_;
        const uint32_t p = at(id).parent;
        // a parent in another stream (chains cross streams) joins its own queue once the child is gone
        if (p == none || at(p).st != state::waiting || at(p).stream != stream) continue;
        auto it = std::find_if(left.begin(), left.end(), [p](const auto& e) { return e.first == p; });
        if (it == left.end()) it = left.insert(left.end(), {p, at(p).n_children});
        if (--it->second > 0) continue;
        ++joins;  // at the head the last joined goes first, at the tail the first joined
        if (level_of(at(p)) == level_of(at(id)))
            ready.push_back({place(level_of(at(p)), 0, -joins), p});
        else
            ready.push_back({place(level_of(at(p)), 2, joins), p});
    }
    return true;
}

// -- removal --

void prefix_index::free_record(uint32_t id) {
    const uint32_t gen = rec(id).gen;
    rec(id) = block{};
    rec(id).gen = gen;
    free_ids_.push_back(id);
}

void prefix_index::child_gone(uint32_t parent, uint32_t child_level) {
    while (parent != none) {
        block& p = rec(parent);
        assert(p.n_children > 0);
        if (--p.n_children > 0) return;
        if (p.st == state::waiting) {
            streams_[p.stream].n_protected_waiting -= p.segment;
            // the protected bound is enforced again at the next release
            if (level_of(p) == child_level)
                push_front(parent);
            else
                push_back(parent);
            return;
        }
        if (p.st != state::dead) return;
        const uint32_t up = p.parent;
        child_level = level_of(p);
        free_record(parent);
        parent = up;
    }
}

void prefix_index::evicting(uint32_t id) {
    if (policy_ != evict_policy::adaptive) return;
    const block& b = at(id);
    stream_queues& sq = streams_[b.stream];
    ghosts_.insert({.hash = b.hash, .serial = ++sq.evicted[b.seen], .stream = b.stream, .kind = b.seen});
}

void prefix_index::remove(uint32_t id) {
    block& b = rec(id);
    assert(b.st != state::unused && b.st != state::dead);
    ++b.gen;  // references to it are stale from now on
    if (b.st == state::queued) unlink(id);
    if (b.st == state::waiting) streams_[b.stream].n_protected_waiting -= b.segment;
    if (b.pins > 0) --streams_[b.stream].n_pinned;
    table_erase(id);
    const uint32_t parent = b.parent;
    if (b.n_children > 0) {
        b.st = state::dead;  // its children must never verify against a block reusing this id
        b.held = b.pins = 0;
        return;
    }
    const uint32_t level = level_of(b);
    free_record(id);
    child_gone(parent, level);
}

void prefix_index::clear() {
    chunks_.clear();
    n_records_ = 0;
    free_ids_.clear();
    slots_.assign(64, none);
    n_live_ = 0;
    for (stream_queues& q : streams_) {
        q = stream_queues{};
        q.max_protected = max_protected_;
        q.bound = uint64_t{max_protected_} << 17;
    }
    ghosts_.clear();
}

size_t prefix_index::bytes() const {
    return chunks_.size() *
               (chunk * (sizeof(block) + sizeof(uint64_t) + bs_ * (sizeof(token_t) + sizeof(uint32_t)))) +
           chunks_.capacity() * sizeof(chunk_data) + free_ids_.capacity() * sizeof(uint32_t) +
           slots_.capacity() * sizeof(uint32_t) + ghosts_.bytes();
}

void check_prompt_tokens(std::span<const token_t> tokens, int32_t n_vocab, const char* what) {
    if (tokens.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max()))
        throw error(errc::invalid_argument,
                    fmt::format("{}: {} tokens, more than {}", what, tokens.size(), INT32_MAX));
    for (size_t i = 0; i < tokens.size(); ++i)  // a token id is never negative, vocabulary known or not
        if (tokens[i] < 0 || (n_vocab > 0 && tokens[i] >= n_vocab))
            throw error(errc::invalid_argument,
                        n_vocab > 0
                            ? fmt::format("{}: token[{}] = {} not in [0, {})", what, i, tokens[i], n_vocab)
                            : fmt::format("{}: token[{}] = {} is negative", what, i, tokens[i]));
}

void notify(const std::function<void(const prefix_event&)>& listener, const prefix_event& e,
            uint64_t& errors) {
    if (!listener) return;
    try {
        listener(e);
    } catch (...) {
        ++errors;
    }
}

}  // namespace kvc::detail
