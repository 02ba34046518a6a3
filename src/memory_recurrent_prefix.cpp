// memory_recurrent: the prefix cache (docs/prefix-cache.md, "Recurrent memories"). A recurrent state is
// overwritten by every token, so a prefix is resumable only where the engine wrote a copy of the state: a
// snapshot at a block boundary. The index (prefix/prefix_index) keeps the token chains that lead to
// snapshots; this file decides where snapshots are taken, publishes them at the next step, evicts them
// (with the blocks that serve nothing without them), and resumes sequences from them.
#include <algorithm>
#include <cassert>
#include <cstring>
#include <limits>

#include <fmt/format.h>
#include <kvcache/memory_recurrent.h>

#include "detail/memory_recurrent_impl.h"
#include "detail/recurrent_prefix.h"
#include "detail/recurrent_prefix_part.h"
#include "prefix/prefix_coordinator.h"

namespace kvc {

namespace {
using detail::none;
// The adaptive policy's ghosts learn from K/V blocks evicted one by one; snapshots have their own queue
// (design D33), so under that policy they follow SLRU.
evict_policy snapshot_policy(evict_policy p) {
    return p == evict_policy::adaptive ? evict_policy::slru : p;
}
}  // namespace

// -- the state --

memory_recurrent::prefix_state::prefix_state(const prefix_cache_params& p, uint32_t n_seq_max,
                                             uint32_t n_slots)
    : index(p.block_size, 1, snapshot_policy(p.policy),
            static_cast<uint32_t>(static_cast<double>(p.protected_fraction) * n_slots)),
      queue(n_slots, snapshot_policy(p.policy),
            static_cast<uint32_t>(static_cast<double>(p.protected_fraction) * n_slots)),
      bs(p.block_size),
      interval(p.snapshot_interval),
      seqs(n_seq_max),
      slot_block(n_slots, none),
      slot_kind(n_slots, snap_kind::rolling),
      slots(n_slots, slot_state::free),
      zeros(p.block_size, 0),
      on_event(p.on_event) {
    free_slots.reserve(n_slots);
    for (uint32_t s = n_slots; s-- > 0;) free_slots.push_back(s);
    std::make_heap(free_slots.begin(), free_slots.end(), std::greater<>());
    pending.reserve(n_seq_max);
}

void memory_recurrent::prefix_state::call(const prefix_event& e) {
    detail::notify(on_event, e, stats.event_errors);
}

void memory_recurrent::prefix_state::emit(prefix_event::kind type, uint32_t id) {
    if (on_event) call(index.event(type, id));
}

void memory_recurrent::prefix_state::grow() {
    if (holders.size() < index.records()) {
        holders.resize(index.records(), 0);
        block_slot.resize(index.records(), none);
    }
}

void memory_recurrent::prefix_state::hold(uint32_t id) {
    if (holders[id]++ == 0) index.acquire(id);
}

void memory_recurrent::prefix_state::unhold(uint32_t id) {
    assert(holders[id] > 0);
    if (--holders[id] > 0) return;
    index.release(id);
    collect(id);
}

uint32_t memory_recurrent::prefix_state::collect(uint32_t id) {
    using state = detail::prefix_index::state;
    uint32_t n = 0;
    while (id != none && index.at(id).st == state::queued && !has_snapshot(id)) {
        const uint32_t parent = index.at(id).parent;
        emit(prefix_event::kind::removed, id);
        index.remove(id);
        ++n;
        id = parent;  // now perhaps a childless leaf itself
    }
    return n;
}

uint32_t memory_recurrent::prefix_state::take_slot() {
    if (free_slots.empty()) return none;
    std::pop_heap(free_slots.begin(), free_slots.end(), std::greater<>());
    const uint32_t s = free_slots.back();
    free_slots.pop_back();
    slots[s] = slot_state::pending;
    top = std::max(top, s + 1);
    return s;
}

void memory_recurrent::prefix_state::free_slot(uint32_t slot) {
    queue.erase(slot);
    slots[slot] = slot_state::free;
    slot_block[slot] = none;
    free_slots.push_back(slot);  // capacity: every slot
    std::push_heap(free_slots.begin(), free_slots.end(), std::greater<>());
}

void memory_recurrent::prefix_state::publish(uint32_t slot, uint32_t id, snap_kind kind) {
    slots[slot] = slot_state::published;
    slot_block[slot] = id;
    block_slot[id] = slot;
    if (kind == snap_kind::rolling) {
        slot_kind[slot] = kind;
        queue.push_rolling(slot);
    } else {
        enqueue(slot, kind);
    }
    ++stats.snapshots_saved;
}

bool memory_recurrent::prefix_state::known(snap_kind kind) const {
    const kind_use& u = use[static_cast<size_t>(kind)];
    return u.taken + u.used >= 32;  // a kind taken rarely but resumed from often is known by its uses
}

bool memory_recurrent::prefix_state::cold(snap_kind kind) const {
    const kind_use& u = use[static_cast<size_t>(kind)];
    return known(kind) && uint64_t{u.used} * 16 < u.taken;
}

void memory_recurrent::prefix_state::taken(snap_kind kind) {
    kind_use& u = use[static_cast<size_t>(kind)];
    if (++u.taken >= kind_window) {
        u.taken /= 2;
        u.used /= 2;
    }
}

void memory_recurrent::prefix_state::ghost(const recurrent_tracker& t) {
    if (!t.active || (t.tail != none && !index.alive(t.tail, t.tail_gen))) return;
    uint64_t h = t.tail != none ? index.at(t.tail).hash : t.key;
    const size_t full = t.toks.size() / bs * bs;
    if (t.tail == none && full == 0) return;
    for (size_t i = 0; i < full; i += bs) h = detail::prefix_index::chain_hash(h, {t.toks.data() + i, bs});
    if (ghosts.size() == max_ghosts) {
        ghost_set.erase(ghosts.front());
        ghosts.pop_front();
    }
    ghosts.push_back(h);
    ghost_set.insert(h);
    taken(snap_kind::sequence_end);
}

void memory_recurrent::prefix_state::find_ghost(std::span<const token_t> tokens, uint64_t seed,
                                                uint64_t from) {
    if (ghost_set.empty()) return;
    uint64_t h = seed;
    for (uint64_t b = from; b + bs < tokens.size(); b += bs) {
        h = detail::prefix_index::chain_hash(h, tokens.subspan(b, bs));
        if (ghost_set.erase(h) > 0) {
            ++use[static_cast<size_t>(snap_kind::sequence_end)].used;
            return;
        }
    }
}

// Like an adaptive insertion policy of a CPU cache: a kind of snapshot that is seldom resumed from enters
// at the head of the queue, so one that is never used costs a row for a moment only; one in 16 enters at
// the tail all the same, so a kind that becomes useful is seen to be.
void memory_recurrent::prefix_state::enqueue(uint32_t slot, snap_kind kind) {
    slot_kind[slot] = kind;
    taken(kind);
    const bool first = kind != snap_kind::fetched && cold(kind) && ++n_cold % 16 != 0;
    queue.push(slot, index.at(slot_block[slot]).priority, first);
}

// A prompt going on from a snapshot (the one it resumed from, or one it took) to a deeper one makes the
// first useless to whoever sent it: conversations and agents come back to their newest end only. Only
// prompts that leave the chain between the two can use it, which none has done while its block has one
// child (where one does, a branch snapshot is taken: prefix_attach). Decoded tokens supersede nothing:
// whether the next prompt repeats them is up to the client.
void memory_recurrent::prefix_state::passed(recurrent_tracker& t, uint32_t id) {
    if (t.last != none && t.last != id && index.alive(t.last, t.last_gen) && has_snapshot(t.last) &&
        index.at(t.last).n_children <= 1)
        queue.demote(block_slot[t.last]);
    t.last = id;
    t.last_gen = index.at(id).gen;
}

void memory_recurrent::prefix_state::drop_snapshot(uint32_t id) {
    const uint32_t slot = block_slot[id];
    assert(slot != none);
    free_slot(slot);
    block_slot[id] = none;
    ++stats.snapshots_dropped;
    collect(id);
}

bool memory_recurrent::prefix_state::evict_one(bool rolling_only) {
    const uint32_t slot = queue.front();
    if (slot == none || (rolling_only && !queue.rolling(slot))) return false;
    const uint32_t id = slot_block[slot];
    // a rolling snapshot's state lives on in its sequence: written when it is kept, not at every step
    if (before_evict && !queue.rolling(slot)) before_evict(id);
    free_slot(slot);
    block_slot[id] = none;
    ++stats.snapshots_dropped;
    stats.evicted_blocks += collect(id);
    return true;
}

void memory_recurrent::prefix_state::stop(recurrent_tracker& t) {
    for (const recurrent_tracker::pending& p : t.snaps) free_slot(p.slot);
    // its rolling snapshot is the state where it ended: kept now
    if (t.roll != none && index.alive(t.roll, t.roll_gen) && has_snapshot(t.roll))
        enqueue(block_slot[t.roll], snap_kind::sequence_end);
    else
        ghost(t);
    const uint32_t tail = t.tail;
    const bool held = tail != none && index.alive(tail, t.tail_gen);
    t.active = false;
    t.tail = none;
    t.roll = none;
    t.toks.clear();
    t.snaps.clear();
    t.prompt = {};
    if (held) unhold(tail);
}

void memory_recurrent::prefix_state::reset() {
    if (index.size() > 0) call(prefix_event{.type = prefix_event::kind::cleared});
    index.clear();
    for (recurrent_tracker& t : seqs) t = recurrent_tracker{};
    pending.clear();
    holders.clear();
    block_slot.clear();
    queue.clear();
    free_slots.clear();
    for (uint32_t s = 0; s < slots.size(); ++s) free_slot(s);
}

// -- construction --

void memory_recurrent::prefix_init() {
    const prefix_cache_params& q = params_.prefix;
    const auto bad = [](const std::string& msg) {
        throw error(errc::invalid_argument, "memory_recurrent: " + msg);
    };
    if (q.block_size == 0 || q.block_size > 65536)
        bad(fmt::format("prefix block_size {} must be in [1, 65536]", q.block_size));
    if (q.policy > evict_policy::adaptive)
        bad(fmt::format("prefix policy {} unknown", static_cast<int>(q.policy)));
    if (!(q.protected_fraction >= 0.0f && q.protected_fraction <= 1.0f))
        bad(fmt::format("prefix protected_fraction {} must be in [0, 1]", q.protected_fraction));
    if (q.n_vocab < 0) bad(fmt::format("prefix n_vocab {} must not be negative", q.n_vocab));
    detail::tier_set::check(q.tiers, "memory_recurrent");
    prefix_ = std::make_unique<prefix_state>(q, size_, n_snap_);
    part_ = std::make_unique<detail::recurrent_prefix_part>(*this);
    coord_ = std::make_unique<detail::prefix_coordinator>(q, params_.n_seq_max);
    coord_->adopt(*part_);  // its events go to the user through the coordinator
    set_prefix_cache(coord_.get());
    if (q.tiers.stores.empty()) return;
    prefix_->tiers.init(q.tiers, prefix_block_layout(q.tiers.model_id));
    prefix_->before_evict = [this](uint32_t id) { tier_evicting(id); };
}

uint32_t memory_recurrent::get_snapshots_used() const {
    return prefix_ ? static_cast<uint32_t>(prefix_->slots.size() - prefix_->free_slots.size()) : 0;
}

size_t memory_recurrent::snapshot_bytes() const {
    size_t b = 0;
    for (const layer& l : layers_) b += l.row_r + l.row_s;
    return b;
}

// -- checks --

int64_t memory_recurrent::prefix_state::deepest(std::span<const token_t> tokens, uint64_t key,
                                                std::vector<uint32_t>& chain, size_t limit) const {
    index.match(key, tokens, chain);
    limit = std::min(limit, tokens.size());
    for (auto d = static_cast<int64_t>(chain.size()) - 1; d >= 0; --d)
        if ((static_cast<uint64_t>(d) + 1) * bs < limit && has_snapshot(chain[static_cast<size_t>(d)]))
            return d;
    return -1;
}

// -- the API --

uint32_t memory_recurrent::prefix_lookup(std::span<const token_t> tokens, uint64_t key) {
    prefix_state& ps = *prefix_;
    ++ps.stats.lookups;
    ps.stats.tokens_looked_up += tokens.size();
    std::vector<uint32_t> chain;
    const int64_t d = ps.deepest(tokens, key, chain);
    return static_cast<uint32_t>((d + 1) * ps.bs);
}

uint32_t memory_recurrent::prefix_attach(seq_id_t seq_id, std::span<const token_t> tokens, uint64_t key,
                                         uint8_t priority, uint32_t max_tokens) {
    prefix_publish();
    prefix_state& ps = *prefix_;
    ++ps.stats.lookups;
    ps.stats.tokens_looked_up += tokens.size();
    const auto usable = tokens.first(std::min<size_t>(tokens.size(), uint64_t{max_tokens} + 1));
    tier_fetch(usable, key);  // a deeper snapshot than memory's, from the tiers
    std::vector<uint32_t> chain;
    const int64_t d = ps.deepest(tokens, key, chain, usable.size());
    recurrent_tracker& t = ps.seqs[static_cast<size_t>(seq_id)];
    ps.stop(t);
    t = recurrent_tracker{};
    t.key = key;
    t.priority = priority;
    if (key != 0) t.prompt.assign(tokens.begin(), tokens.end());  // what embeddings at [n, size) stand for
    // where the prompt leaves a chain other prompts went on along: a branch point the next prompts of that
    // chain will come back to, whose state this one computes anyway
    if (chain.size() > static_cast<size_t>(d + 1) && !ps.has_snapshot(chain.back()) &&
        tokens.size() > chain.size() * ps.bs)
        t.fork = chain.size() * ps.bs;
    ps.find_ghost(tokens, d < 0 ? key : ps.index.at(chain[static_cast<size_t>(d)]).hash,
                  static_cast<uint64_t>(d + 1) * ps.bs);
    if (d < 0) return 0;
    const auto n_blocks = static_cast<uint32_t>(d + 1);
    for (uint32_t j = 0; j < n_blocks; ++j) {
        if (ps.index.at(chain[j]).priority >= priority) continue;
        ps.index.set_priority(chain[j], priority);
        if (ps.has_snapshot(chain[j])) ps.queue.set_priority(ps.block_slot[chain[j]], priority);
    }
    const uint32_t id = chain[n_blocks - 1];
    ps.queue.hit(ps.block_slot[id]);
    // the snapshots above it that no prompt has branched off at: this one went past them too
    for (uint32_t j = 0; j + 1 < n_blocks; ++j)
        if (ps.has_snapshot(chain[j]) && ps.index.at(chain[j]).n_children <= 1)
            ps.queue.demote(ps.block_slot[chain[j]]);
    ++ps.use[static_cast<size_t>(ps.slot_kind[ps.block_slot[id]])].used;
    // a cell of its own (one is free: seq_id has none), holding a copy of the snapshot's rows
    const auto c = static_cast<uint32_t>(next_free(head_));
    const uint64_t row0 = (uint64_t{params_.n_rs_seq} + 1) * size_ + ps.block_slot[id];
    for (layer& l : layers_) {
        if (l.row_r) std::memcpy(l.r.data() + size_t{c} * l.row_r, l.r.data() + row0 * l.row_r, l.row_r);
        if (l.row_s) std::memcpy(l.s.data() + size_t{c} * l.row_s, l.s.data() + row0 * l.row_s, l.row_s);
    }
    cells_[c] = cell_rec{};
    cells_[c].pos = static_cast<pos_t>(n_blocks * ps.bs - 1);
    cells_[c].src = static_cast<int32_t>(c);
    link(c, seq_id);
    mark_ = std::max(mark_, c + 1);
    t.n_full = n_blocks;
    t.tail = id;
    t.tail_gen = ps.index.at(id).gen;
    ps.passed(t, id);
    ps.hold(id);
    const uint32_t n = n_blocks * ps.bs;
    ps.stats.hit_tokens += n;
    return n;
}

void memory_recurrent::prefix_publish() {
    if (!prefix_) return;
    prefix_state& ps = *prefix_;
    const uint32_t bs = ps.bs;
    for (seq_id_t s : ps.pending) {
        recurrent_tracker& t = ps.seqs[static_cast<size_t>(s)];
        if (!t.active) continue;  // its snapshots went with it
        size_t done = 0;
        size_t k = 0;
        for (; k < t.snaps.size(); ++k) {
            const recurrent_tracker::pending p = t.snaps[k];
            // the chain down to the boundary: found, or published now
            bool lost = false;
            while (uint64_t{t.n_full} * bs < p.boundary) {
                if (!ps.alive(t.tail, t.tail_gen)) {
                    lost = true;  // its chain was evicted: what follows has no parent to hang from
                    break;
                }
                const std::span<const token_t> toks(t.toks.data() + done, bs);
                uint32_t id = ps.index.find(t.tail, t.key, toks);
                if (id == none) {
                    id = ps.index.add(t.tail, t.key, toks, ps.zeros, 0, t.priority, 0);
                    ps.grow();
                    ++ps.stats.published_blocks;
                    ps.emit(prefix_event::kind::stored, id);
                }
                ps.hold(id);
                if (t.tail != none) ps.unhold(t.tail);
                t.tail = id;
                t.tail_gen = ps.index.at(id).gen;
                ++t.n_full;
                done += bs;
            }
            if (lost) break;
            if (ps.has_snapshot(t.tail)) {  // another sequence left the same state there
                ps.free_slot(p.slot);
                if (!p.kept) t.roll = none;
                if (p.prompt) ps.passed(t, t.tail);
                continue;
            }
            using kind = prefix_state::snap_kind;
            ps.publish(p.slot, t.tail,
                       !p.kept  ? kind::rolling
                       : p.end  ? kind::prompt_end
                       : p.fork ? kind::branch
                                : kind::interval);
            if (p.prompt) ps.passed(t, t.tail);
            if (p.kept && ps.tiers.write_through()) ps.tiers.published.emplace_back(t.tail, t.tail_gen);
            if (!p.kept) {
                t.roll = t.tail;
                t.roll_gen = t.tail_gen;
            }
        }
        if (k < t.snaps.size()) {
            t.snaps.erase(t.snaps.begin(), t.snaps.begin() + static_cast<ptrdiff_t>(k));
            ps.stop(t);
            continue;
        }
        t.snaps.clear();
        t.toks.erase(t.toks.begin(), t.toks.begin() + static_cast<ptrdiff_t>(done));
    }
    ps.pending.clear();
    fit_snapshots();
    tier_flush();  // write-through
}

prefix_stats memory_recurrent::get_prefix_stats() const {
    if (!prefix_) return {};
    const prefix_state& ps = *prefix_;
    prefix_stats st = ps.stats;
    st.blocks = ps.index.size();
    st.snapshots = get_snapshots_used();
    st.tier_fetched_blocks = ps.tiers.fetched_total();
    st.tier_written_blocks = ps.tiers.written_total();
    st.index_bytes = ps.index.bytes() + ps.pending.capacity() * sizeof(seq_id_t) +
                     (ps.holders.capacity() + ps.block_slot.capacity() + ps.slot_block.capacity() +
                      ps.free_slots.capacity()) *
                         sizeof(uint32_t) +
                     ps.slots.capacity() + ps.slot_kind.capacity() + ps.queue.bytes() +
                     ps.ghosts.size() * sizeof(uint64_t) +
                     ps.ghost_set.size() * (sizeof(uint64_t) + 2 * sizeof(void*));  // a node and a bucket
    for (const recurrent_tracker& t : ps.seqs)
        st.index_bytes += sizeof(t) + (t.toks.capacity() + t.prompt.capacity()) * sizeof(token_t) +
                          t.snaps.capacity() * sizeof(recurrent_tracker::pending);
    return st;
}

// -- placement --

bool memory_recurrent::prefix_state::in_order(const recurrent_tracker& t, const ubatch& ub,
                                              uint32_t b) const {
    const uint32_t T = ub.n_seq_tokens;
    const pos_t nx = next(t);
    for (uint32_t j = 0; j < T; ++j) {
        const uint32_t i = b * T + j;
        const int64_t p = ub.pos[i];
        if (p != int64_t{nx} + j) return false;
        // embeddings count as the attached prompt's tokens when the engine named their content with a key
        if (ub.token.empty() && (t.key == 0 || static_cast<uint64_t>(p) >= t.prompt.size())) return false;
    }
    return true;
}

void memory_recurrent::prefix_plan(const ubatch& ub, std::span<const std::pair<seq_id_t, uint64_t>> prompts) {
    if (!prefix_) return;
    prefix_state& ps = *prefix_;
    const uint32_t T = ub.n_seq_tokens, bs = ps.bs;
    ps.requests.clear();
    for (uint32_t b = 0; b < ub.n_seqs; ++b) {
        const seq_id_t s = ub.primary_seq(b * T);
        recurrent_tracker& t = ps.seqs[static_cast<size_t>(s)];
        if (!t.active || !ps.in_order(t, ub, b)) continue;
        t.toks.reserve(t.toks.size() + T);
        const uint64_t n0 = static_cast<uint64_t>(ps.next(t)), n1 = n0 + T;
        const uint64_t last = n1 / bs * bs;  // the newest boundary the block reaches
        if (last <= n0) continue;
        // a prompt's end: its newest boundary before its last token, so that the same prompt sent again
        // (n samples, a retry) resumes there too; a continuation resumes at most a block earlier
        const auto pr =
            std::find_if(prompts.begin(), prompts.end(), [s](const auto& e) { return e.first == s; });
        const bool prompt = pr != prompts.end();
        const uint64_t end = prompt ? (n1 + pr->second - 1) / bs * bs : 0;
        const uint64_t every = uint64_t{ps.interval} * bs;
        const size_t first = ps.requests.size();
        for (uint64_t B = (n0 / bs + 1) * bs; B < last; B += bs)
            if ((every > 0 && B % every == 0) || B == end || B == t.fork)
                ps.requests.push_back({s, b, B, true, prompt, B == end, B == t.fork});
        ps.requests.push_back({s, b, last, last == end || last == t.fork || (every > 0 && last % every == 0),
                               prompt, last == end, last == t.fork});
        if (t.fork <= last) t.fork = 0;
        // its rolling snapshot gives way to the new ones
        for (auto it = t.snaps.begin(); it != t.snaps.end(); ++it)
            if (!it->kept) {
                ps.free_slot(it->slot);
                ++ps.stats.snapshots_dropped;
                t.snaps.erase(it);
                break;
            }
        if (t.roll != none && ps.index.alive(t.roll, t.roll_gen) && ps.has_snapshot(t.roll))
            ps.drop_snapshot(t.roll);
        t.roll = none;
        t.snaps.reserve(t.snaps.size() + ps.requests.size() - first);
    }
    // room in the pool, evicting in policy order; what does not fit is not taken. A rolling snapshot serves
    // only as where its sequence ends: unless sequence ends are known to be used (learnt from ghosts while
    // they are not kept), it takes a row from rolling ones only.
    ps.n_kept = static_cast<uint32_t>(
        std::count_if(ps.requests.begin(), ps.requests.end(), [](const auto& r) { return r.kept; }));
    while (ps.free_slots.size() < ps.n_kept && ps.evict_one(false)) {}
    using kind = prefix_state::snap_kind;
    const bool rolls = ps.known(kind::sequence_end) && !ps.cold(kind::sequence_end);
    while (ps.free_slots.size() < ps.requests.size() && ps.evict_one(!rolls)) {}
    tier_flush();  // the snapshots evicted, when they go to the tiers
    ps.snaps.clear();
    ps.snaps.reserve(ps.requests.size());
    if (ps.pending.capacity() < ps.pending.size() + ub.n_seqs)
        ps.pending.reserve(ps.pending.size() + ub.n_seqs);
}

void memory_recurrent::prefix_record(const ubatch& ub, rs_slot& slot) {
    if (!prefix_) return;
    prefix_state& ps = *prefix_;
    const uint32_t T = ub.n_seq_tokens;
    const int64_t row0 = (int64_t{params_.n_rs_seq} + 1) * size_;
    auto req = ps.requests.begin();
    for (uint32_t b = 0; b < ub.n_seqs; ++b) {
        while (req != ps.requests.end() && req->block < b) ++req;
        const auto ids = ub.seq_ids(b * T);
        // a sequence coupled to the block's primary shares its result, not its history
        for (size_t q = 1; q < ids.size(); ++q) ps.stop(ps.seqs[static_cast<size_t>(ids[q])]);
        const seq_id_t s = ids[0];
        recurrent_tracker& t = ps.seqs[static_cast<size_t>(s)];
        if (!t.active) continue;
        if (!ps.in_order(t, ub, b)) {
            ps.stop(t);
            continue;
        }
        const uint64_t n0 = static_cast<uint64_t>(ps.next(t));
        for (uint32_t j = 0; j < T; ++j) {
            const uint32_t i = b * T + j;
            t.toks.push_back(ub.token.empty() ? t.prompt[static_cast<size_t>(ub.pos[i])] : ub.token[i]);
        }
        bool any = false;
        for (; req != ps.requests.end() && req->block == b; ++req) {
            // the rows made room for kept snapshots are theirs
            if (!req->kept && ps.free_slots.size() <= ps.n_kept) continue;
            if (req->kept && ps.n_kept > 0) --ps.n_kept;
            const uint32_t sl = ps.take_slot();
            if (sl == none) continue;  // the pool is full of snapshots in use
            t.snaps.push_back({req->boundary, sl, req->kept, req->prompt, req->end, req->fork});
            ps.snaps.push_back({b, static_cast<uint32_t>(req->boundary - 1 - n0), row0 + sl});
            any = true;
        }
        if (any) ps.pending.push_back(s);
    }
    slot.snaps = std::move(ps.snaps);
    ps.snaps = {};
}

// -- sequence operations --

void memory_recurrent::prefix_forget(seq_id_t seq_id) {
    if (!prefix_) return;
    prefix_state& ps = *prefix_;
    const auto one = [&](size_t s) {
        recurrent_tracker& t = ps.seqs[s];
        ps.stop(t);
        if (tail_[s] < 0) t = recurrent_tracker{};  // empty: what it decodes from 0 is published again
    };
    if (seq_id == seq_all) {
        for (size_t s = 0; s < ps.seqs.size(); ++s) one(s);
    } else {
        one(static_cast<size_t>(seq_id));
    }
}

void memory_recurrent::prefix_cut(seq_id_t seq_id, pos_t p0) {
    if (!prefix_) return;
    prefix_state& ps = *prefix_;
    recurrent_tracker& t = ps.seqs[static_cast<size_t>(seq_id)];
    if (!t.active) return;
    const auto keep = static_cast<uint64_t>(p0);
    const uint64_t full = uint64_t{t.n_full} * ps.bs;
    if (keep >= full) {
        t.toks.resize(std::min<uint64_t>(t.toks.size(), keep - full));
        return;
    }
    if (!ps.alive(t.tail, t.tail_gen)) {
        ps.stop(t);
        return;
    }
    // back up the chain to block keep / bs; its first keep % bs tokens stay pending
    uint32_t cut = none, tail = t.tail;
    for (uint32_t d = t.n_full; d > keep / ps.bs; --d) {
        cut = tail;
        tail = ps.index.at(tail).parent;
    }
    const auto toks = ps.index.tokens(cut);
    t.toks.assign(toks.begin(), toks.begin() + static_cast<ptrdiff_t>(keep % ps.bs));
    if (tail != none) ps.hold(tail);
    ps.unhold(t.tail);
    t.tail = tail;
    if (tail != none) t.tail_gen = ps.index.at(tail).gen;
    t.n_full = static_cast<uint32_t>(keep / ps.bs);
}

void memory_recurrent::prefix_copy(seq_id_t src, seq_id_t dst) {
    if (!prefix_) return;
    prefix_state& ps = *prefix_;
    recurrent_tracker& d = ps.seqs[static_cast<size_t>(dst)];
    ps.stop(d);
    const recurrent_tracker& s = ps.seqs[static_cast<size_t>(src)];
    if (tail_[static_cast<size_t>(src)] < 0 || !s.active || !ps.alive(s.tail, s.tail_gen)) {
        if (tail_[static_cast<size_t>(src)] < 0) d = recurrent_tracker{};
        return;
    }
    d = s;
    d.snaps.clear();  // published before any sequence operation: none
    d.roll = none;    // src's to replace
    if (d.tail != none) ps.hold(d.tail);
}

void memory_recurrent::prefix_reset() {
    if (!prefix_) return;
    prefix_->reset();
    fit_snapshots();
}

void memory_recurrent::fit_snapshots() {
    prefix_state& ps = *prefix_;
    uint32_t top = ps.top;
    while (top > 0 && ps.slots[top - 1] == prefix_state::slot_state::free) --top;
    if (top == ps.top) return;
    const uint64_t row0 = (uint64_t{params_.n_rs_seq} + 1) * size_;
    for (layer& l : layers_) {
        l.r.release((row0 + top) * l.row_r, size_t{ps.top - top} * l.row_r);
        l.s.release((row0 + top) * l.row_s, size_t{ps.top - top} * l.row_s);
    }
    ps.top = top;
}

}  // namespace kvc
