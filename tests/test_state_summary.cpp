#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>
#include <kvcache/kv_cache.h>
#include <kvcache/state.h>
#include <kvcache/state_summary.h>

#include "state_test_util.h"

namespace kvc {
namespace {

using namespace kvc::test;

std::span<const uint8_t> payload_of(const std::vector<uint8_t>& buffer) {
    return std::span(buffer).subspan(8);
}

TEST(state_summary, counts_cells_positions_and_bytes_of_every_stream_and_layer) {
    std::mt19937 rng(1);
    const auto p = params_for(dtype::q8_0, dtype::f16, true, false);  // one stream per sequence
    kv_cache c(p);
    decode(c, 0, 0, 5, rng);
    decode(c, 2, 7, 3, rng);
    const auto buf = whole(c);
    const state_summary s = summarize_kv_state(payload_of(buf), false);
    ASSERT_EQ(s.streams.size(), 4u);
    EXPECT_EQ(s.streams[0].n_cells, 5u);
    EXPECT_EQ(s.streams[1].n_cells, 0u);
    ASSERT_EQ(s.streams[2].seqs.size(), 1u);
    EXPECT_EQ(s.streams[2].seqs[0].seq, 2);
    EXPECT_EQ(s.streams[2].seqs[0].n_cells, 3u);
    EXPECT_EQ(s.streams[2].seqs[0].pos_min, 7);
    EXPECT_EQ(s.streams[2].seqs[0].pos_max, 9);
    EXPECT_TRUE(s.v_trans);
    EXPECT_EQ(s.bytes, buf.size() - 8);
    ASSERT_EQ(s.layers.size(), 2u);
    // layer 0: E_k = 64 (2 q8_0 blocks of 34 bytes), E_v = 64 f16; layer 1: E_k = 64, E_v = 32
    EXPECT_EQ(s.layers[0].k_bytes, 8u * 68);
    EXPECT_EQ(s.layers[0].v_bytes, 8u * 128);
    EXPECT_EQ(s.layers[1].v_bytes, 8u * 64);
    const auto per_type = s.bytes_per_type();
    ASSERT_EQ(per_type.size(), 2u);
    EXPECT_EQ(per_type[0], (std::pair<dtype, uint64_t>{dtype::q8_0, 16u * 68}));
    EXPECT_EQ(per_type[1], (std::pair<dtype, uint64_t>{dtype::f16, 8u * 192}));
}

TEST(state_summary, shared_cells_count_for_every_sequence_and_mrope_is_found) {
    std::mt19937 rng(2);
    auto p = params_for(dtype::f16, dtype::f16, false, true);
    kv_cache c(p);
    decode(c, 0, 0, 4, rng);
    c.seq_cp(0, 1, 1, 3);
    const state_summary s = summarize_kv_state(payload_of(whole(c)), false);
    ASSERT_EQ(s.streams[0].seqs.size(), 2u);
    EXPECT_EQ(s.streams[0].n_cells, 4u);
    EXPECT_EQ(s.streams[0].seqs[1].n_cells, 2u);
    EXPECT_EQ(s.streams[0].seqs[1].pos_min, 1);
    EXPECT_EQ(s.streams[0].seqs[1].pos_max, 2);

    p.n_pos = 4;
    kv_cache m(p);
    decode(m, 0, 0, 3, rng, 4);
    const auto buf = whole(m);
    EXPECT_THROW(summarize_kv_state(payload_of(buf), false), error);
    EXPECT_TRUE(summarize_kv_state_any(payload_of(buf)).mrope);
}

TEST(state_summary, malformed_payloads_are_errors_never_crashes) {
    std::mt19937 rng(3);
    kv_cache c(params_for(dtype::q4_0, dtype::q8_0, false, true));
    decode(c, 1, 0, 3, rng);
    const auto buf = whole(c);
    const auto payload = payload_of(buf);
    for (size_t n = 0; n < payload.size(); ++n)
        EXPECT_THROW(summarize_kv_state(payload.first(n), false), error) << "truncated at " << n;
    std::vector<uint8_t> bad(payload.begin(), payload.end());
    bad.push_back(0);
    EXPECT_THROW(summarize_kv_state(bad, false), error);
    bad.pop_back();
    const uint64_t huge = ~uint64_t{0} / 2;
    std::memcpy(bad.data() + 8 + 3 * 12 + 8 + 4, &huge, 8);  // layer 0's K row size
    EXPECT_THROW(summarize_kv_state(bad, false), error);
}

}  // namespace
}  // namespace kvc
