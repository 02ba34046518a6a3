// The recurrent memory's prefix cache (snapshots at block boundaries) against an oracle.
//
// The engine folds each token into every state exactly (integers in floats), so a state is a fingerprint of
// the tokens that produced it: a sequence resumed from a snapshot holds exactly the state of recomputing
// its prefix, or the test sees it. The oracle knows which boundaries the rules promise (the end of every
// prompt batch, every snapshot_interval blocks, the newest boundary of a sequence when it ends) and checks
// that every attach resumes at least at the deepest promised one, at a boundary some sequence decoded.
// (A prompt's end is its newest boundary before its last token.)
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <random>
#include <vector>

#include <unistd.h>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <kvcache/batch.h>
#include <kvcache/disk_store.h>
#include <kvcache/memory_recurrent.h>
#include <kvcache/recurrent_engine.h>
#include <kvcache/state.h>

namespace kvc {
namespace {

constexpr uint32_t bs = 4;

// The state after `tokens`, one value per row entry: the exact integer fold of every token.
float fold1(float x, token_t tok, uint32_t j, uint32_t il) {
    return std::fmod(
        x * 31.0f + static_cast<float>(tok) * static_cast<float>(j + 1) + static_cast<float>(il + 1),
        65521.0f);
}

recurrent_params make_params(uint32_t n_rs_seq, uint32_t interval, uint32_t snapshots) {
    recurrent_params p;
    p.layers = {{.n_embd_r = 3, .n_embd_s = 5}, {}, {.n_embd_r = 0, .n_embd_s = 2}};
    p.n_seq_max = 4;
    p.n_rs_seq = n_rs_seq;
    p.prefix = {.enabled = true, .block_size = bs, .snapshot_interval = interval, .max_snapshots = snapshots};
    return p;
}

// Decodes tokens of seq s from position p0 through the memory (one batch), folding with fold1.
bool decode(memory_recurrent& m, const std::vector<std::tuple<seq_id_t, pos_t, token_t>>& toks,
            uint32_t n_ubatch) {
    batch_storage b = batch::init(static_cast<int32_t>(toks.size()), 0, 1);
    for (const auto& [s, p, t] : toks) {
        const seq_id_t ids[] = {s};
        b.add(t, p, ids, false);
    }
    batch_allocr a;
    a.init(b.view(), positions_of(m), {.n_seq_max = m.params().n_seq_max});
    auto ctx = m.init_batch(a, n_ubatch, false);
    if (is_fail(ctx->get_status())) return false;
    memory_recurrent_context& rc = *ctx->get_recr();
    do {
        rc.apply();
        const ubatch& ub = rc.get_ubatch();
        run_recurrent_ubatch(rc, [&](uint32_t il, rs_tensor, uint32_t i, std::span<float> x) {
            for (uint32_t j = 0; j < x.size(); ++j) x[j] = fold1(x[j], ub.token[i], j, il);
        });
    } while (rc.next());
    return true;
}

// Whether seq s's state in m is that of decoding `tokens` from nothing.
testing::AssertionResult state_is(const memory_recurrent& m, seq_id_t s, std::span<const token_t> tokens) {
    const int32_t c = m.seq_tail(s);
    if (c < 0) return testing::AssertionFailure() << "seq " << s << " has no state";
    const memory_recurrent::cell_info cell = m.cell(static_cast<uint32_t>(c));  // a rollback: another plane
    for (uint32_t il : m.layer_ids())
        for (const bool r : {true, false}) {
            if (!(r ? m.has_r(il) : m.has_s(il))) continue;
            const const_tensor_view v = r ? m.get_r(il) : m.get_s(il);
            const auto* row = reinterpret_cast<const float*>(v.row(cell.src, cell.rs_idx));
            for (uint32_t j = 0; j < v.ne[0]; ++j) {
                float x = 0;
                for (token_t t : tokens) x = fold1(x, t, j, il);
                if (row[j] != x)
                    return testing::AssertionFailure()
                           << "seq " << s << " layer " << il << (r ? " r" : " s") << "[" << j
                           << "] = " << row[j] << ", recomputed " << x << " (" << tokens.size() << " tokens)";
            }
        }
    return testing::AssertionSuccess();
}

struct oracle_seq {
    bool live = false;
    bool tracked = false;  // the memory's tracker follows it (decoded in order from 0 or attached)
    bool roll_ok = false;  // its newest boundary has its snapshot (no rollback or copy since it was taken)
    std::vector<token_t> toks;
};

struct config {
    uint32_t n_rs_seq;
    uint32_t interval;
    uint32_t snapshots;  // large: no eviction, every promise must hold
    bool exact() const { return snapshots >= 4096; }
};

void run_random(const config& cf, uint32_t seed, int n_ops, std::map<std::string, int>& counts) {
    memory_recurrent m(make_params(cf.n_rs_seq, cf.interval, cf.snapshots));
    std::mt19937 rng(seed);
    std::vector<oracle_seq> seqs(4);
    std::vector<std::vector<token_t>> promised;   // prefixes whose snapshot the rules keep
    std::vector<std::vector<token_t>> histories;  // what sequences decoded (prompts to extend)
    const auto promise = [&](const std::vector<token_t>& toks, uint64_t b) {
        if (b > 0) promised.emplace_back(toks.begin(), toks.begin() + static_cast<ptrdiff_t>(b));
    };
    const auto rnd = [&](uint32_t n) { return static_cast<uint32_t>(rng() % n); };
    const auto tok = [&] { return static_cast<token_t>(rng() % 5); };  // few ids: chains collide
    // Decodes `add` more tokens of s in one batch; a prompt batch (several tokens) keeps its newest boundary.
    const auto extend = [&](seq_id_t s, const std::vector<token_t>& add, uint32_t n_ubatch) {
        oracle_seq& q = seqs[static_cast<size_t>(s)];
        std::vector<std::tuple<seq_id_t, pos_t, token_t>> b;
        const uint64_t n0 = q.toks.size();
        for (size_t i = 0; i < add.size(); ++i) b.emplace_back(s, static_cast<pos_t>(n0 + i), add[i]);
        ASSERT_TRUE(decode(m, b, n_ubatch));
        q.toks.insert(q.toks.end(), add.begin(), add.end());
        const uint64_t n1 = q.toks.size();
        if (!q.tracked || n1 / bs * bs <= n0) return;
        q.roll_ok = true;
        // a prompt's end: its newest boundary before its last token
        if (add.size() > 1 && (n1 - 1) / bs * bs > n0) promise(q.toks, (n1 - 1) / bs * bs);
        for (uint64_t every = uint64_t{cf.interval} * bs, B = every ? (n0 / every + 1) * every : 0;
             every && B <= n1; B += every)
            promise(q.toks, B);
    };
    const auto end = [&](seq_id_t s) {
        oracle_seq& q = seqs[static_cast<size_t>(s)];
        ASSERT_TRUE(m.seq_rm(s, -1, -1));
        if (q.tracked && q.roll_ok) promise(q.toks, q.toks.size() / bs * bs);
        histories.push_back(q.toks);
        q = oracle_seq{};
    };
    for (int op = 0; op < n_ops; ++op) {
        const uint32_t what = rnd(100);
        const auto s = static_cast<seq_id_t>(rnd(4));
        oracle_seq& q = seqs[static_cast<size_t>(s)];
        if (!q.live && what < 60) {  // a request: a known history (or part of it) and new tokens
            std::vector<token_t> prompt;
            if (!histories.empty() && rnd(4) != 0) {
                prompt = histories[rnd(static_cast<uint32_t>(histories.size()))];
                prompt.resize(std::min<size_t>(prompt.size(), rnd(static_cast<uint32_t>(prompt.size()) + 8)));
            }
            for (uint32_t i = 1 + rnd(9); i > 0; --i) prompt.push_back(tok());
            const uint32_t n = m.prefix_cache()->prefix_attach(s, prompt);
            ASSERT_EQ(n % bs, 0u);
            ASSERT_LT(n, prompt.size());
            // the deepest promise this prompt starts with
            size_t want = 0;
            for (const auto& p : promised)
                if (p.size() < prompt.size() && p.size() > want &&
                    std::equal(p.begin(), p.end(), prompt.begin()))
                    want = p.size();
            if (cf.exact()) {
                ASSERT_GE(n, want) << "op " << op << ": a promised snapshot is gone";
            }
            counts["attach"]++;
            counts["hit tokens"] += static_cast<int>(n);
            q = oracle_seq{
                .live = true, .tracked = true, .roll_ok = true, .toks = {prompt.begin(), prompt.begin() + n}};
            if (n > 0) {
                ASSERT_TRUE(state_is(m, s, q.toks)) << "op " << op << ": resumed from a wrong snapshot";
            }
            extend(s, {prompt.begin() + n, prompt.end()}, rnd(2) ? 3 : 512);
        } else if (q.live && what < 60) {  // a decode step of every live sequence, a token each
            std::vector<std::tuple<seq_id_t, pos_t, token_t>> b;
            for (seq_id_t x = 0; x < 4; ++x) {
                oracle_seq& o = seqs[static_cast<size_t>(x)];
                if (!o.live) continue;
                b.emplace_back(x, static_cast<pos_t>(o.toks.size()), tok());
            }
            ASSERT_TRUE(decode(m, b, 512));
            for (const auto& [x, p, t] : b) {
                oracle_seq& o = seqs[static_cast<size_t>(x)];
                o.toks.push_back(t);
                const uint64_t n1 = o.toks.size();
                if (!o.tracked || n1 % bs != 0) continue;
                o.roll_ok = true;
                if (cf.interval && n1 % (uint64_t{cf.interval} * bs) == 0) promise(o.toks, n1);
            }
            counts["step"]++;
        } else if (q.live && what < 75) {
            end(s);
            counts["end"]++;
        } else if (q.live && what < 83 && cf.n_rs_seq > 0) {  // a rollback within the history
            const auto r = static_cast<pos_t>(1 + rnd(cf.n_rs_seq));
            const auto p0 = static_cast<pos_t>(q.toks.size()) - r;
            if (p0 > 0 && m.seq_rm(s, p0, -1)) {
                if (static_cast<uint64_t>(p0) / bs * bs < q.toks.size() / bs * bs) q.roll_ok = false;
                q.toks.resize(static_cast<size_t>(p0));
                counts["rollback"]++;
            }
        } else if (q.live && what < 90) {  // a copy into an empty sequence, or a restore of one
            const auto d = static_cast<seq_id_t>(rnd(4));
            oracle_seq& o = seqs[static_cast<size_t>(d)];
            if (o.live) continue;
            if (rnd(2)) {
                m.seq_cp(s, d, -1, -1);
                o = q;
                o.roll_ok = false;  // its newest snapshot is the original's to replace
                counts["copy"]++;
            } else {
                state_seq_set_data(m, state_seq_get_data(m, s), d);
                o = q;
                o.tracked = false;  // a restored sequence publishes nothing until emptied
                counts["restore"]++;
            }
        } else if (what >= 99) {
            m.clear(false);
            for (oracle_seq& x : seqs) x = oracle_seq{};
            promised.clear();
            histories.clear();
            counts["clear"]++;
        }
        // every live sequence holds the state of its tokens; the pool holds what it may
        for (seq_id_t x = 0; x < 4; ++x)
            if (seqs[static_cast<size_t>(x)].live) {
                ASSERT_TRUE(state_is(m, x, seqs[static_cast<size_t>(x)].toks)) << "op " << op;
            }
        const prefix_stats st = m.prefix_cache()->get_prefix_stats();
        ASSERT_LE(st.snapshots, m.get_n_snapshots());
        m.validate();
    }
    counts["snapshots saved"] += static_cast<int>(m.prefix_cache()->get_prefix_stats().snapshots_saved);
    counts["snapshots dropped"] += static_cast<int>(m.prefix_cache()->get_prefix_stats().snapshots_dropped);
}

TEST(memory_recurrent_prefix, random_operations_resume_where_the_rules_promise_and_states_are_exact) {
    for (const config cf :
         {config{0, 0, 8192}, config{0, 3, 8192}, config{2, 2, 8192}, config{2, 1, 6}, config{0, 0, 3}}) {
        std::map<std::string, int> counts;
        for (uint32_t seed = 1; seed <= 6; ++seed) run_random(cf, seed, 800, counts);
        std::string line;
        for (const auto& [k, v] : counts) line += fmt::format(" {}={}", k, v);
        std::printf("rs=%u interval=%u pool=%u:%s\n", cf.n_rs_seq, cf.interval, cf.snapshots, line.c_str());
        EXPECT_GT(counts["hit tokens"], 0);
        if (cf.snapshots < 8) {
            EXPECT_GT(counts["snapshots dropped"], 0);
        }
    }
}

// -- the API's edges --

TEST(memory_recurrent_prefix, bad_calls_are_refused_and_change_nothing) {
    memory_recurrent m(make_params(0, 0, 16));
    ASSERT_TRUE(decode(m, {{0, 0, 1}, {0, 1, 2}, {0, 2, 3}, {0, 3, 4}, {0, 4, 5}}, 512));
    const auto before = state_seq_get_data(m, seq_all);
    const std::vector<token_t> prompt{1, 2, 3, 4, 5, 6};
    EXPECT_THROW(m.prefix_cache()->prefix_attach(0, prompt), error);  // not empty
    EXPECT_THROW(m.prefix_cache()->prefix_attach(7, prompt), error);  // no such sequence
    EXPECT_THROW(m.prefix_cache()->prefix_attach(1, std::vector<token_t>{1, -2}), error);
    EXPECT_THROW(m.prefix_cache()->prefix_attach(1, prompt, 0, 101), error);
    EXPECT_EQ(state_seq_get_data(m, seq_all), before);
    EXPECT_EQ(m.prefix_cache()->prefix_lookup(prompt), 4u);  // the prompt batch's newest boundary
    EXPECT_EQ(m.prefix_cache()->prefix_lookup(std::vector<token_t>{1, 2, 3, 4}),
              0u);                                              // resumes before the last token
    EXPECT_EQ(m.prefix_cache()->prefix_lookup(prompt, 9), 0u);  // another key
    recurrent_params q = make_params(0, 0, 0);
    q.prefix.enabled = false;
    memory_recurrent plain(q);
    EXPECT_EQ(plain.prefix_cache(), nullptr);  // made without one
    recurrent_params p = make_params(0, 0, 0);
    p.prefix.block_size = 0;
    EXPECT_THROW(memory_recurrent{p}, error);
    p = make_params(0, 0, (1u << 24) + 1);
    EXPECT_THROW(memory_recurrent{p}, error);
    p = make_params(0, 0, 2);
    p.prefix.policy = static_cast<evict_policy>(3);
    try {
        memory_recurrent r(p);
        ADD_FAILURE() << "a policy past adaptive was accepted";
    } catch (const error& x) {
        EXPECT_NE(std::string(x.what()).find("prefix policy 3 unknown"), std::string::npos) << x.what();
    }
}

// Snapshots live after the planes: the memory counts them as cached, and their rows go back when they go.
TEST(memory_recurrent_prefix, snapshots_are_counted_and_clear_empties_the_pool) {
    memory_recurrent m(make_params(1, 0, 16));
    EXPECT_EQ(m.get_n_snapshots(), 16u);
    EXPECT_EQ(m.size_bytes(), m.snapshot_bytes() * (4 * 2 + 16));
    ASSERT_TRUE(decode(m, {{0, 0, 1}, {0, 1, 2}, {0, 2, 3}, {0, 3, 4}, {0, 4, 5}}, 512));
    m.prefix_cache()->prefix_publish();
    EXPECT_EQ(m.prefix_cache()->get_prefix_stats().snapshots, 1u);
    const memory_breakdown b = m.get_memory_breakdown();
    EXPECT_EQ(b.cached, m.snapshot_bytes());
    EXPECT_EQ(b.committed, b.used + b.cached + b.free);
    m.clear(true);
    EXPECT_EQ(m.prefix_cache()->get_prefix_stats().snapshots, 0u);
    EXPECT_EQ(m.prefix_cache()->get_prefix_stats().blocks, 0u);
    EXPECT_EQ(m.get_memory_breakdown().cached, 0u);
}

// -- the eviction order of snapshots (src/prefix/snapshot_queue.h) --

// Decodes `toks` of seq s from p0 as one prompt batch (several tokens) or one decode step (one token).
void feed(memory_recurrent& m, seq_id_t s, pos_t p0, const std::vector<token_t>& toks) {
    std::vector<std::tuple<seq_id_t, pos_t, token_t>> b;
    for (size_t i = 0; i < toks.size(); ++i) b.emplace_back(s, p0 + static_cast<pos_t>(i), toks[i]);
    ASSERT_TRUE(decode(m, b, 512));
    m.prefix_cache()->prefix_publish();
}

std::vector<token_t> cat(std::vector<token_t> a, const std::vector<token_t>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
}

// A snapshot under a sequence still decoding (an inner block of its chain) is evictable: the pool never
// stalls on the chains of live sequences. (A prompt's end is its newest boundary before its last token.)
TEST(memory_recurrent_prefix, snapshots_under_live_sequences_give_way_to_new_ones) {
    memory_recurrent m(make_params(0, 0, 2));
    const std::vector<token_t> a{1, 2, 3, 4, 5, 6, 7, 8, 9}, b{10, 11, 12, 13}, c{14, 15, 16, 17};
    feed(m, 0, 0, a);   // 8
    feed(m, 0, 9, b);   // 12: the pool is full, both under seq 0's chain
    feed(m, 0, 13, c);  // 16 takes the row of 8
    ASSERT_TRUE(m.seq_rm(0, -1, -1));
    const std::vector<token_t> abc = cat(cat(a, b), c);
    EXPECT_EQ(m.prefix_cache()->prefix_lookup(cat(abc, {99})), 16u);
    EXPECT_EQ(m.prefix_cache()->prefix_lookup(cat(a, {99})), 0u);
    EXPECT_EQ(m.prefix_cache()->prefix_attach(1, cat(abc, {99})), 16u);
    EXPECT_TRUE(state_is(m, 1, std::span(abc).first(16)));
    m.validate();
}

// The adaptive policy's ghosts are for K/V blocks: a recurrent memory's snapshots follow SLRU under it (a
// snapshot resumed from is protected; LRU lets newer snapshots push it out).
TEST(memory_recurrent_prefix, snapshots_follow_slru_under_the_adaptive_policy) {
    const std::vector<token_t> a{1, 2, 3, 4, 5}, q1{20, 21, 22, 23, 24, 25, 26, 27, 28},
        q2{30, 31, 32, 33, 34, 35, 36, 37, 38};
    const auto run = [&](evict_policy policy) {
        recurrent_params p = make_params(0, 0, 2);
        p.prefix.policy = policy;
        memory_recurrent m(p);
        feed(m, 0, 0, a);  // 4
        EXPECT_TRUE(m.seq_rm(0, -1, -1));
        EXPECT_EQ(m.prefix_cache()->prefix_attach(1, cat(a, {99})), 4u);  // resumed from: a hit
        EXPECT_TRUE(m.seq_rm(1, -1, -1));
        feed(m, 2, 0, q1);  // 8
        EXPECT_TRUE(m.seq_rm(2, -1, -1));
        feed(m, 3, 0, q2);  // 8: the pool of 2 is full, one of the others goes
        EXPECT_TRUE(m.seq_rm(3, -1, -1));
        return std::vector<uint32_t>{m.prefix_cache()->prefix_lookup(cat(a, {99})),
                                     m.prefix_cache()->prefix_lookup(cat(q1, {99}))};
    };
    const auto slru = run(evict_policy::slru);
    EXPECT_NE(run(evict_policy::lru), slru) << "the scenario must tell the policies apart";
    EXPECT_EQ(run(evict_policy::adaptive), slru);
}

// A live sequence's rolling snapshot matters only once it ends: kept snapshots do not give way to it.
TEST(memory_recurrent_prefix, rolling_snapshots_go_before_kept_ones) {
    memory_recurrent m(make_params(0, 0, 2));
    const std::vector<token_t> a{1, 2, 3, 4, 5}, b{6, 7, 8}, q{20, 21, 22, 23, 24, 25, 26, 27, 28};
    const std::vector<token_t> ab = cat(a, b);
    feed(m, 0, 0, a);                                                                     // 4: kept
    for (size_t i = 0; i < b.size(); ++i) feed(m, 0, static_cast<pos_t>(5 + i), {b[i]});  // 8: rolling
    feed(m, 1, 0, q);  // 8: kept, in the rolling snapshot's row
    ASSERT_TRUE(m.seq_rm(0, -1, -1));
    ASSERT_TRUE(m.seq_rm(1, -1, -1));
    EXPECT_EQ(m.prefix_cache()->prefix_lookup(cat(ab, {99})), 4u);
    EXPECT_EQ(m.prefix_cache()->prefix_lookup(cat(q, {99})), 8u);
    // once its sequence ends, a rolling snapshot is kept like the others
    memory_recurrent n(make_params(0, 0, 2));
    feed(n, 0, 0, a);
    for (size_t i = 0; i < b.size(); ++i) feed(n, 0, static_cast<pos_t>(5 + i), {b[i]});
    ASSERT_TRUE(n.seq_rm(0, -1, -1));
    feed(n, 1, 0, q);  // takes the row of 4, the oldest
    EXPECT_EQ(n.prefix_cache()->prefix_lookup(cat(ab, {99})), 8u);
    EXPECT_EQ(n.prefix_cache()->prefix_attach(2, cat(ab, {99})), 8u);
    EXPECT_TRUE(state_is(n, 2, ab));
}

// A prompt that goes on from a snapshot to a deeper one makes the first the next to go, unless another
// continuation already hangs from its block (a branch point).
TEST(memory_recurrent_prefix, snapshots_a_prompt_went_past_go_first_unless_they_are_branch_points) {
    const std::vector<token_t> a{1, 2, 3, 4, 5}, b{6, 7, 8, 9}, x{9, 9, 9, 9}, q{20, 21, 22, 23, 24},
        z{30, 31, 32, 33, 34};
    for (const bool branch : {false, true}) {
        memory_recurrent m(make_params(0, 0, branch ? 4 : 3));
        feed(m, 1, 0, q);  // the oldest snapshot
        ASSERT_TRUE(m.seq_rm(1, -1, -1));
        feed(m, 0, 0, a);  // 4
        const std::vector<token_t> ax = cat(cat(a, x), {99});
        if (branch) {  // seq 3 decodes another continuation of a: the block of 4 has two children
            ASSERT_EQ(m.prefix_cache()->prefix_attach(3, ax), 4u);
            for (size_t i = 4; i < ax.size(); ++i) feed(m, 3, static_cast<pos_t>(i), {ax[i]});
            ASSERT_TRUE(m.seq_rm(3, -1, -1));
        }
        feed(m, 0, 5, b);  // 8: seq 0's prompt went past 4
        ASSERT_TRUE(m.seq_rm(0, -1, -1));
        feed(m, 2, 0, z);  // the pool is full: one goes
        ASSERT_TRUE(m.seq_rm(2, -1, -1));
        if (!branch) {
            EXPECT_EQ(m.prefix_cache()->prefix_lookup(cat(a, {99})), 0u) << "the snapshot seq 0 went past";
            EXPECT_EQ(m.prefix_cache()->prefix_lookup(cat(q, {99})), 4u) << "older, but nobody went past it";
        } else {
            EXPECT_EQ(m.prefix_cache()->prefix_lookup(cat(a, {99})), 4u) << "a branch point";
            EXPECT_EQ(m.prefix_cache()->prefix_lookup(cat(q, {99})), 0u) << "the least recently used";
            EXPECT_EQ(m.prefix_cache()->prefix_lookup(cat(ax, {99})), 8u);
        }
        EXPECT_EQ(m.prefix_cache()->prefix_lookup(cat(cat(a, b), {99})), 8u);
        EXPECT_EQ(m.prefix_cache()->prefix_lookup(cat(z, {99})), 4u);
        m.validate();
    }
}

// The same prompt sent again (n samples, a retry) resumes at its end, a block before it when its length is
// a whole number of blocks.
TEST(memory_recurrent_prefix, the_same_prompt_sent_again_resumes_at_its_end) {
    memory_recurrent m(make_params(0, 0, 4));
    const std::vector<token_t> p{1, 2, 3, 4, 5, 6, 7, 8}, r{1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
    feed(m, 0, 0, p);
    feed(m, 1, 0, r);
    ASSERT_TRUE(m.seq_rm(0, -1, -1));
    ASSERT_TRUE(m.seq_rm(1, -1, -1));
    EXPECT_EQ(m.prefix_cache()->prefix_attach(2, p), 4u);
    EXPECT_TRUE(state_is(m, 2, std::span(p).first(4)));
    EXPECT_EQ(m.prefix_cache()->prefix_attach(3, r), 8u);
    EXPECT_TRUE(state_is(m, 3, std::span(r).first(8)));
}

// Kinds of snapshots nobody resumes from (here: prompt ends, every prompt being new after a shared
// document) enter the queue as the next to go, and no longer push out the kind that is used (the
// document's interval snapshot).
TEST(memory_recurrent_prefix, a_kind_of_snapshot_never_resumed_from_goes_first) {
    memory_recurrent m(make_params(0, 2, 3));
    const std::vector<token_t> a{1, 2, 3, 4, 5, 6, 7, 8}, b{11, 12, 13, 14, 15, 16, 17, 18};
    token_t next = 100;
    const auto ask = [&](const std::vector<token_t>& doc) {
        std::vector<token_t> prompt = doc;
        for (int i = 0; i < 5; ++i) prompt.push_back(next++);
        const uint32_t n = m.prefix_cache()->prefix_attach(0, prompt);
        feed(m, 0, static_cast<pos_t>(n), {prompt.begin() + n, prompt.end()});
        ASSERT_TRUE(m.seq_rm(0, -1, -1));
    };
    for (int i = 0; i < 40; ++i) ask(a);  // the interval snapshot at 8 is used, the prompt ends at 12 never
    for (int i = 0; i < 4; ++i) ask(b);   // b's document and prompt ends: a's document stays
    EXPECT_EQ(m.prefix_cache()->prefix_lookup(cat(a, {99})), 8u);
    EXPECT_EQ(m.prefix_cache()->prefix_lookup(cat(b, {99})), 8u);
    m.validate();
}

// While sequence ends are never resumed from (clients send back other tokens than were decoded), a live
// sequence's rolling snapshot takes no row from kept snapshots.
TEST(memory_recurrent_prefix, rolling_snapshots_take_no_kept_rows_while_sequence_ends_are_not_used) {
    memory_recurrent m(make_params(0, 0, 2));
    token_t next = 100;
    const auto unique = [&](int n) {
        std::vector<token_t> t;
        for (int i = 0; i < n; ++i) t.push_back(next++);
        return t;
    };
    for (int i = 0; i < 40; ++i) {  // each prompt's end is resumed from, the sequence's end never
        m.clear(false);             // room for the rolling snapshot (what kinds are used is kept)
        const std::vector<token_t> x = unique(9);
        feed(m, 0, 0, x);
        for (pos_t p = 9; p < 13; ++p) feed(m, 0, p, {next++});
        ASSERT_TRUE(m.seq_rm(0, -1, -1));
        ASSERT_EQ(m.prefix_cache()->prefix_attach(1, cat(x, {7})), 8u);
        ASSERT_TRUE(m.seq_rm(1, -1, -1));
    }
    const std::vector<token_t> a = unique(9), b = unique(9);
    feed(m, 0, 0, a);
    feed(m, 1, 0, b);  // the pool holds both prompt ends
    feed(m, 2, 0, unique(3));
    for (pos_t p = 3; p < 13; ++p) feed(m, 2, p, {next++});  // boundaries 4, 8 and 12: no rows for them
    EXPECT_EQ(m.prefix_cache()->prefix_lookup(cat(a, {7})), 8u);
    EXPECT_EQ(m.prefix_cache()->prefix_lookup(cat(b, {7})), 8u);
    ASSERT_TRUE(m.seq_rm(2, -1, -1));
    // one ubatch: seq 2 passes 4 in the middle of its prompt (a rolling snapshot), seq 3's prompt ends at 4;
    // the row made for seq 3's end is not taken by seq 2 before it
    const std::vector<token_t> c = unique(12), d = unique(5);
    std::vector<std::tuple<seq_id_t, pos_t, token_t>> both;
    for (size_t i = 0; i < c.size(); ++i) both.emplace_back(2, static_cast<pos_t>(i), c[i]);
    for (size_t i = 0; i < d.size(); ++i) both.emplace_back(3, static_cast<pos_t>(i), d[i]);
    ASSERT_TRUE(decode(m, both, 10));
    m.prefix_cache()->prefix_publish();
    EXPECT_EQ(m.prefix_cache()->prefix_lookup(cat(d, {7})), 4u);
    m.validate();
}

// Evicting a live sequence's rolling snapshot writes nothing to the tiers (that would be a state write per
// block decoded under pressure); the snapshot kept where it ends is written when it leaves memory.
TEST(memory_recurrent_prefix, rolling_snapshots_are_not_written_to_tiers) {
    const std::filesystem::path dir =
        std::filesystem::temp_directory_path() / fmt::format("kvc-rolling-tier-{}", ::getpid());
    std::filesystem::remove_all(dir);
    disk_store_params dp;
    dp.dir = dir.string();
    auto store = std::make_shared<disk_block_store>(dp);
    recurrent_params p = make_params(0, 0, 2);
    p.prefix.tiers = {.stores = {store}, .model_id = 1, .write = tier_write::on_evict};
    memory_recurrent m(p);
    // seqs 2 and 3 decode side by side: their rolling snapshots fill the pool
    feed(m, 2, 0, {20, 21});
    feed(m, 3, 0, {22, 23});
    for (pos_t q = 2; q < 13; ++q) {
        ASSERT_TRUE(decode(m, {{2, q, 30 + q}, {3, q, 60 + q}}, 512));
        m.prefix_cache()->prefix_publish();
    }
    feed(m, 0, 0, {1, 2, 3, 4, 5});   // its end at 4 evicts a rolling snapshot
    feed(m, 1, 0, {6, 7, 8, 9, 10});  // and the other
    EXPECT_EQ(store->stats().puts, 0u);
    m.prefix_cache()->prefix_tier_drain();
    ASSERT_TRUE(m.seq_rm(2, -1, -1));
    ASSERT_TRUE(m.seq_rm(3, -1, -1));
    feed(m, 2, 0, {40, 41, 42, 43, 44});  // evicts a kept snapshot: it goes to the tier
    EXPECT_EQ(store->stats().puts, 1u);
    std::filesystem::remove_all(dir);
}

// A chat client sends back what was decoded: once the memory has seen that sequence ends are resumed from,
// rolling snapshots take rows again, and each turn resumes where the previous one ended, not at its
// prompt's end.
TEST(memory_recurrent_prefix, chats_learn_to_resume_where_the_previous_turn_ended) {
    memory_recurrent m(make_params(0, 0, 6));
    std::vector<std::vector<token_t>> history(3);
    token_t next = 100;
    uint64_t late_short = 0;  // tokens of the last turns' histories not resumed (beyond a block)
    for (int turn = 0; turn < 120; ++turn) {
        std::vector<token_t>& h = history[static_cast<size_t>(turn % 3)];
        for (int i = 0; i < 5; ++i) h.push_back(next++);
        const uint32_t n = m.prefix_cache()->prefix_attach(0, h);
        if (turn >= 100 && h.size() > 5)
            late_short += h.size() - 5 - std::min<uint64_t>(n + bs, h.size() - 5);
        feed(m, 0, static_cast<pos_t>(n), {h.begin() + n, h.end()});
        for (int i = 0; i < 6; ++i) {  // the answer, decoded: the next prompt repeats it
            h.push_back(next++);
            feed(m, 0, static_cast<pos_t>(h.size() - 1), {h.back()});
        }
        ASSERT_TRUE(m.seq_rm(0, -1, -1));
    }
    EXPECT_EQ(late_short, 0u);
    m.validate();
}

// A prompt that leaves a chain of the index where no snapshot is (a shared system prompt followed by
// another conversation) takes one there as it computes through it: the next prompts branching there
// resume at it.
TEST(memory_recurrent_prefix, a_prompt_leaving_a_chain_takes_a_snapshot_where_it_leaves_it) {
    memory_recurrent m(make_params(0, 0, 8));
    std::vector<token_t> system(20);
    for (size_t i = 0; i < system.size(); ++i) system[i] = static_cast<token_t>(1 + i);
    const auto conversation = [&](token_t first) {
        std::vector<token_t> p = system;
        for (token_t i = 0; i < 9; ++i) p.push_back(first + i);
        return p;
    };
    const std::vector<token_t> a = conversation(100), b = conversation(200), c = conversation(300);
    feed(m, 0, 0, a);  // its end at 28: nothing at 20
    ASSERT_TRUE(m.seq_rm(0, -1, -1));
    EXPECT_EQ(m.prefix_cache()->prefix_attach(1, b), 0u);
    feed(m, 1, 0, b);  // leaves a's chain at 20
    ASSERT_TRUE(m.seq_rm(1, -1, -1));
    EXPECT_EQ(m.prefix_cache()->prefix_attach(2, c), 20u);
    EXPECT_TRUE(state_is(m, 2, system));
    m.validate();
}

}  // namespace
}  // namespace kvc
