// kvcache sim with a Redis tier (issue 19): four instances sharing one redis-server hit what the others
// computed. The test starts its own server and skips, saying why, without one (label `redis`).
#include <gtest/gtest.h>
#include <kvcache/redis/redis_store.h>

#include "redis_test_util.h"
#include "sim_engine.h"
#include "sim_generate.h"

namespace kvc::cli {
namespace {

TEST(sim_redis, four_instances_sharing_redis_hit_more_than_four_alone) {
    test::redis_server server;
    KVC_REQUIRE_REDIS(server);
    generate_options g;
    g.kind = "shared-prefix";
    g.block = 16;
    g.groups = 8;
    g.prompts = 8;
    g.system = 512;
    g.question = 32;
    g.output = 8;
    const auto reqs = generate(g);
    sim_options o;
    o.budget = 2048;
    o.concurrency = 4;
    o.trace_block = o.cache_block = 16;
    o.instances = 4;
    const sim_result alone = run_sim(reqs, sim_policy::kvcache, o);
    redis_store_params rp;
    rp.port = server.port();
    o.tiers.stores.push_back(std::make_shared<redis_block_store>(rp));
    o.tiers.model_id = 7;
    const sim_result shared = run_sim(reqs, sim_policy::kvcache, o);
    EXPECT_GT(shared.hit_tokens, alone.hit_tokens);
    EXPECT_LE(shared.hit_tokens, analyse_trace(reqs, 16, 16).reusable_tokens);
    EXPECT_GT(shared.tier_hit_tokens, 0u);
    ASSERT_EQ(shared.tiers.size(), 1u);
    const sim_tier_result& t = shared.tiers[0];
    EXPECT_EQ(t.where, fmt::format("redis:127.0.0.1:{}", server.port()));
    EXPECT_GT(t.fetched_blocks, 0u);
    EXPECT_GT(t.written_blocks, 0u);
    EXPECT_EQ(t.errors + t.store.errors, 0u);
    EXPECT_GT(t.store.round_trips, 0u);
    EXPECT_GT(t.store.bytes_in, 0u);
}

}  // namespace
}  // namespace kvc::cli
