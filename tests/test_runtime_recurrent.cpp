// Cache == recompute for recurrent and hybrid models: the logits of the tiny mamba and tiny jamba decoding
// through memory_recurrent / memory_hybrid (state rows gathered, updated and scattered through the
// memory's context, rollback planes included) equal those of reference_recurrent, which keeps each
// sequence as its token list and recomputes its state from the first token.
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <variant>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <kvcache/disk_store.h>
#include <kvcache/memory_hybrid.h>
#include <kvcache/memory_recurrent.h>
#include <kvcache/runtime/gguf.h>
#include <kvcache/runtime/reference_recurrent.h>
#include <kvcache/runtime/runtime.h>
#include <kvcache/runtime/tiny_model.h>
#include <kvcache/session.h>
#include <kvcache/state.h>

namespace kvc {
namespace {

namespace fs = std::filesystem;

// The peer's tiny models, loaded once each.
const model& tiny(tiny_arch arch) {
    static std::unique_ptr<model> m[3];
    auto& slot = m[static_cast<int>(arch)];
    if (!slot) {
        const fs::path path = fs::temp_directory_path() /
                              fmt::format("kvc-rt-recr-{}-{}.gguf", ::getpid(), static_cast<int>(arch));
        write_tiny_model(path.string(), arch == tiny_arch::mamba ? tiny_model_options::mamba()
                                                                 : tiny_model_options::jamba());
        slot = std::make_unique<model>(model::load(path.string()));
        fs::remove(path);
    }
    return *slot;
}

struct setup {
    tiny_arch arch = tiny_arch::mamba;
    uint32_t n_rs_seq = 0;    // rollback depth
    uint32_t n_ubatch = 512;  // small: batches split into several ubatches
    bool embd_all = false;    // split_seq instead of split_equal
    bool unified = true;      // jamba's KV cache: one stream (split_equal not sequential) or one per seq
    dtype type_rs = dtype::f32;
    dtype type_kv = dtype::f32;
    bool engine = false;  // jamba: the runtime owns the K/V tensors (engine-owned storage)
    // a prefix cache of 4-token blocks: snapshots every `interval` blocks, in a pool of `snapshots`
    bool prefix = false;
    uint32_t interval = 2;
    uint32_t snapshots = 64;
    prefix_tier_params tiers{};  // stores below the prefix cache (recurrent memories)
    // jamba: the attention part is an iSWA pair, layer 1 sliding a window of 6 in a 256-cell SWA cache
    // (ubatches of at most 16 tokens), layer 3 full in a 1024-cell base cache
    bool iswa = false;
    bool window = false;  // jamba: a plain attention part whose layers all slide that window
    std::string name() const {
        return fmt::format("{}_rs{}_ub{}_{}_{}_{}_{}{}{}", arch == tiny_arch::mamba ? "mamba" : "jamba",
                           n_rs_seq, n_ubatch, embd_all ? "seq" : "equal", unified ? "unified" : "streams",
                           to_string(type_rs), to_string(type_kv), engine ? "_engine" : "",
                           iswa ? "_iswa" : (window ? "_window" : "")) +
               (prefix ? fmt::format("_prefix_i{}_p{}", interval, snapshots) : "");
    }
    double limit() const { return std::max({logits_tolerance(type_rs), logits_tolerance(type_kv)}); }
};

void PrintTo(const setup& s, std::ostream* os) {
    *os << s.name();
}

constexpr uint32_t iswa_window = 6;  // setup::iswa

// A memory for the model of s (recurrent or hybrid, as the model needs); with s.engine its K/V tensors are
// `tensors`.
std::unique_ptr<memory_i> make_memory(const setup& s, uint32_t n_seq_max, kv_tensors& tensors) {
    const model& m = tiny(s.arch);
    if (m.memory_kind() == model_memory::recurrent) {
        recurrent_params p = m.recr_params(n_seq_max);
        p.n_rs_seq = s.n_rs_seq;
        p.type_r = p.type_s = s.type_rs;
        p.prefix = {.enabled = s.prefix,
                    .block_size = 4,
                    .n_vocab = static_cast<int32_t>(m.hparams().n_vocab),
                    .snapshot_interval = s.interval,
                    .max_snapshots = s.snapshots};
        p.prefix.tiers = s.tiers;
        return std::make_unique<memory_recurrent>(p);
    }
    memory_hybrid_params p = m.hybrid_params(s.iswa ? 1024 : 256, n_seq_max);
    if (s.iswa) {
        p.attn.layers[1].is_swa = true;
        p.attn.n_swa = iswa_window;
        p.attn.swa = swa_type::standard;
        p.iswa = iswa_sizing{.swa_full = false, .n_ubatch = 16};
    } else if (s.window) {
        p.attn.n_swa = iswa_window;
        p.attn.swa = swa_type::standard;
    }
    p.attn.type_k = p.attn.type_v = s.type_kv;
    p.attn.unified = s.unified;
    if (s.engine) p.attn.engine = &tensors;
    p.recr.n_rs_seq = s.n_rs_seq;
    p.recr.type_r = p.recr.type_s = s.type_rs;
    p.prefix = {.enabled = s.prefix,
                .block_size = 4,
                .n_vocab = static_cast<int32_t>(m.hparams().n_vocab),
                .snapshot_interval = s.interval,
                .max_snapshots = s.snapshots};
    p.prefix.tiers = s.tiers;
    return std::make_unique<memory_hybrid>(p);
}

std::unique_ptr<runtime> make_runtime(const setup& s, memory_i& mem, kv_tensors& tensors) {
    const runtime_params rp{.n_threads = 2,
                            .n_ubatch = s.n_ubatch,
                            .embd_all = s.embd_all,
                            .tensors = s.engine ? &tensors : nullptr};
    if (auto* h = dynamic_cast<memory_hybrid*>(&mem)) return std::make_unique<runtime>(tiny(s.arch), *h, rp);
    return std::make_unique<runtime>(tiny(s.arch), dynamic_cast<memory_recurrent&>(mem), rp);
}

// The memory with its runtime and the oracle, driven side by side; every decode compares their logits.
class pair_run {
public:
    explicit pair_run(const setup& s, uint32_t n_seq_max = 4)
        : s_(s),
          m_(&tiny(s.arch)),
          tensors_(std::make_unique<kv_tensors>()),
          mem_(make_memory(s, n_seq_max, *tensors_)),
          rt_(make_runtime(s, *mem_, *tensors_)),
          ref_(*m_, n_seq_max) {
        if (s.iswa) ref_.set_swa(iswa_window, swa_type::standard, {false, true, false, false});
        if (s.window) ref_.set_swa(iswa_window, swa_type::standard);
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
            pos_t p = g.pos >= 0 ? g.pos : mem_->seq_pos_max(g.seqs[0]) + 1;
            EXPECT_EQ(mem_->seq_pos_max(g.seqs[0]), ref_.seq_pos_max(g.seqs[0])) << "seq " << g.seqs[0];
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
        last_ubatches_ = a.n_ubatches;
        return rel;
    }
    // The memory resumes seq from the deepest snapshot of `prompt`; the oracle decodes those tokens.
    uint32_t attach(seq_id_t seq, const std::vector<token_t>& prompt) {
        auto* hyb = dynamic_cast<memory_hybrid*>(mem_.get());
        // what a lookup promises is what an attach gives (less only when copies across streams lack room;
        // more when the tiers, which lookups do not ask, bring blocks back)
        const uint32_t promised =
            hyb ? hyb->prefix_cache()->prefix_lookup(prompt)
                : dynamic_cast<memory_recurrent&>(*mem_).prefix_cache()->prefix_lookup(prompt);
        const uint32_t n =
            hyb ? hyb->prefix_cache()->prefix_attach(seq, prompt)
                : dynamic_cast<memory_recurrent&>(*mem_).prefix_cache()->prefix_attach(seq, prompt);
        if (!s_.tiers.stores.empty()) {
            EXPECT_GE(n, promised) << "seq " << seq;
        } else if (s_.unified) {
            EXPECT_EQ(n, promised) << "seq " << seq;
        } else {
            EXPECT_LE(n, promised) << "seq " << seq;
        }
        EXPECT_EQ(mem_->seq_pos_max(seq), static_cast<pos_t>(n) - 1);
        if (n > 0) {
            batch_storage b = batch::init(static_cast<int32_t>(n), 0, 1);
            const seq_id_t ids[] = {seq};
            for (uint32_t p = 0; p < n; ++p) b.add(prompt[p], static_cast<pos_t>(p), ids, p + 1 == n);
            (void)ref_.decode(b.view());
        }
        return n;
    }
    // Decodes the rest of `prompt` after what attach gave (positions from n).
    void rest(seq_id_t seq, const std::vector<token_t>& prompt, uint32_t n) {
        decode({{{seq}, static_cast<pos_t>(n), {prompt.begin() + n, prompt.end()}}});
    }
    std::vector<token_t> tokens(size_t n) {
        std::vector<token_t> t(n);
        for (auto& x : t) x = static_cast<token_t>(rng_() % m_->hparams().n_vocab);
        return t;
    }
    // Drops the runtime and the memory and decodes from now on through a fresh pair built alike.
    void renew(uint32_t n_seq_max = 4) {
        rt_.reset();
        mem_.reset();
        tensors_ = std::make_unique<kv_tensors>();
        mem_ = make_memory(s_, n_seq_max, *tensors_);
        rt_ = make_runtime(s_, *mem_, *tensors_);
    }
    double worst() const { return worst_; }
    double limit() const { return s_.limit(); }
    uint32_t last_ubatches() const { return last_ubatches_; }
    memory_i& mem() { return *mem_; }
    reference_recurrent& ref() { return ref_; }
    const setup& config() const { return s_; }

private:
    setup s_;
    const model* m_;
    std::unique_ptr<kv_tensors> tensors_;  // the engine's K/V (used with s_.engine); outlives mem_
    std::unique_ptr<memory_i> mem_;
    std::unique_ptr<runtime> rt_;
    reference_recurrent ref_;
    std::mt19937 rng_{7};
    double worst_ = 0;
    uint32_t last_ubatches_ = 0;
};

#define EXPECT_CLOSE(r) EXPECT_LE((r).worst(), (r).limit()) << "worst relative difference"

class recurrent_equals_recompute : public ::testing::TestWithParam<setup> {};

TEST_P(recurrent_equals_recompute, several_sequences_in_batches_split_into_ubatches) {
    pair_run r(GetParam());
    r.decode({{{0}, 0, r.tokens(10)}, {{1}, 0, r.tokens(4)}, {{2}, 0, r.tokens(7)}});
    if (GetParam().n_ubatch < 8) {
        EXPECT_GT(r.last_ubatches(), 1u);
    }
    for (int step = 0; step < 3; ++step)
        r.decode(
            {{{0}, -1, r.tokens(1)}, {{1}, -1, r.tokens(2)}, {{2}, -1, r.tokens(1)}, {{3}, -1, r.tokens(3)}});
    EXPECT_GT(r.ref().n_forwards(), 0u);
    EXPECT_CLOSE(r);
}

TEST_P(recurrent_equals_recompute, shared_prefix_through_seq_cp_then_seq_keep) {
    pair_run r(GetParam());
    r.decode({{{0}, 0, r.tokens(9)}});
    for (seq_id_t d : {1, 2}) {
        r.mem().seq_cp(0, d, -1, -1);
        r.ref().seq_cp(0, d, -1, -1);
    }
    // the copies share seq 0's cell until they decode: copy-on-write sources in one batch
    r.decode({{{1}, -1, r.tokens(3)}, {{2}, -1, r.tokens(2)}, {{0}, -1, r.tokens(1)}});
    r.decode({{{2}, -1, r.tokens(1)}, {{1}, -1, r.tokens(1)}});
    r.mem().seq_keep(1);
    r.ref().seq_keep(1);
    for (seq_id_t s : {0, 2, 3}) EXPECT_EQ(r.mem().seq_pos_max(s), -1);
    r.decode({{{1}, -1, r.tokens(2)}, {{0}, 0, r.tokens(4)}});
    EXPECT_CLOSE(r);
}

// Suffix removal: with n_rs_seq = k, up to k last tokens roll back (composed, over several decodes);
// beyond the history it is refused and nothing changes. The oracle recomputes from the first token.
TEST_P(recurrent_equals_recompute, suffix_removal_rolls_back_within_the_history) {
    const uint32_t k = GetParam().n_rs_seq;
    pair_run r(GetParam());
    r.decode({{{0}, 0, r.tokens(12)}, {{1}, 0, r.tokens(6)}});
    const auto remove = [&](seq_id_t s, pos_t p0, bool want) {
        EXPECT_EQ(r.mem().seq_rm(s, p0, -1), want) << "seq_rm(" << s << ", " << p0 << ")";
        if (want) r.ref().seq_rm(s, p0, -1);
        EXPECT_EQ(r.mem().seq_pos_max(s), r.ref().seq_pos_max(s));
    };
    if (k == 0) {
        remove(0, 11, false);
        r.decode({{{0}, -1, r.tokens(2)}});
        EXPECT_CLOSE(r);
        return;
    }
    // one rollback of every depth, each followed by a decode
    for (uint32_t back = 1; back <= k; ++back) {
        const pos_t p = r.mem().seq_pos_max(0);
        remove(0, p - static_cast<pos_t>(back) + 1, true);
        r.decode({{{0}, -1, r.tokens(back + 1)}, {{1}, -1, r.tokens(1)}});
    }
    // composed: one token back, then the rest of the history, before the next decode
    if (k >= 2) {
        const pos_t p = r.mem().seq_pos_max(0);
        remove(0, p, true);
        remove(0, p - static_cast<pos_t>(k) + 1, true);
        remove(0, p - static_cast<pos_t>(k), false);  // beyond the history
        r.decode({{{0}, -1, r.tokens(1)}});
    }
    // one token at a time builds the history up again (history copies of short ubatches)
    for (uint32_t i = 0; i < k; ++i) r.decode({{{1}, -1, r.tokens(1)}});
    const pos_t p1 = r.mem().seq_pos_max(1);
    remove(1, p1 - static_cast<pos_t>(k) + 1, true);
    r.decode({{{1}, -1, r.tokens(2)}, {{0}, -1, r.tokens(1)}});
    // a shared cell does not roll back
    r.mem().seq_cp(1, 2, -1, -1);
    r.ref().seq_cp(1, 2, -1, -1);
    remove(2, r.mem().seq_pos_max(2), false);
    r.decode({{{2}, -1, r.tokens(1)}, {{1}, -1, r.tokens(1)}});
    EXPECT_CLOSE(r);
}

TEST_P(recurrent_equals_recompute, states_restore_into_other_sequences_and_fresh_memories) {
    pair_run r(GetParam());
    r.decode({{{0}, 0, r.tokens(10)}, {{1}, 0, r.tokens(5)}});
    // one sequence into another
    const auto saved = state_seq_get_data(r.mem(), 0);
    state_seq_set_data(r.mem(), saved, 2);
    r.ref().seq_cp(0, 2, -1, -1);
    r.decode({{{2}, -1, r.tokens(3)}, {{0}, -1, r.tokens(1)}});

    // the whole memory through a compressed session file into a fresh memory
    const auto path = (fs::temp_directory_path() / fmt::format("kvc-rt-recr-{}.kvc", ::getpid())).string();
    session_save_options o;
    o.compress = true;
    save_file(r.mem(), path, seq_all, o);
    r.renew();
    load_file(r.mem(), path, seq_all);
    r.decode({{{1}, -1, r.tokens(2)}, {{2}, -1, r.tokens(1)}});
    // one sequence through a plain session file, into another sequence
    save_file(r.mem(), path, 1);
    load_file(r.mem(), path, 3);
    r.ref().seq_cp(1, 3, -1, -1);
    fs::remove(path);
    r.decode({{{1}, -1, r.tokens(1)}, {{3}, -1, r.tokens(2)}});
    // a whole-memory buffer restored over a memory changed since (the oracle not): everything back
    const auto whole = state_seq_get_data(r.mem(), seq_all);
    r.mem().seq_rm(1, -1, -1);
    r.mem().seq_cp(3, 0, -1, -1);
    state_seq_set_data(r.mem(), whole, seq_all);
    r.decode({{{0}, -1, r.tokens(1)}, {{1}, -1, r.tokens(2)}, {{3}, -1, r.tokens(1)}});
    EXPECT_CLOSE(r);
}

std::vector<setup> every_setup() {
    std::vector<setup> out;
    for (tiny_arch a : {tiny_arch::mamba, tiny_arch::jamba}) {
        for (uint32_t k : {0u, 1u, 2u, 3u, 4u}) out.push_back({.arch = a, .n_rs_seq = k});
        out.push_back({.arch = a, .n_rs_seq = 2, .n_ubatch = 3});
        out.push_back({.arch = a, .n_rs_seq = 1, .n_ubatch = 4, .embd_all = true});
        out.push_back({.arch = a, .n_rs_seq = 0, .n_ubatch = 5, .embd_all = true});
        out.push_back({.arch = a, .n_rs_seq = 2, .type_rs = dtype::f16});
    }
    out.push_back({.arch = tiny_arch::jamba, .n_rs_seq = 2, .n_ubatch = 3, .unified = false});
    out.push_back({.arch = tiny_arch::jamba, .n_rs_seq = 1, .type_kv = dtype::f16});
    // every hybrid setup again with the runtime owning the attention part's K/V tensors
    for (size_t i = 0, n = out.size(); i < n; ++i)
        if (out[i].arch == tiny_arch::jamba) {
            setup e = out[i];
            e.engine = true;
            out.push_back(e);
        }
    return out;
}

std::string setup_name(const ::testing::TestParamInfo<setup>& i) {
    return i.param.name();
}

INSTANTIATE_TEST_SUITE_P(models, recurrent_equals_recompute, ::testing::ValuesIn(every_setup()), setup_name);

// -- the prefix cache: resuming from a snapshot, then decoding, gives the logits of decoding everything --

class recurrent_prefix_equals_recompute : public ::testing::TestWithParam<setup> {};

struct prefix_of {
    pair_run& r;
    prefix_stats stats() const {
        if (auto* h = dynamic_cast<memory_hybrid*>(&r.mem())) return h->prefix_cache()->get_prefix_stats();
        return dynamic_cast<memory_recurrent&>(r.mem()).prefix_cache()->get_prefix_stats();
    }
    uint32_t lookup(std::span<const token_t> t) const {
        if (auto* h = dynamic_cast<memory_hybrid*>(&r.mem())) return h->prefix_cache()->prefix_lookup(t);
        return dynamic_cast<memory_recurrent&>(r.mem()).prefix_cache()->prefix_lookup(t);
    }
};

std::vector<token_t> concat(std::vector<token_t> a, const std::vector<token_t>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
}

// A chat: each turn's prompt is the history, the answer is decoded a token at a time, and the sequence
// ends; the next turn resumes at the newest boundary the previous one reached (within one block of its
// end), a regenerated answer at the end of the prompt, and a branch inside the prompt at the newest
// interval snapshot before it.
TEST_P(recurrent_prefix_equals_recompute, turns_resume_within_a_block_of_where_they_diverge) {
    pair_run r(GetParam());
    const uint32_t every = GetParam().interval * 4;
    const bool roomy = GetParam().snapshots >= 16;  // else evictions may leave only shallower snapshots
    const auto expect_n = [&](uint32_t got, uint32_t want, int turn) {
        EXPECT_EQ(got % 4, 0u);
        if (roomy) {
            EXPECT_EQ(got, want) << "turn " << turn;
        } else {
            EXPECT_LE(got, want) << "turn " << turn;
        }
    };
    std::vector<token_t> history;
    for (int turn = 0; turn < 4; ++turn) {
        const std::vector<token_t> prompt = concat(history, r.tokens(9 + 2 * turn));
        const uint32_t n = r.attach(0, prompt);
        expect_n(n, static_cast<uint32_t>(history.size() / 4 * 4),
                 turn);  // the previous turn's last boundary
        r.rest(0, prompt, n);
        history = prompt;
        for (int i = 0; i < 6; ++i) {
            const std::vector<token_t> t = r.tokens(1);
            r.decode({{{0}, -1, t}});
            history.push_back(t[0]);
        }
        EXPECT_TRUE(r.mem().seq_rm(0, -1, -1));
        r.ref().seq_rm(0, -1, -1);
        // another answer to the same prompt: from the prompt's end (kept), not from the rolled boundary
        const uint32_t m = r.attach(1, concat(prompt, r.tokens(3)));
        expect_n(m, static_cast<uint32_t>(prompt.size() / 4 * 4), turn);
        r.decode({{{1}, -1, r.tokens(2)}});
        EXPECT_TRUE(r.mem().seq_rm(1, -1, -1));
        r.ref().seq_rm(1, -1, -1);
    }
    // a branch in the middle: the interval snapshots
    const auto cut = static_cast<uint32_t>(history.size() - 11);
    std::vector<token_t> branch(history.begin(), history.begin() + cut);
    branch = concat(branch, r.tokens(5));
    const uint32_t n = r.attach(2, branch);
    if (roomy && every > 0) {
        EXPECT_GE(n + every, cut / 4 * 4);
    }
    EXPECT_LE(n, cut);
    r.rest(2, branch, n);
    const prefix_stats st = prefix_of{r}.stats();
    EXPECT_GT(st.snapshots_saved, 0u);
    EXPECT_GT(st.hit_tokens, 0u);
    EXPECT_CLOSE(r);
}

// Several sequences at once, prompts sharing a system prompt; a pool smaller than what they leave makes
// snapshots go (lookups then find less, never something wrong).
TEST_P(recurrent_prefix_equals_recompute, concurrent_sequences_and_evictions) {
    pair_run r(GetParam());
    const std::vector<token_t> system = r.tokens(13);
    std::vector<std::vector<token_t>> prompts;
    for (int i = 0; i < 10; ++i) prompts.push_back(concat(system, r.tokens(3 + static_cast<size_t>(i) % 7)));
    for (size_t i = 0; i < prompts.size(); i += 2) {
        // two requests decode their prompts in one batch, then answer side by side
        std::vector<pair_run::group> groups;
        for (size_t j = i; j < i + 2; ++j) {
            const auto s = static_cast<seq_id_t>(j - i);
            const uint32_t n = r.attach(s, prompts[j]);
            groups.push_back({{s}, static_cast<pos_t>(n), {prompts[j].begin() + n, prompts[j].end()}});
        }
        r.decode(groups);
        for (int step = 0; step < 5; ++step) r.decode({{{0}, -1, r.tokens(1)}, {{1}, -1, r.tokens(1)}});
        for (seq_id_t s : {0, 1}) {
            r.mem().seq_rm(s, -1, -1);
            r.ref().seq_rm(s, -1, -1);
        }
    }
    for (const auto& p : prompts) {
        const uint32_t n = r.attach(3, concat(p, r.tokens(2)));
        EXPECT_LE(n, p.size() + 1);
        r.decode({{{3}, -1, r.tokens(1)}});
        r.mem().seq_rm(3, -1, -1);
        r.ref().seq_rm(3, -1, -1);
    }
    const prefix_stats st = prefix_of{r}.stats();
    EXPECT_LE(st.snapshots, GetParam().snapshots);
    if (GetParam().snapshots < 8) {
        EXPECT_GT(st.snapshots_dropped, 0u);
    }
    EXPECT_GT(st.hit_tokens, 0u);
    EXPECT_CLOSE(r);
}

// Rollbacks (speculative decoding), copies and state restores around the snapshots.
TEST_P(recurrent_prefix_equals_recompute, rollbacks_copies_and_restores) {
    const setup& s = GetParam();
    pair_run r(s);
    const std::vector<token_t> prompt = r.tokens(18);
    r.attach(0, prompt);
    r.rest(0, prompt, 0);
    if (s.n_rs_seq > 0) {  // a drafted token crossing a boundary, then rolled back
        r.decode({{{0}, -1, r.tokens(s.n_rs_seq)}});
        const pos_t p = r.mem().seq_pos_max(0);
        ASSERT_TRUE(r.mem().seq_rm(0, p - static_cast<pos_t>(s.n_rs_seq) + 1, -1));
        r.ref().seq_rm(0, p - static_cast<pos_t>(s.n_rs_seq) + 1, -1);
    }
    r.decode({{{0}, -1, r.tokens(3)}});
    // a copy continues the original's chain; both answer differently and end
    r.mem().seq_cp(0, 1, -1, -1);
    r.ref().seq_cp(0, 1, -1, -1);
    r.decode({{{0}, -1, r.tokens(2)}, {{1}, -1, r.tokens(2)}});
    // a restored sequence resumes from its state but publishes nothing (its tokens are not in the state)
    const auto saved = state_seq_get_data(r.mem(), 1);
    state_seq_set_data(r.mem(), saved, 2);
    r.ref().seq_cp(1, 2, -1, -1);
    r.decode({{{2}, -1, r.tokens(4)}});
    for (seq_id_t q : {0, 1, 2}) {
        r.mem().seq_rm(q, -1, -1);
        r.ref().seq_rm(q, -1, -1);
    }
    EXPECT_GE(r.attach(3, concat(prompt, r.tokens(2))), 16u);
    r.decode({{{3}, -1, r.tokens(1)}});
    // a whole-memory restore empties the index, as clear() does
    const auto whole = state_seq_get_data(r.mem(), seq_all);
    state_seq_set_data(r.mem(), whole, seq_all);
    EXPECT_EQ(prefix_of{r}.lookup(prompt), 0u);
    r.decode({{{3}, -1, r.tokens(2)}});
    EXPECT_CLOSE(r);
}

// Snapshots through a disk tier: written when published (kept ones: prompt ends and intervals) they bring
// every conversation back into a fresh memory (a restart); written when evicted from a pool of 3 they bring
// back the conversations it lost. Resuming from them gives the logits of decoding everything.
// (Registered for the setups without a sliding window only: caches with one refuse tiers, docs/tiers.md.)
class recurrent_prefix_tiers_equal_recompute : public recurrent_prefix_equals_recompute {};

TEST_P(recurrent_prefix_tiers_equal_recompute, snapshots_come_back_from_a_tier) {
    for (const tier_write write : {tier_write::through, tier_write::on_evict}) {
        SCOPED_TRACE(static_cast<int>(write));
        const fs::path dir = fs::temp_directory_path() / fmt::format("kvc-rt-tier-{}", ::getpid());
        fs::remove_all(dir);
        disk_store_params dp;
        dp.dir = dir.string();
        setup s = GetParam();
        s.tiers = {.stores = {std::make_shared<disk_block_store>(dp)}, .model_id = 5, .write = write};
        if (write == tier_write::on_evict) s.snapshots = 3;
        pair_run r(s);
        std::vector<std::vector<token_t>> prompts;
        for (int i = 0; i < 6; ++i) {
            prompts.push_back(r.tokens(13 + 2 * static_cast<size_t>(i)));
            EXPECT_EQ(r.attach(0, prompts.back()), 0u);
            r.rest(0, prompts.back(), 0);
            r.decode({{{0}, -1, r.tokens(1)}});
            EXPECT_TRUE(r.mem().seq_rm(0, -1, -1));
            r.ref().seq_rm(0, -1, -1);
        }
        const auto tiers = [&] {
            if (auto* h = dynamic_cast<memory_hybrid*>(&r.mem()))
                return h->prefix_cache()->get_tier_stats().at(0);
            return dynamic_cast<memory_recurrent&>(r.mem()).prefix_cache()->get_tier_stats().at(0);
        };
        EXPECT_GT(tiers().written_blocks, 0u);
        if (write == tier_write::through) r.renew();  // a restart: memory is empty, the tier is not
        if (auto* h = dynamic_cast<memory_hybrid*>(&r.mem())) {  // refused before the tiers are asked
            const uint64_t asked = tiers().fetches;
            EXPECT_THROW(h->prefix_cache()->prefix_attach(1, prompts[0], 0, 101), error);
            EXPECT_THROW(h->prefix_cache()->prefix_attach(1, concat(prompts[0], {-1})), error);
            EXPECT_EQ(tiers().fetches, asked);
        }
        for (size_t i = 0; i < 2; ++i) {
            // the prompt's end snapshot (or, with interval 0 and a small pool, what eviction wrote)
            const std::vector<token_t> next = concat(prompts[i], r.tokens(3));
            const uint32_t n = r.attach(1, next);
            EXPECT_EQ(n, prompts[i].size() / 4 * 4) << i;
            r.rest(1, next, n);
            r.decode({{{1}, -1, r.tokens(1)}});
            EXPECT_TRUE(r.mem().seq_rm(1, -1, -1));
            r.ref().seq_rm(1, -1, -1);
        }
        EXPECT_GE(tiers().fetched_blocks, 2u);
        EXPECT_EQ(tiers().errors, 0u);
        EXPECT_CLOSE(r);
        fs::remove_all(dir);
    }
}

std::vector<setup> prefix_setups() {
    std::vector<setup> out;
    for (uint32_t k : {0u, 2u}) {
        out.push_back({.arch = tiny_arch::mamba, .n_rs_seq = k, .prefix = true});
        out.push_back({.arch = tiny_arch::mamba, .n_rs_seq = k, .n_ubatch = 3, .prefix = true});
        out.push_back(
            {.arch = tiny_arch::mamba, .n_rs_seq = k, .prefix = true, .interval = 0, .snapshots = 5});
    }
    out.push_back({.arch = tiny_arch::mamba, .n_rs_seq = 1, .n_ubatch = 5, .embd_all = true, .prefix = true});
    out.push_back(
        {.arch = tiny_arch::mamba, .n_rs_seq = 1, .type_rs = dtype::f16, .prefix = true, .interval = 1});
    // jamba: the attention part's blocks and the recurrent part's snapshots together
    for (uint32_t k : {0u, 2u}) {
        out.push_back({.arch = tiny_arch::jamba, .n_rs_seq = k, .prefix = true});
        out.push_back({.arch = tiny_arch::jamba, .n_rs_seq = k, .n_ubatch = 3, .prefix = true});
    }
    out.push_back({.arch = tiny_arch::jamba, .prefix = true, .interval = 0, .snapshots = 5});
    out.push_back({.arch = tiny_arch::jamba, .n_rs_seq = 1, .unified = false, .prefix = true});
    out.push_back(
        {.arch = tiny_arch::jamba, .n_rs_seq = 1, .type_kv = dtype::f16, .engine = true, .prefix = true});
    // jamba with an iSWA attention part: a hit needs the base chain, the window before it and a snapshot
    for (uint32_t k : {0u, 2u}) {
        out.push_back(
            {.arch = tiny_arch::jamba, .n_rs_seq = k, .n_ubatch = 16, .prefix = true, .iswa = true});
        out.push_back({.arch = tiny_arch::jamba, .n_rs_seq = k, .n_ubatch = 3, .prefix = true, .iswa = true});
    }
    out.push_back({.arch = tiny_arch::jamba,
                   .n_ubatch = 16,
                   .prefix = true,
                   .interval = 0,
                   .snapshots = 5,
                   .iswa = true});
    out.push_back({.arch = tiny_arch::jamba,
                   .n_rs_seq = 1,
                   .n_ubatch = 16,
                   .unified = false,
                   .prefix = true,
                   .iswa = true});
    out.push_back({.arch = tiny_arch::jamba,
                   .n_rs_seq = 1,
                   .n_ubatch = 16,
                   .type_kv = dtype::f16,
                   .engine = true,
                   .prefix = true,
                   .iswa = true});
    // a plain attention part with a window: the same rule, with the window in the one cache
    out.push_back({.arch = tiny_arch::jamba, .n_rs_seq = 1, .prefix = true, .window = true});
    out.push_back({.arch = tiny_arch::jamba, .prefix = true, .interval = 0, .snapshots = 5, .window = true});
    return out;
}

INSTANTIATE_TEST_SUITE_P(models, recurrent_prefix_equals_recompute, ::testing::ValuesIn(prefix_setups()),
                         setup_name);

std::vector<setup> tier_setups() {
    std::vector<setup> out = prefix_setups();
    std::erase_if(out, [](const setup& s) { return s.iswa || s.window; });
    return out;
}
INSTANTIATE_TEST_SUITE_P(models, recurrent_prefix_tiers_equal_recompute, ::testing::ValuesIn(tier_setups()),
                         setup_name);

// Jamba with an iSWA attention part whose 256-cell SWA cache cannot keep the windows of every
// conversation: conversations sharing a system prompt end one after another, the SWA cache evicts old
// windows, the snapshots there are dropped and the base chains that led only to them let go. Every resume
// (the newest conversations at their ends, old ones wherever a whole hit is left) decodes like
// recomputation; so does one of a sequence that is still decoding while its early windows are evicted.
TEST(recurrent_prefix_equals_recompute_iswa, swa_evictions_drop_snapshots_and_base_chains) {
    for (const bool unified : {true, false}) {
        SCOPED_TRACE(unified);
        const setup s{.arch = tiny_arch::jamba,
                      .n_ubatch = 16,
                      .unified = unified,
                      .prefix = true,
                      .interval = 1,
                      .snapshots = 256,
                      .iswa = true};
        pair_run r(s);
        const std::vector<token_t> system = r.tokens(10);
        std::vector<std::vector<token_t>> prompts;
        for (int i = 0; i < 14; ++i) {
            const seq_id_t q = unified ? i % 4 : 0;
            const std::vector<token_t> p = concat(system, r.tokens(30));
            const uint32_t n = r.attach(q, p);
            if (i > 0) {
                EXPECT_GE(n, 8u) << "the system prompt, " << i;
            }
            r.rest(q, p, n);
            for (int t = 0; t < 3; ++t) r.decode({{{q}, -1, r.tokens(1)}});
            r.mem().seq_rm(q, -1, -1);
            r.ref().seq_rm(q, -1, -1);
            prompts.push_back(p);
        }
        // a long sequence: its early windows leave the SWA cache while it decodes
        const std::vector<token_t> longer = concat(prompts[13], r.tokens(200));
        const uint32_t n_long = r.attach(1, longer);
        EXPECT_GE(n_long, 40u);
        for (size_t at = n_long; at < longer.size(); at += 20) {
            const size_t end = std::min(longer.size(), at + 20);
            r.decode({{{1},
                       static_cast<pos_t>(at),
                       {longer.begin() + static_cast<std::ptrdiff_t>(at),
                        longer.begin() + static_cast<std::ptrdiff_t>(end)}}});
        }
        r.mem().seq_rm(1, -1, -1);
        r.ref().seq_rm(1, -1, -1);
        const prefix_stats st = prefix_of{r}.stats();
        EXPECT_GT(st.swa_evicted_blocks, 0u);
        EXPECT_GT(st.snapshots_dropped, 0u);
        EXPECT_GT(st.evicted_blocks, 0u) << "base chains that led only to dropped snapshots";
        // every conversation again, and branches of the long one: what is left of each hit is whole
        for (const auto& p : prompts) {
            const std::vector<token_t> next = concat(p, r.tokens(2));
            const uint32_t n = r.attach(2, next);
            r.rest(2, next, n);
            r.mem().seq_rm(2, -1, -1);
            r.ref().seq_rm(2, -1, -1);
        }
        for (const size_t cut : {60u, 121u, 200u, 237u}) {
            const std::vector<token_t> branch =
                concat({longer.begin(), longer.begin() + static_cast<std::ptrdiff_t>(cut)}, r.tokens(3));
            const uint32_t n = r.attach(3, branch);
            EXPECT_LE(n, cut);
            r.rest(3, branch, n);
            r.mem().seq_rm(3, -1, -1);
            r.ref().seq_rm(3, -1, -1);
        }
        EXPECT_GT(prefix_of{r}.stats().hit_tokens, 14u * 8);
        EXPECT_CLOSE(r);
    }
}

// Jamba's partial-only state (the recurrent part alone), used as a checkpoint: saved after a prompt,
// restored after the attention part has dropped what came later, the sequence continues as if the
// later tokens had never been decoded.
TEST(recurrent_equals_recompute_hybrid, partial_only_state_is_a_checkpoint_of_the_recurrent_part) {
    for (const bool engine : {false, true}) {
        pair_run r({.arch = tiny_arch::jamba, .engine = engine});
        r.decode({{{0}, 0, r.tokens(10)}, {{1}, 0, r.tokens(3)}});
        const auto checkpoint = state_seq_get_data(r.mem(), 0, state_seq_flag_partial_only);
        EXPECT_LT(checkpoint.size(), state_seq_get_size(r.mem(), 0));
        r.decode({{{0}, -1, r.tokens(4)}});
        // without rollback planes the hybrid refuses the suffix; the attention part alone drops it
        auto& hyb = dynamic_cast<memory_hybrid&>(r.mem());
        EXPECT_FALSE(hyb.seq_rm(0, 10, -1));
        EXPECT_TRUE(hyb.get_attn().seq_rm(0, 10, -1));
        state_seq_set_data(r.mem(), checkpoint, 0, state_seq_flag_partial_only);
        r.ref().seq_rm(0, 10, -1);
        EXPECT_EQ(r.mem().seq_pos_max(0), 9);
        r.decode({{{0}, -1, r.tokens(3)}, {{1}, -1, r.tokens(1)}});
        EXPECT_CLOSE(r) << "engine " << engine;
    }
}

// The oracle is not the cache: a state left out of the comparison would be seen.
TEST(recurrent_equals_recompute_oracle, a_wrong_state_is_detected) {
    pair_run r({.arch = tiny_arch::mamba});
    r.decode({{{0}, 0, r.tokens(6)}, {{1}, 0, r.tokens(6)}});
    // the memory's seq 1 takes seq 0's state, the oracle's does not
    r.mem().seq_cp(0, 1, -1, -1);
    EXPECT_GT(r.decode({{{1}, 6, r.tokens(1)}}), 1e-3);
}

TEST(runtime_recurrent, refuses_memories_of_another_shape) {
    const model& mamba = tiny(tiny_arch::mamba);
    recurrent_params p = mamba.recr_params(2);
    p.layers[1].n_embd_s += 1;
    memory_recurrent wrong(p);
    EXPECT_THROW(runtime(mamba, wrong), error);
    recurrent_params q = mamba.recr_params(2);
    q.layers.pop_back();
    memory_recurrent fewer(q);
    EXPECT_THROW(runtime(mamba, fewer), error);
    // a jamba needs its attention layers in the hybrid's KV cache
    const model& jamba = tiny(tiny_arch::jamba);
    memory_hybrid_params h = jamba.hybrid_params(256, 2);
    h.attn.layers[1].has_kv = false;
    memory_hybrid no_kv(h);
    EXPECT_THROW(runtime(jamba, no_kv), error);
}

// The tiny jamba rewritten: metadata `edit` may change or drop (false) an entry, tensors pass `keep` or not,
// and `extra` adds metadata; loading it must fail with a message naming `what`.
void expect_refused(const std::function<bool(std::string_view key, gguf_writer&)>& edit,
                    const std::function<bool(const gguf_tensor_info&, gguf_writer&)>& keep,
                    const std::string& what) {
    const auto f = gguf_file::parse(tiny_model_bytes(tiny_model_options::jamba()));
    gguf_writer w;
    for (const gguf_kv& kv : f.metadata()) {
        if (!edit(kv.key, w)) continue;
        const gguf_value& v = kv.value;
        if (const auto* u = std::get_if<uint64_t>(&v.value))
            w.set_u32(kv.key, static_cast<uint32_t>(*u));
        else if (const auto* d = std::get_if<double>(&v.value))
            w.set_f32(kv.key, static_cast<float>(*d));
        else if (const auto* b = std::get_if<bool>(&v.value))
            w.set_bool(kv.key, *b);
        else if (const auto* t = std::get_if<std::string>(&v.value))
            w.set_string(kv.key, *t);
        else if (const auto* ss = std::get_if<std::vector<std::string>>(&v.value))
            w.set_string_array(kv.key, *ss);
        else if (const auto* a = std::get_if<gguf_array>(&v.value)) {
            if (a->elem_type == gguf_type::f32) {
                const auto fs_ = a->floats();
                w.set_f32_array(kv.key, std::vector<float>(fs_.begin(), fs_.end()));
            } else if (a->elem_type == gguf_type::i32) {
                const auto is = a->ints();
                w.set_i32_array(kv.key, std::vector<int32_t>(is.begin(), is.end()));
            } else {
                const auto us = a->uints();
                w.set_u32_array(kv.key, std::vector<uint32_t>(us.begin(), us.end()));
            }
        }
    }
    for (const gguf_tensor_info& t : f.tensors()) {
        if (!keep(t, w)) continue;
        const auto* p = reinterpret_cast<const uint8_t*>(t.data);
        w.add_tensor(t.name, t.ne, t.ggml_type, std::vector<uint8_t>(p, p + t.n_bytes));
    }
    const auto path = (fs::temp_directory_path() / fmt::format("kvc-rt-bad-{}.gguf", ::getpid())).string();
    w.write(path);
    try {
        model::load(path);
        ADD_FAILURE() << "loaded; expected an error naming " << what;
    } catch (const error& e) {
        EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
    fs::remove(path);
}

TEST(runtime_recurrent, bad_models_are_refused_naming_what_is_wrong) {
    const auto all_keys = [](std::string_view, gguf_writer&) { return true; };
    const auto all_tensors = [](const gguf_tensor_info&, gguf_writer&) { return true; };
    // a missing tensor, a tensor of the wrong shape
    expect_refused(
        all_keys, [](const gguf_tensor_info& t, gguf_writer&) { return t.name != "blk.2.ssm_a"; },
        "tensor 'blk.2.ssm_a' is missing");
    expect_refused(
        all_keys,
        [](const gguf_tensor_info& t, gguf_writer& w) {
            if (t.name != "blk.0.ssm_dt_norm.weight") return true;
            w.add_tensor(t.name, {5}, 0, std::vector<uint8_t>(20));
            return false;
        },
        "tensor 'blk.0.ssm_dt_norm.weight' is [5], expected [4]");
    // a missing key, mixture-of-experts, Mamba-2 groups
    expect_refused([](std::string_view k, gguf_writer&) { return k != "jamba.ssm.state_size"; }, all_tensors,
                   "key 'jamba.ssm.state_size' is missing");
    expect_refused(
        [](std::string_view k, gguf_writer& w) {
            if (k == "jamba.ssm.time_step_rank") w.set_u32("jamba.expert_count", 16);
            return true;
        },
        all_tensors, "mixture-of-experts");
    expect_refused(
        [](std::string_view k, gguf_writer& w) {
            if (k == "jamba.ssm.time_step_rank") w.set_u32("jamba.ssm.group_count", 1);
            return true;
        },
        all_tensors, "Mamba-2");
    expect_refused(
        all_keys,
        [](const gguf_tensor_info& t, gguf_writer& w) {
            if (t.name == "blk.1.ffn_norm.weight")
                w.add_tensor("blk.1.ffn_gate_inp.weight", {32, 4}, 0, std::vector<uint8_t>(512));
            return true;
        },
        "mixture-of-experts");
    // head_count_kv with a value per layer for another layer count
    expect_refused(
        [](std::string_view k, gguf_writer& w) {
            if (k != "jamba.attention.head_count_kv") return true;
            w.set_u32_array(k, {0, 2, 0});
            return false;
        },
        all_tensors, "key 'jamba.attention.head_count_kv' has 3 values for 4 layers");
}

}  // namespace
}  // namespace kvc
