// The threading contract (docs/c-api.md, "Threads"): read-only calls on one memory may run on several
// threads at once (const member functions in C++, functions taking a `const kvc_memory*` in C), one writer
// at a time, and different memories freely. Readers on several threads must see exactly what one thread
// sees. CI runs these tests under ThreadSanitizer (the `tsan` preset), which reports any data race.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <kvcache/disk_store.h>
#include <kvcache/kv_cache.h>
#include <kvcache/kvcache.h>
#include <kvcache/kvcache_state.h>
#include <kvcache/session.h>
#include <kvcache/state.h>

#include "state_test_util.h"

namespace kvc {
namespace {

using namespace kvc::test;
namespace fs = std::filesystem;

constexpr int n_threads = 4;
constexpr int n_rounds = 25;

// Runs reader(thread index) on n_threads threads at once, n_rounds times each, and collects what each
// round returned; every result must equal what one thread saw alone.
void readers_agree(const std::function<std::string(int)>& reader, const std::string& what) {
    const std::string alone = reader(n_threads);
    std::vector<std::vector<std::string>> seen(n_threads);
    std::vector<std::thread> threads;
    threads.reserve(n_threads);
    for (int t = 0; t < n_threads; ++t)
        threads.emplace_back([&, t] {
            for (int r = 0; r < n_rounds; ++r) seen[t].push_back(reader(t));
        });
    for (std::thread& th : threads) th.join();
    for (int t = 0; t < n_threads; ++t)
        for (int r = 0; r < n_rounds; ++r)
            ASSERT_EQ(seen[t][r], alone) << what << ": thread " << t << ", round " << r;
}

std::string text(const std::vector<uint8_t>& b) {
    return {b.begin(), b.end()};
}

// What an engine reads from a cache between its writes: positions, the layout, the whole state and each
// sequence's, stored rows, the pictures of the cells, a mask of the current ubatch.
std::string read_everything(const kv_cache& c, const kv_cache_context& kc) {
    std::string out = c.state_layout();
    for (seq_id_t s = 0; s < static_cast<seq_id_t>(c.params().n_seq_max); ++s) {
        out += fmt::format(" {}:[{},{}]", s, c.seq_pos_min(s), c.seq_pos_max(s));
        out += text(state_seq_get_data(c, s));
    }
    out += text(state_seq_get_data(c, seq_all));
    const uint32_t n_streams = c.params().unified ? 1 : c.params().n_seq_max;
    for (uint32_t s = 0; s < n_streams; ++s) out += c.cells(s).picture();
    std::vector<float> row(64);
    c.read_row(kv_part::k, 0, 0, 0, std::span(row).first(64));
    out.append(reinterpret_cast<const char*>(row.data()), 64 * sizeof(float));
    const size_t n = kc.kq_mask_elements();
    std::vector<float> mask(n);
    kc.set_input_kq_mask(tensor_view::contiguous(dtype::f32, reinterpret_cast<std::byte*>(mask.data()),
                                                 static_cast<int64_t>(n)));
    out.append(reinterpret_cast<const char*>(mask.data()), n * sizeof(float));
    return out;
}

TEST(threading, readers_of_one_cache_see_what_one_thread_sees) {
    for (const bool unified : {true, false})
        for (const bool prefix : {false, true}) {
            if (prefix && !unified) continue;
            auto p = params_for(dtype::f16, dtype::q8_0, false, unified);
            p.layers[1].n_embd_head_v = 64;
            if (prefix) {
                p.prefix.enabled = true;
                p.prefix.block_size = 4;
            }
            kv_cache c(p);
            std::mt19937 rng(3);
            decode(c, 0, 0, 9, rng);
            decode(c, 1, 0, 5, rng);
            decode(c, 2, 3, 4, rng);
            // the current ubatch of an applied context: its mask is read by every thread
            auto ctx = c.init_ubatches({make_ub({4, 5}, 1)}, {});
            ASSERT_EQ(ctx->get_status(), memory_status::success);
            ctx->apply();
            const kv_cache_context& kc = *ctx->get_attn(0);
            readers_agree([&](int) { return read_everything(c, kc); },
                          fmt::format("unified={} prefix={}", unified, prefix));
        }
}

// Saves are readers of the memory: several threads save one memory into their own files at once.
TEST(threading, saves_of_one_memory_from_several_threads_write_the_same_bytes) {
    const fs::path dir = fs::temp_directory_path() / fmt::format("kvc-threads-{}", ::getpid());
    fs::create_directories(dir);
    kv_cache c(params_for(dtype::f16, dtype::f16, true, true));
    std::mt19937 rng(4);
    decode(c, 0, 0, 6, rng);
    decode(c, 3, 0, 2, rng);
    readers_agree(
        [&](int t) {
            const std::string f = (dir / fmt::format("t{}.kvc", t)).string();
            const std::string g = (dir / fmt::format("t{}.ggsq", t)).string();
            session_save_options o;
            o.compress = t % 2 == 0;
            save_file(c, f, seq_all, o);
            save_llama_seq_file(c, g, 0, {});
            std::vector<uint8_t> payload;
            read_session(read_file_bytes(f), &payload);  // compressed or not: the same payload
            return text(payload) + text(read_file_bytes(g));
        },
        "saves");
    fs::remove_all(dir);
}

// The C API's readers: every function taking a const kvc_memory*.
TEST(threading, c_api_readers_of_one_memory_see_what_one_thread_sees) {
    std::vector<kvc_layer_desc> layers(2, kvc_layer_desc_default());
    for (auto& l : layers) l.n_embd_head_k = l.n_embd_head_v = 32;
    kvc_kv_cache_params p = kvc_kv_cache_default_params();
    p.layers = layers.data();
    p.n_layers = layers.size();
    p.kv_size = 64;
    p.n_seq_max = 2;
    p.n_kv_pad = 1;
    kvc_memory* m = nullptr;
    ASSERT_EQ(kvc_kv_cache_create(&p, &m), KVC_OK);
    kvc_batch* b = kvc_batch_init(7, 0, 1);
    for (int32_t i = 0; i < 7; ++i) {
        const int32_t s = i % 2;
        ASSERT_EQ(kvc_batch_add(b, i, i / 2, &s, 1, i == 6), KVC_OK);
    }
    kvc_memory_context* ctx = nullptr;
    ASSERT_EQ(kvc_memory_init_batch(m, b, 8, false, &ctx), KVC_OK);
    ASSERT_EQ(kvc_memory_context_apply(ctx), KVC_OK);
    kvc_memory_context_free(ctx);
    kvc_batch_free(b);
    ASSERT_EQ(kvc_memory_seq_add(m, 0, 1, -1, 2), KVC_OK);  // a pending shift for the K-shift input
    const kvc_memory* reader = m;
    readers_agree(
        [&](int) {
            std::string out;
            for (int32_t s = 0; s < 2; ++s) {
                int32_t lo = 0, hi = 0;
                size_t n = 0;
                EXPECT_EQ(kvc_memory_seq_pos_min(reader, s, &lo), KVC_OK);
                EXPECT_EQ(kvc_memory_seq_pos_max(reader, s, &hi), KVC_OK);
                EXPECT_EQ(kvc_state_seq_get_size(reader, s, 0, &n), KVC_OK);
                std::vector<uint8_t> st(n);
                EXPECT_EQ(kvc_state_seq_get_data(reader, s, st.data(), st.size(), nullptr, 0), KVC_OK);
                out += fmt::format("{}:[{},{}]", s, lo, hi) + text(st);
            }
            bool can = false;
            kvc_memory_kind kind{};
            EXPECT_EQ(kvc_memory_can_shift(reader, &can), KVC_OK);
            EXPECT_EQ(kvc_memory_get_kind(reader, &kind), KVC_OK);
            const int64_t n_shift = kvc_memory_k_shift_elements(reader, 0);
            EXPECT_GT(n_shift, 0);
            std::vector<int32_t> shift(static_cast<size_t>(n_shift));
            EXPECT_EQ(kvc_memory_set_input_k_shift(reader, 0, shift.data(), shift.size()), KVC_OK);
            out += fmt::format(" {} {} ", can, static_cast<int>(kind));
            out.append(reinterpret_cast<const char*>(shift.data()), shift.size() * sizeof(int32_t));
            // a failure on one thread leaves its message on that thread only
            int32_t x = 0;
            EXPECT_NE(kvc_memory_seq_pos_max(reader, 99, &x), KVC_OK);
            out += kvc_last_error();
            return out;
        },
        "C API readers");
    kvc_memory_free(m);
}

// Different memories are independent: each thread decodes into its own cache while the others do.
TEST(threading, different_memories_are_used_from_different_threads_freely) {
    std::vector<std::string> got(n_threads);
    std::vector<std::thread> threads;
    threads.reserve(n_threads);
    const auto run = [](int t) {
        kv_cache c(params_for(dtype::q8_0, dtype::f16, true, t % 2 == 0));
        std::mt19937 rng(static_cast<unsigned>(10 + t));
        decode(c, 0, 0, 5, rng);
        decode(c, 1, 0, 3, rng);
        c.seq_rm(0, 2, 4);
        c.seq_add(1, 0, -1, 3);
        c.update();
        return text(state_seq_get_data(c, seq_all));
    };
    for (int t = 0; t < n_threads; ++t) threads.emplace_back([&, t] { got[t] = run(t); });
    for (std::thread& th : threads) th.join();
    for (int t = 0; t < n_threads; ++t) EXPECT_EQ(got[t], run(t)) << "thread " << t;
}

// Caches on four threads share one disk store, each writing it from its own writer thread (async_writes)
// while its engine thread evicts and reads the counters: every record reaches the store.
TEST(threading, caches_sharing_a_store_write_it_from_their_writer_threads) {
    const fs::path dir = fs::temp_directory_path() / fmt::format("kvc-threading-tier-{}", ::getpid());
    fs::remove_all(dir);
    disk_store_params dp;
    dp.dir = dir.string();
    const auto store = std::make_shared<disk_block_store>(dp);
    std::vector<uint64_t> written(n_threads);
    const auto run = [&](int t) {
        kv_cache_params p = params_for(dtype::f16, dtype::f16, false, true, 1);
        p.prefix = {.enabled = true, .block_size = 4};
        p.prefix.tiers = {
            .stores = {store}, .model_id = static_cast<uint64_t>(t), .write = tier_write::on_evict};
        p.prefix.tiers.async_writes = true;
        kv_cache c(p);
        for (int round = 0; round < n_rounds; ++round) {  // 16 new tokens a round in 64 cells: evictions
            std::vector<pos_t> pos(16);
            for (size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<pos_t>(i);
            ubatch ub = make_ub(pos, 0);
            for (int i = 0; i < 16; ++i) ub.token.push_back(static_cast<token_t>(round * 16 + i));
            auto ctx = c.init_ubatches({ub}, {});
            ASSERT_EQ(ctx->get_status(), memory_status::success);
            ctx->apply();
            c.prefix_cache()->prefix_publish();
            c.seq_rm(0, -1, -1);
            (void)c.prefix_cache()->get_tier_stats();  // while the writer thread writes
        }
        c.prefix_cache()->prefix_tier_drain();
        written[static_cast<size_t>(t)] = c.prefix_cache()->get_tier_stats()[0].written_blocks;
    };
    std::vector<std::thread> threads;
    for (int t = 0; t < n_threads; ++t) threads.emplace_back([&, t] { run(t); });
    for (std::thread& th : threads) th.join();
    uint64_t total = 0;
    for (int t = 0; t < n_threads; ++t) {
        EXPECT_GT(written[static_cast<size_t>(t)], 0u) << "thread " << t;
        total += written[static_cast<size_t>(t)];
    }
    EXPECT_EQ(store->stats().puts, total);
    EXPECT_EQ(store->stats().errors, 0u);
    fs::remove_all(dir);
}

}  // namespace
}  // namespace kvc
