#include <bit>
#include <cmath>
#include <random>
#include <vector>

#include <gtest/gtest.h>
#include <kvcache/ops.h>

namespace kvc {
namespace {

// RoPE written from the formulas in double precision, pair by pair (no YaRN): the reference.
std::vector<float> reference_rope(std::vector<float> x, uint32_t n_head, uint32_t head_dim, uint32_t n_rot,
                                  double pos, double base, double scale, bool neox) {
    for (uint32_t h = 0; h < n_head; ++h)
        for (uint32_t k = 0; k < n_rot / 2; ++k) {
            const double theta = scale * pos * std::pow(base, -2.0 * k / n_rot);
            const uint32_t i0 = h * head_dim + (neox ? k : 2 * k);
            const uint32_t i1 = h * head_dim + (neox ? k + n_rot / 2 : 2 * k + 1);
            const double a = x[i0], b = x[i1];
            x[i0] = static_cast<float>(a * std::cos(theta) - b * std::sin(theta));
            x[i1] = static_cast<float>(a * std::sin(theta) + b * std::cos(theta));
        }
    return x;
}

TEST(rope, matches_the_formula_for_normal_and_neox) {
    std::mt19937 rng(3);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (rope_type t : {rope_type::normal, rope_type::neox}) {
        std::vector<float> x(2 * 64);
        for (float& v : x) v = normal(rng);
        const rope_params p{.type = t, .n_rot = 48, .freq_base = 10000.0f, .freq_scale = 0.25f};
        std::vector<float> got = x;
        ops::rope(got, 2, 64, 123, p);
        const auto want = reference_rope(x, 2, 64, 48, 123, 10000.0, 0.25, t == rope_type::neox);
        for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(got[i], want[i], 2e-4) << to_string(t) << " " << i;
        for (size_t i = 48; i < 64; ++i) EXPECT_EQ(got[i], x[i]) << "dims past n_rot are untouched";
    }
}

// apply_rope (vector path where the CPU has one) gives exactly the bits of the pair rotation in f32,
// x0 * c - x1 * s and x0 * s + x1 * c, with tails that do not fill a vector (n_rot 44, head of 52).
TEST(rope, table_rotation_is_bit_exact_pair_by_pair) {
    std::mt19937 rng(8);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    for (rope_type t : {rope_type::normal, rope_type::neox})
        for (pos_t pos : {1, 77, -5000}) {
            const rope_params p{
                .type = t, .n_rot = 44, .freq_base = 10000.0f, .ext_factor = 0.5f, .n_ctx_orig = 64};
            const ops::rope_table tab = ops::make_rope_table(52, pos, p, false);
            std::vector<float> x(3 * 52);
            for (float& v : x) v = normal(rng);
            std::vector<float> got = x;
            ops::apply_rope(got, 3, 52, tab);
            std::vector<float> want = x;
            for (uint32_t h = 0; h < 3; ++h)
                for (uint32_t k = 0; k < 22; ++k) {
                    const uint32_t i0 = h * 52 + (t == rope_type::neox ? k : 2 * k);
                    const uint32_t i1 = h * 52 + (t == rope_type::neox ? k + 22 : 2 * k + 1);
                    const uint32_t d0 = i0 - h * 52;
                    const float c = tab.c[d0], sn = tab.s[i1 - h * 52];
                    ASSERT_EQ(tab.c[i1 - h * 52], c);
                    ASSERT_EQ(tab.s[d0], -sn);
                    want[i0] = x[i0] * c - x[i1] * sn;
                    want[i1] = x[i0] * sn + x[i1] * c;
                }
            for (size_t i = 0; i < x.size(); ++i)
                ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want[i]))
                    << to_string(t) << " pos " << pos << " value " << i;
        }
}

TEST(rope, a_pure_rotation_composes_with_yarn) {
    // design D5: rotating by d after p equals rotating by p + d, also with YaRN's ramp
    std::mt19937 rng(4);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const rope_params p{.type = rope_type::neox,
                        .n_rot = 64,
                        .freq_base = 500000.0f,
                        .freq_scale = 0.125f,
                        .ext_factor = 1.0f,
                        .attn_factor = 1.0f,
                        .n_ctx_orig = 8192};
    std::vector<float> x(64);
    for (float& v : x) v = normal(rng);
    std::vector<float> a = x, b = x;
    ops::rope(a, 1, 64, 1000, p, false);
    ops::rope(a, 1, 64, -300, p, false);
    ops::rope(b, 1, 64, 700, p, false);
    for (size_t i = 0; i < 64; ++i) EXPECT_NEAR(a[i], b[i], 2e-3) << i;
    // the magnitude factor is applied only when asked for
    std::vector<float> m = x;
    ops::rope(m, 1, 64, 0, p, true);
    const float mscale = 1.0f + 0.1f * std::log(1.0f / 0.125f);
    EXPECT_NEAR(m[0], x[0] * mscale, 1e-5);
}

TEST(rope, rejects_bad_shapes) {
    std::vector<float> x(10);
    EXPECT_THROW(ops::rope(x, 2, 4, 1, {}), error);              // 10 values for 2 x 4
    EXPECT_THROW(ops::rope(x, 1, 10, 1, {.n_rot = 3}), error);   // odd
    EXPECT_THROW(ops::rope(x, 1, 10, 1, {.n_rot = 12}), error);  // past the head
    std::vector<float> y = x;
    ops::rope(y, 1, 10, 5, {.type = rope_type::none});
    EXPECT_EQ(y, x);
}

}  // namespace
}  // namespace kvc
