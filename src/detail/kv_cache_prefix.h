// The prefix cache's state inside a kv_cache (src/kv_cache_prefix.cpp): the index and what each
// sequence has decoded in order.
#pragma once

#include <cstdint>
#include <vector>

#include <kvcache/kv_cache.h>

#include "detail/prefix_index.h"

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
};

struct kv_cache::prefix_state {
    detail::prefix_index index;
    std::vector<prefix_tracker> seqs;  // [n_seq_max]
    std::vector<seq_id_t> pending;     // sequences that may have full blocks to publish
    prefix_stats stats;
    std::function<void(const prefix_event&)> on_event;
    bool share_duplicates = false;  // kv_cache::prefix_share_duplicates

    // Tells on_event that block id was stored or removed (its record still intact).
    void emit(prefix_event::kind type, uint32_t id) {
        if (on_event) call(index.event(type, id));
    }
    void call(const prefix_event& e) { detail::notify(on_event, e, stats.event_errors); }

    prefix_state(const prefix_cache_params& p, uint32_t kv_size, uint32_t n_stream, uint32_t n_seq_max)
        : index(p.block_size, n_stream, p.policy, max_protected(p, kv_size)),
          seqs(n_seq_max),
          on_event(p.on_event) {}

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
