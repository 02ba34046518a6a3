// kvcache sim's generators (tools/kvcache/sim_generate.cpp): seeded, in Mooncake's format, with the
// structure each kind promises.
#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <sstream>
#include <utility>

#include <gtest/gtest.h>

#include "sim_generate.h"

namespace kvc::cli {
namespace {

std::vector<sim_request> gen(const std::string& kind, uint64_t seed = 1) {
    generate_options o;
    o.kind = kind;
    o.seed = seed;
    return generate(o);
}

TEST(sim_generate, every_kind_is_a_valid_trace_and_seeded) {
    for (const std::string& k : generator_kinds()) {
        const auto a = gen(k), b = gen(k), c = gen(k, 2);
        ASSERT_FALSE(a.empty()) << k;
        std::ostringstream wa, wb, wc;
        write_trace(wa, a);
        write_trace(wb, b);
        write_trace(wc, c);
        EXPECT_EQ(wa.str(), wb.str()) << k;  // same seed, same trace
        EXPECT_NE(wa.str(), wc.str()) << k;  // another seed, another trace (parallel: its arrival times)
        std::istringstream in(wa.str());
        const auto back = read_trace(in, k, 512);  // the checks of a trace file hold
        EXPECT_EQ(back.size(), a.size()) << k;
    }
}

TEST(sim_generate, shared_prefix_has_sglang_defaults) {
    const auto r = gen("shared-prefix");
    ASSERT_EQ(r.size(), 64u * 16u);
    std::set<std::vector<uint64_t>> systems;
    for (const sim_request& q : r) {
        EXPECT_EQ(q.input_length, 2048u + 128u);
        EXPECT_EQ(q.output_length, 256u);
        ASSERT_EQ(q.hash_ids.size(), 5u);
        systems.insert({q.hash_ids.begin(), q.hash_ids.begin() + 4});
    }
    EXPECT_EQ(systems.size(), 64u);  // one system prompt per group
    const trace_stats st = analyse_trace(r, 512, 16);
    EXPECT_EQ(st.reusable_tokens, (64u * 16u - 64u) * 2048u);  // the ideal: every system prompt but its first
}

TEST(sim_generate, multi_turn_prompts_extend_their_history) {
    generate_options o;
    o.kind = "multi-turn";
    o.groups = 3;
    o.prompts = 4;
    o.block = 16;
    const auto r = generate(o);
    ASSERT_EQ(r.size(), 12u);
    // every request after a conversation's first repeats all of the blocks of an earlier prompt but the last
    size_t extended = 0;
    for (size_t i = 0; i < r.size(); ++i)
        for (size_t j = 0; j < i; ++j) {
            const auto& a = r[j].hash_ids;
            const auto& b = r[i].hash_ids;
            if (r[i].input_length > r[j].input_length && a.size() > 1 &&
                std::equal(a.begin(), a.end() - 1, b.begin())) {
                ++extended;
                break;
            }
        }
    EXPECT_EQ(extended, 12u - 3u);
}

TEST(sim_generate, parallel_repeats_each_prompt) {
    const auto r = gen("parallel");
    ASSERT_EQ(r.size(), 128u * 8u);
    for (size_t i = 0; i < r.size(); i += 8)
        for (size_t k = 1; k < 8; ++k) EXPECT_EQ(r[i].hash_ids, r[i + k].hash_ids);
    EXPECT_NE(r[0].hash_ids, r[8].hash_ids);
}

TEST(sim_generate, mooncake_like_statistics) {
    const auto r = gen("mooncake-like");
    const trace_stats st = analyse_trace(r, 512, 16);
    const double mean_in = static_cast<double>(st.prompt_tokens) / static_cast<double>(st.requests);
    const double reuse = static_cast<double>(st.reusable_tokens) / static_cast<double>(st.prompt_tokens);
    EXPECT_GT(mean_in, 10000);  // Mooncake's conversation trace: ~12k tokens on average
    EXPECT_LT(mean_in, 14000);
    EXPECT_GT(reuse, 0.35);  // ~40% reusable with an infinite cache
    EXPECT_LT(reuse, 0.45);
}

// The median number of requests between a conversation's turns (block 5 is always the conversation's own:
// system prompts end by block 4).
double median_turn_gap(const std::vector<sim_request>& r) {
    std::map<uint64_t, size_t> last;
    std::vector<size_t> gaps;
    for (size_t i = 0; i < r.size(); ++i) {
        if (r[i].hash_ids.size() <= 5) continue;
        const auto [it, fresh] = last.try_emplace(r[i].hash_ids[5], i);
        if (!fresh) gaps.push_back(i - std::exchange(it->second, i));
    }
    if (gaps.empty()) return 0;
    std::nth_element(gaps.begin(), gaps.begin() + gaps.size() / 2, gaps.end());
    return static_cast<double>(gaps[gaps.size() / 2]);
}

TEST(sim_generate, mooncake_like_follow_gap_sets_when_conversations_come_back) {
    generate_options o;
    o.kind = "mooncake-like";
    o.prompts = 6000;
    const double recent = median_turn_gap(generate(o));
    o.follow_gap = 423;  // Mooncake's conversation trace
    const auto r = generate(o);
    const double late = median_turn_gap(r);
    EXPECT_LT(recent, 100);
    EXPECT_GT(late, 0.8 * 423);
    EXPECT_LT(late, 1.2 * 423);
    const trace_stats st = analyse_trace(r, 512, 16);
    const double mean_in = static_cast<double>(st.prompt_tokens) / static_cast<double>(st.requests);
    const double reuse = static_cast<double>(st.reusable_tokens) / static_cast<double>(st.prompt_tokens);
    EXPECT_GT(mean_in, 10000);
    EXPECT_LT(mean_in, 14000);
    EXPECT_GT(reuse, 0.35);
    EXPECT_LT(reuse, 0.5);
}

TEST(sim_generate, bad_kind_and_knobs_are_errors) {
    generate_options o;
    o.kind = "chat";
    EXPECT_THROW(generate(o), error);
    o.kind = "agent";
    o.block = 0;
    EXPECT_THROW(generate(o), error);
    o.block = 512;
    for (double bad : {-1.0, std::nan("")}) {
        o.rate = bad;
        EXPECT_THROW(generate(o), error) << bad;
    }
    o.rate = 0;
    o.kind = "mooncake-like";
    for (double bad : {-1.0, std::nan(""), 1e10}) {
        o.follow_gap = bad;
        EXPECT_THROW(generate(o), error) << bad;
    }
    o.follow_gap = 0;
    o.recency = -2;
    EXPECT_THROW(generate(o), error);
    o.recency = 8;
    o.follow_gap = 100;
    try {
        generate(o);
        ADD_FAILURE() << "--recency with --follow-gap accepted";
    } catch (const error& e) {
        EXPECT_NE(std::string(e.what()).find("--follow-gap"), std::string::npos) << e.what();
    }
}

}  // namespace
}  // namespace kvc::cli
