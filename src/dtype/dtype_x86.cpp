// AVX2 + F16C and AVX-512 conversion kernels. Compiled for the baseline target: each kernel carries its
// own target attribute and runs only after dtype.cpp checked the CPU, so no AVX instruction leaks into
// code shared with other translation units.
//
// Each kernel mirrors its scalar twin in dtype.cpp operation for operation (same products, same
// rounding, same NaN handling of max/min), so that the output bytes are identical.
#include <cstring>

#include "dtype/dtype_kernels.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KVC_HAVE_X86_KERNELS 1
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's AVX-512 headers start from _mm512_undefined_*() and trip -Wmaybe-uninitialized, and with
// sanitizers -Wuninitialized (GCC PR 105593).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>
#endif

namespace kvc::detail {

#if KVC_HAVE_X86_KERNELS
namespace {

#define KVC_AVX2 __attribute__((target("avx2,f16c")))
#define KVC_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c")))

// ---------------------------------------------------------------- AVX2 + F16C

// Block scales through F16C rather than a call to the software conversion per block: the same bits as
// fp32_to_fp16 / fp16_to_fp32 for every input (all 2^32 floats and 2^16 halves were compared).
KVC_AVX2 inline void store_scale_f16c(uint8_t* y, float d) {
    const auto h =
        static_cast<uint16_t>(_mm_extract_epi16(_mm_cvtps_ph(_mm_set_ss(d), _MM_FROUND_TO_NEAREST_INT), 0));
    std::memcpy(y, &h, sizeof h);
}

KVC_AVX2 inline float load_scale_f16c(const uint8_t* x) {
    uint16_t h;
    std::memcpy(&h, x, sizeof h);
    return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
}

KVC_AVX2 void avx2_f32_to_f16(const float* x, uint8_t* y, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m128i a = _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT);
        const __m128i b = _mm256_cvtps_ph(_mm256_loadu_ps(x + i + 8), _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(y + 2 * i), a);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(y + 2 * i + 16), b);
    }
    scalar_kernels().f32_to_f16(x + i, y + 2 * i, n - i);
}

KVC_AVX2 void avx2_f16_to_f32(const uint8_t* x, float* y, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 2 * i));
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 2 * i + 16));
        _mm256_storeu_ps(y + i, _mm256_cvtph_ps(a));
        _mm256_storeu_ps(y + i + 8, _mm256_cvtph_ps(b));
    }
    scalar_kernels().f16_to_f32(x + 2 * i, y + i, n - i);
}

// bf16 by integer arithmetic: the BF16 instructions flush subnormals, ggml's rounding does not.
KVC_AVX2 __m256i avx2_bf16_bits(__m256i u) {
    const __m256i abs = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    const __m256i is_nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f800000));
    const __m256i hi = _mm256_srli_epi32(u, 16);
    const __m256i nan = _mm256_or_si256(hi, _mm256_set1_epi32(64));
    const __m256i bias =
        _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(hi, _mm256_set1_epi32(1)));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    return _mm256_blendv_epi8(rounded, nan, is_nan);
}

KVC_AVX2 void avx2_f32_to_bf16(const float* x, uint8_t* y, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256i a = avx2_bf16_bits(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)));
        const __m256i b = avx2_bf16_bits(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i + 8)));
        // packus works per 128-bit lane: [a0-3 b0-3 a4-7 b4-7] -> reorder the 64-bit quarters.
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xd8);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + 2 * i), packed);
    }
    scalar_kernels().f32_to_bf16(x + i, y + 2 * i, n - i);
}

KVC_AVX2 void avx2_bf16_to_f32(const uint8_t* x, float* y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 2 * i));
        const __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), u);
    }
    scalar_kernels().bf16_to_f32(x + 2 * i, y + i, n - i);
}

KVC_AVX2 float avx2_hmax(__m256 v) {  // no NaN lanes by construction
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

// Largest |x| over the non-NaN lanes of 32 values; *nan tells whether a NaN was seen.
KVC_AVX2 float avx2_amax32(const __m256 v[4], const __m256 a[4], bool* nan) {
    __m256 m = _mm256_setzero_ps();
    __m256 unord = _mm256_setzero_ps();
    for (int k = 0; k < 4; ++k) {
        m = _mm256_max_ps(a[k], m);  // a NaN in a[k] yields m, as the scalar `a > amax ? a : amax`
        unord = _mm256_or_ps(unord, _mm256_cmp_ps(v[k], v[k], _CMP_UNORD_Q));
    }
    *nan = _mm256_movemask_ps(unord) != 0;
    return avx2_hmax(m);
}

// roundf(): half away from zero. x - trunc(x) is exact, so the comparison with 0.5 is too.
KVC_AVX2 __m256 avx2_round_away(__m256 x) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 t = _mm256_round_ps(x, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 frac = _mm256_andnot_ps(sign, _mm256_sub_ps(x, t));
    const __m256 up = _mm256_cmp_ps(frac, _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    const __m256 one = _mm256_or_ps(_mm256_and_ps(x, sign), _mm256_set1_ps(1.0f));
    return _mm256_add_ps(t, _mm256_and_ps(up, one));
}

KVC_AVX2 void avx2_f32_to_q8_0(const float* x, uint8_t* y, int64_t n) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t b = 0; b < n / qk8_0; ++b, x += qk8_0, y += sizeof(block_q8_0)) {
        __m256 v[4], a[4];
        for (int k = 0; k < 4; ++k) {
            v[k] = _mm256_loadu_ps(x + 8 * k);
            a[k] = _mm256_and_ps(v[k], abs_mask);
        }
        bool nan = false;
        float amax = avx2_amax32(v, a, &nan);
        if (nan) amax = NAN;
        const float d = q8_0_scale(amax);
        const __m256 id = _mm256_set1_ps(inverse_scale(d));
        store_scale_f16c(y, d);
        __m256i q[4];
        for (int k = 0; k < 4; ++k) {
            __m256 r = avx2_round_away(_mm256_mul_ps(v[k], id));
            r = _mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
            q[k] = _mm256_cvttps_epi32(r);
        }
        // 32 x int32 -> 32 x int8: the packs interleave 128-bit lanes, the permute restores the order.
        const __m256i p01 = _mm256_packs_epi32(q[0], q[1]);
        const __m256i p23 = _mm256_packs_epi32(q[2], q[3]);
        const __m256i p = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23),
                                                      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + 2), p);
    }
}

KVC_AVX2 void avx2_q8_0_to_f32(const uint8_t* x, float* y, int64_t n) {
    for (int64_t b = 0; b < n / qk8_0; ++b, x += sizeof(block_q8_0), y += qk8_0) {
        const __m256 d = _mm256_set1_ps(load_scale_f16c(x));
        for (int k = 0; k < 4; ++k) {
            const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(x + 2 + 8 * k));
            const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8));
            _mm256_storeu_ps(y + 8 * k, _mm256_mul_ps(q, d));
        }
    }
}

KVC_AVX2 void avx2_f32_to_q4_0(const float* x, uint8_t* y, int64_t n) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t b = 0; b < n / qk4_0; ++b, x += qk4_0, y += sizeof(block_q4_0)) {
        __m256 v[4], a[4];
        for (int k = 0; k < 4; ++k) {
            v[k] = _mm256_loadu_ps(x + 8 * k);
            a[k] = _mm256_and_ps(v[k], abs_mask);
        }
        bool nan = false;
        const float amax = avx2_amax32(v, a, &nan);
        float max = 0.0f;  // as the scalar loop: +0 unless some |x| > 0; else the first x with |x| == amax
        if (amax > 0.0f) {
            const __m256 target = _mm256_set1_ps(amax);
            for (int k = 0; k < 4; ++k) {
                const int hits = _mm256_movemask_ps(_mm256_cmp_ps(a[k], target, _CMP_EQ_OQ));
                if (hits) {
                    max = x[8 * k + __builtin_ctz(static_cast<unsigned>(hits))];
                    break;
                }
            }
        }
        if (nan) max = NAN;
        const float d = q4_0_scale(max);
        const __m256 id = _mm256_set1_ps(inverse_scale(d));
        store_scale_f16c(y, d);
        __m256i q[4];
        for (int k = 0; k < 4; ++k) {
            __m256 t = _mm256_add_ps(_mm256_mul_ps(v[k], id), _mm256_set1_ps(8.5f));
            t = _mm256_min_ps(_mm256_max_ps(t, _mm256_setzero_ps()), _mm256_set1_ps(15.0f));
            q[k] = _mm256_cvttps_epi32(t);
        }
        // byte j = q[j] | q[j + 16] << 4
        const __m256i lo = _mm256_or_si256(q[0], _mm256_slli_epi32(q[2], 4));
        const __m256i hi = _mm256_or_si256(q[1], _mm256_slli_epi32(q[3], 4));
        const __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xd8);  // 16 x u16 in order
        const __m128i bytes = _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(y + 2), bytes);
    }
}

KVC_AVX2 void avx2_q4_0_to_f32(const uint8_t* x, float* y, int64_t n) {
    const __m128i low4 = _mm_set1_epi8(0x0f);
    const __m256i eight = _mm256_set1_epi32(8);
    for (int64_t b = 0; b < n / qk4_0; ++b, x += sizeof(block_q4_0), y += qk4_0) {
        const __m256 d = _mm256_set1_ps(load_scale_f16c(x));
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 2));
        const __m128i lo = _mm_and_si128(bytes, low4);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
        const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int k = 0; k < 4; ++k) {
            const __m256i q = _mm256_sub_epi32(_mm256_cvtepu8_epi32(parts[k]), eight);
            _mm256_storeu_ps(y + 8 * k, _mm256_mul_ps(_mm256_cvtepi32_ps(q), d));
        }
    }
}

// ---------------------------------------------------------------- AVX-512

KVC_AVX512 void avx512_f32_to_f16(const float* x, uint8_t* y, int64_t n) {
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m256i a = _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT);
        const __m256i b = _mm512_cvtps_ph(_mm512_loadu_ps(x + i + 16), _MM_FROUND_TO_NEAREST_INT);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + 2 * i), a);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + 2 * i + 32), b);
    }
    avx2_f32_to_f16(x + i, y + 2 * i, n - i);
}

KVC_AVX512 void avx512_f16_to_f32(const uint8_t* x, float* y, int64_t n) {
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 2 * i));
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 2 * i + 32));
        _mm512_storeu_ps(y + i, _mm512_cvtph_ps(a));
        _mm512_storeu_ps(y + i + 16, _mm512_cvtph_ps(b));
    }
    avx2_f16_to_f32(x + 2 * i, y + i, n - i);
}

KVC_AVX512 __m256i avx512_bf16_bits(__m512i u) {
    const __m512i abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
    const __mmask16 is_nan = _mm512_cmpgt_epi32_mask(abs, _mm512_set1_epi32(0x7f800000));
    const __m512i hi = _mm512_srli_epi32(u, 16);
    const __m512i bias =
        _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(hi, _mm512_set1_epi32(1)));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    r = _mm512_mask_or_epi32(r, is_nan, hi, _mm512_set1_epi32(64));
    return _mm512_cvtepi32_epi16(r);
}

KVC_AVX512 void avx512_f32_to_bf16(const float* x, uint8_t* y, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256i h = avx512_bf16_bits(_mm512_loadu_si512(x + i));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + 2 * i), h);
    }
    scalar_kernels().f32_to_bf16(x + i, y + 2 * i, n - i);
}

KVC_AVX512 void avx512_bf16_to_f32(const uint8_t* x, float* y, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 2 * i));
        _mm512_storeu_si512(y + i, _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    scalar_kernels().bf16_to_f32(x + 2 * i, y + i, n - i);
}

KVC_AVX512 float avx512_amax32(__m512 v0, __m512 v1, __m512 a0, __m512 a1, bool* nan) {
    const __m512 m = _mm512_max_ps(a1, _mm512_max_ps(a0, _mm512_setzero_ps()));  // NaN lanes yield 0
    *nan = (_mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q)) != 0;
    return _mm512_reduce_max_ps(m);
}

KVC_AVX512 __m512 avx512_round_away(__m512 x) {
    const __m512 t = _mm512_roundscale_ps(x, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __mmask16 up =
        _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(x, t)), _mm512_set1_ps(0.5f), _CMP_GE_OQ);
    const __m512 one = _mm512_or_ps(_mm512_and_ps(x, _mm512_set1_ps(-0.0f)), _mm512_set1_ps(1.0f));
    return _mm512_mask_add_ps(t, up, t, one);
}

KVC_AVX512 void avx512_q8_0_block(const float* x, float id, uint8_t* y) {
    const __m512 v0 = _mm512_loadu_ps(x);
    const __m512 v1 = _mm512_loadu_ps(x + 16);
    const __m512 s = _mm512_set1_ps(id);
    const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    const __m512 r0 = _mm512_min_ps(_mm512_max_ps(avx512_round_away(_mm512_mul_ps(v0, s)), lo), hi);
    const __m512 r1 = _mm512_min_ps(_mm512_max_ps(avx512_round_away(_mm512_mul_ps(v1, s)), lo), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + 2), _mm512_cvtsepi32_epi8(_mm512_cvttps_epi32(r0)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + 18), _mm512_cvtsepi32_epi8(_mm512_cvttps_epi32(r1)));
}

// One step of a transposing reduction: a and b each hold 16 / G blocks of G lanes; the result holds the
// blocks of a then those of b, G / 2 lanes each, every lane the max of the two halves of its group.
template <uint32_t G>
struct fold_index {
    alignas(64) int32_t lo[16], up[16];
    constexpr fold_index() : lo{}, up{} {
        for (uint32_t i = 0; i < 16; ++i) {
            const uint32_t group = i / (G / 2), lane = i % (G / 2);
            const uint32_t src = (group % (16 / G)) * G + lane + (group >= 16 / G ? 16 : 0);
            lo[i] = static_cast<int32_t>(src);
            up[i] = static_cast<int32_t>(src + G / 2);
        }
    }
};

template <uint32_t G>
KVC_AVX512 void avx512_fold_max(__m512* m) {
    static constexpr fold_index<G> idx;
    // G vectors of 16 / G blocks on the way in, folded pairwise into G / 2
    for (uint32_t j = 0; j < G / 2; ++j)
        m[j] = _mm512_max_ps(_mm512_permutex2var_ps(m[2 * j], _mm512_load_si512(idx.lo), m[2 * j + 1]),
                             _mm512_permutex2var_ps(m[2 * j], _mm512_load_si512(idx.up), m[2 * j + 1]));
}

// 16 blocks at a time: their maxima folded into one vector, so that the scales, their inverses and their
// fp16 forms take one vector operation each instead of a horizontal reduction and a division per block.
KVC_AVX512 void avx512_f32_to_q8_0(const float* x, uint8_t* y, int64_t n) {
    int64_t b = 0;
    for (; b + 16 <= n / qk8_0; b += 16, x += 16 * qk8_0, y += 16 * sizeof(block_q8_0)) {
        __m512 m[16];
        __mmask16 nan = 0;
        for (int j = 0; j < 16; ++j) {
            const __m512 v0 = _mm512_loadu_ps(x + j * qk8_0), v1 = _mm512_loadu_ps(x + j * qk8_0 + 16);
            // a NaN lane yields the other operand, as the scalar `a > amax ? a : amax`
            m[j] = _mm512_max_ps(_mm512_abs_ps(v1), _mm512_max_ps(_mm512_abs_ps(v0), _mm512_setzero_ps()));
            const bool any =
                (_mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q));
            nan = static_cast<__mmask16>(nan | (any ? 1u << j : 0u));
        }
        avx512_fold_max<16>(m);  // m[0..7]: 2 blocks of 8 lanes each
        avx512_fold_max<8>(m);
        avx512_fold_max<4>(m);
        avx512_fold_max<2>(m);  // m[0]: lane j is the max of block j
        const __m512 amax = _mm512_mask_mov_ps(m[0], nan, _mm512_set1_ps(NAN));
        const __m512 d = _mm512_div_ps(amax, _mm512_set1_ps(127.0f));
        const __mmask16 nonzero = _mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_NEQ_UQ);
        const __m512 id = _mm512_maskz_div_ps(nonzero, _mm512_set1_ps(1.0f), d);
        alignas(64) float ids[16];
        alignas(32) uint16_t ds[16];
        _mm512_store_ps(ids, id);
        _mm256_store_si256(reinterpret_cast<__m256i*>(ds), _mm512_cvtps_ph(d, _MM_FROUND_TO_NEAREST_INT));
        for (int j = 0; j < 16; ++j) {
            std::memcpy(y + j * sizeof(block_q8_0), &ds[j], sizeof ds[j]);
            avx512_q8_0_block(x + j * qk8_0, ids[j], y + j * sizeof(block_q8_0));
        }
    }
    for (; b < n / qk8_0; ++b, x += qk8_0, y += sizeof(block_q8_0)) {
        const __m512 v0 = _mm512_loadu_ps(x);
        const __m512 v1 = _mm512_loadu_ps(x + 16);
        bool nan = false;
        float amax = avx512_amax32(v0, v1, _mm512_abs_ps(v0), _mm512_abs_ps(v1), &nan);
        if (nan) amax = NAN;
        const float d = q8_0_scale(amax);
        store_scale_f16c(y, d);
        avx512_q8_0_block(x, inverse_scale(d), y);
    }
}

KVC_AVX512 void avx512_q8_0_to_f32(const uint8_t* x, float* y, int64_t n) {
    for (int64_t b = 0; b < n / qk8_0; ++b, x += sizeof(block_q8_0), y += qk8_0) {
        const __m512 d = _mm512_set1_ps(load_scale_f16c(x));
        for (int k = 0; k < 2; ++k) {
            const __m128i q8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 2 + 16 * k));
            const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q8));
            _mm512_storeu_ps(y + 16 * k, _mm512_mul_ps(q, d));
        }
    }
}

KVC_AVX512 void avx512_f32_to_q4_0(const float* x, uint8_t* y, int64_t n) {
    for (int64_t b = 0; b < n / qk4_0; ++b, x += qk4_0, y += sizeof(block_q4_0)) {
        const __m512 v0 = _mm512_loadu_ps(x);
        const __m512 v1 = _mm512_loadu_ps(x + 16);
        const __m512 a0 = _mm512_abs_ps(v0), a1 = _mm512_abs_ps(v1);
        bool nan = false;
        const float amax = avx512_amax32(v0, v1, a0, a1, &nan);
        float max = 0.0f;  // see avx2_f32_to_q4_0
        if (amax > 0.0f) {
            const __m512 target = _mm512_set1_ps(amax);
            const uint32_t hits = static_cast<uint32_t>(_mm512_cmp_ps_mask(a0, target, _CMP_EQ_OQ)) |
                                  (static_cast<uint32_t>(_mm512_cmp_ps_mask(a1, target, _CMP_EQ_OQ)) << 16);
            max = x[__builtin_ctz(hits)];
        }
        if (nan) max = NAN;
        const float d = q4_0_scale(max);
        const __m512 id = _mm512_set1_ps(inverse_scale(d));
        store_scale_f16c(y, d);
        const __m512 half = _mm512_set1_ps(8.5f), zero = _mm512_setzero_ps(), top = _mm512_set1_ps(15.0f);
        const __m512 t0 = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(_mm512_mul_ps(v0, id), half), zero), top);
        const __m512 t1 = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(_mm512_mul_ps(v1, id), half), zero), top);
        const __m512i q =
            _mm512_or_si512(_mm512_cvttps_epi32(t0), _mm512_slli_epi32(_mm512_cvttps_epi32(t1), 4));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(y + 2), _mm512_cvtepi32_epi8(q));
    }
}

KVC_AVX512 void avx512_q4_0_to_f32(const uint8_t* x, float* y, int64_t n) {
    const __m128i low4 = _mm_set1_epi8(0x0f);
    const __m512i eight = _mm512_set1_epi32(8);
    for (int64_t b = 0; b < n / qk4_0; ++b, x += sizeof(block_q4_0), y += qk4_0) {
        const __m512 d = _mm512_set1_ps(load_scale_f16c(x));
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 2));
        const __m128i lo = _mm_and_si128(bytes, low4);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
        const __m512i q0 = _mm512_sub_epi32(_mm512_cvtepu8_epi32(lo), eight);
        const __m512i q1 = _mm512_sub_epi32(_mm512_cvtepu8_epi32(hi), eight);
        _mm512_storeu_ps(y, _mm512_mul_ps(_mm512_cvtepi32_ps(q0), d));
        _mm512_storeu_ps(y + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(q1), d));
    }
}

}  // namespace

const dtype_kernels* x86_kernels(simd_level level) {
    static const dtype_kernels avx2 = {avx2_f32_to_f16,  avx2_f16_to_f32,  avx2_f32_to_bf16,
                                       avx2_bf16_to_f32, avx2_f32_to_q8_0, avx2_q8_0_to_f32,
                                       avx2_f32_to_q4_0, avx2_q4_0_to_f32};
    static const dtype_kernels avx512 = {avx512_f32_to_f16,  avx512_f16_to_f32,  avx512_f32_to_bf16,
                                         avx512_bf16_to_f32, avx512_f32_to_q8_0, avx512_q8_0_to_f32,
                                         avx512_f32_to_q4_0, avx512_q4_0_to_f32};
    switch (level) {
        case simd_level::avx2:
            return &avx2;
        case simd_level::avx512:
            return &avx512;
        default:
            return nullptr;
    }
}

#else

const dtype_kernels* x86_kernels(simd_level) {
    return nullptr;
}

#endif

}  // namespace kvc::detail
