// redis_block_store (include/kvcache/redis/redis_store.h) against a redis-server each test starts itself
// (tests/redis_test_util.h): round trips, one MGET per get_many, TTLs, damaged and foreign values as misses,
// a server down at start, killed (SIGKILL) mid-run, or stopped (SIGSTOP: a timeout, not a hang). Label
// `redis`; skipped with a message when redis-server is not installed.
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <kvcache/block_record.h>
#include <kvcache/redis/redis_store.h>
#include <kvcache/runtime/runtime.h>
#include <kvcache/runtime/tiny_model.h>

#include "redis_test_util.h"

namespace kvc {
namespace {

using test::redis_server;
using clock_type = std::chrono::steady_clock;

block_layout test_layout(uint64_t model = 1) {
    block_layout l;
    l.model_id = model;
    l.block_size = 4;
    l.layers = {{.il = 0, .n_k = 64, .n_v = 64}, {.il = 1, .n_k = 64, .n_v = 64}};
    return l;
}

struct blocks {
    block_layout layout;
    std::vector<std::string> keys;
    std::vector<std::vector<uint8_t>> values;

    explicit blocks(int n, uint64_t model = 1) : layout(test_layout(model)) {
        for (int i = 0; i < n; ++i) {
            const std::vector<token_t> t{i, i, i + 1, i + 2};
            const block_id id{.key = 3, .hash = block_chain_hash(3, t), .parent_hash = 3, .depth = 0};
            std::vector<uint8_t> rows(layout.row_bytes());
            for (size_t j = 0; j < rows.size(); ++j) rows[j] = static_cast<uint8_t>(j * 7 + i);
            values.push_back(encode_block(layout, id, t, rows));
            keys.push_back(block_key(layout.fingerprint(), id.key, id.hash));
        }
    }
    std::vector<block_put> puts() const {
        std::vector<block_put> out;
        for (size_t i = 0; i < keys.size(); ++i) out.push_back({keys[i], values[i]});
        return out;
    }
};

redis_store_params params_for(int port, const blocks& b) {
    redis_store_params p;
    p.port = port;
    p.key_prefix = "test:";
    p.connect_timeout_ms = 200;
    p.command_timeout_ms = 300;
    p.backoff_min_ms = 50;
    p.backoff_max_ms = 200;
    p.check = block_value_check(b.layout);
    return p;
}

double seconds_since(clock_type::time_point t0) {
    return std::chrono::duration<double>(clock_type::now() - t0).count();
}

// Collects what kvcache logs while it lives.
struct log_capture {
    static std::vector<std::string>& lines() {
        static std::vector<std::string> l;
        return l;
    }
    log_capture() {
        lines().clear();
        set_log_callback([](log_level, const char* m, void*) { lines().emplace_back(m); });
    }
    ~log_capture() { set_log_callback(nullptr); }
    log_capture(const log_capture&) = delete;
    log_capture& operator=(const log_capture&) = delete;
};

TEST(redis_store, round_trip_in_one_round_trip_per_call) {
    redis_server server;
    KVC_REQUIRE_REDIS(server);
    const blocks b(8);
    redis_block_store s(params_for(server.port(), b));
    EXPECT_FALSE(s.connected());  // lazily
    s.put_many(b.puts());
    EXPECT_EQ(server.command({"EXISTS", "test:" + b.keys[3]}), "1");  // the prefix is applied
    std::vector<std::string> ask = b.keys;
    ask.insert(ask.begin() + 2, "absent-1");
    ask.push_back("absent-2");
    const long mget_before = server.calls("mget");
    const auto got = s.get_many(ask);
    EXPECT_EQ(server.calls("mget"), mget_before + 1);  // ten keys, one MGET
    EXPECT_EQ(server.calls("get"), 0);
    ASSERT_EQ(got.size(), 10u);
    EXPECT_TRUE(got[2].empty());
    EXPECT_TRUE(got[9].empty());
    for (size_t i = 0; i < 8; ++i) EXPECT_EQ(got[i < 2 ? i : i + 1], b.values[i]) << i;
    EXPECT_EQ(s.contains_many(std::vector<std::string>{b.keys[0], "absent"}), (std::vector<uint8_t>{1, 0}));
    const block_store_stats st = s.stats();
    EXPECT_EQ(st.lookups, 10u);
    EXPECT_EQ(st.hits, 8u);
    EXPECT_EQ(st.puts, 8u);
    EXPECT_EQ(st.round_trips, 3u);  // the SET pipeline, the MGET, the EXISTS pipeline
    EXPECT_EQ(st.calls, 3u);
    EXPECT_EQ(st.bytes_out, 8 * b.values[0].size());
    EXPECT_EQ(st.bytes_in, st.bytes_out);
    EXPECT_EQ(st.errors, 0u);
    EXPECT_EQ(s.describe(), "redis:127.0.0.1:" + std::to_string(server.port()));
    // a second store (another engine process) sees the same blocks
    redis_block_store other(params_for(server.port(), b));
    EXPECT_EQ(other.get_many(std::vector{b.keys[5]})[0], b.values[5]);
}

TEST(redis_store, ttl) {
    redis_server server;
    KVC_REQUIRE_REDIS(server);
    const blocks b(2);
    redis_store_params p = params_for(server.port(), b);
    p.ttl_seconds = 100;
    redis_block_store s(p);
    s.put_many(b.puts());
    const long ttl = std::stol(server.command({"TTL", "test:" + b.keys[0]}));
    EXPECT_GT(ttl, 90);
    EXPECT_LE(ttl, 100);
    p.ttl_seconds = 0;
    p.key_prefix = "other:";
    redis_block_store forever(p);
    forever.put_many(b.puts());
    EXPECT_EQ(server.command({"TTL", "other:" + b.keys[0]}), "-1");  // no expiry
}

TEST(redis_store, damaged_and_foreign_values_are_misses) {
    redis_server server;
    KVC_REQUIRE_REDIS(server);
    const blocks b(3), foreign(1, /*model=*/2);
    redis_block_store s(params_for(server.port(), b));
    s.put_many(b.puts());
    std::string damaged(b.values[0].begin(), b.values[0].end());
    damaged[100] ^= 1;
    server.command({"SET", "test:" + b.keys[0], damaged});
    server.command(
        {"SET", "test:" + b.keys[1], std::string(b.values[2].begin(), b.values[2].end())});  // 2's value
    server.command(
        {"SET", "test:" + foreign.keys[0], std::string(foreign.values[0].begin(), foreign.values[0].end())});
    const auto got = s.get_many(std::vector{b.keys[0], b.keys[1], b.keys[2], foreign.keys[0]});
    EXPECT_TRUE(got[0].empty());
    EXPECT_TRUE(got[1].empty());
    EXPECT_EQ(got[2], b.values[2]);
    EXPECT_TRUE(got[3].empty());  // a valid record of another model's layout
    EXPECT_EQ(s.stats().damaged, 3u);
    EXPECT_EQ(s.stats().hits, 1u);
    EXPECT_EQ(s.stats().errors, 0u);
    EXPECT_TRUE(s.connected());
}

TEST(redis_store, server_down_at_start_then_up) {
    if (!test::have_redis_server()) GTEST_SKIP() << "no redis-server on PATH (apt-get install redis-server)";
    const blocks b(2);
    const int port = test::free_port();  // nothing listens there
    const log_capture logs;
    redis_block_store s(params_for(port, b));
    const auto t0 = clock_type::now();
    for (int i = 0; i < 5; ++i) {
        EXPECT_TRUE(s.get_many(b.keys)[0].empty());
        s.put_many(b.puts());
    }
    EXPECT_LT(seconds_since(t0), 1.0);  // refused at once, then within the back-off no attempt at all
    EXPECT_EQ(s.stats().errors, 10u);
    EXPECT_EQ(s.stats().hits, 0u);
    ASSERT_EQ(logs.lines().size(), 1u);  // once, not per call
    EXPECT_NE(logs.lines()[0].find("cannot connect"), std::string::npos) << logs.lines()[0];
    redis_server server(port);
    KVC_REQUIRE_REDIS(server);
    std::this_thread::sleep_for(std::chrono::milliseconds(250));  // past the longest back-off
    s.put_many(b.puts());
    EXPECT_EQ(s.get_many(b.keys)[1], b.values[1]);
    ASSERT_EQ(logs.lines().size(), 2u);
    EXPECT_NE(logs.lines()[1].find("answering again"), std::string::npos);
}

TEST(redis_store, server_killed_mid_run) {
    redis_server server;
    KVC_REQUIRE_REDIS(server);
    const blocks b(4);
    redis_block_store s(params_for(server.port(), b));
    s.put_many(b.puts());
    ASSERT_EQ(s.get_many(b.keys)[0], b.values[0]);
    server.kill9();
    // the connection is dead: writes hit a closed socket, the second write of a large value gets EPIPE
    // (and no SIGPIPE kills the engine), reads find nothing
    const std::vector<uint8_t> big(size_t{8} << 20, 1);
    s.put_many(std::vector{block_put{"big", big}});
    EXPECT_FALSE(s.connected());
    s.put_many(b.puts());
    EXPECT_TRUE(s.get_many(b.keys)[0].empty());
    EXPECT_GE(s.stats().errors, 2u);
    EXPECT_FALSE(s.connected());
    server.restart();  // same port, empty (no persistence)
    ASSERT_TRUE(server.ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    EXPECT_TRUE(s.get_many(b.keys)[0].empty());  // reconnected: a plain miss
    s.put_many(b.puts());
    EXPECT_EQ(s.get_many(b.keys)[3], b.values[3]);
    EXPECT_EQ(s.stats().damaged, 0u);
}

TEST(redis_store, slow_server_times_out) {
    redis_server server;
    KVC_REQUIRE_REDIS(server);
    const blocks b(2);
    redis_block_store s(params_for(server.port(), b));
    s.put_many(b.puts());
    server.pause();  // SIGSTOP: connected, never answers
    const log_capture logs;
    auto t0 = clock_type::now();
    EXPECT_TRUE(s.get_many(b.keys)[0].empty());
    const double waited = seconds_since(t0);
    EXPECT_GE(waited, 0.25);  // the command timeout (300 ms), not a hang
    EXPECT_LT(waited, 2.0);
    EXPECT_EQ(s.stats().errors, 1u);
    ASSERT_EQ(logs.lines().size(), 1u);
    EXPECT_NE(logs.lines()[0].find("MGET of 2 keys: no answer within the command timeout of 300 ms"),
              std::string::npos)
        << logs.lines()[0];
    t0 = clock_type::now();
    s.put_many(b.puts());  // within the back-off: no attempt
    EXPECT_LT(seconds_since(t0), 0.1);
    server.resume();
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    EXPECT_EQ(s.get_many(b.keys)[1], b.values[1]);
}

TEST(redis_store, throw_errors_when_asked) {
    const blocks b(1);
    redis_store_params p = params_for(test::free_port(), b);
    p.throw_errors = true;
    redis_block_store s(p);
    try {
        (void)s.get_many(b.keys);
        ADD_FAILURE() << "no throw";
    } catch (const error& e) {
        EXPECT_EQ(e.code(), errc::io);
        EXPECT_NE(std::string(e.what()).find("cannot connect"), std::string::npos) << e.what();
    }
    p.port = 0;
    EXPECT_THROW(redis_block_store{p}, error);
    p.port = 1;
    p.command_timeout_ms = 0;
    EXPECT_THROW(redis_block_store{p}, error);
}

// Two engine processes share a server: the first (a child process) decodes a prompt on the tiny model and
// stores its blocks; the second fetches them into a fresh cache, attaches, decodes the rest, and gets the
// logits of decoding the whole prompt without any cache.
TEST(redis_store, a_second_process_hits_what_the_first_published) {
    redis_server server;
    KVC_REQUIRE_REDIS(server);
    const std::string path =
        (std::filesystem::temp_directory_path() / ("kvc-two-process-" + std::to_string(::getpid()) + ".gguf"))
            .string();
    write_tiny_model(path, tiny_model_options{});
    const model m = model::load(path);
    std::filesystem::remove(path);
    constexpr uint64_t model_id = 0x7e57;
    std::vector<token_t> prompt;
    for (int i = 0; i < 22; ++i) prompt.push_back(static_cast<token_t>((i * 7 + 3) % m.hparams().n_vocab));
    const auto make_cache = [&](bool prefix) {
        kv_cache_params p = m.cache_params(128, 1);
        p.type_k = p.type_v = dtype::f32;
        p.prefix = {.enabled = prefix, .block_size = 4};
        return std::make_unique<kv_cache>(p);
    };
    const auto decode = [&](kv_cache& cache, std::span<const token_t> toks, pos_t p0) {
        runtime rt(m, cache);
        batch_storage b = batch::init(static_cast<int32_t>(toks.size()), 0, 1);
        const seq_id_t ids[1] = {0};
        for (size_t i = 0; i < toks.size(); ++i)
            b.add(toks[i], p0 + static_cast<pos_t>(i), ids, i + 1 == toks.size());
        const decode_result r = rt.decode(b.view());
        EXPECT_EQ(r.status, memory_status::success);
        return r.logits;
    };
    const auto store_params = [&] {
        redis_store_params p;
        p.port = server.port();
        p.key_prefix = "two:";
        return p;
    };
    const pid_t child = ::fork();
    if (child == 0) {  // the first engine process: exit status 0 when it stored the prompt's 5 blocks
        auto cache = make_cache(true);
        (void)decode(*cache, std::span(prompt).first(20), 0);
        redis_block_store s(store_params());
        const uint32_t n =
            cache->prefix_cache()->prefix_store_blocks(s, model_id, std::span(prompt).first(20));
        ::_exit(n == 5 && s.stats().errors == 0 ? 0 : 1);
    }
    int status = -1;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "the first process did not store its blocks";
    // the second process (this one): a fresh cache hits 20 tokens of the 22-token prompt
    auto cache = make_cache(true);
    redis_block_store s(store_params());
    EXPECT_EQ(cache->prefix_cache()->prefix_fetch_blocks(s, model_id, prompt), 20u);
    EXPECT_EQ(s.stats().round_trips, 1u);
    EXPECT_EQ(cache->prefix_cache()->prefix_attach(0, prompt), 20u);
    const std::vector<float> hit = decode(*cache, std::span(prompt).subspan(20), 20);
    auto plain = make_cache(false);
    const std::vector<float> recompute = decode(*plain, prompt, 0);
    ASSERT_EQ(hit.size(), recompute.size());
    ASSERT_FALSE(hit.empty());
    double worst = 0;
    for (size_t i = 0; i < hit.size(); ++i)
        worst = std::max(worst,
                         std::abs(double{hit[i]} - recompute[i]) / (1e-3 + std::abs(double{recompute[i]})));
    EXPECT_LT(worst, 1e-4);
    // another model's fetch finds nothing there
    auto other = make_cache(true);
    EXPECT_EQ(other->prefix_cache()->prefix_fetch_blocks(s, model_id + 1, prompt), 0u);
}

}  // namespace
}  // namespace kvc
