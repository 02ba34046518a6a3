#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <vector>

#include <fmt/format.h>
#include <kvcache/dtype.h>
#include <kvcache/types.h>

#include "dtype/dtype_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace kvc {

// -- sizes and names --

int64_t block_size(dtype type) {
    switch (type) {
        case dtype::q8_0:
            return qk8_0;
        case dtype::q4_0:
            return qk4_0;
        default:
            return 1;
    }
}

size_t type_size(dtype type) {
    switch (type) {
        case dtype::f32:
            return 4;
        case dtype::f16:
        case dtype::bf16:
            return 2;
        case dtype::q8_0:
            return sizeof(block_q8_0);
        case dtype::q4_0:
            return sizeof(block_q4_0);
    }
    return 0;
}

bool is_quantized(dtype type) {
    return type == dtype::q8_0 || type == dtype::q4_0;
}

bool is_valid(dtype type) {
    return std::find(all_dtypes.begin(), all_dtypes.end(), type) != all_dtypes.end();
}

static void check_type(dtype type, const char* what) {
    if (!is_valid(type))
        throw error(errc::invalid_argument,
                    fmt::format("{}: invalid dtype value {}", what, static_cast<int32_t>(type)));
}

size_t row_size(dtype type, int64_t n) {
    check_type(type, "row_size");
    if (n < 0) throw error(errc::invalid_argument, fmt::format("row_size: negative value count {}", n));
    if (n % block_size(type) != 0)
        throw error(errc::invalid_argument,
                    fmt::format("row_size: {} values is not a whole number of {} blocks "
                                "({} values each)",
                                n, to_string(type), block_size(type)));
    return static_cast<size_t>(n / block_size(type)) * type_size(type);
}

const char* to_string(dtype type) {
    switch (type) {
        case dtype::f32:
            return "f32";
        case dtype::f16:
            return "f16";
        case dtype::bf16:
            return "bf16";
        case dtype::q8_0:
            return "q8_0";
        case dtype::q4_0:
            return "q4_0";
    }
    return "invalid";
}

std::optional<dtype> dtype_from_name(std::string_view name) {
    for (dtype t : all_dtypes)
        if (name == to_string(t)) return t;
    return std::nullopt;
}

dtype parse_dtype(std::string_view name) {
    if (auto t = dtype_from_name(name)) return *t;
    throw error(errc::invalid_argument,
                fmt::format("unknown element type '{}' (expected one of: f32, f16, bf16, q8_0, q4_0)", name));
}

std::optional<dtype> dtype_from_ggml(int32_t ggml_type) {
    const auto t = static_cast<dtype>(ggml_type);
    if (is_valid(t)) return t;
    return std::nullopt;
}

// -- scalar conversions --
// f16 conversions reproduce the x86 F16C instructions exactly, NaN payloads included, so that the
// vector kernels and this code agree on every input.

uint16_t fp32_to_fp16(float f) {
    const uint32_t x = std::bit_cast<uint32_t>(f);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));  // quiet NaN
    if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to inf
    if (ax >= 0x38800000u) {  // normal half: rebias the exponent, round the 13 dropped bits to even
        const uint32_t m = ax - (112u << 23);
        return static_cast<uint16_t>(sign | ((m + 0xfffu + ((m >> 13) & 1u)) >> 13));
    }
    // Subnormal half (unit 2^-24) or zero: shift the full significand, round to nearest even.
    const uint32_t e = ax >> 23;
    const int shift = 126 - static_cast<int>(e);
    if (e == 0 || shift > 24) return static_cast<uint16_t>(sign);
    const uint32_t mant = (ax & 0x7fffffu) | 0x800000u;
    uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
}

float fp16_to_fp32(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t e = (h >> 10) & 0x1fu;
    const uint32_t m = h & 0x3ffu;
    if (e == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (m ? 0x400000u | (m << 13) : 0u));
    if (e == 0) {
        const float v = static_cast<float>(m) * 0x1p-24f;  // exact
        return std::bit_cast<float>(sign | std::bit_cast<uint32_t>(v));
    }
    return std::bit_cast<float>(sign | ((e + 112u) << 23) | (m << 13));
}

uint16_t fp32_to_bf16(float f) {
    const uint32_t u = std::bit_cast<uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 64u);  // quiet NaN
    return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

float bf16_to_fp32(uint16_t h) {
    return std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
}

namespace detail {
namespace {

uint16_t load_u16(const uint8_t* p) {
    uint16_t v;
    std::memcpy(&v, p, sizeof v);
    return v;
}
void store_u16(uint8_t* p, uint16_t v) {
    std::memcpy(p, &v, sizeof v);
}

void s_f32_to_f16(const float* x, uint8_t* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) store_u16(y + 2 * i, fp32_to_fp16(x[i]));
}
void s_f16_to_f32(const uint8_t* x, float* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = fp16_to_fp32(load_u16(x + 2 * i));
}
void s_f32_to_bf16(const float* x, uint8_t* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) store_u16(y + 2 * i, fp32_to_bf16(x[i]));
}
void s_bf16_to_f32(const uint8_t* x, float* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = bf16_to_fp32(load_u16(x + 2 * i));
}

// Comparisons written as the vector max/min instructions behave: a NaN operand yields the bound.
float clamp_like_simd(float v, float lo, float hi) {
    v = v > lo ? v : lo;
    return v < hi ? v : hi;
}

void s_f32_to_q8_0(const float* x, uint8_t* y, int64_t n) {
    for (int64_t b = 0; b < n / qk8_0; ++b, x += qk8_0, y += sizeof(block_q8_0)) {
        float amax = 0.0f;
        bool nan = false;
        for (int64_t j = 0; j < qk8_0; ++j) {
            const float a = std::fabs(x[j]);
            amax = a > amax ? a : amax;
            nan |= std::isnan(x[j]);
        }
        if (nan) amax = NAN;
        const float d = q8_0_scale(amax);
        const float id = inverse_scale(d);
        store_scale(y, d);
        auto* qs = reinterpret_cast<int8_t*>(y + 2);
        for (int64_t j = 0; j < qk8_0; ++j)
            qs[j] = static_cast<int8_t>(clamp_like_simd(std::round(x[j] * id), -127.0f, 127.0f));
    }
}

void s_q8_0_to_f32(const uint8_t* x, float* y, int64_t n) {
    for (int64_t b = 0; b < n / qk8_0; ++b, x += sizeof(block_q8_0), y += qk8_0) {
        const float d = load_scale(x);
        const auto* qs = reinterpret_cast<const int8_t*>(x + 2);
        for (int64_t j = 0; j < qk8_0; ++j) y[j] = static_cast<float>(qs[j]) * d;
    }
}

void s_f32_to_q4_0(const float* x, uint8_t* y, int64_t n) {
    for (int64_t b = 0; b < n / qk4_0; ++b, x += qk4_0, y += sizeof(block_q4_0)) {
        float amax = 0.0f;
        float max = 0.0f;  // the first value of largest magnitude, signed (ggml: strict <)
        bool nan = false;
        for (int64_t j = 0; j < qk4_0; ++j) {
            const float a = std::fabs(x[j]);
            if (amax < a) {
                amax = a;
                max = x[j];
            }
            nan |= std::isnan(x[j]);
        }
        if (nan) max = NAN;
        const float d = q4_0_scale(max);
        const float id = inverse_scale(d);
        store_scale(y, d);
        uint8_t* qs = y + 2;
        for (int64_t j = 0; j < qk4_0 / 2; ++j) {
            const auto q0 = static_cast<uint8_t>(clamp_like_simd(x[j] * id + 8.5f, 0.0f, 15.0f));
            const auto q1 = static_cast<uint8_t>(clamp_like_simd(x[j + qk4_0 / 2] * id + 8.5f, 0.0f, 15.0f));
            qs[j] = static_cast<uint8_t>(q0 | (q1 << 4));
        }
    }
}

void s_q4_0_to_f32(const uint8_t* x, float* y, int64_t n) {
    for (int64_t b = 0; b < n / qk4_0; ++b, x += sizeof(block_q4_0), y += qk4_0) {
        const float d = load_scale(x);
        const uint8_t* qs = x + 2;
        for (int64_t j = 0; j < qk4_0 / 2; ++j) {
            y[j] = static_cast<float>((qs[j] & 0x0f) - 8) * d;
            y[j + qk4_0 / 2] = static_cast<float>((qs[j] >> 4) - 8) * d;
        }
    }
}

}  // namespace

const dtype_kernels& scalar_kernels() {
    static const dtype_kernels k = {s_f32_to_f16,  s_f16_to_f32,  s_f32_to_bf16, s_bf16_to_f32,
                                    s_f32_to_q8_0, s_q8_0_to_f32, s_f32_to_q4_0, s_q4_0_to_f32};
    return k;
}

}  // namespace detail

// -- kernel selection --

namespace {

// F16C is read from CPUID directly: not every compiler's __builtin_cpu_supports knows it.
bool cpu_has_f16c() {
#if defined(__x86_64__) || defined(__i386__)
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
#else
    return false;
#endif
}

simd_level detect_simd() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();  // the builtins below also check that the OS saves the vector registers
    const bool avx2 = __builtin_cpu_supports("avx2") && cpu_has_f16c();
    if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        detail::x86_kernels(simd_level::avx512))
        return simd_level::avx512;
    if (avx2 && detail::x86_kernels(simd_level::avx2)) return simd_level::avx2;
#endif
    return simd_level::scalar;
}

const detail::dtype_kernels& kernels_for(simd_level level) {
    if (level == simd_level::scalar) return detail::scalar_kernels();
    return *detail::x86_kernels(level);
}

struct active_kernels {
    std::atomic<simd_level> level{simd_supported()};
};

active_kernels& active() {
    static active_kernels a;
    return a;
}

const detail::dtype_kernels& current() {
    return kernels_for(active().level.load(std::memory_order_relaxed));
}

void check_row(dtype type, int64_t n, const void* src, const void* dst, const char* what) {
    check_type(type, what);
    if (n < 0 || n % block_size(type) != 0)
        throw error(errc::invalid_argument,
                    fmt::format("{}: {} values is not a whole number of {} blocks ({} values each)", what, n,
                                to_string(type), block_size(type)));
    if (n > 0 && (src == nullptr || dst == nullptr))
        throw error(errc::invalid_argument, fmt::format("{}: null row pointer for {} values", what, n));
}

}  // namespace

const char* to_string(simd_level level) {
    switch (level) {
        case simd_level::scalar:
            return "scalar";
        case simd_level::avx2:
            return "avx2";
        case simd_level::avx512:
            return "avx512";
    }
    return "unknown";
}

simd_level simd_supported() {
    static const simd_level level = detect_simd();
    return level;
}

simd_level simd_active() {
    return active().level.load(std::memory_order_relaxed);
}

simd_level set_simd_level(simd_level level) {
    const simd_level best = simd_supported();
    const simd_level chosen = static_cast<uint8_t>(level) <= static_cast<uint8_t>(best) ? level : best;
    active().level.store(chosen, std::memory_order_relaxed);
    return chosen;
}

// -- rows --

void from_f32(dtype type, const float* src, void* dst, int64_t n) {
    check_row(type, n, src, dst, "from_f32");
    if (n == 0) return;
    auto* y = static_cast<uint8_t*>(dst);
    const detail::dtype_kernels& k = current();
    switch (type) {
        case dtype::f32:
            std::memmove(dst, src, static_cast<size_t>(n) * sizeof(float));
            break;
        case dtype::f16:
            k.f32_to_f16(src, y, n);
            break;
        case dtype::bf16:
            k.f32_to_bf16(src, y, n);
            break;
        case dtype::q8_0:
            k.f32_to_q8_0(src, y, n);
            break;
        case dtype::q4_0:
            k.f32_to_q4_0(src, y, n);
            break;
    }
}

void to_f32(dtype type, const void* src, float* dst, int64_t n) {
    check_row(type, n, src, dst, "to_f32");
    if (n == 0) return;
    const auto* x = static_cast<const uint8_t*>(src);
    const detail::dtype_kernels& k = current();
    switch (type) {
        case dtype::f32:
            std::memmove(dst, src, static_cast<size_t>(n) * sizeof(float));
            break;
        case dtype::f16:
            k.f16_to_f32(x, dst, n);
            break;
        case dtype::bf16:
            k.bf16_to_f32(x, dst, n);
            break;
        case dtype::q8_0:
            k.q8_0_to_f32(x, dst, n);
            break;
        case dtype::q4_0:
            k.q4_0_to_f32(x, dst, n);
            break;
    }
}

void convert_row(dtype src_type, const void* src, dtype dst_type, void* dst, int64_t n) {
    check_row(src_type, n, src, dst, "convert_row");
    check_row(dst_type, n, src, dst, "convert_row");
    if (n == 0) return;
    if (src_type == dst_type) {
        std::memmove(dst, src, row_size(src_type, n));
        return;
    }
    if (src_type == dtype::f32) return from_f32(dst_type, static_cast<const float*>(src), dst, n);
    if (dst_type == dtype::f32) return to_f32(src_type, src, static_cast<float*>(dst), n);
    // Through a bounded f32 scratch, a whole number of blocks at a time.
    constexpr int64_t chunk = 4096;
    thread_local std::vector<float> scratch(chunk);
    const auto* x = static_cast<const uint8_t*>(src);
    auto* y = static_cast<uint8_t*>(dst);
    for (int64_t i = 0; i < n; i += chunk) {
        const int64_t m = std::min(chunk, n - i);
        to_f32(src_type, x + row_size(src_type, i), scratch.data(), m);
        from_f32(dst_type, scratch.data(), y + row_size(dst_type, i), m);
    }
}

}  // namespace kvc
