// The memory_recurrent tests' helpers: hand-made ubatches of blocks, placement through find_slot with the
// oracle engine (recurrent_oracle.h), hash chains, and snapshots of a memory.
#pragma once

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include <kvcache/batch.h>
#include <kvcache/memory_recurrent.h>
#include <kvcache/state.h>

#include "memory_recurrent_test_access.h"
#include "recurrent_oracle.h"

namespace kvc::test {

// -- building batches and ubatches --

// A hand-made equal-seqs ubatch: blocks of one sequence set each, positions given per block.
struct block {
    std::vector<seq_id_t> ids;
    std::vector<pos_t> pos;
};

inline ubatch make_ub(const std::vector<block>& blocks) {
    ubatch u;
    u.equal_seqs = true;
    u.n_seqs = static_cast<uint32_t>(blocks.size());
    u.n_seq_tokens = static_cast<uint32_t>(blocks[0].pos.size());
    u.n_tokens = u.n_seqs * u.n_seq_tokens;
    u.seq_id_begin.push_back(0);
    for (const block& b : blocks)
        for (pos_t p : b.pos) {
            u.pos.push_back(p);
            u.token.push_back(0);
            u.n_seq_id.push_back(static_cast<int32_t>(b.ids.size()));
            u.seq_id_data.insert(u.seq_id_data.end(), b.ids.begin(), b.ids.end());
            u.seq_id_begin.push_back(static_cast<uint32_t>(u.seq_id_data.size()));
            u.output.push_back(0);
            u.batch_idx.push_back(static_cast<int32_t>(u.batch_idx.size()));
        }
    u.seq_id_unq = u.seq_id_data;
    std::sort(u.seq_id_unq.begin(), u.seq_id_unq.end());
    u.seq_id_unq.erase(std::unique(u.seq_id_unq.begin(), u.seq_id_unq.end()), u.seq_id_unq.end());
    u.n_seqs_unq = static_cast<uint32_t>(u.seq_id_unq.size());
    return u;
}

// find_slot + the engine for one hand-made ubatch.
inline rs_slot step(memory_recurrent& m, const std::vector<block>& blocks) {
    const ubatch ub = make_ub(blocks);
    rs_slot sl = memory_recurrent_test_access::find_slot(m, ub);
    engine_step(m, sl, ub);
    return sl;
}

// One decode through the whole stack: batch_allocr, init_batch, then per ubatch apply + the engine, reading
// the inputs from the context. Tokens: (seq, pos) in batch order. Returns the number of ubatches, or -1 when
// init_batch failed.
inline int decode(memory_recurrent& m, const std::vector<std::pair<seq_id_t, pos_t>>& tokens,
                  uint32_t n_ubatch = 512, bool embd_all = false) {
    batch_storage b = batch::init(static_cast<int32_t>(tokens.size()), 0, 1);
    for (const auto& [s, p] : tokens) {
        const seq_id_t ids[] = {s};
        b.add(1, p, ids, false);
    }
    batch_allocr a;
    a.init(b.view(), positions_of(m), {.n_seq_max = m.params().n_seq_max});
    auto ctx = m.init_batch(a, n_ubatch, embd_all);
    if (is_fail(ctx->get_status())) return -1;
    memory_recurrent_context& rc = *ctx->get_recr();
    int n = 0;
    do {
        rc.apply();
        engine_step(m, slot_of(rc), rc.get_ubatch());
        ++n;
    } while (rc.next());
    return n;
}

// n tokens of s from position p0.
inline std::vector<std::pair<seq_id_t, pos_t>> run(seq_id_t s, pos_t p0, pos_t n) {
    std::vector<std::pair<seq_id_t, pos_t>> t;
    for (pos_t i = 0; i < n; ++i) t.emplace_back(s, p0 + i);
    return t;
}

// The chain of states of s over positions [p0, p0 + n) from h.
inline std::vector<uint64_t> chain(uint64_t h, seq_id_t s, pos_t p0, pos_t n) {
    std::vector<uint64_t> out;
    for (pos_t i = 0; i < n; ++i) out.push_back(h = mix(h, s, p0 + i));
    return out;
}

// Two layers with state, one without: r of 4 and s of 6 values, then nothing, then s of 3 values.
inline recurrent_params params(uint32_t n_seq_max, uint32_t n_rs_seq = 0) {
    recurrent_params p;
    p.layers = {{.n_embd_r = 4, .n_embd_s = 6}, {}, {.n_embd_r = 0, .n_embd_s = 3}};
    p.n_seq_max = n_seq_max;
    p.n_rs_seq = n_rs_seq;
    return p;
}
inline std::vector<uint8_t> payload(const memory_i& m, seq_id_t s) {
    std::vector<uint8_t> out;
    io_vector_writer w(out);
    m.state_write(w, s, 0);
    return out;
}

// Everything observable: cells, tails, head, used and the whole state.
inline std::string snapshot(const memory_recurrent& m) {
    std::string out =
        m.picture() + " head=" + std::to_string(m.get_head()) + " used=" + std::to_string(m.get_used());
    for (uint32_t c = 0; c < m.get_size(); ++c) {
        const auto x = m.cell(c);
        out += " [" + std::to_string(x.pos) + "," + std::to_string(x.src) + "," + std::to_string(x.rs_idx) +
               "," + std::to_string(x.depth) + "]";
    }
    const auto bytes = payload(m, seq_all);
    out += " state=" + std::to_string(std::hash<std::string>{}(std::string(bytes.begin(), bytes.end())));
    return out;
}

}  // namespace kvc::test
