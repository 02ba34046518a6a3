// Out-of-memory injection: this binary replaces the global operator new with one that counts allocations
// and, when armed, throws std::bad_alloc at the Nth (counting_new.h). Every allocation of a state load (from
// a buffer, from session and 'ggsq' files, through C++ and the C API), of a batch (batch storage,
// kvc_batch_init, the batch allocator) and of a placement (init_batch, then each ubatch's apply) fails in
// turn. After each: a clean error (std::bad_alloc or kvc::error(out_of_memory) in C++, KVC_ERR_OUT_OF_MEMORY
// in C) and the memory exactly as before (every stream's cells, heads, every sequence's positions, the whole
// state with its K/V bytes).
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <new>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <kvcache/batch.h>
#include <kvcache/kv_cache.h>
#include <kvcache/kv_cache_iswa.h>
#include <kvcache/kvcache.h>
#include <kvcache/kvcache_state.h>
#include <kvcache/memory_hybrid.h>
#include <kvcache/memory_recurrent.h>
#include <kvcache/session.h>
#include <kvcache/state.h>

#include "counting_new.h"
#include "memory_test_util.h"
#include "state_test_util.h"

namespace kvc {
namespace {

using namespace kvc::test;
namespace fs = std::filesystem;

// Arms the counter for its lifetime: allocation `at` fails (0: only counts).
class oom_at {
public:
    explicit oom_at(uint64_t at) {
        g_count = 0;
        g_failed = false;
        g_fail_at = at == 0 ? UINT64_MAX : at;
    }
    ~oom_at() { g_fail_at = 0; }
    oom_at(const oom_at&) = delete;
    oom_at& operator=(const oom_at&) = delete;
    static uint64_t count() { return g_count; }
    static bool failed() { return g_failed; }
};

// Runs f with the injection paused (the test's own checks allocate).
template <class F>
auto unarmed(const F& f) {
    struct pause {
        uint64_t at = g_fail_at;
        pause() { g_fail_at = 0; }
        ~pause() { g_fail_at = at; }
        pause(const pause&) = delete;
        pause& operator=(const pause&) = delete;
    } p;
    return f();
}

// Everything observable of a cache, as text: cells and heads of every stream, every sequence's positions,
// the whole state (positions, sequences, K/V bytes).
std::string observe(const kv_cache& c) {
    std::string out;
    const uint32_t n_streams = c.params().unified ? 1 : c.params().n_seq_max;
    for (uint32_t s = 0; s < n_streams; ++s)
        out += fmt::format("stream {} head {} used {}: {}\n", s, c.head(s), c.cells(s).get_used(),
                           c.cells(s).picture());
    for (seq_id_t q = 0; q < static_cast<seq_id_t>(c.params().n_seq_max); ++q)
        out += fmt::format("seq {}: [{}, {}]\n", q, c.seq_pos_min(q), c.seq_pos_max(q));
    const auto state = state_seq_get_data(c, seq_all);
    const std::string_view bytes(reinterpret_cast<const char*>(state.data()), state.size());
    out += fmt::format("state: {} bytes, hash {:016x}\n", state.size(), std::hash<std::string_view>{}(bytes));
    return out;
}

// The outcome of one operation under an armed allocation.
enum class outcome { done, out_of_memory };

// Runs op with allocation n failing; a failure must be out of memory and nothing else.
outcome run_failing(uint64_t n, const std::function<void()>& op, const std::string& where, bool* reached) {
    const oom_at arm(n);
    outcome o = outcome::done;
    std::string other;
    try {
        op();
    } catch (const std::bad_alloc&) {
        o = outcome::out_of_memory;
    } catch (const error& e) {
        if (e.code() == errc::out_of_memory)
            o = outcome::out_of_memory;
        else
            other = e.what();
    }
    *reached = oom_at::failed();
    g_fail_at = 0;
    if (!other.empty()) ADD_FAILURE() << where << ": not an out-of-memory error: " << other;
    return o;
}

// Counts the allocations of op on a fresh memory, then fails each in turn on another fresh memory: after a
// failure the memory is as before; when op succeeds anyway it gives what it gives without a failure.
// Returns the number of failures injected.
// transactional: op is one call (a placement of several ubatches keeps those applied before a failure and
// checks each call itself).
uint64_t each_allocation_fails(const std::string& name,
                               const std::function<std::unique_ptr<kv_cache>()>& make,
                               const std::function<void(kv_cache&)>& op, bool transactional = true) {
    std::string after_success;
    uint64_t total = 0;
    {
        auto c = make();
        {
            const oom_at counting(0);
            op(*c);
            total = oom_at::count();
        }
        after_success = observe(*c);
    }
    EXPECT_GT(total, 0u) << name;
    uint64_t injected = 0;
    for (uint64_t n = 1; n <= total; ++n) {
        const std::string where = fmt::format("{}: allocation {} of {}", name, n, total);
        auto c = make();
        const std::string before = observe(*c);
        bool reached = false;
        const outcome o = run_failing(
            n, [&] { op(*c); }, where, &reached);
        if (!reached) continue;
        ++injected;
        if (o == outcome::out_of_memory && transactional)
            EXPECT_EQ(observe(*c), before) << where << ": the memory changed";
        else if (o == outcome::out_of_memory)
            continue;
        else
            EXPECT_EQ(observe(*c), after_success) << where << ": succeeded with another result";
    }
    return injected;
}

kv_cache_params small(bool unified, bool prefix = false) {
    auto p = params_for(dtype::f16, dtype::q8_0, false, unified);
    p.layers[1].n_embd_head_v = 64;
    p.kv_size = 32;
    if (prefix) {
        p.prefix.enabled = true;
        p.prefix.block_size = 4;
    }
    return p;
}

// A cache with content: seq 0 (6 tokens), seq 1 (4 tokens), seq 2 (3 tokens from position 2).
std::unique_ptr<kv_cache> filled(bool unified, bool prefix = false) {
    auto c = std::make_unique<kv_cache>(small(unified, prefix));
    std::mt19937 rng(7);
    decode(*c, 0, 0, 6, rng);
    decode(*c, 1, 0, 4, rng);
    decode(*c, 2, 2, 3, rng);
    return c;
}

class out_of_memory : public ::testing::Test {
protected:
    void TearDown() override {
        std::printf("%s: %llu allocations failed in turn\n",
                    ::testing::UnitTest::GetInstance()->current_test_info()->name(),
                    static_cast<unsigned long long>(injected_));
        RecordProperty("injected_faults", static_cast<int>(injected_));
    }
    uint64_t injected_ = 0;
};

TEST_F(out_of_memory, every_allocation_of_a_state_load_fails_in_turn_and_the_memory_is_unchanged) {
    const std::string dir = (fs::temp_directory_path() / fmt::format("kvc-oom-{}", ::getpid())).string();
    fs::create_directories(dir);
    for (const bool unified : {true, false}) {
        const auto src = filled(unified);
        const auto seq1 = state_seq_get_data(*src, 1);
        const auto all = state_seq_get_data(*src, seq_all);
        const std::string plain = dir + "/plain.kvc", zstd = dir + "/zstd.kvc", ggsq = dir + "/s.ggsq";
        save_file(*src, plain, 1);
        session_save_options o;
        o.compress = true;
        const std::vector<token_t> tokens = {4, 5, 6};
        o.tokens = tokens;
        save_file(*src, zstd, seq_all, o);
        save_llama_seq_file(*src, ggsq, 1, tokens);
        // the destination holds other content, so that a partial load would show
        const auto dest = [unified] {
            auto c = std::make_unique<kv_cache>(small(unified));
            std::mt19937 rng(9);
            decode(*c, 3, 0, 5, rng);
            decode(*c, 2, 0, 2, rng);
            return c;
        };
        const std::string u = unified ? "unified" : "split";
        if (unified) {  // into a cache with the prefix cache on
            const auto dest_prefix = [] {
                auto c = std::make_unique<kv_cache>(small(true, true));
                std::mt19937 rng(9);
                decode(*c, 3, 0, 5, rng);
                return c;
            };
            injected_ += each_allocation_fails("prefix buffer seq", dest_prefix,
                                               [&](kv_cache& c) { state_seq_set_data(c, seq1, 2); });
            injected_ += each_allocation_fails("prefix buffer all", dest_prefix,
                                               [&](kv_cache& c) { state_seq_set_data(c, all, seq_all); });
        }
        injected_ += each_allocation_fails(u + " buffer seq", dest,
                                           [&](kv_cache& c) { state_seq_set_data(c, seq1, 2); });
        injected_ += each_allocation_fails(u + " buffer all", dest,
                                           [&](kv_cache& c) { state_seq_set_data(c, all, seq_all); });
        injected_ +=
            each_allocation_fails(u + " session file", dest, [&](kv_cache& c) { load_file(c, plain, 2); });
        injected_ += each_allocation_fails(u + " zstd session file", dest,
                                           [&](kv_cache& c) { load_file(c, zstd, seq_all); });
        injected_ += each_allocation_fails(u + " ggsq file", dest,
                                           [&](kv_cache& c) { (void)load_llama_seq_file(c, ggsq, 2); });
    }
    fs::remove_all(dir);
    EXPECT_GT(injected_, 100u);
}

// The recurrent, iSWA and hybrid memories: every allocation of a state restore (one sequence, the whole
// memory, the partial-only part of a composite) fails in turn and leaves the memory as it was (every
// sequence's positions, the whole state).
TEST_F(out_of_memory, every_allocation_of_a_restore_into_the_other_memories_fails_in_turn) {
    constexpr uint32_t n_seq = 3;
    const auto observe_memory = [](const memory_i& m) {
        std::string out;
        for (seq_id_t q = 0; q < static_cast<seq_id_t>(n_seq); ++q)
            out += fmt::format("seq {}: [{}, {}]\n", q, m.seq_pos_min(q), m.seq_pos_max(q));
        const auto state = state_seq_get_data(m, seq_all);
        out += fmt::format("state: {} bytes, hash {:016x}\n", state.size(),
                           std::hash<std::string_view>{}(
                               std::string_view(reinterpret_cast<const char*>(state.data()), state.size())));
        return out;
    };
    kv_cache_params attn;
    for (uint32_t il = 0; il < 4; ++il)
        attn.layers.push_back(layer_desc{.n_head_kv = 1,
                                         .n_embd_head_k = 32,
                                         .n_embd_head_v = 32,
                                         .is_swa = il == 3,
                                         .has_kv = il % 2 == 1});
    attn.kv_size = 32;
    attn.n_seq_max = n_seq;
    attn.v_trans = false;
    recurrent_params recr;
    for (uint32_t il = 0; il < 4; ++il)
        recr.layers.push_back(il % 2 == 0 ? recurrent_layer_desc{.n_embd_r = 4, .n_embd_s = 8}
                                          : recurrent_layer_desc{});
    recr.n_seq_max = n_seq;
    recr.n_rs_seq = 1;
    kv_cache_iswa_params iswa;
    iswa.kv = attn;
    for (auto& l : iswa.kv.layers) l.has_kv = true;
    iswa.kv.n_swa = 4;
    iswa.kv.swa = swa_type::standard;
    iswa.sizing = {.swa_full = false, .n_ubatch = 4};
    memory_hybrid_params hybrid{.attn = attn, .recr = recr, .iswa = std::nullopt, .prefix = {}};
    for (auto& l : hybrid.attn.layers) l.is_swa = false;
    memory_hybrid_params hybrid_iswa{.attn = attn, .recr = recr, .iswa = iswa.sizing, .prefix = {}};
    hybrid_iswa.attn.n_swa = 4;
    hybrid_iswa.attn.swa = swa_type::standard;

    const std::vector<std::pair<std::string, std::function<std::unique_ptr<memory_i>()>>> kinds = {
        {"recurrent", [&] { return std::make_unique<memory_recurrent>(recr); }},
        {"iswa", [&] { return std::make_unique<kv_cache_iswa>(iswa); }},
        {"hybrid", [&] { return std::make_unique<memory_hybrid>(hybrid); }},
        {"hybrid iswa", [&] { return std::make_unique<memory_hybrid>(hybrid_iswa); }},
    };
    // fills through placements, K/V rows of every attention layer written (values of the sequence, the
    // position and `salt`, so that rows left over from a failed restore show)
    const auto fill = [&](memory_i& m, const std::vector<test::run>& runs, float salt) {
        for (const test::run& r : runs) {
            const auto ctx = init_runs(m, n_seq, {r}, 4);
            ASSERT_EQ(ctx->get_status(), memory_status::success);
            do {
                ctx->apply();
                const ubatch& ub = ctx->get_ubatch();
                std::vector<float> rows(size_t{32} * ub.n_tokens);
                for (uint32_t t = 0; t < ub.n_tokens; ++t)
                    for (uint32_t d = 0; d < 32; ++d)
                        rows[t * 32 + d] = salt + static_cast<float>(ub.primary_seq(t) * 100 + ub.pos[t] + d);
                const auto view = const_tensor_view::contiguous(
                    dtype::f32, reinterpret_cast<const std::byte*>(rows.data()), 32, ub.n_tokens);
                for (uint32_t il = 0; il < 4; ++il)
                    if (kv_cache_context* a = ctx->get_attn(il)) {
                        a->cpy_k(il, view);
                        a->cpy_v(il, view);
                    }
            } while (ctx->next());
        }
    };
    for (const auto& [name, make] : kinds) {
        auto src = make();
        fill(*src, {{0, 0, 6}, {1, 0, 3}}, 0.5f);
        const auto dest = [&, make = make] {
            auto m = make();
            fill(*m, {{2, 0, 5}, {1, 0, 2}}, 0.25f);
            return m;
        };
        for (const state_seq_flags flags : {state_seq_flags{0}, state_seq_flag_partial_only}) {
            if (flags && name == "recurrent") continue;
            for (const seq_id_t s : {seq_id_t{0}, seq_all}) {
                const auto buffer = state_seq_get_data(*src, s, flags);
                const std::string what =
                    fmt::format("{} {} {}", name, s == seq_all ? "all" : "seq", flags ? "partial" : "full");
                uint64_t total = 0;
                std::string after_success;
                {
                    auto m = dest();
                    {
                        const oom_at counting(0);
                        state_seq_set_data(*m, buffer, s == seq_all ? seq_all : 1, flags);
                        total = oom_at::count();
                    }
                    after_success = observe_memory(*m);
                }
                for (uint64_t n = 1; n <= total; ++n) {
                    auto m = dest();
                    const std::string before = observe_memory(*m);
                    bool reached = false;
                    const outcome o = run_failing(
                        n, [&] { state_seq_set_data(*m, buffer, s == seq_all ? seq_all : 1, flags); },
                        fmt::format("{}: allocation {} of {}", what, n, total), &reached);
                    if (!reached) continue;
                    ++injected_;
                    EXPECT_EQ(observe_memory(*m), o == outcome::out_of_memory ? before : after_success)
                        << what << ": allocation " << n << " of " << total;
                }
            }
        }
    }
    EXPECT_GT(injected_, 100u);
}

// The C API turns every failed allocation into KVC_ERR_OUT_OF_MEMORY with the memory unchanged.
TEST_F(out_of_memory, c_api_loads_batches_and_placements_report_out_of_memory) {
    const std::string dir = (fs::temp_directory_path() / fmt::format("kvc-oom-c-{}", ::getpid())).string();
    fs::create_directories(dir);
    std::vector<kvc_layer_desc> layers(2, kvc_layer_desc_default());
    for (auto& l : layers) l.n_embd_head_k = l.n_embd_head_v = 32;
    kvc_kv_cache_params p = kvc_kv_cache_default_params();
    p.layers = layers.data();
    p.n_layers = layers.size();
    p.kv_size = 64;
    p.n_seq_max = 3;
    p.n_kv_pad = 1;
    const auto create = [&] {
        kvc_memory* m = nullptr;
        EXPECT_EQ(kvc_kv_cache_create(&p, &m), KVC_OK);
        return m;
    };
    const auto state_of = [](const kvc_memory* m) {
        size_t n = 0;
        EXPECT_EQ(kvc_state_seq_get_size(m, KVC_SEQ_ALL, 0, &n), KVC_OK);
        std::vector<uint8_t> b(n);
        EXPECT_EQ(kvc_state_seq_get_data(m, KVC_SEQ_ALL, b.data(), b.size(), nullptr, 0), KVC_OK);
        return b;
    };
    // Places n tokens of seq s from position p0 and applies every ubatch. A failing call must leave the
    // memory as it was before that call (ubatches applied before it stay, as documented).
    const auto place = [&](kvc_memory* m, int32_t s, int32_t p0, int32_t n, uint32_t n_ubatch) -> kvc_status {
        std::vector<uint8_t> before = unarmed([&] { return state_of(m); });
        const auto check = [&](kvc_status st, const char* call) {
            if (st != KVC_OK) unarmed([&] { EXPECT_EQ(state_of(m), before) << call << " changed it"; });
            return st;
        };
        kvc_batch* b = kvc_batch_init(n, 0, 1);
        if (!b) return check(KVC_ERR_OUT_OF_MEMORY, "kvc_batch_init");
        kvc_status st = KVC_OK;
        for (int32_t i = 0; i < n && st == KVC_OK; ++i)
            st = check(kvc_batch_add(b, i, p0 + i, &s, 1, i == n - 1), "kvc_batch_add");
        kvc_memory_context* ctx = nullptr;
        if (st == KVC_OK)
            st = check(kvc_memory_init_batch(m, b, n_ubatch, false, &ctx), "kvc_memory_init_batch");
        kvc_batch_free(b);
        bool more = true;
        while (st == KVC_OK && more) {
            before = unarmed([&] { return state_of(m); });
            st = check(kvc_memory_context_apply(ctx), "kvc_memory_context_apply");
            if (st == KVC_OK) st = check(kvc_memory_context_next(ctx, &more), "kvc_memory_context_next");
        }
        kvc_memory_context_free(ctx);
        return st;
    };
    kvc_memory* src = create();
    ASSERT_EQ(place(src, 0, 0, 7, 8), KVC_OK);
    ASSERT_EQ(place(src, 1, 0, 5, 8), KVC_OK);
    const std::string file = dir + "/c.kvc";
    ASSERT_EQ(kvc_state_seq_save_file(src, file.c_str(), 1, nullptr, 0, true), KVC_OK);
    const auto buffer = [&] {
        size_t n = 0;
        EXPECT_EQ(kvc_state_seq_get_size(src, 0, 0, &n), KVC_OK);
        std::vector<uint8_t> b(n);
        EXPECT_EQ(kvc_state_seq_get_data(src, 0, b.data(), b.size(), nullptr, 0), KVC_OK);
        return b;
    }();

    using op_fn = std::function<kvc_status(kvc_memory*)>;
    const std::vector<std::pair<std::string, op_fn>> ops = {
        {"kvc_state_seq_set_data",
         [&](kvc_memory* m) {
             return kvc_state_seq_set_data(m, buffer.data(), buffer.size(), 2, 0, nullptr);
         }},
        {"kvc_state_seq_load_file",
         [&](kvc_memory* m) { return kvc_state_seq_load_file(m, file.c_str(), 2, nullptr, 0, nullptr); }},
        {"place 9 tokens in ubatches of 4", [&](kvc_memory* m) { return place(m, 2, 0, 9, 4); }},
        {"place 3 tokens after seq 0", [&](kvc_memory* m) { return place(m, 0, 7, 3, 2); }},
    };
    for (const auto& [name, op] : ops) {
        uint64_t total = 0;
        std::vector<uint8_t> after_success;
        {
            kvc_memory* m = create();
            EXPECT_EQ(place(m, 0, 0, 7, 8), KVC_OK);
            {
                const oom_at counting(0);
                EXPECT_EQ(op(m), KVC_OK) << name;
                total = oom_at::count();
            }
            after_success = state_of(m);
            kvc_memory_free(m);
        }
        for (uint64_t n = 1; n <= total; ++n) {
            const std::string where = fmt::format("{}: allocation {} of {}", name, n, total);
            kvc_memory* m = create();
            EXPECT_EQ(place(m, 0, 0, 7, 8), KVC_OK);
            const auto before = state_of(m);
            kvc_status st = KVC_OK;
            bool reached = false;
            {
                const oom_at arm(n);
                st = op(m);
                reached = oom_at::failed();
            }
            if (reached) {
                ++injected_;
                if (st == KVC_OK) {
                    EXPECT_EQ(state_of(m), after_success) << where;
                } else {
                    EXPECT_EQ(st, KVC_ERR_OUT_OF_MEMORY) << where << ": " << kvc_last_error();
                    if (name.rfind("kvc_", 0) == 0) {  // placements compare call by call (place)
                        EXPECT_EQ(state_of(m), before) << where;
                    }
                }
            }
            kvc_memory_free(m);
        }
    }
    kvc_memory_free(src);
    {  // a batch: NULL and the message, never a crash
        const oom_at arm(1);
        EXPECT_EQ(kvc_batch_init(64, 0, 2), nullptr);
        ++injected_;
    }
    EXPECT_NE(std::string(kvc_last_error()).find("out of memory"), std::string::npos) << kvc_last_error();
    fs::remove_all(dir);
}

// Every allocation of batch storage, of the batch allocator's validation and split, and of a placement
// (init_batch, then each ubatch's apply) fails in turn; each failure leaves the memory as before the call.
TEST_F(out_of_memory, every_allocation_of_a_batch_and_a_placement_fails_in_turn) {
    for (const bool unified : {true, false})
        for (const bool prefix : {false, true}) {
            if (prefix && !unified) continue;
            const std::string u = fmt::format("{}{}", unified ? "unified" : "split", prefix ? " prefix" : "");
            const auto make = [=] { return filled(unified, prefix); };
            // what a decode step does, one failing allocation at a time: batch, validation, init_batch, then
            // each apply (the memory is compared before the failing call)
            const auto step = [&](kv_cache& c, seq_id_t s, pos_t p0, int32_t n, uint32_t n_ubatch) {
                std::string before = unarmed([&] { return observe(c); });
                try {
                    batch_storage b = batch::init(n, 0, 2);
                    for (int32_t i = 0; i < n; ++i) {
                        const seq_id_t ids[] = {s};
                        b.add(100 + i, p0 + i, ids, i == n - 1);
                    }
                    batch_allocr a;
                    a.init(b.view(), positions_of(c), {.n_seq_max = c.params().n_seq_max});
                    const auto ctx = c.init_batch(a, n_ubatch, false);
                    if (ctx->get_status() != memory_status::success)
                        throw error(errc::invalid_state, "no room");
                    do {
                        before = unarmed([&] { return observe(c); });
                        ctx->apply();
                    } while (ctx->next());
                } catch (...) {  // the call that failed changed nothing
                    unarmed([&] { EXPECT_EQ(observe(c), before) << "a failed call changed the memory"; });
                    throw;
                }
            };
            injected_ += each_allocation_fails(
                u + " batch of 5 in ubatches of 2", make, [&](kv_cache& c) { step(c, 2, 5, 5, 2); }, false);
            injected_ += each_allocation_fails(
                u + " new sequence of 9 in one ubatch", make, [&](kv_cache& c) { step(c, 3, 0, 9, 16); },
                false);
        }
    EXPECT_GT(injected_, 100u);
}

}  // namespace
}  // namespace kvc
