#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>
#include <kvcache/dtype.h>
#include <kvcache/types.h>

namespace kvc {
namespace {

uint32_t bits(float f) {
    return std::bit_cast<uint32_t>(f);
}
float from_bits(uint32_t u) {
    return std::bit_cast<float>(u);
}

// Restores the process-wide kernel level after a test that changes it.
struct simd_guard {
    simd_level saved = simd_active();
    ~simd_guard() { set_simd_level(saved); }
};

std::vector<simd_level> vector_levels() {
    std::vector<simd_level> levels;
    for (simd_level l : {simd_level::avx2, simd_level::avx512})
        if (static_cast<int>(l) <= static_cast<int>(simd_supported())) levels.push_back(l);
    return levels;
}

// -- sizes and names --

TEST(dtype, block_layouts_match_ggml) {
    EXPECT_EQ(block_size(dtype::f32), 1);
    EXPECT_EQ(block_size(dtype::f16), 1);
    EXPECT_EQ(block_size(dtype::bf16), 1);
    EXPECT_EQ(block_size(dtype::q8_0), 32);
    EXPECT_EQ(block_size(dtype::q4_0), 32);
    EXPECT_EQ(type_size(dtype::f32), 4u);
    EXPECT_EQ(type_size(dtype::f16), 2u);
    EXPECT_EQ(type_size(dtype::bf16), 2u);
    EXPECT_EQ(type_size(dtype::q8_0), 34u);
    EXPECT_EQ(type_size(dtype::q4_0), 18u);
    // ggml type ids, as written into llama.cpp state payloads
    EXPECT_EQ(static_cast<int>(dtype::f32), 0);
    EXPECT_EQ(static_cast<int>(dtype::f16), 1);
    EXPECT_EQ(static_cast<int>(dtype::q4_0), 2);
    EXPECT_EQ(static_cast<int>(dtype::q8_0), 8);
    EXPECT_EQ(static_cast<int>(dtype::bf16), 30);
    EXPECT_TRUE(is_quantized(dtype::q4_0));
    EXPECT_FALSE(is_quantized(dtype::bf16));
}

TEST(dtype, row_size_counts_blocks) {
    EXPECT_EQ(row_size(dtype::f32, 128), 512u);
    EXPECT_EQ(row_size(dtype::f16, 7), 14u);
    EXPECT_EQ(row_size(dtype::q8_0, 128), 4u * 34u);
    EXPECT_EQ(row_size(dtype::q4_0, 4096), 128u * 18u);
    EXPECT_EQ(row_size(dtype::q4_0, 0), 0u);
}

TEST(dtype, row_size_rejects_partial_blocks_and_negative_counts) {
    try {
        (void)row_size(dtype::q8_0, 40);
        FAIL() << "no error";
    } catch (const error& e) {
        EXPECT_EQ(e.code(), errc::invalid_argument);
        EXPECT_NE(std::string(e.what()).find("40 values"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("q8_0"), std::string::npos) << e.what();
    }
    EXPECT_THROW((void)row_size(dtype::f16, -1), error);
    EXPECT_THROW((void)row_size(static_cast<dtype>(3), 32), error);
}

TEST(dtype, names_round_trip_and_unknown_names_are_rejected) {
    for (dtype t : all_dtypes) {
        EXPECT_EQ(dtype_from_name(to_string(t)), t);
        EXPECT_EQ(parse_dtype(to_string(t)), t);
        EXPECT_EQ(dtype_from_ggml(static_cast<int32_t>(t)), t);
    }
    EXPECT_EQ(dtype_from_name("F16"), std::nullopt);
    EXPECT_EQ(dtype_from_ggml(3), std::nullopt);  // ggml q4_1: not a kvcache type
    EXPECT_EQ(dtype_from_ggml(-1), std::nullopt);
    try {
        (void)parse_dtype("q5_1");
        FAIL() << "no error";
    } catch (const error& e) {
        EXPECT_EQ(std::string(e.what()),
                  "unknown element type 'q5_1' (expected one of: f32, f16, bf16, q8_0, q4_0)");
    }
}

// -- f16 --

// Decodes a half from its fields with ldexp: independent of the library's bit manipulation.
double half_value(uint16_t h) {
    const int e = (h >> 10) & 0x1f;
    const int m = h & 0x3ff;
    const double s = (h & 0x8000) ? -1.0 : 1.0;
    if (e == 0) return s * std::ldexp(m, -24);
    return s * std::ldexp(1024 + m, e - 25);
}

TEST(f16, all_65536_halves_decode_exactly_and_encode_back) {
    for (uint32_t u = 0; u <= 0xffff; ++u) {
        const auto h = static_cast<uint16_t>(u);
        const float f = fp16_to_fp32(h);
        const bool sign = (h & 0x8000) != 0;
        const int e = (h >> 10) & 0x1f;
        if (e == 0x1f && (h & 0x3ff)) {  // NaN: quiet, sign and payload kept
            ASSERT_TRUE(std::isnan(f)) << std::hex << h;
            EXPECT_EQ(std::signbit(f), sign);
            EXPECT_EQ((bits(f) >> 13) & 0x3ff, (h & 0x3ffu) | 0x200u) << std::hex << h;
            EXPECT_EQ(fp32_to_fp16(f), h | 0x200) << std::hex << h;
        } else if (e == 0x1f) {
            EXPECT_TRUE(std::isinf(f));
            EXPECT_EQ(std::signbit(f), sign);
            EXPECT_EQ(fp32_to_fp16(f), h);
        } else {
            ASSERT_EQ(static_cast<double>(f), half_value(h)) << std::hex << h;
            EXPECT_EQ(std::signbit(f), sign) << std::hex << h;  // -0 stays -0
            ASSERT_EQ(fp32_to_fp16(f), h) << std::hex << h;
        }
    }
}

// Round-to-nearest-even oracle over the sorted finite halves, in double arithmetic.
uint16_t oracle_fp16(float x) {
    static const std::vector<double> values = [] {
        std::vector<double> v;
        for (uint32_t h = 0; h <= 0x7bff; ++h) v.push_back(half_value(static_cast<uint16_t>(h)));
        return v;
    }();
    const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
    const double a = std::fabs(static_cast<double>(x));
    if (a >= 65520.0) return sign | 0x7c00;  // halfway between 65504 and 65536 and above -> inf
    const auto it = std::lower_bound(values.begin(), values.end(), a);
    if (it == values.end()) return sign | 0x7bff;  // (65504, 65520): nearer to 65504
    auto hi = static_cast<uint16_t>(it - values.begin());
    if (values[hi] == a || hi == 0) return sign | hi;
    const auto lo = static_cast<uint16_t>(hi - 1);
    const double dl = a - values[lo], dh = values[hi] - a;
    if (dl < dh || (dl == dh && (lo & 1) == 0)) return sign | lo;
    return sign | hi;
}

TEST(f16, rounding_matches_nearest_even_oracle) {
    // every midpoint between adjacent halves (a tie) and its float neighbours
    for (uint32_t h = 0; h < 0x7bff; ++h) {
        const double mid =
            (half_value(static_cast<uint16_t>(h)) + half_value(static_cast<uint16_t>(h + 1))) / 2;
        const auto m = static_cast<float>(mid);
        ASSERT_EQ(static_cast<double>(m), mid);  // midpoints are exact in float
        for (float x : {m, std::nextafter(m, 0.0f), std::nextafter(m, 1e9f), -m})
            ASSERT_EQ(fp32_to_fp16(x), oracle_fp16(x)) << x;
    }
    std::mt19937 rng(1);
    std::uniform_int_distribution<uint32_t> any(0, 0xffffffffu);
    for (int i = 0; i < 1000000; ++i) {
        const float x = from_bits(any(rng));
        if (std::isnan(x)) continue;
        ASSERT_EQ(fp32_to_fp16(x), oracle_fp16(x)) << std::hex << bits(x);
    }
}

TEST(f16, edge_values) {
    EXPECT_EQ(fp32_to_fp16(65504.0f), 0x7bff);
    EXPECT_EQ(fp32_to_fp16(65519.996f), 0x7bff);
    EXPECT_EQ(fp32_to_fp16(65520.0f), 0x7c00);  // overflow rounds to inf
    EXPECT_EQ(fp32_to_fp16(-1e10f), 0xfc00);
    EXPECT_EQ(fp32_to_fp16(0x1p-24f), 0x0001);      // smallest subnormal
    EXPECT_EQ(fp32_to_fp16(0x1p-25f), 0x0000);      // tie to even: 0
    EXPECT_EQ(fp32_to_fp16(0x1.8p-24f), 0x0002);    // tie to even: 2
    EXPECT_EQ(fp32_to_fp16(0x1.ff8p-15f), 0x03ff);  // largest subnormal
    EXPECT_EQ(fp32_to_fp16(0x1.ffcp-15f), 0x0400);  // tie above it rounds to even: the smallest normal
    EXPECT_EQ(fp32_to_fp16(1e-45f), 0x0000);        // float subnormal
    EXPECT_EQ(fp32_to_fp16(-0.0f), 0x8000);
    EXPECT_EQ(fp32_to_fp16(from_bits(0x7fa00000)), 0x7f00);  // signalling NaN is quietened, payload kept
}

// -- bf16 --

TEST(bf16, rounds_to_nearest_even_like_ggml) {
    EXPECT_EQ(fp32_to_bf16(1.0f), 0x3f80);
    EXPECT_EQ(fp32_to_bf16(from_bits(0x3f808000)), 0x3f80);              // tie, even stays
    EXPECT_EQ(fp32_to_bf16(from_bits(0x3f818000)), 0x3f82);              // tie, odd rounds up
    EXPECT_EQ(fp32_to_bf16(from_bits(0x3f808001)), 0x3f81);              // above the tie
    EXPECT_EQ(fp32_to_bf16(from_bits(0x3f807fff)), 0x3f80);              // below the tie
    EXPECT_EQ(fp32_to_bf16(from_bits(0xbf818000)), 0xbf82);              // negative
    EXPECT_EQ(fp32_to_bf16(std::numeric_limits<float>::max()), 0x7f80);  // overflow to inf
    EXPECT_EQ(fp32_to_bf16(from_bits(0x00018000)), 0x0002);  // subnormals are rounded, not flushed
    EXPECT_EQ(fp32_to_bf16(from_bits(0x00008000)), 0x0000);
    EXPECT_EQ(fp32_to_bf16(from_bits(0x7f800001)), 0x7fc0);  // NaN made quiet
    EXPECT_EQ(fp32_to_bf16(from_bits(0xff800001)), 0xffc0);
    EXPECT_EQ(fp32_to_bf16(-std::numeric_limits<float>::infinity()), 0xff80);
}

TEST(bf16, every_non_nan_value_round_trips) {
    for (uint32_t u = 0; u <= 0xffff; ++u) {
        const auto h = static_cast<uint16_t>(u);
        const float f = bf16_to_fp32(h);
        EXPECT_EQ(bits(f), u << 16);
        if (!std::isnan(f)) {
            ASSERT_EQ(fp32_to_bf16(f), h);
        }
    }
}

// -- q8_0 and q4_0 --

struct q8_block {
    uint16_t d;
    std::vector<int8_t> qs;
};

q8_block quantize_q8(const std::vector<float>& x) {
    std::vector<uint8_t> raw(34);
    from_f32(dtype::q8_0, x.data(), raw.data(), 32);
    q8_block b;
    std::memcpy(&b.d, raw.data(), 2);
    b.qs.assign(reinterpret_cast<int8_t*>(raw.data() + 2), reinterpret_cast<int8_t*>(raw.data() + 34));
    return b;
}

TEST(q8_0, hand_computed_block_with_unit_scale) {
    // amax = 127 -> d = 1 (half 0x3c00), id = 1: every value rounds half away from zero
    std::vector<float> x(32, 0.0f);
    const std::vector<float> in = {0.5f, -0.5f, 1.5f, 2.5f, -2.5f, 126.4f, 127.0f, -127.0f, 0.49f, -3.51f};
    const std::vector<int8_t> want = {1, -1, 2, 3, -3, 126, 127, -127, 0, -4};
    std::copy(in.begin(), in.end(), x.begin());
    const q8_block b = quantize_q8(x);
    EXPECT_EQ(b.d, 0x3c00);
    for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(b.qs[i], want[i]) << i;
    for (size_t i = want.size(); i < 32; ++i) EXPECT_EQ(b.qs[i], 0);
}

TEST(q8_0, hand_computed_block_with_scale_two) {
    // amax = 254 -> d = 2 (0x4000), id = 0.5
    std::vector<float> x(32, 0.0f);
    const std::vector<float> in = {254.0f, 3.0f, -3.0f, 5.0f, 1.0f, -1.0f, 2.9f};
    const std::vector<int8_t> want = {127, 2, -2, 3, 1, -1, 1};
    std::copy(in.begin(), in.end(), x.begin());
    const q8_block b = quantize_q8(x);
    EXPECT_EQ(b.d, 0x4000);
    for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(b.qs[i], want[i]) << i;
    std::vector<float> back(32);
    std::vector<uint8_t> raw(34);
    from_f32(dtype::q8_0, x.data(), raw.data(), 32);
    to_f32(dtype::q8_0, raw.data(), back.data(), 32);
    EXPECT_EQ(back[0], 254.0f);
    EXPECT_EQ(back[1], 4.0f);
    EXPECT_EQ(back[3], 6.0f);
}

TEST(q8_0, zero_block_has_zero_scale) {
    const q8_block b = quantize_q8(std::vector<float>(32, 0.0f));
    EXPECT_EQ(b.d, 0x0000);
    for (int8_t q : b.qs) EXPECT_EQ(q, 0);
}

std::vector<uint8_t> quantize_q4(const std::vector<float>& x) {
    std::vector<uint8_t> raw(18);
    from_f32(dtype::q4_0, x.data(), raw.data(), 32);
    return raw;
}
int nibble(const std::vector<uint8_t>& raw, int j) {
    return j < 16 ? raw[2 + j] & 0x0f : raw[2 + j - 16] >> 4;
}

TEST(q4_0, hand_computed_block_scale_from_signed_extreme) {
    // largest magnitude is -8 -> d = -8 / -8 = 1 (0x3c00), id = 1, q = trunc(x + 8.5) capped at 15
    std::vector<float> x(32, 0.0f);
    const std::vector<float> in = {-8.0f, 7.0f, 0.0f, 0.5f, -0.5f, -0.6f, 7.9f};
    const std::vector<int> want = {0, 15, 8, 9, 8, 7, 15};
    std::copy(in.begin(), in.end(), x.begin());
    x[16] = 3.0f;  // goes to the high nibble of byte 0
    const auto raw = quantize_q4(x);
    EXPECT_EQ(raw[0] | raw[1] << 8, 0x3c00);
    for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(nibble(raw, static_cast<int>(i)), want[i]) << i;
    EXPECT_EQ(nibble(raw, 16), 11);
    EXPECT_EQ(raw[2], 0 | (11 << 4));
}

TEST(q4_0, first_of_equal_magnitudes_gives_the_sign) {
    // +8 comes first -> d = 8 / -8 = -1 (0xbc00): +8 maps to q = 0, -8 to q = 16 -> 15
    std::vector<float> x(32, 0.0f);
    x[3] = 8.0f;
    x[20] = -8.0f;
    auto raw = quantize_q4(x);
    EXPECT_EQ(raw[0] | raw[1] << 8, 0xbc00);
    EXPECT_EQ(nibble(raw, 3), 0);
    EXPECT_EQ(nibble(raw, 20), 15);
    std::swap(x[3], x[20]);  // now -8 comes first
    raw = quantize_q4(x);
    EXPECT_EQ(raw[0] | raw[1] << 8, 0x3c00);
}

TEST(q4_0, zero_block_has_negative_zero_scale_like_ggml) {
    // ggml: max starts at +0, d = 0 / -8 = -0
    for (float z : {0.0f, -0.0f}) {
        const auto raw = quantize_q4(std::vector<float>(32, z));
        EXPECT_EQ(raw[0] | raw[1] << 8, 0x8000);
        for (int j = 0; j < 32; ++j) EXPECT_EQ(nibble(raw, j), 8);
    }
}

TEST(quantized, error_bounds_on_random_data) {
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const int64_t n = 32 * 4096;
    std::vector<float> x(n), back(n);
    for (auto& v : x) v = normal(rng) * 3.0f;
    for (dtype t : {dtype::q8_0, dtype::q4_0}) {
        std::vector<uint8_t> raw(row_size(t, n));
        from_f32(t, x.data(), raw.data(), n);
        to_f32(t, raw.data(), back.data(), n);
        for (int64_t b = 0; b < n / 32; ++b) {
            float amax = 0;
            for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[b * 32 + j]));
            // q8_0: half a step plus the fp16 rounding of the scale; q4_0: one step (the +8 side clips at 15)
            const float bound = t == dtype::q8_0 ? 0.5f * amax / 127 * 1.2f : amax / 8 * 1.01f;
            for (int j = 0; j < 32; ++j)
                ASSERT_LE(std::fabs(back[b * 32 + j] - x[b * 32 + j]), bound)
                    << to_string(t) << " block " << b;
        }
    }
}

TEST(quantized, non_finite_input_is_defined) {
    std::vector<float> x(32, 1.0f);
    x[5] = NAN;
    std::vector<float> back(32);
    for (dtype t : {dtype::q8_0, dtype::q4_0}) {
        std::vector<uint8_t> raw(row_size(t, 32));
        from_f32(t, x.data(), raw.data(), 32);
        to_f32(t, raw.data(), back.data(), 32);
        EXPECT_TRUE(std::isnan(back[0])) << to_string(t) << ": a NaN poisons its block's scale";
    }
}

// -- rows, errors --

TEST(rows, reject_bad_counts_types_and_null_pointers) {
    std::vector<float> x(64);
    std::vector<uint8_t> y(1024);
    EXPECT_THROW(from_f32(dtype::q8_0, x.data(), y.data(), 33), error);
    EXPECT_THROW(to_f32(dtype::q4_0, y.data(), x.data(), 16), error);
    EXPECT_THROW(from_f32(static_cast<dtype>(99), x.data(), y.data(), 32), error);
    EXPECT_THROW(from_f32(dtype::f16, nullptr, y.data(), 32), error);
    EXPECT_NO_THROW(from_f32(dtype::f16, nullptr, nullptr, 0));
}

TEST(rows, convert_row_goes_through_f32) {
    std::mt19937 rng(3);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const int64_t n = 32 * 300;  // more than one internal chunk
    std::vector<float> x(n), mid(n);
    for (auto& v : x) v = normal(rng);
    std::vector<uint8_t> f16(row_size(dtype::f16, n)), q(row_size(dtype::q8_0, n)), want(q.size());
    from_f32(dtype::f16, x.data(), f16.data(), n);
    convert_row(dtype::f16, f16.data(), dtype::q8_0, q.data(), n);
    to_f32(dtype::f16, f16.data(), mid.data(), n);
    from_f32(dtype::q8_0, mid.data(), want.data(), n);
    EXPECT_EQ(q, want);
    std::vector<uint8_t> same(f16.size());
    convert_row(dtype::f16, f16.data(), dtype::f16, same.data(), n);
    EXPECT_EQ(same, f16);
}

// -- vectorised == scalar --

// Inputs that stress every branch: normal data, random bit patterns (NaN, inf, subnormals), exact
// ties after scaling, zero and negative-zero blocks, equal magnitudes of both signs.
std::vector<float> stress_input(int64_t n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_int_distribution<uint32_t> any(0, 0xffffffffu);
    std::uniform_int_distribution<int> small(-127, 127);
    std::vector<float> x(n);
    for (int64_t b = 0; b < n / 32; ++b) {
        float* p = x.data() + b * 32;
        switch (b % 7) {
            case 0:
                for (int j = 0; j < 32; ++j) p[j] = normal(rng);
                break;
            case 1:
                for (int j = 0; j < 32; ++j) p[j] = from_bits(any(rng));
                break;
            case 2:
                for (int j = 0; j < 32; ++j) p[j] = static_cast<float>(small(rng)) + 0.5f;
                break;
            case 3:
                for (int j = 0; j < 32; ++j) p[j] = (j % 2) ? 0.0f : -0.0f;
                break;
            case 4:
                for (int j = 0; j < 32; ++j) p[j] = (j % 3 == 0 ? -1.0f : 1.0f) * 4.0f;
                break;
            case 5:
                for (int j = 0; j < 32; ++j) p[j] = normal(rng) * 1e-40f;
                break;  // subnormal range
            default:
                for (int j = 0; j < 32; ++j) p[j] = normal(rng) * (j == 7 ? 1e30f : 1.0f);
                break;
        }
    }
    for (int64_t i = n / 32 * 32; i < n; ++i) x[i] = normal(rng);
    return x;
}

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<uint8_t> v(n);
    for (auto& b : v) b = static_cast<uint8_t>(rng());
    return v;
}

TEST(simd, every_level_matches_scalar_bit_for_bit) {
    const auto levels = vector_levels();
    if (levels.empty()) GTEST_SKIP() << "no vector kernels on this CPU";
    simd_guard guard;
    for (dtype t : all_dtypes) {
        // odd lengths for the float types exercise the scalar tails of the vector loops
        std::vector<int64_t> lengths = {32, 64, 96, 32 * 1000};
        if (!is_quantized(t))
            for (int64_t n = 1; n < 70; ++n) lengths.push_back(n);
        for (int64_t n : lengths) {
            const auto x = stress_input(n, static_cast<uint32_t>(n));
            const auto raw = random_bytes(row_size(t, n), static_cast<uint32_t>(n) + 1);
            set_simd_level(simd_level::scalar);
            std::vector<uint8_t> enc_ref(row_size(t, n));
            std::vector<float> dec_ref(n);
            from_f32(t, x.data(), enc_ref.data(), n);
            to_f32(t, raw.data(), dec_ref.data(), n);
            for (simd_level l : levels) {
                ASSERT_EQ(set_simd_level(l), l);
                std::vector<uint8_t> enc(row_size(t, n));
                std::vector<float> dec(n);
                from_f32(t, x.data(), enc.data(), n);
                to_f32(t, raw.data(), dec.data(), n);
                ASSERT_EQ(enc, enc_ref) << to_string(t) << " encode n=" << n << " level " << to_string(l);
                ASSERT_EQ(std::memcmp(dec.data(), dec_ref.data(), n * sizeof(float)), 0)
                    << to_string(t) << " decode n=" << n << " level " << to_string(l);
            }
        }
    }
}

TEST(simd, unaligned_rows_are_fine) {
    simd_guard guard;
    const int64_t n = 64;
    const auto x = stress_input(n, 11);
    for (dtype t : {dtype::f16, dtype::bf16, dtype::q8_0, dtype::q4_0}) {
        std::vector<uint8_t> aligned(row_size(t, n)), shifted(row_size(t, n) + 1);
        from_f32(t, x.data(), aligned.data(), n);
        from_f32(t, x.data(), shifted.data() + 1, n);
        EXPECT_EQ(std::memcmp(aligned.data(), shifted.data() + 1, aligned.size()), 0) << to_string(t);
    }
}

TEST(simd, level_selection_is_clamped_to_the_cpu) {
    simd_guard guard;
    EXPECT_EQ(set_simd_level(simd_level::scalar), simd_level::scalar);
    EXPECT_EQ(simd_active(), simd_level::scalar);
    EXPECT_EQ(set_simd_level(simd_level::avx512), simd_supported());
    EXPECT_STREQ(to_string(simd_level::avx2), "avx2");
}

}  // namespace
}  // namespace kvc
