// kvcache sim's serving loop and policies (tools/kvcache/sim_engine.cpp and the backends): the hits it
// reports are the prefix cache's own, requests wait rather than fail, budgets are checked before a run,
// and the policies keep their order (oracle >= kvcache >= none).
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>
#include <kvcache/disk_store.h>

#include <filesystem>
#include <set>

#include "sim_engine.h"
#include "sim_generate.h"

namespace kvc::cli {
namespace {

sim_options small(uint32_t budget, uint32_t concurrency = 8) {
    sim_options o;
    o.budget = budget;
    o.concurrency = concurrency;
    o.trace_block = 16;
    o.cache_block = 16;
    return o;
}

std::vector<sim_request> shared_prefix(uint32_t groups, uint32_t prompts, uint32_t system, uint32_t question,
                                       uint32_t output) {
    generate_options g;
    g.kind = "shared-prefix";
    g.block = 16;
    g.groups = groups;
    g.prompts = prompts;
    g.system = system;
    g.question = question;
    g.output = output;
    return generate(g);
}

TEST(sim_engine, hits_are_the_prefix_cache_counters) {
    const auto reqs = shared_prefix(8, 8, 256, 32, 16);
    for (uint32_t budget : {1024u, 4096u}) {
        const sim_result r = run_sim(reqs, sim_policy::kvcache, small(budget));
        EXPECT_EQ(r.requests, reqs.size());
        EXPECT_GT(r.hit_tokens, 0u);
        EXPECT_EQ(r.hit_tokens + r.prefill_tokens, r.prompt_tokens);
        EXPECT_EQ(r.hit_tokens + r.probe_hit_tokens, r.cache_hit_tokens);  // the cache's own count
        EXPECT_EQ(r.output_tokens, reqs.size() * 16u);
        EXPECT_LE(r.peak_cells, budget);
        EXPECT_LE(r.max_live, 8u);
    }
}

TEST(sim_engine, second_turn_reuses_the_first) {
    // trace blocks of 16: the second prompt starts with the first one's two blocks
    const std::vector<sim_request> reqs{{0, 32, 4, {1, 2}}, {0, 48, 4, {1, 2, 3}}};
    for (sim_policy p : {sim_policy::kvcache, sim_policy::llama_server, sim_policy::oracle}) {
        const sim_result r = run_sim(reqs, p, small(256, 1));
        EXPECT_EQ(r.hit_tokens, 32u) << to_string(p);
        EXPECT_EQ(r.prompt_tokens, 80u) << to_string(p);
    }
    EXPECT_EQ(run_sim(reqs, sim_policy::none, small(256, 1)).hit_tokens, 0u);
}

TEST(sim_engine, llama_server_reuses_only_its_slot) {
    // two conversations on one slot: each new turn finds the slot holding the other conversation
    const std::vector<sim_request> reqs{{0, 32, 1, {1, 2}}, {0, 32, 1, {5, 6}}, {0, 48, 1, {1, 2, 3}}};
    EXPECT_EQ(run_sim(reqs, sim_policy::llama_server, small(256, 1)).hit_tokens, 0u);
    EXPECT_EQ(run_sim(reqs, sim_policy::kvcache, small(256, 1)).hit_tokens, 32u);
    // with its RAM prompt cache the slot's old prompt comes back
    sim_options o = small(256, 1);
    o.cache_ram = 1000;
    const sim_result r = run_sim(reqs, sim_policy::llama_server, o);
    EXPECT_EQ(r.hit_tokens, 32u);
    EXPECT_GT(r.copied_tokens, 0u);
}

TEST(sim_engine, requests_wait_for_room_and_none_is_lost) {
    const auto reqs = shared_prefix(4, 16, 64, 32, 32);
    for (sim_policy p : {sim_policy::kvcache, sim_policy::none, sim_policy::llama_server}) {
        const sim_result r = run_sim(reqs, p, small(256, 16));  // 256 cells hold two requests at most
        EXPECT_EQ(r.requests, reqs.size()) << to_string(p);
        EXPECT_EQ(r.output_tokens, reqs.size() * 32u) << to_string(p);
        EXPECT_GT(r.queued, 0u) << to_string(p);
        EXPECT_LE(r.peak_live_cells, 256u) << to_string(p);
    }
}

TEST(sim_engine, shared_prefix_keeps_more_sequences_live) {
    // S = 256 shared, P = 64 private (32 question + 32 output); M = S + 20 P
    const auto reqs = shared_prefix(1, 200, 256, 32, 32);
    const uint32_t M = 256 + 20 * 64;
    const sim_result k = run_sim(reqs, sim_policy::kvcache, small(M, 64));
    const sim_result l = run_sim(reqs, sim_policy::llama_server, small(M, 64));
    EXPECT_GE(static_cast<double>(k.max_live), 0.95 * 20);
    EXPECT_LE(l.max_live, M / (256 + 64));  // each slot holds its own copy
}

TEST(sim_engine, oracle_bounds_the_policies) {
    const auto reqs = shared_prefix(16, 8, 128, 32, 16);
    for (uint32_t budget : {512u, 1024u, 4096u}) {
        const double o = run_sim(reqs, sim_policy::oracle, small(budget)).hit_rate();
        const double k = run_sim(reqs, sim_policy::kvcache, small(budget)).hit_rate();
        const double l = run_sim(reqs, sim_policy::llama_server, small(budget)).hit_rate();
        EXPECT_GE(o, k) << budget;
        EXPECT_GE(o, l) << budget;
    }
    // with room for everything the oracle hits every repeated block
    const trace_stats st = analyse_trace(reqs, 16, 16);
    EXPECT_EQ(run_sim(reqs, sim_policy::oracle, small(1 << 16)).hit_tokens, st.reusable_tokens);
}

TEST(sim_engine, respected_arrivals_space_the_requests) {
    // 10 s apart, 20 ms steps: each request is alone, and nobody waits
    std::vector<sim_request> reqs;
    reqs.reserve(5);
    for (int i = 0; i < 5; ++i) reqs.push_back({10000.0 * i, 32, 4, {1, static_cast<uint64_t>(10 + i)}});
    sim_options o = small(256, 8);
    o.respect_arrival = true;
    const sim_result r = run_sim(reqs, sim_policy::kvcache, o);
    EXPECT_EQ(r.max_live, 1u);
    EXPECT_EQ(r.queued, 0u);
    EXPECT_EQ(r.hit_tokens, 4u * 16u);  // the first block of the first request, again and again
    EXPECT_EQ(r.steps, 5u * 5u);        // a prefill step and four decode steps each; idle time is skipped
}

TEST(sim_engine, deferring_shared_prefixes_saves_their_recomputation) {
    // 8 prompts of one system prompt arrive together: admitted in the same step, each would compute it
    const auto reqs = shared_prefix(1, 8, 256, 16, 8);
    sim_options o = small(4096, 8);
    const sim_result with = run_sim(reqs, sim_policy::kvcache, o);
    o.defer_shared = false;
    const sim_result without = run_sim(reqs, sim_policy::kvcache, o);
    EXPECT_EQ(with.hit_tokens, 7u * 256u);
    EXPECT_EQ(without.hit_tokens, 0u);
    EXPECT_EQ(with.max_live, 8u);  // the others follow one step later
}

TEST(sim_engine, lpm_admits_the_longest_cached_prefix_first) {
    // room for one request at a time: A, then B and A's next turn C wait. In arrival order B goes first and
    // evicts the deeper block of A's prompt; longest prefix first admits C while all of it is cached.
    const std::vector<sim_request> reqs{{0, 32, 1, {1, 2}}, {0, 32, 1, {7, 8}}, {0, 48, 1, {1, 2, 3}}};
    sim_options o = small(64, 3);
    const sim_result fcfs = run_sim(reqs, sim_policy::kvcache, o);
    o.schedule = sim_schedule::lpm;
    const sim_result lpm = run_sim(reqs, sim_policy::kvcache, o);
    EXPECT_EQ(fcfs.hit_tokens, 16u);
    EXPECT_EQ(lpm.hit_tokens, 32u);
    EXPECT_EQ(lpm.hit_tokens + lpm.probe_hit_tokens, lpm.cache_hit_tokens);
    EXPECT_EQ(lpm.requests, 3u);
    // the other policies keep arrival order whatever the option says
    EXPECT_EQ(run_sim(reqs, sim_policy::llama_server, o).hit_tokens,
              run_sim(reqs, sim_policy::llama_server, small(64, 3)).hit_tokens);
}

TEST(sim_engine, lpm_with_a_window_of_one_is_fcfs) {
    generate_options g;
    g.kind = "multi-turn";
    g.block = 16;
    g.groups = 12;
    g.prompts = 4;
    g.system = 64;
    g.question = 32;
    g.output = 16;
    const auto reqs = generate(g);
    sim_options o = small(1024, 8);
    const sim_result fcfs = run_sim(reqs, sim_policy::kvcache, o);
    o.schedule = sim_schedule::lpm;
    o.schedule_window = 1;
    const sim_result one = run_sim(reqs, sim_policy::kvcache, o);
    EXPECT_EQ(one.hit_tokens, fcfs.hit_tokens);
    EXPECT_EQ(one.steps, fcfs.steps);
    EXPECT_EQ(one.wait_steps, fcfs.wait_steps);
    o.schedule_window = 64;  // looking further finds the conversations whose history is cached
    const sim_result lpm = run_sim(reqs, sim_policy::kvcache, o);
    EXPECT_GT(lpm.hit_tokens, fcfs.hit_tokens);
    EXPECT_EQ(lpm.requests, reqs.size());
    EXPECT_EQ(lpm.hit_tokens + lpm.prefill_tokens, lpm.prompt_tokens);
    o.schedule_window = 0;
    EXPECT_THROW(run_sim(reqs, sim_policy::kvcache, o), error);
}

TEST(sim_engine, wait_answer_holds_a_follow_up_until_its_turn_ended) {
    // C continues A; D is unrelated. A runs 5 steps (a prefill, 4 decodes), C only after it, D beside A
    const std::vector<sim_request> reqs{{0, 32, 4, {1, 2}}, {0, 48, 4, {1, 2, 3}}, {0, 32, 4, {9, 10}}};
    sim_options o = small(256, 3);
    const sim_result free = run_sim(reqs, sim_policy::kvcache, o);
    EXPECT_EQ(free.steps, 6u);  // C waits one step (A computes its prefix), then runs beside A
    o.wait_answer = true;
    for (sim_policy p : {sim_policy::kvcache, sim_policy::llama_server, sim_policy::none}) {
        const sim_result r = run_sim(reqs, p, o);
        EXPECT_EQ(r.steps, 10u) << to_string(p);
        EXPECT_EQ(r.max_live, 2u) << to_string(p);
        EXPECT_EQ(r.requests, 3u) << to_string(p);
        EXPECT_EQ(r.queued, 0u) << to_string(p);  // C arrives when A ends, and is admitted at once
    }
    EXPECT_EQ(run_sim(reqs, sim_policy::kvcache, o).hit_tokens, 32u);
    o.respect_arrival = true;  // the same with timestamps (all at 0)
    EXPECT_EQ(run_sim(reqs, sim_policy::kvcache, o).steps, 10u);
}

TEST(sim_engine, lru_blocks_evicts_roots_first) {
    // two blocks of room: B's block pushes out A's root, so A's second visit hits nothing under a plain
    // LRU, while the oracle does not keep B's block (never used again) and hits both of A's
    const std::vector<sim_request> reqs{{0, 32, 0, {1, 2}}, {0, 16, 0, {3}}, {0, 32, 0, {1, 2}}};
    EXPECT_EQ(run_sim(reqs, sim_policy::lru_blocks, small(32)).hit_tokens, 0u);
    EXPECT_EQ(run_sim(reqs, sim_policy::oracle, small(32)).hit_tokens, 32u);
}

TEST(sim_engine, budget_smaller_than_a_request_is_an_error) {
    const std::vector<sim_request> reqs{{0, 32, 4, {1, 2}}, {0, 300, 20, std::vector<uint64_t>(19, 3)}};
    try {
        run_sim(reqs, sim_policy::kvcache, small(256));
        FAIL() << "no error";
    } catch (const error& e) {
        EXPECT_NE(
            std::string(e.what()).find("request 2 needs 320 cells (300 prompt + 20 output tokens), more "
                                       "than the budget of 256 tokens"),
            std::string::npos)
            << e.what();
    }
    EXPECT_THROW(run_sim(reqs, sim_policy::kvcache, small(100)), error);  // not a multiple of the block
    sim_options o = small(1024);
    o.concurrency = 0;
    EXPECT_THROW(run_sim(reqs, sim_policy::kvcache, o), error);
}

// Recurrent and hybrid models: kvcache resumes at snapshots (within a block of where a turn's prompt
// ended), llama-server at its checkpoints; a hybrid hit needs both halves, so it is at most the K/V hit.
TEST(sim_engine, recurrent_and_hybrid_memories_resume_at_states_kept) {
    // trace blocks of 16; the second prompt continues the first (32 tokens) past its end, the third
    // branches inside it (after 16 tokens); cache blocks of 8
    const std::vector<sim_request> reqs{
        {0, 40, 4, {1, 2, 3}}, {0, 56, 4, {1, 2, 3, 4}}, {0, 40, 4, {1, 5, 6}}};
    sim_options o = small(512, 1);
    o.cache_block = 8;
    o.snapshot_interval = 0;  // snapshots at prompt and sequence ends only
    o.snapshots = 16;
    o.state_tokens = 8;
    const sim_result kv = run_sim(reqs, sim_policy::kvcache, o);
    for (const sim_memory m : {sim_memory::recurrent, sim_memory::hybrid}) {
        o.memory = m;
        const sim_result r = run_sim(reqs, sim_policy::kvcache, o);
        // turn 2 resumes at 40 (its prompt end), turn 3 finds no state inside the first prompt
        EXPECT_EQ(r.hit_tokens, 40u) << to_string(m);
        EXPECT_LE(r.hit_tokens, kv.hit_tokens) << to_string(m);
        EXPECT_GT(r.peak_snapshots, 0u) << to_string(m);
        EXPECT_LE(r.peak_snapshots, 16u) << to_string(m);
        // llama-server: the slot's checkpoint at the first prompt's end (40) serves turn 2; turn 3 diverges
        // at 16, before any checkpoint
        const sim_result ls = run_sim(reqs, sim_policy::llama_server, o);
        EXPECT_EQ(ls.hit_tokens, 40u) << to_string(m);
        o.snapshot_interval = 2;  // every 16 tokens: turn 3 resumes at 16
        EXPECT_EQ(run_sim(reqs, sim_policy::kvcache, o).hit_tokens, 56u) << to_string(m);
        o.snapshot_interval = 0;
    }
}

TEST(sim_engine, state_options_must_be_positive) {
    const std::vector<sim_request> reqs{{0, 32, 4, {1, 2}}};
    for (const auto bad :
         {&sim_options::state_tokens, &sim_options::checkpoint_every, &sim_options::max_checkpoints}) {
        sim_options o = small(256, 1);
        o.memory = sim_memory::hybrid;
        o.*bad = 0;
        EXPECT_THROW(run_sim(reqs, sim_policy::kvcache, o), error);
    }
}

// Several instances (issue 19). Request i goes to instance i % N under rr; with room for everything an
// instance hits exactly the system prompts it computed itself before, so N instances lose, against one,
// one system prompt per (group, instance) pair beyond the first of each group: they share nothing.
TEST(sim_engine, instances_round_robin_hit_only_what_each_computed) {
    const auto reqs = shared_prefix(6, 8, 256, 32, 8);
    sim_options o = small(1 << 16, 4);
    const sim_result one = run_sim(reqs, sim_policy::kvcache, o);
    o.instances = 4;
    const sim_result four = run_sim(reqs, sim_policy::kvcache, o);
    std::set<uint64_t> seen1;
    std::set<std::pair<uint64_t, size_t>> seen4;
    uint64_t expect1 = 0, expect4 = 0;
    for (size_t i = 0; i < reqs.size(); ++i) {
        expect1 += seen1.insert(reqs[i].hash_ids[0]).second ? 0 : 256;
        expect4 += seen4.insert({reqs[i].hash_ids[0], i % 4}).second ? 0 : 256;
    }
    EXPECT_EQ(one.hit_tokens, expect1);
    EXPECT_EQ(four.hit_tokens, expect4);
    EXPECT_LT(four.hit_tokens, one.hit_tokens);
    ASSERT_EQ(four.per_instance.size(), 4u);
    uint64_t requests = 0, hits = 0;
    for (const sim_result& x : four.per_instance) {
        EXPECT_EQ(x.requests, reqs.size() / 4);  // round-robin
        EXPECT_EQ(x.hit_tokens + x.probe_hit_tokens, x.cache_hit_tokens);
        EXPECT_LE(x.max_live, 4u);
        requests += x.requests;
        hits += x.hit_tokens;
    }
    EXPECT_EQ(requests, reqs.size());
    EXPECT_EQ(hits, four.hit_tokens);
    EXPECT_EQ(four.hit_tokens + four.prefill_tokens, four.prompt_tokens);
    EXPECT_EQ(four.instances, 4u);
    EXPECT_LE(four.max_live, 16u);
}

// The prefix route sends a request to the instance that holds its system prompt: with room for
// everything, the same hits as one instance save the first request of each group while it is computed.
TEST(sim_engine, instances_prefix_route_keeps_groups_together) {
    const auto reqs = shared_prefix(6, 8, 256, 32, 8);
    sim_options o = small(1 << 16, 4);
    o.instances = 4;
    const sim_result rr = run_sim(reqs, sim_policy::kvcache, o);
    o.route = sim_route::prefix;
    const sim_result px = run_sim(reqs, sim_policy::kvcache, o);
    EXPECT_GT(px.hit_tokens, rr.hit_tokens);
    const trace_stats st = analyse_trace(reqs, 16, 16);
    EXPECT_LE(px.hit_tokens, st.reusable_tokens);
    EXPECT_EQ(px.requests, reqs.size());
    // none runs several instances too, and hits nothing
    EXPECT_EQ(run_sim(reqs, sim_policy::none, o).hit_tokens, 0u);
}

// A temporary directory, removed at the end.
struct temp_dir {
    std::shared_ptr<block_store_i> store() const {
        disk_store_params p;
        p.dir = path.string();
        return std::make_shared<disk_block_store>(p);
    }
    std::filesystem::path path;
    explicit temp_dir(const std::string& name)
        : path(std::filesystem::temp_directory_path() / fmt::format("kvc-sim-{}-{}", name, ::getpid())) {
        std::filesystem::remove_all(path);
    }
    ~temp_dir() { std::filesystem::remove_all(path); }
};

TEST(sim_engine, instances_and_tiers_are_refused_where_they_do_not_apply) {
    const auto reqs = shared_prefix(2, 2, 64, 16, 4);
    sim_options o = small(4096);
    o.instances = 0;
    EXPECT_THROW(run_sim(reqs, sim_policy::kvcache, o), error);
    o.instances = 2;
    try {
        run_sim(reqs, sim_policy::llama_server, o);
        FAIL() << "llama-server ran 2 instances";
    } catch (const error& e) {
        EXPECT_NE(std::string(e.what()).find("--instances 2: policy llama-server"), std::string::npos)
            << e.what();
    }
    o.instances = 1;
    temp_dir dir("refuse");
    o.tiers.stores.push_back(dir.store());
    try {
        run_sim(reqs, sim_policy::none, o);
        FAIL() << "none ran with a tier";
    } catch (const error& e) {
        EXPECT_NE(std::string(e.what()).find("--tier: policy none"), std::string::npos) << e.what();
    }
}

// Four instances sharing a disk tier hit what the others computed: more than four independent ones, never
// more than an infinite cache; the hits the tier brought back are counted apart.
TEST(sim_engine, a_shared_disk_tier_raises_the_hits_of_instances) {
    const auto reqs = shared_prefix(6, 6, 256, 32, 8);
    const trace_stats st = analyse_trace(reqs, 16, 16);
    for (tier_write w : {tier_write::on_evict, tier_write::through}) {
        temp_dir dir(w == tier_write::through ? "through" : "evict");
        // room for a request or two per instance: on_evict writes what memory loses
        sim_options o = small(1024, 4);
        o.instances = 4;
        const sim_result alone = run_sim(reqs, sim_policy::kvcache, o);
        o.tiers.stores.push_back(dir.store());
        o.tiers.write = w;
        o.tiers.model_id = 42;
        const sim_result shared = run_sim(reqs, sim_policy::kvcache, o);
        SCOPED_TRACE(w == tier_write::through ? "through" : "evict");
        EXPECT_GT(shared.hit_tokens, alone.hit_tokens);
        EXPECT_LE(shared.hit_tokens, st.reusable_tokens);
        EXPECT_EQ(shared.hit_tokens + shared.prefill_tokens, shared.prompt_tokens);
        EXPECT_GT(shared.tier_hit_tokens, 0u);
        EXPECT_LE(shared.tier_hit_tokens, shared.hit_tokens);
        ASSERT_EQ(shared.tiers.size(), 1u);
        const sim_tier_result& t = shared.tiers[0];
        EXPECT_GT(t.fetched_blocks, 0u);
        EXPECT_GT(t.written_blocks, 0u);
        EXPECT_EQ(t.errors, 0u);
        EXPECT_EQ(t.store.errors, 0u);
        EXPECT_GT(t.store.bytes_in, 0u);
        EXPECT_GT(t.store.bytes_out, 0u);
        EXPECT_LE(shared.tier_hit_tokens, t.fetched_blocks * 16);
        for (const sim_result& x : shared.per_instance)
            EXPECT_EQ(x.hit_tokens + x.probe_hit_tokens, x.cache_hit_tokens);
    }
}

}  // namespace
}  // namespace kvc::cli
