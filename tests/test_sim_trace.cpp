// kvcache sim's traces (tools/kvcache/sim_trace.cpp): Mooncake's JSONL read and written, errors that name
// the line and the field, tokens synthesised from block ids, and the trace's statistics.
#include <algorithm>
#include <sstream>

#include <gtest/gtest.h>

#include "sim_generate.h"
#include "sim_trace.h"

namespace kvc::cli {
namespace {

std::vector<sim_request> read(const std::string& text, uint32_t block = 4) {
    std::istringstream in(text);
    return read_trace(in, "t.jsonl", block);
}

std::string error_of(const std::string& text, uint32_t block = 4) {
    try {
        read(text, block);
    } catch (const error& e) {
        return e.what();
    }
    return "(no error)";
}

TEST(sim_trace, reads_mooncake_lines) {
    const auto r = read(
        "{\"timestamp\": 0, \"input_length\": 6, \"output_length\": 3, \"hash_ids\": [7, 8]}\n"
        "\n"
        "{\"timestamp\": 27482, \"input_length\": 4, \"output_length\": 0, \"hash_ids\": [7]}\n");
    ASSERT_EQ(r.size(), 2u);
    EXPECT_EQ(r[0].input_length, 6u);
    EXPECT_EQ(r[0].output_length, 3u);
    EXPECT_EQ(r[0].hash_ids, (std::vector<uint64_t>{7, 8}));
    EXPECT_EQ(r[1].timestamp, 27482);
}

TEST(sim_trace, write_then_read_is_identity) {
    const std::vector<sim_request> a{{1.5, 5, 2, {1, 2}}, {3, 8, 9, {1, 3}}};
    std::ostringstream out;
    write_trace(out, a);
    const auto b = read(out.str());
    ASSERT_EQ(b.size(), 2u);
    for (size_t i = 0; i < 2; ++i) {
        EXPECT_EQ(a[i].timestamp, b[i].timestamp);
        EXPECT_EQ(a[i].input_length, b[i].input_length);
        EXPECT_EQ(a[i].output_length, b[i].output_length);
        EXPECT_EQ(a[i].hash_ids, b[i].hash_ids);
    }
}

TEST(sim_trace, malformed_line_names_line_and_field) {
    const std::string ok =
        "{\"timestamp\": 0, \"input_length\": 4, \"output_length\": 1, \"hash_ids\": [1]}\n";
    EXPECT_NE(error_of(ok + "{\"timestamp\": 1, \"output_length\": 1, \"hash_ids\": [1]}\n")
                  .find("t.jsonl:2: field 'input_length' is missing"),
              std::string::npos);
    EXPECT_NE(error_of(ok + ok +
                       "{\"timestamp\": 1, \"input_length\": 4, \"output_length\": -1, \"hash_ids\": [1]}")
                  .find("t.jsonl:3: field 'output_length' must be a non-negative integer, got -1"),
              std::string::npos);
    EXPECT_NE(
        error_of("{\"timestamp\": 0, \"input_length\": 9, \"output_length\": 1, \"hash_ids\": [1]}")
            .find("t.jsonl:1: field 'hash_ids' has 1 ids, but input_length 9 needs 3 blocks of 4 tokens"),
        std::string::npos);
    EXPECT_NE(error_of("{\"timestamp\": 0, \"input_length\": 4, \"output_length\": 1, \"hash_ids\": [\"a\"]}")
                  .find("t.jsonl:1: field 'hash_ids'[0] must be a non-negative integer"),
              std::string::npos);
    EXPECT_NE(error_of("{\"timestamp\": 5, \"input_length\": 4, \"output_length\": 1, \"hash_ids\": [1]}\n"
                       "{\"timestamp\": 4, \"input_length\": 4, \"output_length\": 1, \"hash_ids\": [1]}")
                  .find("t.jsonl:2: field 'timestamp' goes back in time"),
              std::string::npos);
    EXPECT_NE(error_of(ok + "{\"timestamp\": 1, ").find("t.jsonl:2: not a JSON object"), std::string::npos);
    EXPECT_NE(error_of("[1, 2]").find("t.jsonl:1: not a JSON object"), std::string::npos);
    EXPECT_NE(error_of("{\"timestamp\": 0, \"input_length\": 0, \"output_length\": 1, \"hash_ids\": []}")
                  .find("t.jsonl:1: field 'input_length' must be at least 1"),
              std::string::npos);
    EXPECT_NE(
        error_of("{\"timestamp\": 0, \"input_length\": 99999999, \"output_length\": 1, \"hash_ids\": []}")
            .find("above the limit"),
        std::string::npos);
    EXPECT_NE(error_of("").find("t.jsonl: no requests"), std::string::npos);
}

TEST(sim_trace, tokens_follow_block_ids) {
    const sim_request a{0, 6, 0, {7, 8}}, b{0, 8, 0, {7, 9}}, c{0, 3, 0, {8}};
    std::vector<token_t> ta, tb, tc;
    prompt_tokens(a, 4, ta);
    prompt_tokens(b, 4, tb);
    prompt_tokens(c, 4, tc);
    ASSERT_EQ(ta.size(), 6u);
    ASSERT_EQ(tb.size(), 8u);
    EXPECT_TRUE(std::equal(ta.begin(), ta.begin() + 4, tb.begin()));  // same first id: same first block
    EXPECT_NE(ta[4], tb[4]);                                          // different second id
    EXPECT_NE(ta[0], tc[0]);                                          // id 8 at the start is not id 7
    for (token_t t : ta) EXPECT_GE(t, 0);
    std::vector<token_t> again;
    prompt_tokens(a, 4, again);
    EXPECT_EQ(ta, again);  // deterministic
    EXPECT_NE(output_token(0, 0), output_token(1, 0));
    EXPECT_NE(output_token(0, 0), output_token(0, 1));
}

TEST(sim_trace, statistics_count_reuse_in_cache_blocks) {
    // trace blocks of 4 tokens, cache blocks of 2: request 2 repeats request 1's first block and a half
    const std::vector<sim_request> r{{0, 7, 1, {1, 2}}, {0, 5, 2, {1, 3}}};
    const trace_stats st = analyse_trace(r, 4, 2);
    EXPECT_EQ(st.prompt_tokens, 12u);
    EXPECT_EQ(st.output_tokens, 3u);
    EXPECT_EQ(st.reusable_tokens, 4u);      // the two cache blocks of id 1
    EXPECT_EQ(st.unique_tokens, 12u - 4u);  // partial tails count as unique
    EXPECT_EQ(st.max_request, 8u);
}

TEST(sim_trace, follow_ups_find_the_turn_before) {
    // 0: {1,2}; 1: unrelated; 2 and 3: two samples continuing 0 (same ids and length: neither continues
    // the other); 4 continues 3, the latest of them
    const std::vector<sim_request> reqs{{0, 8, 1, {1, 2}},        {0, 8, 1, {5, 6}},
                                        {0, 12, 1, {1, 2, 3}},    {0, 12, 1, {1, 2, 3}},
                                        {0, 16, 1, {1, 2, 3, 4}}, {0, 8, 1, {1, 7}}};
    EXPECT_EQ(follow_ups(reqs), (std::vector<int64_t>{-1, -1, 0, 0, 3, -1}));
    // a generated conversation's turns continue each other: one root per conversation
    generate_options g;
    g.kind = "multi-turn";
    g.block = 16;
    g.groups = 10;
    g.prompts = 5;
    const auto mt = generate(g);
    const std::vector<int64_t> parent = follow_ups(mt);
    EXPECT_EQ(std::count(parent.begin(), parent.end(), -1), 10);
    for (size_t i = 0; i < mt.size(); ++i)
        if (parent[i] >= 0) {
            EXPECT_LT(mt[static_cast<size_t>(parent[i])].input_length, mt[i].input_length);
        }
}

}  // namespace
}  // namespace kvc::cli
