// The prefix cache's state inside a kv_cache (src/kv_cache_prefix.cpp): the index and what each
// sequence has decoded in order.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include <kvcache/kv_cache.h>

#include "prefix/prefix_index.h"
#include "tiers/tier_set.h"

namespace kvc {

// What one sequence has decoded from position 0 in order, for publishing: the chain of its full blocks
// (tail: the last, found or published; checked by generation, as the record may be reused) and the
// tokens and cells after it. Full blocks among them are published at the next step.
struct prefix_tracker {
    bool active = true;
    uint8_t priority = prefix_default_priority;  // of the blocks it publishes
    uint64_t key = 0;
    uint32_t tail = detail::prefix_index::none;
    uint32_t tail_gen = 0;
    uint32_t n_full = 0;          // chain blocks: positions [0, n_full * block_size)
    std::vector<token_t> toks;    // positions [n_full * block_size, next())
    std::vector<uint32_t> cells;  // their cells
    std::vector<token_t> prompt;  // with a key: the attached prompt, which embeddings fed later stand for
    // With a window: the chain hash of each block [0, n_full) (blocks may be missing from the index), and
    // cells holds `none` for positions the sequence no longer has.
    std::vector<uint64_t> hashes;
};

struct kv_cache::prefix_state {
    detail::prefix_index index;
    std::vector<prefix_tracker> seqs;  // [n_seq_max]
    std::vector<seq_id_t> pending;     // sequences that may have full blocks to publish
    prefix_stats stats;
    bool logged_drop = false;  // the first dropped_blocks is logged, the rest only counted
    std::function<void(const prefix_event&)> on_event;
    bool share_duplicates = false;  // kv_cache::prefix_share_duplicates
    // With a sliding window (design D30): blocks are kept on their own, each near the boundaries it
    // serves; a sequence resumed at n needs only the cells of [first(n), n).
    swa_type swa = swa_type::none;
    uint32_t n_swa = 0;
    std::vector<seq_id_t> placed;    // sequences placed since the last prune (their window slid)
    std::vector<uint8_t> is_placed;  // [n_seq_max] in `placed`
    detail::tier_set tiers;          // below memory (src/kv_cache_tier.cpp)

    // Tells on_event that block id was stored or removed (its record still intact).
    void emit(prefix_event::kind type, uint32_t id) {
        if (on_event) call(index.event(type, id));
    }
    void call(const prefix_event& e) { detail::notify(on_event, e, stats.event_errors); }

    prefix_state(const prefix_cache_params& p, uint32_t kv_size, uint32_t n_stream, uint32_t n_seq_max,
                 swa_type swa_rule, uint32_t window)
        : index(p.block_size, n_stream, p.policy, max_protected(p, kv_size), kv_size / p.block_size),
          seqs(n_seq_max),
          on_event(p.on_event),
          swa(swa_rule),
          n_swa(window) {
        if (!windowed()) return;
        placed.reserve(n_seq_max);  // recording a placement allocates nothing
        is_placed.resize(n_seq_max);
    }

    bool windowed() const { return swa != swa_type::none; }
    // The first position a query at position n (and every later one) can see.
    uint32_t first(uint32_t n) const {
        if (swa == swa_type::standard) return n >= n_swa ? n - n_swa + 1 : 0;
        if (swa == swa_type::chunked) return n / n_swa * n_swa;
        return 0;
    }
    // The first position a sequence resumed at n > 0 holds: what a query at n can see, and at least the
    // last position (so that the sequence's positions go on from n).
    uint32_t attach_from(uint32_t n) const { return std::min(first(n), n - 1); }

    // SLRU: the protected blocks of a stream (kv_size / block_size blocks at most)
    static uint32_t max_protected(const prefix_cache_params& p, uint32_t kv_size) {
        const uint32_t blocks = kv_size / p.block_size;
        return static_cast<uint32_t>(static_cast<double>(p.protected_fraction) * blocks);
    }

    uint32_t bs() const { return index.block_size(); }
    pos_t next(const prefix_tracker& t) const { return static_cast<pos_t>(t.n_full * bs() + t.toks.size()); }
    void stop(prefix_tracker& t) {
        t.active = false;
        t.toks.clear();
        t.cells.clear();
        t.prompt = {};
        t.hashes = {};
    }
    bool tail_alive(const prefix_tracker& t) const {
        return t.tail == detail::prefix_index::none || index.alive(t.tail, t.tail_gen);
    }
    void set_tail(prefix_tracker& t, uint32_t id) {
        t.tail = id;
        if (id != detail::prefix_index::none) t.tail_gen = index.at(id).gen;
    }
};

}  // namespace kvc
