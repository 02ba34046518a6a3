#include <algorithm>
#include <cmath>
#include <numbers>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <fmt/format.h>
#include <kvcache/ops.h>

namespace kvc {

const char* to_string(rope_type t) {
    switch (t) {
        case rope_type::none:
            return "none";
        case rope_type::normal:
            return "normal";
        case rope_type::neox:
            return "neox";
    }
    return "unknown";
}

namespace ops {
namespace {

// ggml's YaRN correction dims: the rotary dims at which the ramp between interpolation and extrapolation
// starts and ends.
float corr_dim(int n_dims, int n_ctx_orig, float n_rot, float base) {
    return static_cast<float>(n_dims) *
           std::log(static_cast<float>(n_ctx_orig) / (n_rot * 2.0f * std::numbers::pi_v<float>)) /
           (2.0f * std::log(base));
}

}  // namespace

rope_table make_rope_table(uint32_t head_dim, pos_t pos, const rope_params& p, bool with_magnitude) {
    const uint32_t n_rot = p.n_rot > 0 ? static_cast<uint32_t>(p.n_rot) : head_dim;
    if (n_rot % 2 != 0 || n_rot > head_dim)
        throw error(errc::invalid_argument,
                    fmt::format("rope: n_rot {} must be even and at most the head size {}", n_rot, head_dim));
    rope_table t;
    t.type = p.type;
    t.n_rot = n_rot;
    if (p.type == rope_type::none) return t;

    const auto n_dims = static_cast<int>(n_rot);
    const float theta_scale = std::pow(p.freq_base, -2.0f / static_cast<float>(n_dims));
    float corr0 = 0.0f, corr1 = 0.0f;
    if (p.ext_factor != 0.0f) {
        corr0 = std::max(0.0f, std::floor(corr_dim(n_dims, p.n_ctx_orig, p.beta_fast, p.freq_base)));
        corr1 = std::min(static_cast<float>(n_dims - 1),
                         std::ceil(corr_dim(n_dims, p.n_ctx_orig, p.beta_slow, p.freq_base)));
    }
    float mscale = with_magnitude ? p.attn_factor : 1.0f;
    if (with_magnitude && p.ext_factor != 0.0f) mscale *= 1.0f + 0.1f * std::log(1.0f / p.freq_scale);

    const uint32_t n_pairs = n_rot / 2;
    t.c.resize(n_rot);
    t.s.resize(n_rot);
    float theta_extrap = static_cast<float>(pos);
    for (uint32_t k = 0; k < n_pairs; ++k, theta_extrap *= theta_scale) {
        const float theta_interp = p.freq_scale * theta_extrap;
        float theta = theta_interp;
        if (p.ext_factor != 0.0f) {
            const float y = (static_cast<float>(k) - corr0) / std::max(0.001f, corr1 - corr0);
            const float ramp_mix = (1.0f - std::min(1.0f, std::max(0.0f, y))) * p.ext_factor;
            theta = theta_interp * (1.0f - ramp_mix) + theta_extrap * ramp_mix;
        }
        const float c = std::cos(theta) * mscale, sn = std::sin(theta) * mscale;
        const uint32_t i0 = p.type == rope_type::neox ? k : 2 * k;
        const uint32_t i1 = p.type == rope_type::neox ? k + n_pairs : 2 * k + 1;
        t.c[i0] = t.c[i1] = c;
        t.s[i0] = -sn;
        t.s[i1] = sn;
    }
    return t;
}

namespace {

// x[i] * c[i] + x[partner] * s[i] equals the pair rotation x0 * c - x1 * s, x0 * s + x1 * c exactly
// (negation is exact, addition commutes), so the vector and scalar paths give the same bits.
void rotate_head_scalar(float* v, const rope_table& t) {
    const uint32_t h = t.n_rot / 2;
    if (t.type == rope_type::neox) {
        for (uint32_t k = 0; k < h; ++k) {
            const float x0 = v[k], x1 = v[k + h];
            v[k] = x0 * t.c[k] + x1 * t.s[k];
            v[k + h] = x1 * t.c[k + h] + x0 * t.s[k + h];
        }
        return;
    }
    for (uint32_t i = 0; i < t.n_rot; i += 2) {
        const float x0 = v[i], x1 = v[i + 1];
        v[i] = x0 * t.c[i] + x1 * t.s[i];
        v[i + 1] = x1 * t.c[i + 1] + x0 * t.s[i + 1];
    }
}

#if defined(__x86_64__)
__attribute__((target("avx2"))) void rotate_head_avx2(float* v, const rope_table& t) {
    const uint32_t h = t.n_rot / 2;
    const float* c = t.c.data();
    const float* s = t.s.data();
    if (t.type == rope_type::neox) {
        uint32_t k = 0;
        for (; k + 8 <= h; k += 8) {
            const __m256 x0 = _mm256_loadu_ps(v + k), x1 = _mm256_loadu_ps(v + k + h);
            _mm256_storeu_ps(v + k, _mm256_add_ps(_mm256_mul_ps(x0, _mm256_loadu_ps(c + k)),
                                                  _mm256_mul_ps(x1, _mm256_loadu_ps(s + k))));
            _mm256_storeu_ps(v + k + h, _mm256_add_ps(_mm256_mul_ps(x1, _mm256_loadu_ps(c + k + h)),
                                                      _mm256_mul_ps(x0, _mm256_loadu_ps(s + k + h))));
        }
        for (; k < h; ++k) {
            const float x0 = v[k], x1 = v[k + h];
            v[k] = x0 * c[k] + x1 * s[k];
            v[k + h] = x1 * c[k + h] + x0 * s[k + h];
        }
        return;
    }
    uint32_t i = 0;
    for (; i + 8 <= t.n_rot; i += 8) {
        const __m256 x = _mm256_loadu_ps(v + i);
        const __m256 xp = _mm256_permute_ps(x, 0xb1);  // each pair swapped: the partners
        _mm256_storeu_ps(v + i, _mm256_add_ps(_mm256_mul_ps(x, _mm256_loadu_ps(c + i)),
                                              _mm256_mul_ps(xp, _mm256_loadu_ps(s + i))));
    }
    for (; i < t.n_rot; i += 2) {
        const float x0 = v[i], x1 = v[i + 1];
        v[i] = x0 * c[i] + x1 * s[i];
        v[i + 1] = x1 * c[i + 1] + x0 * s[i + 1];
    }
}
#endif

}  // namespace

void apply_rope(std::span<float> x, uint32_t n_head, uint32_t head_dim, const rope_table& t) {
    if (x.size() != static_cast<size_t>(n_head) * head_dim || t.n_rot > head_dim)
        throw error(errc::invalid_argument, fmt::format("rope: {} values for {} heads of {} (n_rot {})",
                                                        x.size(), n_head, head_dim, t.n_rot));
    if (t.type == rope_type::none) return;
#if defined(__x86_64__)
    static const bool avx2 = __builtin_cpu_supports("avx2");
    if (avx2) {
        for (uint32_t h = 0; h < n_head; ++h)
            rotate_head_avx2(x.data() + static_cast<size_t>(h) * head_dim, t);
        return;
    }
#endif
    for (uint32_t h = 0; h < n_head; ++h) rotate_head_scalar(x.data() + static_cast<size_t>(h) * head_dim, t);
}

void rope(std::span<float> x, uint32_t n_head, uint32_t head_dim, pos_t pos, const rope_params& p,
          bool with_magnitude) {
    if (x.size() != static_cast<size_t>(n_head) * head_dim)
        throw error(errc::invalid_argument,
                    fmt::format("rope: {} values for {} heads of {}", x.size(), n_head, head_dim));
    apply_rope(x, n_head, head_dim, make_rope_table(head_dim, pos, p, with_magnitude));
}

}  // namespace ops
}  // namespace kvc
