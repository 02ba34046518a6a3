// Cache == recompute: the logits of decoding through kv_cache equal those of reference_memory (plain f32
// keys and values per sequence, attention recomputed from them) for every feature, within the
// tolerance of the cache's element types (docs/runtime.md).
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <kvcache/disk_store.h>
#include <kvcache/runtime/runtime.h>
#include <kvcache/runtime/tiny_model.h>
#include <kvcache/session.h>
#include <kvcache/state.h>

namespace kvc {
namespace {

namespace fs = std::filesystem;

// The tiny model (head size 16) and a wider one (head size 32, for the block types q8_0 and q4_0).
const model& tiny(bool wide) {
    static std::unique_ptr<model> m[2];
    auto& slot = m[wide ? 1 : 0];
    if (!slot) {
        const fs::path path =
            fs::temp_directory_path() / fmt::format("kvc-runtime-{}-{}.gguf", ::getpid(), wide);
        tiny_model_options o;
        if (wide) {
            o.n_embd = 128;
            o.n_ff = 192;
        }
        write_tiny_model(path.string(), o);
        slot = std::make_unique<model>(model::load(path.string()));
        fs::remove(path);
    }
    return *slot;
}

struct setup {
    dtype type_k = dtype::f16, type_v = dtype::f16;
    bool v_trans = true, unified = true;
    uint32_t n_swa = 0;
    swa_type swa = swa_type::none;
    uint32_t n_ubatch = 512;
    bool prefix = false;  // a prefix cache of 4-token blocks
    bool engine = false;  // the runtime owns the K/V tensors (engine-owned storage) and runs the cache's ops
    evict_policy evict = evict_policy::lru;  // the prefix cache's (not a parameter of the suites)
    std::string name() const {
        return fmt::format("k={} v={} v_trans={} unified={} swa={} prefix={} engine={}", to_string(type_k),
                           to_string(type_v), v_trans, unified, n_swa, prefix, engine);
    }
};

// A cache with its runtime and the reference, driven side by side; every decode compares their logits.
class pair_run {
public:
    explicit pair_run(const setup& s, uint32_t n_seq_max = 4, uint32_t kv_size = 256,
                      prefix_tier_params tiers = {})
        : s_(s), m_(&tiny(block_size(s.type_k) > 1 || block_size(s.type_v) > 1)), ref_(*m_, n_seq_max, 2) {
        auto p = m_->cache_params(kv_size, n_seq_max);
        p.type_k = s.type_k;
        p.type_v = s.type_v;
        p.v_trans = s.v_trans;
        p.unified = s.unified;
        p.n_swa = s.n_swa;
        p.swa = s.swa;
        p.prefix = {.enabled = s.prefix, .block_size = 4};
        p.prefix.policy = s.evict;
        p.prefix.tiers = std::move(tiers);
        if (s.engine) p.engine = &tensors_;
        cache_ = std::make_unique<kv_cache>(p);
        rt_ = std::make_unique<runtime>(
            *m_, *cache_,
            runtime_params{
                .n_threads = 2, .n_ubatch = s.n_ubatch, .tensors = s.engine ? &tensors_ : nullptr});
        ref_.set_swa(s.n_swa, s.swa);
    }

    struct group {
        std::vector<seq_id_t> seqs;
        pos_t pos = -1;  // -1: after the first sequence's last position
        std::vector<token_t> tokens;
    };
    // One batch of groups, every token an output; returns the relative difference.
    double decode(const std::vector<group>& groups) {
        size_t n = 0;
        for (const auto& g : groups) n += g.tokens.size();
        batch_storage b = batch::init(static_cast<int32_t>(n), 0, 4);
        for (const auto& g : groups) {
            pos_t p = g.pos >= 0 ? g.pos : cache_->seq_pos_max(g.seqs[0]) + 1;
            EXPECT_EQ(cache_->seq_pos_max(g.seqs[0]), ref_.seq_pos_max(g.seqs[0]));
            for (token_t t : g.tokens) b.add(t, p++, g.seqs, true);
        }
        const decode_result a = rt_->decode(b.view());
        const decode_result r = ref_.decode(b.view());
        EXPECT_EQ(a.status, memory_status::success);
        EXPECT_EQ(a.output_ids, r.output_ids);
        EXPECT_EQ(a.logits.size(), r.logits.size());
        if (a.logits.size() != r.logits.size() || a.logits.empty()) return 1e9;
        const double rel = relative_diff(a.logits, r.logits);
        worst_ = std::max(worst_, rel);
        return rel;
    }
    // The cache attaches the cached prefix of `prompt` to seq; the reference decodes those tokens (their
    // logits are not compared). Returns how many.
    uint32_t attach(seq_id_t seq, const std::vector<token_t>& prompt) {
        const uint32_t n = cache_->prefix_cache()->prefix_attach(seq, prompt);
        if (n > 0) {
            batch_storage b = batch::init(static_cast<int32_t>(n), 0, 1);
            const seq_id_t ids[1] = {seq};
            for (uint32_t i = 0; i < n; ++i) b.add(prompt[i], static_cast<pos_t>(i), ids, false);
            EXPECT_EQ(ref_.decode(b.view()).status, memory_status::success);
        }
        EXPECT_EQ(cache_->seq_pos_max(seq), ref_.seq_pos_max(seq));
        return n;
    }
    std::vector<token_t> tokens(size_t n) {
        std::vector<token_t> t(n);
        for (auto& x : t) x = static_cast<token_t>(rng_() % m_->hparams().n_vocab);
        return t;
    }
    // The same operation on both.
    template <class F>
    void both(F&& f) {
        f(*cache_, ref_);
    }
    double worst() const { return worst_; }
    double limit() const { return std::max(logits_tolerance(s_.type_k), logits_tolerance(s_.type_v)); }
    kv_cache& cache() { return *cache_; }
    reference_memory& ref() { return ref_; }
    runtime& rt() { return *rt_; }
    kv_tensors& tensors() { return tensors_; }

private:
    setup s_;
    const model* m_;
    kv_tensors tensors_;  // the engine's K/V when s_.engine (declared before the cache: it outlives it)
    std::unique_ptr<kv_cache> cache_;
    std::unique_ptr<runtime> rt_;
    reference_memory ref_;
    std::mt19937 rng_{42};
    double worst_ = 0;
};

std::vector<setup> every_setup() {
    std::vector<setup> out;
    for (dtype t : {dtype::f32, dtype::f16, dtype::bf16, dtype::q8_0, dtype::q4_0})
        for (bool v_trans : {false, true})
            for (bool unified : {true, false}) {
                if (v_trans && is_quantized(t)) continue;  // transposed V is for float types
                setup s;
                s.type_k = t;
                s.type_v = t;
                s.v_trans = v_trans;
                s.unified = unified;
                // every test again with a prefix cache, which must change nothing seen, and each of the
                // two with the runtime owning the K/V tensors (engine-owned storage)
                for (const bool prefix : {false, true})
                    for (const bool engine : {false, true}) {
                        s.prefix = prefix;
                        s.engine = engine;
                        out.push_back(s);
                    }
            }
    return out;
}

class cache_equals_recompute : public ::testing::TestWithParam<setup> {};

void PrintTo(const setup& s, std::ostream* os) {
    *os << s.name();
}

#define EXPECT_CLOSE(run)                                                               \
    do {                                                                                \
        EXPECT_LE((run).worst(), (run).limit()) << GetParam().name();                   \
        ::testing::Test::RecordProperty("worst", fmt::format("{:.3g}", (run).worst())); \
    } while (0)

TEST_P(cache_equals_recompute, single_sequence_prompt_then_steps) {
    pair_run r(GetParam());
    r.decode({{{0}, 0, r.tokens(10)}});
    for (int i = 0; i < 5; ++i) r.decode({{{0}, -1, r.tokens(1)}});
    EXPECT_CLOSE(r);
    EXPECT_EQ(r.cache().seq_pos_max(0), 14);
}

TEST_P(cache_equals_recompute, several_sequences_in_one_batch) {
    pair_run r(GetParam());
    r.decode({{{0}, 0, r.tokens(7)}, {{1}, 0, r.tokens(3)}, {{2}, 0, r.tokens(5)}});
    for (int i = 0; i < 3; ++i)
        r.decode({{{2}, -1, r.tokens(1)}, {{0}, -1, r.tokens(2)}, {{1}, -1, r.tokens(1)}});
    EXPECT_CLOSE(r);
}

TEST_P(cache_equals_recompute, shared_prefix_through_seq_cp_and_multi_sequence_tokens) {
    pair_run r(GetParam());
    r.decode({{{0}, 0, r.tokens(9)}});
    r.both([](auto& c, auto& f) {
        for (seq_id_t d : {1, 2, 3}) {
            c.seq_cp(0, d, -1, -1);
            f.seq_cp(0, d, -1, -1);
        }
    });
    r.decode(
        {{{0}, -1, r.tokens(2)}, {{1}, -1, r.tokens(3)}, {{2}, -1, r.tokens(2)}, {{3}, -1, r.tokens(2)}});
    if (GetParam().unified) r.decode({{{2, 3}, -1, r.tokens(2)}});  // tokens in two sequences at once
    if (GetParam().engine && !GetParam().unified) {
        EXPECT_GT(r.tensors().n_ops(kv_op_kind::copy), 0u) << "stream copies reached the engine";
    }
    EXPECT_CLOSE(r);
}

TEST_P(cache_equals_recompute, partial_seq_rm_then_continue) {
    pair_run r(GetParam());
    r.decode({{{0}, 0, r.tokens(12)}, {{1}, 0, r.tokens(6)}});
    r.both([](auto& c, auto& f) {
        c.seq_rm(0, 8, -1);
        f.seq_rm(0, 8, -1);
    });
    r.decode({{{0}, 8, r.tokens(3)}});
    EXPECT_CLOSE(r);
}

TEST_P(cache_equals_recompute, context_shift_seq_rm_and_seq_add_with_k_shift) {
    pair_run r(GetParam());
    r.decode({{{0}, 0, r.tokens(16)}, {{1}, 0, r.tokens(4)}});
    r.both([](auto& c, auto& f) {
        c.seq_rm(0, 2, 6);
        f.seq_rm(0, 2, 6);
        c.seq_add(0, 6, -1, -4);
        f.seq_add(0, 6, -1, -4);
    });
    EXPECT_TRUE(r.cache().get_has_shift());
    r.decode({{{0}, -1, r.tokens(4)}, {{1}, -1, r.tokens(1)}});
    EXPECT_FALSE(r.cache().get_has_shift());
    if (GetParam().engine) {
        EXPECT_GT(r.tensors().n_ops(kv_op_kind::shift), 0u) << "the K-shift reached the engine";
    }
    EXPECT_CLOSE(r);
}

TEST_P(cache_equals_recompute, seq_div_and_seq_keep) {
    pair_run r(GetParam());
    r.decode({{{0}, 0, r.tokens(8)}, {{1}, 0, r.tokens(5)}});
    r.both([](auto& c, auto& f) {
        c.seq_div(0, 0, -1, 2);
        f.seq_div(0, 0, -1, 2);
    });
    r.decode({{{0}, 4, r.tokens(2)}, {{1}, -1, r.tokens(2)}});
    r.both([](auto& c, auto& f) {
        c.seq_keep(1);
        f.seq_keep(1);
    });
    r.decode({{{1}, -1, r.tokens(3)}});
    EXPECT_CLOSE(r);
}

TEST_P(cache_equals_recompute, state_and_session_files_restore_into_other_sequences_and_caches) {
    pair_run r(GetParam());
    r.decode({{{0}, 0, r.tokens(10)}, {{1}, 0, r.tokens(4)}});
    r.both([](auto& c, auto& f) {  // a pending shift must not leak into the saved state (design D8)
        c.seq_add(0, 5, -1, 3);
        f.seq_add(0, 5, -1, 3);
    });
    const auto saved = state_seq_get_data(r.cache(), 0);
    state_seq_set_data(r.cache(), saved, 2);
    r.ref().seq_cp(0, 2, -1, -1);
    r.decode({{{2}, -1, r.tokens(3)}, {{0}, -1, r.tokens(1)}});

    // the whole memory through a compressed session file: save, clear the cache, load
    const auto path = (fs::temp_directory_path() / fmt::format("kvc-runtime-{}.kvc", ::getpid())).string();
    session_save_options o;
    o.compress = true;
    save_file(r.cache(), path, seq_all, o);
    r.cache().clear(true);
    if (GetParam().engine) {
        EXPECT_EQ(r.tensors().n_ops(kv_op_kind::zero), 1u) << "clear(true) zeroed the engine's tensors";
    }
    load_file(r.cache(), path, seq_all);
    // one sequence through a plain session file, into another sequence
    save_file(r.cache(), path, 1);
    load_file(r.cache(), path, 3);
    r.ref().seq_cp(1, 3, -1, -1);
    fs::remove(path);
    r.decode({{{1}, -1, r.tokens(2)}, {{2}, -1, r.tokens(1)}, {{3}, -1, r.tokens(2)}});
    EXPECT_CLOSE(r);
}

TEST_P(cache_equals_recompute, compaction_changes_nothing_a_sequence_sees) {
    pair_run r(GetParam());
    // with the prefix cache, sequence 1's five whole blocks stay cached when it ends; its last 2 cells
    // make the hole
    r.decode({{{0}, 0, r.tokens(6)}, {{1}, 0, r.tokens(22)}, {{2}, 0, r.tokens(6)}});
    r.both([](auto& c, auto& f) {
        c.seq_rm(1, -1, -1);
        f.seq_rm(1, -1, -1);
    });
    const uint32_t moved = r.cache().compact();
    if (GetParam().unified) {
        EXPECT_GT(moved, 0u);
        if (GetParam().engine) {
            EXPECT_GT(r.tensors().n_ops(kv_op_kind::copy), 0u) << "the engine moved rows";
        }
    }
    r.decode({{{0}, -1, r.tokens(2)}, {{2}, -1, r.tokens(2)}});
    EXPECT_CLOSE(r);
}

TEST_P(cache_equals_recompute, small_ubatches) {
    setup s = GetParam();
    s.n_ubatch = 3;
    pair_run r(s);
    r.decode({{{0}, 0, r.tokens(7)}, {{1}, 0, r.tokens(5)}});
    r.decode({{{1}, -1, r.tokens(4)}});
    EXPECT_CLOSE(r);
}

// -- the prefix cache: attach-then-decode gives the logits of decoding the whole prompt --

class prefix_equals_recompute : public cache_equals_recompute {};

TEST_P(prefix_equals_recompute, hits_from_live_and_ended_sequences) {
    pair_run r(GetParam());
    const auto sys = r.tokens(14);  // 3 blocks + 2 tokens
    r.decode({{{0}, 0, sys}});
    for (int i = 0; i < 3; ++i) r.decode({{{0}, -1, r.tokens(1)}});
    // seq 1: the system prompt and its own question; 12 tokens hit while seq 0 still holds them
    auto q1 = sys;
    for (token_t t : r.tokens(5)) q1.push_back(t);
    EXPECT_EQ(r.attach(1, q1), 12u);
    r.decode({{{1}, 12, {q1.begin() + 12, q1.end()}}});
    // seq 0 ends: its blocks stay cached; seq 2 hits them, including the answer's first block
    r.both([](auto& c, auto& f) {
        c.seq_rm(0, -1, -1);
        f.seq_rm(0, -1, -1);
    });
    EXPECT_GT(r.cache().prefix_cache()->get_prefix_stats().cached_cells, 0u);
    EXPECT_EQ(r.attach(2, sys), 12u);  // whole blocks only: sys's last 2 tokens share one with the answer
    r.decode({{{2}, 12, {sys.begin() + 12, sys.end()}}, {{1}, -1, r.tokens(2)}});
    for (int i = 0; i < 4; ++i) r.decode({{{2}, -1, r.tokens(1)}, {{1}, -1, r.tokens(1)}});
    const prefix_stats st = r.cache().prefix_cache()->get_prefix_stats();
    EXPECT_EQ(st.hit_tokens, 24u);
    EXPECT_GT(st.published_blocks, 3u);
    if (GetParam().engine && !GetParam().unified) {
        EXPECT_GT(r.tensors().n_ops(kv_op_kind::copy), 0u) << "attaches copied rows across streams";
    }
    EXPECT_CLOSE(r);
}

TEST_P(prefix_equals_recompute, evictions_under_a_small_cache) {
    pair_run r(GetParam(), 4, 64);  // 64 cells
    std::vector<std::vector<token_t>> prompts;
    for (int k = 0; k < 6; ++k) {  // six conversations of 20 tokens, one after another: later ones evict
        prompts.push_back(r.tokens(20));
        const auto& p = prompts.back();
        const seq_id_t s = GetParam().unified ? k % 4 : 0;  // with a stream each: all in one stream
        const uint32_t n = r.attach(s, p);
        r.decode({{{s}, static_cast<pos_t>(n), {p.begin() + n, p.end()}}});
        r.decode({{{s}, -1, r.tokens(3)}});
        r.both([s](auto& c, auto& f) {
            c.seq_rm(s, -1, -1);
            f.seq_rm(s, -1, -1);
        });
    }
    EXPECT_GT(r.cache().prefix_cache()->get_prefix_stats().evicted_blocks, 0u);
    // the latest conversation is still cached; the first was evicted
    EXPECT_EQ(r.cache().prefix_cache()->prefix_lookup(prompts[5]), 19u);
    EXPECT_EQ(r.cache().prefix_cache()->prefix_lookup(prompts[0]), 0u);
    EXPECT_EQ(r.attach(1, prompts[5]), 19u);
    r.decode({{{1}, 19, {prompts[5].back()}}});
    EXPECT_CLOSE(r);
}

// The adaptive policy: a prompt evicted and then sent again comes back protected (its blocks' ghosts are
// remembered), so the next burst of one-off prompts leaves it whole, and resuming it gives the logits of
// recomputing it.
TEST_P(prefix_equals_recompute, adaptive_policy_keeps_a_prompt_that_came_back) {
    setup s = GetParam();
    s.evict = evict_policy::adaptive;
    pair_run r(s, 4, 64);  // 64 cells: 16 blocks
    const auto serve = [&](const std::vector<token_t>& p) {
        const uint32_t n = r.attach(0, p);
        r.decode({{{0}, static_cast<pos_t>(n), {p.begin() + n, p.end()}}});
        r.decode({{{0}, -1, r.tokens(1)}});
        r.both([](auto& c, auto& f) {
            c.seq_rm(0, -1, -1);
            f.seq_rm(0, -1, -1);
        });
    };
    const auto conv = r.tokens(20);  // 5 blocks
    serve(conv);
    for (int k = 0; k < 4; ++k) serve(r.tokens(20));
    ASSERT_LT(r.cache().prefix_cache()->prefix_lookup(conv), 16u) << "the burst must evict it";
    serve(conv);
    for (int k = 0; k < 4; ++k) serve(r.tokens(20));
    EXPECT_EQ(r.cache().prefix_cache()->prefix_lookup(conv),
              19u);  // all but the last token, which attach leaves to decode
    EXPECT_EQ(r.attach(1, conv), 19u);
    r.decode({{{1}, 19, {conv.back()}}});
    EXPECT_CLOSE(r);
}

TEST_P(prefix_equals_recompute, holder_context_shift_leaves_the_others_alone) {
    pair_run r(GetParam());
    const auto sys = r.tokens(17);
    r.decode({{{0}, 0, sys}});
    EXPECT_EQ(r.attach(1, sys), 16u);
    r.decode({{{1}, 16, {sys.back()}}});
    // seq 0 shifts its context: the cells it shares with seq 1 are copied for it, seq 1 keeps its own
    r.both([](auto& c, auto& f) {
        c.seq_rm(0, 2, 6);
        f.seq_rm(0, 2, 6);
        c.seq_add(0, 6, -1, -4);
        f.seq_add(0, 6, -1, -4);
    });
    r.decode({{{0}, -1, r.tokens(3)}, {{1}, -1, r.tokens(2)}});
    r.decode({{{0}, -1, r.tokens(1)}, {{1}, -1, r.tokens(1)}});
    // a new sequence still hits what seq 1 holds; with a stream per sequence seq 1 holds copies, and
    // the blocks seq 0 alone held from position 4 on left the index when it moved them
    const uint32_t n = r.attach(2, sys);
    EXPECT_EQ(n, GetParam().unified ? 16u : 4u);
    r.decode({{{2}, static_cast<pos_t>(n), {sys.begin() + n, sys.end()}}});
    EXPECT_CLOSE(r);
}

TEST_P(prefix_equals_recompute, survives_suffix_removal_and_state_restores) {
    pair_run r(GetParam());
    const auto a = r.tokens(21);
    r.decode({{{0}, 0, a}});
    r.decode({{{0}, -1, r.tokens(1)}});
    r.both([](auto& c, auto& f) {  // rollback of a suffix: the published blocks stay cached
        c.seq_rm(0, 9, -1);
        f.seq_rm(0, 9, -1);
    });
    EXPECT_EQ(r.attach(1, a), 20u);
    r.decode({{{1}, 20, {a.back()}}, {{0}, 9, r.tokens(2)}});
    // an attached sequence saved and restored into another one
    const auto saved = state_seq_get_data(r.cache(), 1);
    state_seq_set_data(r.cache(), saved, 3);
    r.ref().seq_cp(1, 3, -1, -1);
    r.decode({{{3}, -1, r.tokens(2)}, {{1}, -1, r.tokens(1)}});
    EXPECT_CLOSE(r);
}

TEST_P(prefix_equals_recompute, a_pinned_prefix_survives_churn) {
    pair_run r(GetParam(), 4, 64);
    const auto sys = r.tokens(17);
    r.decode({{{0}, 0, sys}});
    r.cache().prefix_cache()->prefix_publish();
    ASSERT_EQ(r.cache().prefix_cache()->prefix_pin(sys), 16u);
    r.both([](auto& c, auto& f) {
        c.seq_rm(0, -1, -1);
        f.seq_rm(0, -1, -1);
    });
    // conversations of 24 tokens at a high priority fill the (same) stream again and again; the pinned
    // prompt stays
    for (int k = 0; k < 5; ++k) {
        const seq_id_t s = 0;
        const auto p = r.tokens(24);
        ASSERT_EQ(r.cache().prefix_cache()->prefix_attach(s, p, 0, 90), 0u);
        r.decode({{{s}, 0, p}});
        r.cache().prefix_cache()->prefix_publish();
        r.both([s](auto& c, auto& f) {
            c.seq_rm(s, -1, -1);
            f.seq_rm(s, -1, -1);
        });
    }
    EXPECT_GT(r.cache().prefix_cache()->get_prefix_stats().evicted_blocks, 0u);
    EXPECT_EQ(r.attach(1, sys), 16u);  // shared, or copied from seq 0's stream
    r.decode({{{1}, 16, {sys.back()}}});
    r.decode({{{1}, -1, r.tokens(2)}});
    EXPECT_EQ(r.cache().prefix_cache()->prefix_unpin(sys), 16u);
    EXPECT_CLOSE(r);
}

std::string setup_name(const ::testing::TestParamInfo<setup>& i) {
    return fmt::format("{}_{}_{}{}{}", to_string(i.param.type_k), i.param.v_trans ? "vt" : "v",
                       i.param.unified ? "unified" : "split", i.param.prefix ? "_prefix" : "",
                       i.param.engine ? "_engine" : "");
}

// Blocks through a tier (docs/tiers.md): a cache stores a prompt's blocks in a disk store; a fresh cache
// (another engine process, or this one after a restart) fetches them in one read, attaches and decodes the
// rest: the logits of recomputing, for every K/V type, V layout, stream layout and engine-owned storage.
TEST_P(prefix_equals_recompute, blocks_through_a_disk_tier) {
    const std::filesystem::path dir =
        std::filesystem::temp_directory_path() /
        fmt::format("kvc-tier-{}-{:x}", ::getpid(), std::hash<std::string>{}(GetParam().name()));
    std::filesystem::remove_all(dir);
    disk_store_params dp;
    dp.dir = dir.string();
    pair_run a(GetParam());
    const auto sys = a.tokens(14);  // 3 blocks + 2 tokens
    a.decode({{{0}, 0, sys}});
    a.decode({{{0}, -1, a.tokens(1)}});
    {
        disk_block_store store(dp);
        EXPECT_EQ(a.cache().prefix_cache()->prefix_store_blocks(store, 7, sys), 3u);
        EXPECT_EQ(a.cache().prefix_cache()->prefix_store_blocks(store, 7, sys), 0u);  // stored already
        EXPECT_EQ(store.stats().puts, 3u);
    }
    disk_block_store store(dp);  // reopened, as a new process would
    pair_run b(GetParam());
    auto q = sys;
    for (const token_t t : b.tokens(3)) q.push_back(t);
    EXPECT_EQ(b.cache().prefix_cache()->prefix_fetch_blocks(store, 7, q), 12u);
    EXPECT_EQ(store.stats().calls, 1u);  // one read for the whole chain
    EXPECT_EQ(b.attach(1, q), 12u);
    b.decode({{{1}, 12, {q.begin() + 12, q.end()}}});
    for (int i = 0; i < 3; ++i) b.decode({{{1}, -1, b.tokens(1)}});
    EXPECT_CLOSE(b);
    // q's fourth block is cached in memory now too (seq 1 published it): nothing is read
    EXPECT_EQ(b.cache().prefix_cache()->prefix_fetch_blocks(store, 7, q), 16u);
    EXPECT_EQ(store.stats().calls, 1u);
    // another model's layout finds nothing; a damaged second block ends the chain after the first
    pair_run c(GetParam());
    EXPECT_EQ(c.cache().prefix_cache()->prefix_fetch_blocks(store, 8, q), 0u);
    const uint64_t h0 = block_chain_hash(0, std::span(sys).first(4));
    const uint64_t h1 = block_chain_hash(h0, std::span(sys).subspan(4, 4));
    {
        std::fstream f(dir / block_key(c.cache().prefix_cache()->prefix_block_layout(7).fingerprint(), 0, h1),
                       std::ios::binary | std::ios::in | std::ios::out);
        f.seekp(100);
        f.put('\x5a');
    }
    disk_block_store damaged(dp);
    EXPECT_EQ(c.cache().prefix_cache()->prefix_fetch_blocks(damaged, 7, q), 4u);
    EXPECT_EQ(c.attach(2, q), 4u);
    c.decode({{{2}, 4, {q.begin() + 4, q.end()}}});
    EXPECT_CLOSE(c);
    std::filesystem::remove_all(dir);
}

// A small cache with a tier below it: conversations evict earlier ones, whose blocks the tier keeps
// (written when evicted, or when published); attaching an evicted conversation, here or in a fresh cache
// sharing the store, brings its blocks back and decodes with the logits of recomputing.
TEST_P(prefix_equals_recompute, evicted_blocks_come_back_from_a_tier) {
    // on eviction and through, written by the step; on eviction, written by the cache's own thread
    for (const auto& [write, async] :
         {std::pair{tier_write::on_evict, false}, std::pair{tier_write::through, false},
          std::pair{tier_write::on_evict, true}}) {
        SCOPED_TRACE(fmt::format("write {} async {}", static_cast<int>(write), async));
        const std::filesystem::path dir =
            std::filesystem::temp_directory_path() /
            fmt::format("kvc-tiers-{}-{:x}", ::getpid(), std::hash<std::string>{}(GetParam().name()));
        std::filesystem::remove_all(dir);
        disk_store_params dp;
        dp.dir = dir.string();
        auto store = std::make_shared<disk_block_store>(dp);
        prefix_tier_params tiers{.stores = {store}, .model_id = 7, .write = write};
        tiers.async_writes = async;
        pair_run r(GetParam(), 4, 64, tiers);  // 64 cells
        std::vector<std::vector<token_t>> prompts;
        const bool unified = GetParam().unified;
        for (int k = 0; k < 6; ++k) {  // six conversations of 20 tokens: later ones evict earlier ones
            prompts.push_back(r.tokens(20));
            const auto& p = prompts.back();
            const seq_id_t s = unified ? k % 4 : 0;  // with a stream each: all in one stream
            const uint32_t n = r.attach(s, p);
            EXPECT_EQ(n, 0u);
            r.decode({{{s}, static_cast<pos_t>(n), {p.begin() + n, p.end()}}});
            r.decode({{{s}, -1, r.tokens(3)}});
            r.both([s](auto& c, auto& f) {
                c.seq_rm(s, -1, -1);
                f.seq_rm(s, -1, -1);
            });
        }
        EXPECT_EQ(r.cache().prefix_cache()->prefix_lookup(prompts[0]),
                  0u);                                  // not in memory: lookups do not ask tiers
        r.cache().prefix_cache()->prefix_tier_drain();  // async: what the thread still has to write
        const uint64_t written = r.cache().prefix_cache()->get_prefix_stats().tier_written_blocks;
        EXPECT_GT(written, 0u);
        // the first conversation comes back from the tier: 4 blocks (the prompt's last token is computed)
        const seq_id_t s1 = 1;
        EXPECT_EQ(r.attach(s1, prompts[0]), 16u);
        r.decode({{{s1}, 16, {prompts[0].begin() + 16, prompts[0].end()}}});
        r.decode({{{s1}, -1, r.tokens(2)}});
        EXPECT_CLOSE(r);
        std::vector<prefix_tier_stats> ts = r.cache().prefix_cache()->get_tier_stats();
        ASSERT_EQ(ts.size(), 1u);
        EXPECT_EQ(ts[0].fetched_blocks, 4u);
        EXPECT_EQ(ts[0].fetches, 7u);  // every attach asked: six misses, then the hit
        EXPECT_EQ(ts[0].errors, 0u);
        EXPECT_EQ(ts[0].where, "disk:" + dir.string());
        EXPECT_EQ(r.cache().prefix_cache()->get_prefix_stats().tier_fetched_blocks, 4u);
        // a fresh cache (another engine, or this one restarted) sharing the store hits every conversation
        // its blocks reached (with write-through, all of them; on eviction, those evicted)
        pair_run b(GetParam(), 4, 64, tiers);
        for (int k = 0; k < 2; ++k) {
            const seq_id_t s = unified ? k : 0;
            EXPECT_EQ(b.attach(s, prompts[static_cast<size_t>(k)]), 16u) << k;
            b.decode(
                {{{s},
                  16,
                  {prompts[static_cast<size_t>(k)].begin() + 16, prompts[static_cast<size_t>(k)].end()}}});
            b.decode({{{s}, -1, b.tokens(1)}});
            if (!unified)
                b.both([s](auto& c, auto& f) {
                    c.seq_rm(s, -1, -1);
                    f.seq_rm(s, -1, -1);
                });
        }
        EXPECT_CLOSE(b);
        // write-through writes what b published itself (each conversation's fifth block; the store has it
        // already and skips it), never a block it fetched
        b.cache().prefix_cache()->prefix_tier_drain();
        EXPECT_EQ(b.cache().prefix_cache()->get_tier_stats()[0].written_blocks,
                  write == tier_write::through ? 2u : 0u);
        std::filesystem::remove_all(dir);
    }
}

std::vector<setup> prefix_setups() {
    std::vector<setup> out;
    for (const setup& s : every_setup())
        if (s.prefix) out.push_back(s);
    return out;
}

INSTANTIATE_TEST_SUITE_P(types, cache_equals_recompute, ::testing::ValuesIn(every_setup()), setup_name);
INSTANTIATE_TEST_SUITE_P(types, prefix_equals_recompute, ::testing::ValuesIn(prefix_setups()), setup_name);

TEST(cache_equals_recompute_swa, a_sliding_window_sees_the_same_keys) {
    for (const swa_type t : {swa_type::standard, swa_type::chunked})
        for (const bool engine : {false, true}) {
            setup s;
            s.n_swa = 4;
            s.swa = t;
            s.engine = engine;
            pair_run r(s, 2, 64);
            r.decode({{{0}, 0, r.tokens(9)}});
            for (int i = 0; i < 20; ++i) r.decode({{{0}, -1, r.tokens(1)}, {{1}, i, r.tokens(1)}});
            EXPECT_LE(r.worst(), r.limit()) << s.name();
        }
}

// iSWA: layer 0 slides a window through a 256-cell SWA cache that wraps around (keys that left every
// window are overwritten), layer 1 attends to everything in the base cache; the reference applies the
// window to layer 0 only.
TEST(cache_equals_recompute_iswa, window_layers_and_full_layers_see_the_same_keys) {
    const model& m = tiny(false);
    for (const swa_type t : {swa_type::standard, swa_type::chunked})
        for (const bool unified : {true, false})
            for (const bool engine : {false, true}) {
                kv_tensors tensors;  // engine: the runtime owns both caches' K/V tensors
                kv_cache_iswa_params p;
                p.kv = m.cache_params(1024, 2);
                p.kv.layers[0].is_swa = true;
                p.kv.unified = unified;
                p.kv.n_swa = 8;
                p.kv.swa = t;
                p.sizing = {.swa_full = false, .n_ubatch = 32};
                if (engine) p.kv.engine = &tensors;
                kv_cache_iswa mem(p);
                ASSERT_EQ(mem.get_swa().get_size(), 256u);
                runtime rt(
                    m, mem,
                    runtime_params{.n_threads = 2, .n_ubatch = 32, .tensors = engine ? &tensors : nullptr});
                reference_memory ref(m, 2, 2);
                ref.set_swa(8, t, {true, false});
                std::mt19937 rng(7);
                double worst = 0;
                const auto step = [&](uint32_t n0, uint32_t n1) {
                    batch_storage b = batch::init(static_cast<int32_t>(n0 + n1), 0, 1);
                    for (const auto& [s, n] : {std::pair<seq_id_t, uint32_t>{0, n0}, {1, n1}}) {
                        const seq_id_t ids[] = {s};
                        pos_t pos = mem.seq_pos_max(s) + 1;
                        for (uint32_t i = 0; i < n; ++i)
                            b.add(static_cast<token_t>(rng() % m.hparams().n_vocab), pos++, ids, true);
                    }
                    const decode_result a = rt.decode(b.view()), r = ref.decode(b.view());
                    ASSERT_EQ(a.status, memory_status::success);
                    ASSERT_EQ(a.logits.size(), r.logits.size());
                    float scale = 0;
                    for (float x : r.logits) scale = std::max(scale, std::fabs(x));
                    worst = std::max(worst, double{max_abs_diff(a.logits, r.logits)} / scale);
                };
                // more than 256 tokens per stream: the SWA cache wraps
                for (int i = 0; i < (unified ? 7 : 14); ++i) step(20, 20);
                EXPECT_GT(mem.seq_pos_min(0), 0) << "the window slid";
                EXPECT_EQ(mem.get_base().seq_pos_min(0), 0);
                // within the window, removing the last tokens and decoding again sees the same keys
                const pos_t cut = mem.seq_pos_max(0) - 2;
                EXPECT_TRUE(mem.seq_rm(0, cut, -1));
                EXPECT_TRUE(ref.seq_rm(0, cut, -1));
                for (int i = 0; i < 3; ++i) step(1, 1);
                EXPECT_LE(worst, logits_tolerance(dtype::f16))
                    << to_string(t) << " unified " << unified << " engine " << engine;
            }
}

// -- sliding windows with a prefix cache (design D30) --

// A plain cache with SWA layers (llama.cpp's swa_full): a hit resumes at a boundary whose window is
// cached, and a sequence longer than the cache keeps sliding (the cells it left stay cached or go).
TEST(prefix_equals_recompute_swa, a_window_cache_resumes_prefixes_and_keeps_sliding) {
    for (const swa_type t : {swa_type::standard, swa_type::chunked})
        for (const bool unified : {true, false})
            for (const bool engine : {false, true}) {
                setup s;
                s.n_swa = 6;
                s.swa = t;
                s.unified = unified;
                s.prefix = true;
                s.engine = engine;
                pair_run r(s, 4, 64);
                const auto end = [&r](seq_id_t q) {
                    r.both([q](auto& c, auto& f) {
                        c.seq_rm(q, -1, -1);
                        f.seq_rm(q, -1, -1);
                    });
                };
                const auto sys = r.tokens(30);
                r.decode({{{0}, 0, sys}});
                for (int i = 0; i < 3; ++i) r.decode({{{0}, -1, r.tokens(1)}});
                end(0);
                auto q = sys;
                for (token_t x : r.tokens(5)) q.push_back(x);
                ASSERT_EQ(r.attach(1, q), 28u) << s.name();  // 7 blocks of 4; only the window is attached
                EXPECT_EQ(r.cache().seq_pos_min(1), static_cast<pos_t>(t == swa_type::standard ? 23 : 24));
                r.decode({{{1}, 28, {q.begin() + 28, q.end()}}});
                for (int i = 0; i < 12; ++i) r.decode({{{1}, -1, r.tokens(8)}});  // 131 tokens, 64 cells
                const uint32_t n = r.attach(2, q);
                EXPECT_LE(n, 32u);  // seq 1 published q's 8th block
                r.decode({{{2}, static_cast<pos_t>(n), {q.begin() + n, q.end()}}, {{1}, -1, r.tokens(1)}});
                end(1);
                end(2);
                EXPECT_GT(r.cache().prefix_cache()->get_prefix_stats().evicted_blocks, 0u) << s.name();
                EXPECT_LE(r.worst(), r.limit()) << s.name();
            }
}

// iSWA with a window-sized SWA cache (256 cells for a 1024-cell base): conversations share a system
// prompt; the SWA cache evicts the windows of old ones, and the base cache lets go of the chain ends
// those served (nothing else would evict there). Every hit decodes like recomputation.
TEST(prefix_equals_recompute_iswa, hits_need_the_base_prefix_and_the_window_before_it) {
    const model& m = tiny(false);
    for (const swa_type t : {swa_type::standard, swa_type::chunked})
        for (const bool unified : {true, false})
            for (const bool engine : {false, true}) {
                const std::string name =
                    fmt::format("{} unified {} engine {}", to_string(t), unified, engine);
                kv_tensors tensors;
                kv_cache_iswa_params p;
                p.kv = m.cache_params(1024, 4);
                p.kv.layers[0].is_swa = true;
                p.kv.unified = unified;
                p.kv.n_swa = 8;
                p.kv.swa = t;
                p.kv.prefix = {.enabled = true, .block_size = 4};
                p.sizing = {.swa_full = false, .n_ubatch = 16};
                if (engine) p.kv.engine = &tensors;
                kv_cache_iswa mem(p);
                ASSERT_EQ(mem.get_swa().get_size(), 256u);
                runtime rt(
                    m, mem,
                    runtime_params{.n_threads = 2, .n_ubatch = 16, .tensors = engine ? &tensors : nullptr});
                reference_memory ref(m, 4, 2);
                ref.set_swa(8, t, {true, false});
                std::mt19937 rng(11);
                const auto tokens = [&](size_t n) {
                    std::vector<token_t> v(n);
                    for (auto& x : v) x = static_cast<token_t>(rng() % m.hparams().n_vocab);
                    return v;
                };
                double worst = 0;
                const auto decode = [&](seq_id_t s, pos_t pos, std::span<const token_t> toks, bool out) {
                    if (toks.empty()) return;
                    batch_storage b = batch::init(static_cast<int32_t>(toks.size()), 0, 1);
                    const seq_id_t ids[] = {s};
                    for (token_t x : toks) b.add(x, pos++, ids, true);
                    const decode_result r = ref.decode(b.view());
                    if (!out) return;
                    const decode_result a = rt.decode(b.view());
                    ASSERT_EQ(a.status, memory_status::success) << name;
                    ASSERT_EQ(a.logits.size(), r.logits.size());
                    worst = std::max(worst, relative_diff(a.logits, r.logits));
                };
                const auto end = [&](seq_id_t s) {
                    mem.seq_rm(s, -1, -1);
                    ref.seq_rm(s, -1, -1);
                };
                const auto sys = tokens(20);
                std::vector<std::vector<token_t>> prompts;
                for (int k = 0; k < 12; ++k) {  // 12 conversations of 63 tokens
                    auto prompt = sys;
                    for (token_t x : tokens(40)) prompt.push_back(x);
                    const seq_id_t s = unified ? k % 4 : 0;  // a stream each: all in one
                    const uint32_t n = mem.prefix_cache()->prefix_attach(s, prompt);
                    EXPECT_GE(n, k == 0 ? 0u : 16u) << name << " the system prompt's window is cached";
                    decode(s, 0, std::span(prompt).first(n), false);  // the reference recomputes it
                    decode(s, static_cast<pos_t>(n), std::span(prompt).subspan(n), true);
                    for (int i = 0; i < 3; ++i) decode(s, mem.seq_pos_max(s) + 1, tokens(1), true);
                    end(s);
                    prompts.push_back(prompt);
                }
                const prefix_stats st = mem.prefix_cache()->get_prefix_stats();
                EXPECT_GT(st.swa_evicted_blocks, 0u) << name;
                EXPECT_GT(st.evicted_blocks, 0u) << name << ": chain ends without a window were let go";
                EXPECT_LT(st.blocks, 12u * 63 / 4) << name;
                // the newest conversation resumes at its end, the oldest at most at the system prompt
                EXPECT_EQ(mem.prefix_cache()->prefix_lookup(prompts[11]), 59u) << name;
                EXPECT_LE(mem.prefix_cache()->prefix_lookup(prompts[0]), 20u) << name;
                for (const int k : {11, 0}) {
                    auto q = prompts[static_cast<size_t>(k)];
                    for (token_t x : tokens(3)) q.push_back(x);
                    const uint32_t n = mem.prefix_cache()->prefix_attach(1, q);
                    decode(1, 0, std::span(q).first(n), false);
                    decode(1, static_cast<pos_t>(n), std::span(q).subspan(n), true);
                    end(1);
                }
                EXPECT_LE(worst, logits_tolerance(dtype::f16)) << name;
            }
}

// The tolerances are not vacuous: a cache that loses a key differs from the reference by far more.
TEST(cache_equals_recompute_oracle, a_missing_key_is_detected) {
    for (const bool engine : {false, true}) {
        pair_run r(setup{.engine = engine});
        r.decode({{{0}, 0, r.tokens(8)}});
        r.cache().seq_rm(0, 3, 4);  // only the cache forgets position 3
        EXPECT_GT(r.decode({{{0}, 8, r.tokens(2)}}), 10 * logits_tolerance(dtype::f16))
            << "engine " << engine;
    }
}

// So is an engine whose tensors lose rows the cache handed it (here: a stream copy, zeroed behind the
// cache's back).
TEST(cache_equals_recompute_oracle, an_engine_that_loses_rows_is_detected) {
    pair_run r(setup{.unified = false, .engine = true});
    r.decode({{{0}, 0, r.tokens(12)}});
    r.both([](auto& c, auto& f) {
        c.seq_cp(0, 1, -1, -1);  // into another stream: a copy op
        f.seq_cp(0, 1, -1, -1);
    });
    EXPECT_EQ(r.tensors().n_ops(kv_op_kind::copy), 1u);
    r.tensors().run({.kind = kv_op_kind::zero, .layers = r.cache().layer_ids(), .copies = {}, .shifts = {}});
    EXPECT_GT(r.decode({{{1}, -1, r.tokens(2)}}), 10 * logits_tolerance(dtype::f16));
}

TEST(runtime, rejects_a_cache_of_another_shape_and_invalid_batches) {
    const model& m = tiny(false);
    auto p = m.cache_params(64, 2);
    p.layers.pop_back();
    kv_cache wrong(p);
    EXPECT_THROW(runtime(m, wrong), error);
    kv_cache_iswa_params ip;
    ip.kv = m.cache_params(64, 2);
    ip.kv.layers[0].is_swa = true;
    ip.kv.n_swa = 4;
    ip.kv.swa = swa_type::standard;
    ip.kv.layers[1].n_head_kv += 1;  // the full layer's shape is not the model's
    kv_cache_iswa wrong_iswa(ip);
    EXPECT_THROW(runtime(m, wrong_iswa), error);
    kv_cache c(m.cache_params(64, 2));
    runtime rt(m, c);
    const token_t bad[1] = {100000};
    EXPECT_THROW(rt.decode(batch::get_one(bad)), error);
    EXPECT_EQ(c.seq_pos_max(0), -1) << "nothing placed";
    std::vector<token_t> many(100, 5);
    const decode_result res = rt.decode(batch::get_one(many));
    EXPECT_EQ(res.status, memory_status::failed_prepare) << "100 tokens do not fit 64 cells";
    EXPECT_EQ(c.seq_pos_max(0), -1);
}

}  // namespace
}  // namespace kvc
