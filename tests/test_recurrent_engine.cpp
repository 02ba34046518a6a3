// recurrent_step / run_recurrent_ubatch: the library's reference of the recurrent engine contract, checked
// against the tests' independent oracle (recurrent_oracle.h). Two memories get the same operations; one is
// driven by the oracle, the other by the reference folding the same hash chains, and their rows must agree
// byte for byte after every step: zero row, gathers, extra cells, rollback planes and history copies.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <kvcache/batch.h>
#include <kvcache/memory_recurrent.h>
#include <kvcache/recurrent_engine.h>
#include <kvcache/state.h>

#include "recurrent_oracle.h"

namespace kvc {
namespace {

using namespace test;

// Two layers with state, one without: r of 4 and s of 6 values, nothing, s of 3 values (no r).
recurrent_params params(uint32_t n_seq_max, uint32_t n_rs_seq, dtype type = dtype::f32) {
    recurrent_params p;
    p.layers = {{.n_embd_r = 4, .n_embd_s = 6}, {}, {.n_embd_r = 0, .n_embd_s = 3}};
    p.n_seq_max = n_seq_max;
    p.n_rs_seq = n_rs_seq;
    p.type_r = p.type_s = type;
    return p;
}

// A batch of `n` tokens per listed sequence at its next positions, validated against m.
batch_storage next_tokens(const memory_recurrent& m, const std::vector<std::pair<seq_id_t, uint32_t>>& runs) {
    uint32_t n = 0;
    for (const auto& r : runs) n += r.second;
    batch_storage b = batch::init(static_cast<int32_t>(n), 0, 1);
    for (const auto& [s, count] : runs) {
        const seq_id_t ids[] = {s};
        const pos_t p0 = m.seq_pos_max(s) + 1;
        for (uint32_t i = 0; i < count; ++i) b.add(1, p0 + static_cast<pos_t>(i), ids, false);
    }
    return b;
}

// The reference's model for the oracle's states: the hash chain of recurrent_oracle.h, in the f32 working
// state's bytes (bit-exact for f32 tensors).
void fold_chain(const ubatch& ub, uint32_t il, rs_tensor which, uint32_t token, std::span<float> state) {
    auto* bytes = reinterpret_cast<std::byte*>(state.data());
    const size_t n = state.size_bytes();
    const bool is_s = which == rs_tensor::s;
    fill_row(bytes, n, mix(read_row(bytes, n, il, is_s), ub.primary_seq(token), ub.pos[token]), il, is_s);
}

// The same contract driven by hand: tensors s before r, blocks last to first, each block's tokens in order
// (blocks are independent, so the order must not matter).
void reversed_driver(memory_recurrent_context& rc) {
    const memory_recurrent& m = rc.memory();
    const ubatch& ub = rc.get_ubatch();
    for (auto il = m.layer_ids().rbegin(); il != m.layer_ids().rend(); ++il)
        for (const rs_tensor which : {rs_tensor::s, rs_tensor::r}) {
            if (!(which == rs_tensor::r ? m.has_r(*il) : m.has_s(*il))) continue;
            recurrent_step step(rc, *il, which);
            const uint32_t T = step.n_seq_tokens();
            for (uint32_t b = step.n_seqs(); b-- > 0;)
                for (uint32_t t = 0; t < T; ++t) {
                    fold_chain(ub, *il, which, b * T + t, step.state(b));
                    step.store(b, t);
                }
            step.finish();
        }
}

// Every byte of every state tensor, every plane.
std::vector<std::byte> all_rows(memory_recurrent& m) {
    std::vector<std::byte> out;
    for (const auto& [il, is_s] : tensors(m)) {
        const tensor_view v = view_of(m, il, is_s);
        for (int64_t p = 0; p < v.ne[2]; ++p)
            for (int64_t c = 0; c < v.ne[1]; ++c)
                out.insert(out.end(), v.row(c, p), v.row(c, p) + v.row_bytes());
    }
    return out;
}

TEST(recurrent_engine, agrees_with_the_oracle_byte_for_byte) {
    size_t extras = 0, hist = 0, zeroed = 0, ubatches = 0;
    for (uint32_t k = 0; k <= 3; ++k)
        for (uint32_t seed = 1; seed <= 3; ++seed) {
            std::mt19937 rng(seed * 10 + k);
            const uint32_t n_seq = 4;
            memory_recurrent a(params(n_seq, k)), b(params(n_seq, k));  // a: the oracle, b: the reference
            const auto rand_seq = [&] { return static_cast<seq_id_t>(rng() % n_seq); };
            for (int step = 0; step < 250; ++step) {
                const uint32_t what = rng() % 10;
                std::string label;
                if (what < 6) {  // decode 1-3 sequences of 1-5 tokens, in ubatches of 1-8 tokens
                    std::vector<std::pair<seq_id_t, uint32_t>> runs;
                    for (seq_id_t s = 0; s < static_cast<seq_id_t>(n_seq); ++s)
                        if (runs.empty() || rng() % 3 == 0) runs.emplace_back(s, 1 + rng() % 5);
                    std::shuffle(runs.begin(), runs.end(), rng);
                    const uint32_t n_ubatch = 1 + rng() % 8;
                    const bool reversed = rng() % 2;
                    label = "decode";
                    batch_storage bs = next_tokens(a, runs);
                    batch_allocr ba, bb;
                    ba.init(bs.view(), positions_of(a), {.n_seq_max = n_seq});
                    bb.init(bs.view(), positions_of(b), {.n_seq_max = n_seq});
                    auto ca = a.init_batch(ba, n_ubatch, false), cb = b.init_batch(bb, n_ubatch, false);
                    ASSERT_EQ(ca->get_status(), memory_status::success);
                    ASSERT_EQ(cb->get_status(), memory_status::success);
                    memory_recurrent_context &ra = *ca->get_recr(), &rb = *cb->get_recr();
                    do {
                        ra.apply();
                        rb.apply();
                        const rs_slot sl = slot_of(ra);
                        engine_step(a, sl, ra.get_ubatch());
                        if (reversed)
                            reversed_driver(rb);
                        else
                            run_recurrent_ubatch(
                                rb, [&](uint32_t il, rs_tensor w, uint32_t t, std::span<float> x) {
                                    fold_chain(rb.get_ubatch(), il, w, t, x);
                                });
                        extras += sl.n - sl.n_seqs;
                        hist += sl.hist_copy.size();
                        zeroed += sl.rs_z >= 0;
                        ++ubatches;
                    } while (ra.next() && rb.next());
                } else if (what < 8) {  // remove a suffix (a rollback when the history allows) or all
                    const seq_id_t s = rand_seq();
                    const pos_t p0 = rng() % 4 == 0 ? -1 : a.seq_pos_max(s) - static_cast<pos_t>(rng() % 3);
                    label = "rm";
                    ASSERT_EQ(a.seq_rm(s, p0, -1), b.seq_rm(s, p0, -1));
                } else if (what < 9) {  // share a sequence (copy-on-write at its next decode)
                    const seq_id_t s = rand_seq(), d = rand_seq();
                    label = "cp";
                    a.seq_cp(s, d, -1, -1);
                    b.seq_cp(s, d, -1, -1);
                } else {  // one sequence's state restored into another
                    const seq_id_t s = rand_seq(), d = rand_seq();
                    label = "restore";
                    state_seq_set_data(a, state_seq_get_data(a, s), d);
                    state_seq_set_data(b, state_seq_get_data(b, s), d);
                }
                ASSERT_EQ(all_rows(a), all_rows(b))
                    << "k " << k << " seed " << seed << " step " << step << " " << label;
            }
        }
    // the interesting paths were taken
    EXPECT_GT(ubatches, 1000u);
    EXPECT_GT(extras, 50u);
    EXPECT_GT(hist, 50u);
    EXPECT_GT(zeroed, 50u);
}

// f16 and bf16 states are f32 while the engine works on them: with a model whose values stay small
// integers (exact in both), the rows are those of an f32 memory, converted.
TEST(recurrent_engine, f16_and_bf16_states_convert_at_the_gather_and_the_store) {
    const auto model = [](memory_recurrent_context& rc) {
        const ubatch& ub = rc.get_ubatch();
        run_recurrent_ubatch(rc, [&](uint32_t il, rs_tensor w, uint32_t t, std::span<float> x) {
            for (size_t d = 0; d < x.size(); ++d)
                x[d] = std::fmod(3 * x[d] + static_cast<float>(ub.pos[t] + ub.primary_seq(t) + il + d) +
                                     (w == rs_tensor::s ? 1.0f : 0.0f),
                                 256.0f);
        });
    };
    const auto decode = [&](memory_recurrent& m, const std::vector<std::pair<seq_id_t, uint32_t>>& runs,
                            uint32_t n_ubatch) {
        batch_storage bs = next_tokens(m, runs);
        batch_allocr ba;
        ba.init(bs.view(), positions_of(m), {.n_seq_max = 3});
        auto ctx = m.init_batch(ba, n_ubatch, false);
        ASSERT_EQ(ctx->get_status(), memory_status::success);
        memory_recurrent_context& rc = *ctx->get_recr();
        do {
            rc.apply();
            model(rc);
        } while (rc.next());
    };
    for (const dtype type : {dtype::f16, dtype::bf16}) {
        memory_recurrent f(params(3, 2)), h(params(3, 2, type));
        for (memory_recurrent* m : {&f, &h}) {
            decode(*m, {{0, 5}, {1, 2}}, 4);
            decode(*m, {{0, 1}}, 1);  // one-token steps carry the history over
            m->seq_cp(0, 2, -1, -1);
            decode(*m, {{2, 1}, {1, 3}}, 8);
            ASSERT_TRUE(m->seq_rm(0, m->seq_pos_max(0), -1));  // a rollback: the next step reads plane 1
            decode(*m, {{0, 2}}, 8);
        }
        for (const auto& [il, is_s] : tensors(f)) {
            const tensor_view vf = view_of(f, il, is_s), vh = view_of(h, il, is_s);
            std::vector<float> want(static_cast<size_t>(vf.ne[0])), got(want.size());
            for (int64_t p = 0; p < vf.ne[2]; ++p)
                for (int64_t c = 0; c < vf.ne[1]; ++c) {
                    vf.row_to_f32(want, c, p);
                    vh.row_to_f32(got, c, p);
                    ASSERT_EQ(got, want)
                        << to_string(type) << " layer " << il << " plane " << p << " cell " << c;
                }
        }
    }
}

TEST(recurrent_engine, misuse_is_an_error) {
    memory_recurrent m(params(2, 2));
    batch_storage bs = next_tokens(m, {{0, 2}, {1, 2}});
    batch_allocr ba;
    ba.init(bs.view(), positions_of(m), {.n_seq_max = 2});
    auto ctx = m.init_batch(ba, 8, false);
    memory_recurrent_context& rc = *ctx->get_recr();
    EXPECT_THROW(recurrent_step(rc, 0, rs_tensor::r), error);  // not applied yet
    rc.apply();
    EXPECT_THROW(recurrent_step(rc, 1, rs_tensor::s), error);  // layer 1 has no state
    EXPECT_THROW(recurrent_step(rc, 2, rs_tensor::r), error);  // layer 2 has no r
    recurrent_step step(rc, 0, rs_tensor::s);
    EXPECT_EQ(step.n_seqs(), 2u);
    EXPECT_EQ(step.n_seq_tokens(), 2u);
    EXPECT_EQ(step.width(), 6u);
    EXPECT_THROW((void)step.state(2), error);
    EXPECT_THROW(step.store(0, 2), error);
    EXPECT_THROW(step.store(2, 0), error);
    step.store(0, 1);
    try {
        step.finish();
        FAIL() << "finish() before block 1 stored its last token";
    } catch (const error& e) {
        EXPECT_EQ(e.code(), errc::invalid_state);
    }
    step.store(1, 1);
    step.finish();
    EXPECT_THROW(step.finish(), error);

    auto full = m.init_full();
    EXPECT_THROW(recurrent_step(*full->get_recr(), 0, rs_tensor::r), error);  // no ubatch to run
}

}  // namespace
}  // namespace kvc
