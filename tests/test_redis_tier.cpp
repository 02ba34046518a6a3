// A Redis tier under fire (docs/tiers.md, "Faults"): two engine instances (caches of the tiny model with
// their own connections) serve requests through a shared redis-server while another thread kills it
// (SIGKILL, with writes in flight) and restarts it, and damages stored values in place. Every request's
// logits are compared with recomputing its whole prompt without a cache: no hit may ever be wrong, and the
// engines never stop serving. Label `redis`; skipped with a message when redis-server is not installed.
#include <atomic>
#include <cmath>
#include <filesystem>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <kvcache/redis/redis_store.h>
#include <kvcache/runtime/runtime.h>
#include <kvcache/runtime/tiny_model.h>

#include "redis_test_util.h"

namespace kvc {
namespace {

using test::redis_server;

struct instance {
    std::shared_ptr<redis_block_store> store;
    std::unique_ptr<kv_cache> cache;
    std::unique_ptr<runtime> rt;
};

TEST(redis_tier, faults_never_make_a_wrong_hit) {
    redis_server server;
    KVC_REQUIRE_REDIS(server);
    const std::string path =
        (std::filesystem::temp_directory_path() / ("kvc-tier-faults-" + std::to_string(::getpid()) + ".gguf"))
            .string();
    write_tiny_model(path, tiny_model_options{});
    const model m = model::load(path);
    std::filesystem::remove(path);
    const auto n_vocab = static_cast<uint32_t>(m.hparams().n_vocab);

    // 24 prompts of 20 to 76 tokens in 6 families that share their first 16 to 48 tokens
    std::mt19937 rng(19);
    std::vector<std::vector<token_t>> prompts;
    for (int f = 0; f < 6; ++f) {
        std::vector<token_t> stem(16 + 8 * static_cast<size_t>(f % 5));
        for (auto& t : stem) t = static_cast<token_t>(rng() % n_vocab);
        for (int i = 0; i < 4; ++i) {
            std::vector<token_t> p = stem;
            for (uint32_t k = 0, n = 4 + rng() % 28; k < n; ++k)
                p.push_back(static_cast<token_t>(rng() % n_vocab));
            prompts.push_back(std::move(p));
        }
    }
    const auto make_instance = [&] {
        instance in;
        redis_store_params rp;
        rp.port = server.port();
        rp.key_prefix = "faults:";
        rp.connect_timeout_ms = 100;
        rp.command_timeout_ms = 200;
        rp.backoff_min_ms = 20;
        rp.backoff_max_ms = 100;
        in.store = std::make_shared<redis_block_store>(rp);
        kv_cache_params p = m.cache_params(128, 1);  // small: requests evict each other's blocks
        p.type_k = p.type_v = dtype::f32;
        p.prefix = {.enabled = true, .block_size = 4};
        p.prefix.tiers = {.stores = {in.store}, .model_id = 0xfa17, .write = tier_write::through};
        in.cache = std::make_unique<kv_cache>(p);
        in.rt = std::make_unique<runtime>(m, *in.cache);
        return in;
    };
    std::vector<instance> engines;
    engines.push_back(make_instance());
    engines.push_back(make_instance());
    kv_cache_params pp = m.cache_params(128, 1);
    pp.type_k = pp.type_v = dtype::f32;
    kv_cache plain(pp);
    runtime plain_rt(m, plain);
    const auto last_logits = [](runtime& rt, std::span<const token_t> toks, pos_t p0) {
        batch_storage b = batch::init(static_cast<int32_t>(toks.size()), 0, 1);
        const seq_id_t ids[1] = {0};
        for (size_t i = 0; i < toks.size(); ++i)
            b.add(toks[i], p0 + static_cast<pos_t>(i), ids, i + 1 == toks.size());
        const decode_result r = rt.decode(b.view());
        EXPECT_EQ(r.status, memory_status::success);
        return r.logits;
    };

    // the faults, from another thread while the engines serve
    std::atomic<bool> done{false};
    std::atomic<int> kills{0}, damaged{0};
    std::thread faulter([&] {
        std::mt19937 frng(7);
        while (!done) {
            std::this_thread::sleep_for(std::chrono::milliseconds(20 + frng() % 60));
            if (frng() % 3 == 0) {
                server.restart();  // SIGKILL, whatever is in flight, and an empty server after
                ++kills;
            } else {  // a stored value damaged in place: one byte of its rows
                const std::string key = server.command({"RANDOMKEY"});
                if (key.empty()) continue;
                server.command({"SETRANGE", key, std::to_string(200 + frng() % 200), "\x5a"});
                ++damaged;
            }
        }
    });
    double worst = 0;
    uint64_t requests = 0;
    const auto serve = [&](instance& in, const std::vector<token_t>& prompt) {
        const uint32_t n = in.cache->prefix_cache()->prefix_attach(0, prompt);
        const std::vector<float> got =
            last_logits(*in.rt, std::span(prompt).subspan(n), static_cast<pos_t>(n));
        in.cache->prefix_cache()->prefix_publish();
        in.cache->seq_rm(0, -1, -1);
        plain.clear(true);
        const std::vector<float> want = last_logits(plain_rt, prompt, 0);
        EXPECT_EQ(got.size(), want.size());
        if (got.size() == want.size()) worst = std::max(worst, relative_diff(got, want));
        ++requests;
    };
    for (int r = 0; r < 600; ++r) serve(engines[rng() % 2], prompts[rng() % prompts.size()]);
    done = true;
    faulter.join();
    // and every value damaged at once: every read is refused, every request still right
    server.restart();
    ASSERT_TRUE(server.ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(150));  // the stores' back-off ends
    for (const auto& p : prompts) serve(engines[0], p);
    std::vector<std::string> keys;
    for (int i = 0; i < 2000; ++i) {
        const std::string key = server.command({"RANDOMKEY"});
        if (key.empty()) break;
        server.command({"SETRANGE", key, "100", "\x5a"});
        ++damaged;
    }
    instance fresh = make_instance();
    for (const auto& p : prompts) serve(fresh, p);

    uint64_t fetched = 0, refused = 0, errors = 0, store_damaged = 0;
    for (const instance* in : {&engines[0], &engines[1], &fresh}) {
        const prefix_tier_stats s = in->cache->prefix_cache()->get_tier_stats()[0];
        fetched += s.fetched_blocks;
        refused += s.refused_blocks;
        errors += s.errors + s.store.errors;
        store_damaged += s.store.damaged;
    }
    std::printf(
        "%llu requests; faults injected: %d kills of redis-server, %d values damaged; %llu blocks hit in "
        "the tier, %llu damaged values refused by the store's check and %llu by the cache, %llu errors; "
        "worst difference from recomputing %.2e\n",
        static_cast<unsigned long long>(requests), kills.load(), damaged.load(),
        static_cast<unsigned long long>(fetched), static_cast<unsigned long long>(store_damaged),
        static_cast<unsigned long long>(refused), static_cast<unsigned long long>(errors), worst);
    EXPECT_LE(worst, logits_tolerance(dtype::f32)) << "a hit gave other logits than recomputing";
    EXPECT_GT(kills.load(), 0);
    EXPECT_GT(fetched, 0u);
    EXPECT_GT(store_damaged + refused, 0u);
    EXPECT_GT(errors, 0u);
}

}  // namespace
}  // namespace kvc
