// memory_hybrid: design/recurrent.md §5 (composition by layer, batches in both parts or neither,
// all-or-nothing seq_rm, positions combined, status combination, state of both parts, transactional
// restores) and the iSWA attention variant.
#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>
#include <kvcache/batch.h>
#include <kvcache/memory_hybrid.h>
#include <kvcache/recurrent_engine.h>
#include <kvcache/state.h>

#include "memory_test_util.h"

namespace kvc {
namespace {

using test::whole;

// Four layers: 1 and 3 attention, 0 and 2 recurrent (Jamba-like); with both, every layer is both
// (Falcon-H1-like).
memory_hybrid_params make_params(uint32_t kv_size, uint32_t n_seq_max, uint32_t n_rs_seq = 0,
                                 bool both = false) {
    memory_hybrid_params p;
    for (uint32_t il = 0; il < 4; ++il) {
        const bool attn = both || il % 2 == 1, recr = both || il % 2 == 0;
        p.attn.layers.push_back(
            layer_desc{.n_head_kv = 1, .n_embd_head_k = 32, .n_embd_head_v = 32, .has_kv = attn});
        p.recr.layers.push_back(recr ? recurrent_layer_desc{.n_embd_r = 4, .n_embd_s = 8}
                                     : recurrent_layer_desc{});
    }
    p.attn.kv_size = kv_size;
    p.attn.n_seq_max = n_seq_max;
    p.attn.v_trans = false;
    p.recr.n_seq_max = n_seq_max;
    p.recr.n_rs_seq = n_rs_seq;
    return p;
}

// One decode of the groups (sequence, first position, count); every attention layer's rows and every
// recurrent row written as an engine would (values that depend on the sequence and position).
memory_status decode(memory_hybrid& m, const std::vector<test::run>& groups, uint32_t n_ubatch = 512) {
    memory_context_ptr ctx = test::init_runs(m, m.params().attn.n_seq_max, groups, n_ubatch);
    if (is_fail(ctx->get_status())) return ctx->get_status();
    do {
        ctx->apply();
        const ubatch& ub = ctx->get_ubatch();
        for (uint32_t il = 0; il < 4; ++il) {
            if (!m.params().attn.layers[il].has_kv) continue;
            std::vector<float> rows(size_t{32} * ub.n_tokens);
            for (uint32_t t = 0; t < ub.n_tokens; ++t)
                for (uint32_t d = 0; d < 32; ++d)
                    rows[t * 32 + d] = static_cast<float>(ub.primary_seq(t) * 1000 + ub.pos[t] + d);
            const auto view = const_tensor_view::contiguous(
                dtype::f32, reinterpret_cast<const std::byte*>(rows.data()), 32, ub.n_tokens);
            ctx->get_attn(il)->cpy_k(il, view);
            ctx->get_attn(il)->cpy_v(il, view);
        }
        memory_recurrent_context& rc = *ctx->get_recr();
        for (uint32_t il : m.get_recr().layer_ids())
            for (const tensor_view& v : {rc.get_r(il), rc.get_s(il)})
                for (uint32_t i = 0; i < ub.n_seqs; ++i) {  // the block's final state, plane 0
                    auto* row = reinterpret_cast<float*>(v.data + (rc.get_head() + i) * v.nb[1]);
                    for (int64_t d = 0; d < v.ne[0]; ++d)
                        row[d] = static_cast<float>(ub.primary_seq(i * ub.n_seq_tokens) * 1000 +
                                                    ub.pos[(i + 1) * ub.n_seq_tokens - 1]);
                }
    } while (ctx->next());
    return memory_status::success;
}

TEST(memory_hybrid, parts_keep_their_layers) {
    const memory_hybrid m(make_params(256, 2));
    const auto& kv = dynamic_cast<const kv_cache&>(m.get_attn());
    EXPECT_EQ(std::vector<uint32_t>(kv.layer_ids().begin(), kv.layer_ids().end()),
              (std::vector<uint32_t>{1, 3}));
    EXPECT_EQ(std::vector<uint32_t>(m.get_recr().layer_ids().begin(), m.get_recr().layer_ids().end()),
              (std::vector<uint32_t>{0, 2}));
    EXPECT_EQ(m.layer_cache(1), &kv);
    EXPECT_EQ(m.layer_cache(0), nullptr);
    EXPECT_EQ(m.size_bytes(), kv.size_bytes() + m.get_recr().size_bytes());
    EXPECT_EQ(m.state_layout(), "hybrid attn=" + kv.state_layout() + " recr=" + m.get_recr().state_layout());
    const memory_hybrid both(make_params(256, 2, 0, true));  // a layer may be in both parts
    EXPECT_EQ(both.get_recr().layer_ids().size(), 4u);
    ASSERT_NE(both.layer_cache(0), nullptr);
    EXPECT_TRUE(both.layer_cache(0)->has_layer(0));
}

TEST(memory_hybrid, invalid_configurations_are_refused) {
    memory_hybrid_params p = make_params(256, 2);
    p.recr.n_seq_max = 3;
    EXPECT_THROW(memory_hybrid{p}, error);
    p = make_params(256, 2);
    for (recurrent_layer_desc& d : p.recr.layers) d = {};
    EXPECT_THROW(memory_hybrid{p}, error);  // no recurrent layer
}

TEST(memory_hybrid, seq_rm_is_all_or_nothing) {
    memory_hybrid m(make_params(256, 2));
    ASSERT_EQ(decode(m, {{0, 0, 6}, {1, 0, 4}}), memory_status::success);
    const std::vector<uint8_t> before = whole(m);
    // a suffix: the recurrent part cannot remove it, so the attention part is not asked
    EXPECT_FALSE(m.seq_rm(0, 3, -1));
    EXPECT_EQ(whole(m), before);
    EXPECT_EQ(m.get_attn().seq_pos_max(0), 5);
    // a range after the last position: nothing to do in either part
    EXPECT_TRUE(m.seq_rm(0, 10, -1));
    EXPECT_EQ(whole(m), before);
    // the whole sequence goes from both
    EXPECT_TRUE(m.seq_rm(0, -1, -1));
    EXPECT_EQ(m.get_attn().seq_pos_max(0), -1);
    EXPECT_EQ(m.get_recr().seq_pos_max(0), -1);
    EXPECT_EQ(m.seq_pos_max(1), 3);
    EXPECT_THROW(m.seq_rm(2, -1, -1), error);  // out of range, nothing changed
    EXPECT_EQ(m.seq_pos_max(1), 3);
    // a range before the last position: the recurrent part keeps its state (it cannot forget the middle of
    // a history) and says true, so the attention part removes the range, as upstream; the state still
    // reflects the removed tokens
    EXPECT_TRUE(m.seq_rm(1, 1, 3));
    EXPECT_EQ(m.get_recr().seq_pos_max(1), 3);
    std::vector<uint32_t> cells;
    dynamic_cast<const kv_cache&>(m.get_attn()).cells(0).seq_cells(1, -1, -1, cells);
    EXPECT_EQ(cells.size(), 2u);  // positions 0 and 3
}

TEST(memory_hybrid, rollback_removes_a_suffix_from_both_parts) {
    memory_hybrid m(make_params(256, 1, 2));
    ASSERT_EQ(decode(m, {{0, 0, 6}}), memory_status::success);
    ASSERT_EQ(decode(m, {{0, 6, 2}}), memory_status::success);
    EXPECT_TRUE(m.seq_rm(0, 6, -1));  // two tokens back: within the history
    EXPECT_EQ(m.get_attn().seq_pos_max(0), 5);
    EXPECT_EQ(m.get_recr().seq_pos_max(0), 5);
    ASSERT_EQ(decode(m, {{0, 6, 3}}), memory_status::success);
    const std::vector<uint8_t> before = whole(m);
    EXPECT_FALSE(m.seq_rm(0, 6, -1));  // three back: beyond it, nothing changed
    EXPECT_EQ(whole(m), before);
}

TEST(memory_hybrid, positions_combine_the_parts) {
    memory_hybrid m(make_params(256, 2));
    ASSERT_EQ(decode(m, {{0, 0, 5}}), memory_status::success);
    EXPECT_EQ(m.get_attn().seq_pos_min(0), 0);
    EXPECT_EQ(m.get_recr().seq_pos_min(0), 4);
    EXPECT_EQ(m.seq_pos_min(0), 4);  // max of the minimums
    EXPECT_EQ(m.seq_pos_max(0), 4);
    EXPECT_EQ(m.seq_pos_min(1), -1);
    EXPECT_EQ(m.seq_pos_max(1), -1);
    m.seq_add(0, 0, -1, 10);  // both parts shift
    EXPECT_EQ(m.get_attn().seq_pos_max(0), 14);
    EXPECT_EQ(m.get_recr().seq_pos_max(0), 14);
    m.seq_div(0, 0, -1, 2);
    EXPECT_EQ(m.seq_pos_max(0), 7);
    m.seq_cp(0, 1, -1, -1);
    EXPECT_EQ(m.seq_pos_max(1), 7);
    m.seq_keep(1);
    EXPECT_EQ(m.seq_pos_max(0), -1);
    EXPECT_TRUE(m.get_can_shift());
    memory_hybrid_params mrope = make_params(256, 2);
    mrope.attn.n_pos = 4;
    EXPECT_EQ(memory_hybrid(mrope).get_can_shift(), kv_cache(mrope.attn).get_can_shift());
}

TEST(memory_hybrid, a_batch_goes_to_both_parts_or_neither) {
    memory_hybrid m(make_params(256, 2));
    ASSERT_EQ(decode(m, {{0, 0, 200}}), memory_status::success);
    const std::vector<uint8_t> before = whole(m);
    // the attention part has 56 free cells: 60 more tokens do not fit, and the recurrent part (which
    // always has a cell) is not changed either
    EXPECT_EQ(decode(m, {{1, 0, 60}}), memory_status::failed_prepare);
    EXPECT_EQ(whole(m), before);
    EXPECT_EQ(m.get_recr().seq_tail(1), -1);
    EXPECT_EQ(decode(m, {{1, 0, 50}}), memory_status::success);
}

TEST(memory_hybrid, contexts_combine_their_children) {
    memory_hybrid m(make_params(256, 2));
    memory_context_ptr full = m.init_full();
    EXPECT_EQ(full->get_status(), memory_status::success);
    full->apply();
    EXPECT_EQ(full->get_recr()->get_n_rs(), m.get_recr().get_size());
    EXPECT_EQ(&full->get_attn(1)->cache(), m.layer_cache(1));
    EXPECT_EQ(full->get_attn(0), nullptr) << "layer 0 is recurrent";
    EXPECT_EQ(m.init_update(false)->get_status(), memory_status::no_update);  // neither has work
    ASSERT_EQ(decode(m, {{0, 0, 4}}), memory_status::success);
    m.seq_add(0, 0, -1, 2);  // a pending K-shift in the attention part
    memory_context_ptr up = m.init_update(false);
    EXPECT_EQ(up->get_status(), memory_status::success);
    up->apply();
    EXPECT_FALSE(dynamic_cast<const kv_cache&>(m.get_attn()).get_has_shift());
    memory_hybrid_context failed(memory_status::failed_prepare);
    EXPECT_EQ(failed.get_attn(1), nullptr);
    EXPECT_EQ(failed.get_recr(), nullptr);
    // status combination (first failure wins, then success if either has work)
    using ms = memory_status;
    EXPECT_EQ(combine(ms::no_update, ms::no_update), ms::no_update);
    EXPECT_EQ(combine(ms::no_update, ms::success), ms::success);
    EXPECT_EQ(combine(ms::failed_compute, ms::failed_prepare), ms::failed_compute);
    EXPECT_EQ(combine(ms::success, ms::failed_prepare), ms::failed_prepare);
}

TEST(memory_hybrid, state_round_trips_whole_one_sequence_and_partial) {
    memory_hybrid m(make_params(256, 3));
    ASSERT_EQ(decode(m, {{0, 0, 7}, {1, 0, 3}}), memory_status::success);
    const std::vector<uint8_t> all = whole(m);
    std::vector<uint8_t> attn, recr;
    io_vector_writer wa(attn), wr(recr);
    m.get_attn().state_write(wa, seq_all, 0);
    m.get_recr().state_write(wr, seq_all, 0);
    attn.insert(attn.end(), recr.begin(), recr.end());
    EXPECT_EQ(std::vector<uint8_t>(all.begin() + 8, all.end()), attn);  // attention part, then recurrent
    memory_hybrid fresh(make_params(256, 3));
    state_seq_set_data(fresh, all, seq_all);
    EXPECT_EQ(whole(fresh), all);

    const std::vector<uint8_t> seq0 = state_seq_get_data(m, 0);
    state_seq_set_data(m, seq0, 2);
    EXPECT_EQ(m.get_attn().seq_pos_min(2), 0);
    EXPECT_EQ(m.seq_pos_max(2), 6);
    EXPECT_EQ(m.get_recr().seq_pos_max(2), 6);

    // partial: the recurrent part alone (what upstream's context checkpoints save)
    const std::vector<uint8_t> part = state_seq_get_data(m, 0, state_seq_flag_partial_only);
    std::vector<uint8_t> rs;
    io_vector_writer wrs(rs);
    m.get_recr().state_write(wrs, 0, 0);
    EXPECT_EQ(std::vector<uint8_t>(part.begin() + 8, part.end()), rs);
    state_seq_set_data(m, part, 1, state_seq_flag_partial_only);
    EXPECT_EQ(m.get_recr().seq_pos_max(1), 6);
    EXPECT_EQ(m.get_attn().seq_pos_max(1), 2);  // untouched
}

TEST(memory_hybrid, a_failed_restore_changes_neither_part) {
    memory_hybrid m(make_params(256, 3));
    ASSERT_EQ(decode(m, {{0, 0, 7}, {1, 0, 3}}), memory_status::success);
    const std::vector<uint8_t> good = state_seq_get_data(m, 0);
    const std::vector<uint8_t> before = whole(m);
    // the recurrent part is bad (a layer count no memory here has): found before the attention part is
    // restored; upstream would have restored the attention part and cleared the destination
    std::vector<uint8_t> bad = good;
    const size_t recr_at = bad.size() - state_seq_get_size(m.get_recr(), 0) + 8;  // the recurrent payload
    bad[recr_at + 4 + 8 + 4] ^= 0x40;                                             // its n_layer
    EXPECT_THROW(state_seq_set_data(m, bad, 2), error);
    EXPECT_EQ(whole(m), before);
    for (size_t len = 0; len < good.size(); len += 23) {
        EXPECT_THROW(state_seq_set_data(m, std::span(good).first(len), 2), error) << len;
        ASSERT_EQ(whole(m), before) << len;
    }
    // the attention part has no room: nothing changes in the recurrent part either
    memory_hybrid small(make_params(256, 3));
    ASSERT_EQ(decode(small, {{1, 0, 250}}), memory_status::success);
    const std::vector<uint8_t> small_before = whole(small);
    try {
        state_seq_set_data(small, good, 2);
        FAIL() << "7 cells into 6 free ones";
    } catch (const error& e) {
        EXPECT_EQ(e.code(), errc::invalid_state) << e.what();
    }
    EXPECT_EQ(whole(small), small_before);
    EXPECT_EQ(small.get_recr().seq_tail(2), -1);
}

TEST(memory_hybrid, iswa_attention) {
    memory_hybrid_params p = make_params(1024, 2);
    p.iswa = iswa_sizing{.swa_full = false, .n_ubatch = 64};
    p.attn.layers[1].is_swa = true;  // layer 1 slides a window, layer 3 sees everything
    p.attn.n_swa = 8;
    p.attn.swa = swa_type::standard;
    memory_hybrid m(p);
    const auto& is = dynamic_cast<const kv_cache_iswa&>(m.get_attn());
    EXPECT_EQ(m.layer_cache(1), &is.get_swa());
    EXPECT_EQ(m.layer_cache(3), &is.get_base());
    for (pos_t pos = 0; pos < 320; pos += 64)
        ASSERT_EQ(decode(m, {{0, pos, 64}}, 64), memory_status::success);
    EXPECT_EQ(is.get_base().seq_pos_min(0), 0);
    EXPECT_GT(is.get_swa().seq_pos_min(0), 0);
    EXPECT_EQ(m.seq_pos_max(0), 319);
    EXPECT_FALSE(m.get_can_shift());
    const std::vector<uint8_t> all = whole(m);
    memory_hybrid fresh(p);
    state_seq_set_data(fresh, all, seq_all);
    EXPECT_EQ(whole(fresh), all);
}

// -- property: the memory against an oracle of per-sequence token lists --

uint64_t mix(uint64_t h, seq_id_t s, pos_t p) {
    uint64_t x = h ^ (uint64_t{static_cast<uint32_t>(s)} << 32 | static_cast<uint32_t>(p));
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return (x ^ (x >> 31)) | 1;  // never 0, the fresh state
}

// The recurrent engine of this test: the library's reference of the contract (recurrent_engine.h, checked
// against an independent oracle in test_recurrent_engine.cpp) with states as hash chains of (sequence,
// position) in the first 8 bytes of every row: a wrong source row, plane or copy changes the chain.
void recurrent_step(memory_recurrent_context& rc) {
    const ubatch& ub = rc.get_ubatch();
    run_recurrent_ubatch(rc, [&](uint32_t, rs_tensor, uint32_t t, std::span<float> x) {
        uint64_t h = 0;
        std::memcpy(&h, x.data(), 8);
        h = mix(h, ub.primary_seq(t), ub.pos[t]);
        std::memcpy(x.data(), &h, 8);
    });
}

// What a sequence holds: its tokens' positions and the state after each of them.
struct oracle_seq {
    std::vector<pos_t> pos;
    std::vector<uint64_t> states;  // states[i]: after pos[i]
};

TEST(memory_hybrid_property, parts_stay_in_step_with_an_oracle_of_token_lists) {
    for (uint32_t seed = 1; seed <= 6; ++seed) {
        std::mt19937 rng(seed);
        const uint32_t n_seq = 3;
        memory_hybrid m(make_params(256, n_seq, seed % 3));  // rollback depth 0, 1 or 2
        const auto& attn = dynamic_cast<const kv_cache&>(m.get_attn());
        std::vector<oracle_seq> o(n_seq);
        size_t n_rm_true = 0, n_rm_false = 0;
        const auto verify = [&](const char* op, int step) {
            for (seq_id_t s = 0; s < static_cast<seq_id_t>(n_seq); ++s) {
                const oracle_seq& x = o[static_cast<size_t>(s)];
                std::vector<uint32_t> cells;
                attn.cells(0).seq_cells(s, -1, -1, cells);
                std::vector<pos_t> got;
                for (uint32_t c : cells) got.push_back(attn.cells(0).pos_get(c));
                std::sort(got.begin(), got.end());
                ASSERT_EQ(got, x.pos) << op << " step " << step << " seq " << s;
                const int32_t tail = m.get_recr().seq_tail(s);
                ASSERT_EQ(tail >= 0, !x.pos.empty()) << op << " step " << step << " seq " << s;
                if (tail < 0) continue;
                const auto info = m.get_recr().cell(static_cast<uint32_t>(tail));
                EXPECT_EQ(info.pos, x.pos.back());
                uint64_t h = 0;
                const tensor_view v = m.get_recr().get_s(0);
                std::memcpy(&h, v.data + (int64_t{info.rs_idx} * m.get_recr().get_size() + tail) * v.nb[1],
                            8);
                ASSERT_EQ(h, x.states.back()) << op << " step " << step << " seq " << s;
                EXPECT_EQ(m.seq_pos_max(s), x.pos.back());
            }
        };
        for (int step = 0; step < 300; ++step) {
            const auto s = static_cast<seq_id_t>(rng() % n_seq);
            oracle_seq& x = o[static_cast<size_t>(s)];
            const uint32_t op = rng() % 10;
            if (op < 5) {  // decode 1-4 tokens of one or two sequences
                std::vector<std::pair<seq_id_t, uint32_t>> groups = {{s, 1 + rng() % 4}};
                const auto s2 = static_cast<seq_id_t>(rng() % n_seq);
                if (s2 != s && rng() % 2) groups.emplace_back(s2, 1 + rng() % 4);
                uint32_t n = 0;
                for (const auto& g : groups) n += g.second;
                if (attn.cells(0).get_used() + n > 250) {
                    m.clear(false);
                    o.assign(n_seq, oracle_seq{});
                    continue;
                }
                batch_storage b = batch::init(static_cast<int32_t>(n), 0, 1);
                for (const auto& [q, count] : groups) {
                    const seq_id_t ids[] = {q};
                    oracle_seq& y = o[static_cast<size_t>(q)];
                    for (uint32_t i = 0; i < count; ++i) {
                        const pos_t p = y.pos.empty() ? 0 : y.pos.back() + 1;
                        b.add(1, p, ids, false);
                        y.states.push_back(mix(y.states.empty() ? 0 : y.states.back(), q, p));
                        y.pos.push_back(p);
                    }
                }
                batch_allocr a;
                a.init(b.view(), positions_of(m), {.n_seq_max = n_seq});
                memory_context_ptr ctx = m.init_batch(a, 3, false);  // small ubatches: several per batch
                ASSERT_EQ(ctx->get_status(), memory_status::success);
                do {
                    ctx->apply();
                    recurrent_step(*ctx->get_recr());
                } while (ctx->next());
                verify("decode", step);
            } else if (op < 8) {  // remove a suffix (a rollback when the depth allows) or everything
                const auto r = static_cast<pos_t>(rng() % 4);
                const pos_t p0 = x.pos.empty() || r == 3 ? -1 : x.pos.back() - r;
                const std::vector<uint8_t> before = state_seq_get_data(m, seq_all);
                if (m.seq_rm(s, p0, -1)) {
                    ++n_rm_true;
                    while (!x.pos.empty() && (p0 < 0 || x.pos.back() >= p0)) {
                        x.pos.pop_back();
                        x.states.pop_back();
                    }
                } else {
                    ++n_rm_false;
                    ASSERT_EQ(state_seq_get_data(m, seq_all), before) << "a refused seq_rm changed something";
                }
                verify("rm", step);
            } else if (op == 8) {  // share a whole sequence
                const auto d = static_cast<seq_id_t>(rng() % n_seq);
                if (d == s) continue;
                m.seq_rm(d, -1, -1);  // the attention part keeps cp's target free of old cells
                m.seq_cp(s, d, -1, -1);
                o[static_cast<size_t>(d)] = x;
                verify("cp", step);
            } else {  // restore a sequence's state into another
                const auto d = static_cast<seq_id_t>(rng() % n_seq);
                const std::vector<uint8_t> before = state_seq_get_data(m, seq_all);
                try {
                    state_seq_set_data(m, state_seq_get_data(m, s), d);
                    o[static_cast<size_t>(d)] = o[static_cast<size_t>(s)];
                } catch (const error& e) {  // no room in the attention part: nothing changed in either
                    ASSERT_EQ(e.code(), errc::invalid_state) << e.what();
                    ASSERT_EQ(state_seq_get_data(m, seq_all), before);
                }
                verify("restore", step);
            }
        }
        EXPECT_GT(n_rm_true, 10u) << "seed " << seed;
        if (seed % 3 == 0) {
            EXPECT_GT(n_rm_false, 5u) << "seed " << seed;
        }
    }
}

// -- the prefix cache: evictions keep the parts together --

// seq decodes `tokens` from position p0 in one batch (bookkeeping only: the rows are not written).
void decode_prompt(memory_hybrid& m, seq_id_t seq, const std::vector<token_t>& tokens, pos_t p0 = 0) {
    batch_storage b = batch::init(static_cast<int32_t>(tokens.size()), 0, 1);
    const seq_id_t ids[] = {seq};
    for (size_t i = 0; i < tokens.size(); ++i)
        b.add(tokens[i], p0 + static_cast<pos_t>(i), ids, i + 1 == tokens.size());
    batch_allocr a;
    a.init(b.view(), positions_of(m), {.n_seq_max = m.params().attn.n_seq_max});
    memory_context_ptr ctx = m.init_batch(a, 512, false);
    ASSERT_EQ(ctx->get_status(), memory_status::success);
    do ctx->apply();
    while (ctx->next());
}

// 13 tokens: the prompt's end (its newest boundary before the last token) is at 12
std::vector<token_t> prompt_of(int i) {
    std::vector<token_t> t(13);
    for (int j = 0; j < 13; ++j) t[static_cast<size_t>(j)] = 100 * i + j;
    return t;
}

// Snapshots evicted from a small pool take the K/V blocks that led only to them along (the attention
// part keeps no half of a hit), and blocks the attention part evicts take their snapshots along.
TEST(memory_hybrid, prefix_evictions_keep_the_parts_together) {
    for (const bool small_pool : {true, false}) {
        memory_hybrid_params p = make_params(small_pool ? 256 : 32, 2);
        p.prefix = {
            .enabled = true, .block_size = 4, .snapshot_interval = 0, .max_snapshots = small_pool ? 2u : 16u};
        memory_hybrid m(p);
        for (int i = 0; i < 10; ++i) {
            const uint32_t n = m.prefix_cache()->prefix_attach(0, prompt_of(i));
            EXPECT_EQ(n, 0u);
            decode_prompt(m, 0, prompt_of(i));
            ASSERT_TRUE(m.seq_rm(0, -1, -1));
        }
        m.prefix_cache()->prefix_publish();
        const prefix_stats st = m.prefix_cache()->get_prefix_stats();
        const auto& kv = dynamic_cast<const kv_cache&>(m.get_attn());
        // every cached K/V block leads to a snapshot and every snapshot has its K/V: whole chains
        EXPECT_EQ(kv.prefix_cache()->get_prefix_stats().blocks, 3 * st.snapshots)
            << "small pool " << small_pool;
        EXPECT_LE(st.snapshots, 2u);
        EXPECT_GT(st.snapshots, 0u);
        std::vector<token_t> again = prompt_of(9);
        again.push_back(7);
        EXPECT_EQ(m.prefix_cache()->prefix_lookup(again), 12u);
        again = prompt_of(0);
        again.push_back(7);
        EXPECT_EQ(m.prefix_cache()->prefix_lookup(again), 0u);
    }
}

// A sequence resumed at a snapshot before the end of the cached K/V recomputes blocks the attention part
// has: when it publishes them it moves onto the cached cells, so the K/V is not held twice (and the cached
// blocks do not wait, unevictable, for children of the duplicate).
TEST(memory_hybrid, a_sequence_recomputing_cached_blocks_moves_onto_them) {
    memory_hybrid_params p = make_params(256, 2);
    p.prefix = {.enabled = true, .block_size = 4, .snapshot_interval = 0, .max_snapshots = 3};
    memory_hybrid m(p);
    std::vector<token_t> t(20);
    for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<token_t>(10 + i);
    // seq 0: a 13-token prompt (its snapshot at 12), then 7 tokens one at a time (its rolling snapshot at 16
    // gives way to the one at 20, kept when it ends): the K/V of 20 tokens, snapshots at 12 and 20
    decode_prompt(m, 0, {t.begin(), t.begin() + 13});
    for (pos_t q = 13; q < 20; ++q) decode_prompt(m, 0, {t[static_cast<size_t>(q)]}, q);
    ASSERT_TRUE(m.seq_rm(0, -1, -1));
    const auto& kv = dynamic_cast<const kv_cache&>(m.get_attn());
    EXPECT_EQ(kv.prefix_cache()->get_prefix_stats().cached_cells, 20u);
    // seq 1 leaves the chain at 16: it resumes at 12 and recomputes block 3 (positions 12-15) before its
    // own two tokens
    std::vector<token_t> prompt(t.begin(), t.begin() + 16);
    prompt.insert(prompt.end(), {900, 901});
    ASSERT_EQ(m.prefix_cache()->prefix_attach(1, prompt), 12u);
    decode_prompt(m, 1, {prompt.begin() + 12, prompt.end()}, 12);
    m.prefix_cache()->prefix_publish();
    EXPECT_EQ(kv.cells(0).get_used(), 22u);  // the 5 cached blocks and positions 16-17 (not 26)
    const prefix_stats st = kv.prefix_cache()->get_prefix_stats();
    EXPECT_EQ(st.shared_cells, 16u);
    EXPECT_EQ(st.cached_cells, 4u);   // block 4 (positions 16-19), which leads to the snapshot at 20
    EXPECT_EQ(kv.seq_pos_min(1), 0);  // its K/V positions are all there, cached cells included
    EXPECT_EQ(m.seq_pos_max(1), 17);
}

// The listener hears both parts, each event tagged with its index: the attention part's K/V blocks (kv;
// with iswa the SWA cache's too, swa) and the recurrent part's chains of snapshots (snapshot), as many as
// each part counts.
TEST(memory_hybrid, prefix_events_name_the_part_of_each_block) {
    for (const bool iswa : {false, true}) {
        memory_hybrid_params p = make_params(1024, 2);
        if (iswa) {
            p.iswa = iswa_sizing{.swa_full = false, .n_ubatch = 64};
            p.attn.layers[1].is_swa = true;
            p.attn.n_swa = 8;
            p.attn.swa = swa_type::standard;
        }
        p.prefix = {.enabled = true, .block_size = 4, .snapshot_interval = 0, .max_snapshots = 2};
        uint64_t seen[3][3] = {};  // [part][kind]
        p.prefix.on_event = [&seen](const prefix_event& e) {
            ASSERT_LE(static_cast<int>(e.part), 2);
            ++seen[static_cast<int>(e.part)][static_cast<int>(e.type)];
        };
        memory_hybrid m(p);
        for (int i = 0; i < 6; ++i) {
            ASSERT_EQ(m.prefix_cache()->prefix_attach(0, prompt_of(i)), 0u);
            decode_prompt(m, 0, prompt_of(i));
            ASSERT_TRUE(m.seq_rm(0, -1, -1));
        }
        m.prefix_cache()->prefix_publish();
        const prefix_stats r = m.get_recr().prefix_cache()->get_prefix_stats();
        const prefix_stats st = m.prefix_cache()->get_prefix_stats();
        EXPECT_GT(r.snapshots_dropped, 0u) << "a pool of 2 for 6 prompts";
        EXPECT_EQ(seen[2][0], r.published_blocks) << "iswa " << iswa;
        EXPECT_GT(seen[2][1], 0u) << "iswa " << iswa;
        EXPECT_EQ(seen[2][0] - seen[2][1], r.blocks) << "iswa " << iswa;
        EXPECT_EQ(seen[0][0] - seen[0][1], st.blocks) << "iswa " << iswa;
        EXPECT_EQ(seen[1][0], st.swa_published_blocks) << "iswa " << iswa;
        EXPECT_EQ(seen[1][0] - seen[1][1], st.swa_blocks) << "iswa " << iswa;
        if (iswa) {
            EXPECT_GT(seen[1][0], 0u);
        }
        m.clear(false);
        EXPECT_EQ(seen[2][2], 1u) << "iswa " << iswa;
    }
}

// -- an iSWA attention part: a hit needs the base cache's blocks, the SWA cache's window and a snapshot --

memory_hybrid_params iswa_prefix_params(uint32_t max_snapshots, uint32_t interval = 0) {
    memory_hybrid_params p = make_params(1024, 2);
    p.iswa = iswa_sizing{.swa_full = false, .n_ubatch = 64};  // a 256-cell SWA cache
    p.attn.layers[1].is_swa = true;
    p.attn.n_swa = 8;
    p.attn.swa = swa_type::standard;
    p.prefix = {
        .enabled = true, .block_size = 4, .snapshot_interval = interval, .max_snapshots = max_snapshots};
    return p;
}

// 41 tokens: the prompt's end (its newest boundary before the last token) is at 40
std::vector<token_t> long_prompt(int i) {
    std::vector<token_t> t(41);
    for (size_t j = 0; j < t.size(); ++j) t[j] = 1000 * i + static_cast<int>(j);
    return t;
}

// Twelve prompts of 41 tokens through a 256-cell SWA cache: it evicts the windows of old ones. A snapshot
// whose window went is dropped, and the base blocks that led only to it go too, so what stays is whole
// hits: every snapshot has its chain and window (lookups find it), and the base cache keeps 10 blocks
// per snapshot and no more.
TEST(memory_hybrid, iswa_prefix_evictions_keep_the_three_parts_together) {
    memory_hybrid m(iswa_prefix_params(32));
    const auto& is = dynamic_cast<const kv_cache_iswa&>(m.get_attn());
    ASSERT_EQ(is.get_swa().get_size(), 256u);
    for (int i = 0; i < 12; ++i) {
        ASSERT_EQ(m.prefix_cache()->prefix_attach(0, long_prompt(i)), 0u);
        decode_prompt(m, 0, long_prompt(i));
        ASSERT_TRUE(m.seq_rm(0, -1, -1));
        std::vector<token_t> next = long_prompt(i);
        next.push_back(7);
        EXPECT_EQ(m.prefix_cache()->prefix_lookup(next), 40u)
            << "the newest prompt resumes at its end, " << i;
    }
    m.prefix_cache()->prefix_publish();
    const prefix_stats st = m.prefix_cache()->get_prefix_stats();
    EXPECT_GT(st.swa_evicted_blocks, 0u);
    EXPECT_GT(st.snapshots_dropped, 0u) << "the snapshots of windows that went";
    uint32_t hits = 0;
    for (int i = 0; i < 12; ++i) {
        std::vector<token_t> next = long_prompt(i);
        next.push_back(7);
        const uint32_t n = m.prefix_cache()->prefix_lookup(next);
        EXPECT_TRUE(n == 0 || n == 40) << i;
        hits += n == 40 ? 1 : 0;
    }
    EXPECT_LT(hits, 12u);
    EXPECT_EQ(st.snapshots, hits);
    EXPECT_EQ(is.get_base().prefix_cache()->get_prefix_stats().blocks, 10 * hits);
    // an attach takes all three: the base chain, the window (positions 32-39 and no older) and the state
    std::vector<token_t> next = long_prompt(11);
    next.push_back(7);
    ASSERT_EQ(m.prefix_cache()->prefix_attach(1, next), 40u);
    EXPECT_EQ(is.get_base().seq_pos_min(1), 0);
    EXPECT_LE(is.get_swa().seq_pos_min(1), 33);
    EXPECT_EQ(m.seq_pos_max(1), 39);
    EXPECT_EQ(m.get_recr().seq_pos_max(1), 39);
}

// A window of 8 spans two blocks: when the SWA cache evicts a block, the snapshots at the ends of it and
// of the next block both lose their window, and both are dropped. A sequence of 400 tokens with a snapshot
// at every block slides through the 256-cell SWA cache; afterwards every snapshot left is a whole hit.
TEST(memory_hybrid, iswa_prefix_drops_every_snapshot_whose_window_lost_a_block) {
    memory_hybrid m(iswa_prefix_params(128, 1));
    // interval 1: a snapshot at every boundary the sequence passes
    std::vector<token_t> t(400);
    for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<token_t>(3 + i);
    for (size_t i = 0; i < t.size(); i += 20)
        decode_prompt(
            m, 0,
            {t.begin() + static_cast<std::ptrdiff_t>(i), t.begin() + static_cast<std::ptrdiff_t>(i + 20)},
            static_cast<pos_t>(i));
    ASSERT_TRUE(m.seq_rm(0, -1, -1));
    const prefix_stats st = m.prefix_cache()->get_prefix_stats();
    ASSERT_GT(st.swa_evicted_blocks, 0u);
    uint32_t whole = 0;
    for (size_t n = 4; n <= t.size(); n += 4) {
        std::vector<token_t> q(t.begin(), t.begin() + static_cast<std::ptrdiff_t>(n));
        q.push_back(1);
        whole += m.prefix_cache()->prefix_lookup(q) == n ? 1 : 0;
    }
    EXPECT_GT(whole, 0u);
    EXPECT_EQ(st.snapshots, whole) << "a snapshot is kept only with its whole window";
}

// With a window, a hit at n says nothing of the window before a shallower snapshot: lookups and attaches
// look for a boundary where both parts meet, and never cut an attached window back (which would leave
// the sequence without the keys before the old window's start). Here the attention part (a plain cache
// with a window of 8: a boundary needs its two blocks before it) lost block 2 only: the snapshot at 16
// lacks its window, the K/V at 20 has no snapshot, and the hit is the snapshot at 4 with positions 0-3.
TEST(memory_hybrid, a_window_before_a_shallower_snapshot_is_checked) {
    memory_hybrid_params p = make_params(32, 3);
    p.attn.n_swa = 8;
    p.attn.swa = swa_type::standard;
    p.prefix = {.enabled = true, .block_size = 4, .snapshot_interval = 0};
    memory_hybrid m(p);
    auto& kv = dynamic_cast<kv_cache&>(m.get_attn());
    std::vector<token_t> t(25);
    for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<token_t>(10 + i);
    const auto upto = [&t](size_t n) {  // t[0, n) and a token of no prompt
        std::vector<token_t> q(t.begin(), t.begin() + static_cast<std::ptrdiff_t>(n));
        q.push_back(999);
        return q;
    };
    // three prompt batches: snapshots at 4, 16 and 24 (their ends: the boundaries before their last
    // tokens), blocks 0-5 of K/V
    decode_prompt(m, 0, {t.begin(), t.begin() + 5});
    decode_prompt(m, 0, {t.begin() + 5, t.begin() + 17}, 5);
    decode_prompt(m, 0, {t.begin() + 17, t.end()}, 17);
    ASSERT_TRUE(m.seq_rm(0, -1, -1));
    ASSERT_EQ(m.prefix_cache()->prefix_lookup(upto(24)), 24u);
    // the eviction order, set through the attention part alone: every block but block 2 is hit again
    // (the windows of 24, 20 and 8), so block 2 goes first
    for (const size_t n : {24u, 20u, 8u}) {
        ASSERT_EQ(kv.prefix_cache()->prefix_attach(1, upto(n)), n);
        ASSERT_TRUE(kv.seq_rm(1, -1, -1));
    }
    std::vector<token_t> other(9, 500);  // 8 free cells: one block is evicted
    decode_prompt(m, 2, other);
    ASSERT_TRUE(m.seq_rm(2, -1, -1));
    EXPECT_EQ(m.prefix_cache()->prefix_lookup(upto(24)), 24u);
    EXPECT_EQ(m.prefix_cache()->prefix_lookup(upto(16)), 4u) << "the snapshot at 16 lost half of its window";
    EXPECT_EQ(m.prefix_cache()->prefix_lookup(upto(21)), 4u)
        << "the K/V at 20 has no snapshot, the one at 16 no window";
    ASSERT_EQ(m.prefix_cache()->prefix_attach(1, upto(21)), 4u);
    EXPECT_EQ(kv.seq_pos_min(1), 0) << "the window before 4";
    EXPECT_EQ(m.seq_pos_max(1), 3);
    EXPECT_EQ(m.get_recr().seq_pos_max(1), 3);
}

// Tiers are not supported with an iSWA attention part: refused, naming what.
TEST(memory_hybrid, iswa_prefix_refuses_tiers) {
    memory_hybrid_params p = iswa_prefix_params(8);
    p.prefix.tiers.stores.push_back(nullptr);
    try {
        memory_hybrid m(p);
        ADD_FAILURE() << "accepted";
    } catch (const error& e) {
        EXPECT_EQ(e.code(), errc::invalid_argument);
        EXPECT_NE(std::string(e.what()).find("not supported with an iSWA attention part"), std::string::npos)
            << e.what();
    }
}

}  // namespace
}  // namespace kvc
