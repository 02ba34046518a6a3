// The Mamba-1 mixer (llama.cpp's `mamba` and the Mamba layers of `jamba`), run in two phases so that
// each state tensor is gathered, updated and stored once per ubatch: the causal conv over every token
// (the r state: the last d_conv - 1 inputs of each channel), then the selective scan (the s state:
// d_state values per channel). The arithmetic follows ggml's ssm_conv and ssm_scan in f32.
#include <cmath>

#include <fmt/format.h>

#include "model_impl.h"

namespace kvc {

namespace {

float silu(float x) {
    return x / (1.0f + std::exp(-x));
}

float softplus(float x) {
    return x <= 20.0f ? std::log1p(std::exp(x)) : x;  // as ggml: large x is returned as is
}

}  // namespace

void model::impl::mamba_mix(thread_pool& pool, uint32_t il, const float* h, size_t n, rt::ssm_states& st,
                            float* out) const {
    const rt::layer_weights& L = layers[il];
    const size_t di = hp.ssm_d_inner, ds = hp.ssm_d_state, dc = hp.ssm_d_conv, rank = hp.ssm_dt_rank;
    const size_t n_xdb = rank + 2 * ds, w = dc - 1;
    const uint32_t n_blocks = st.n_blocks(), T = st.n_block_tokens();
    if (size_t{n_blocks} * T != n)
        throw error(errc::invalid_state,
                    fmt::format("mamba layer {}: {} blocks of {} tokens for {} tokens", il, n_blocks, T, n));

    // in-projection: x (the conv's input) and z (the gate), [n][2 * d_inner]
    std::vector<float> xz(n * 2 * di), xc(n * di);
    matmul(pool, L.ssm_in, h, n, xz.data());

    // conv: r holds, per channel c, its last d_conv - 1 inputs oldest first at r[c * w .. c * w + w)
    st.begin(il, rs_tensor::r);
    pool.parallel_for(n_blocks, [&](size_t b0, size_t b1) {
        for (size_t b = b0; b < b1; ++b) {
            const std::span<float> r = st.state(static_cast<uint32_t>(b));
            for (uint32_t t = 0; t < T; ++t) {
                const size_t tok = b * T + t;
                for (size_t c = 0; c < di; ++c) {
                    float* win = &r[c * w];
                    const float* k = &L.conv[c * dc];
                    const float in = xz[tok * 2 * di + c];
                    float sum = 0.0f;
                    for (size_t j = 0; j < w; ++j) sum += win[j] * k[j];
                    sum += in * k[w];
                    xc[tok * di + c] = silu(sum + L.conv_b[c]);
                    for (size_t j = 0; j + 1 < w; ++j) win[j] = win[j + 1];
                    if (w > 0) win[w - 1] = in;
                }
                st.store(static_cast<uint32_t>(b), t);
            }
        }
    });
    st.finish();

    // dt, B, C from the conv output; Jamba norms each (RMS norm with a weight)
    std::vector<float> xdb(n * n_xdb), dt_in(n * rank), dt(n * di);
    matmul(pool, L.ssm_x, xc.data(), n, xdb.data());
    for (size_t t = 0; t < n; ++t) {
        float* row = &xdb[t * n_xdb];
        if (!L.dt_norm.empty()) {
            std::vector<float> tmp(row, row + n_xdb);
            rt::rms_norm(tmp.data(), L.dt_norm, hp.rms_eps, rank, row);
            rt::rms_norm(tmp.data() + rank, L.b_norm, hp.rms_eps, ds, row + rank);
            rt::rms_norm(tmp.data() + rank + ds, L.c_norm, hp.rms_eps, ds, row + rank + ds);
        }
        std::copy_n(row, rank, &dt_in[t * rank]);
    }
    matmul(pool, L.ssm_dt, dt_in.data(), n, dt.data());

    // selective scan: s holds, per channel i, d_state values at s[i * d_state ..]
    std::vector<float> y(n * di);
    st.begin(il, rs_tensor::s);
    pool.parallel_for(n_blocks, [&](size_t b0, size_t b1) {
        for (size_t b = b0; b < b1; ++b) {
            const std::span<float> s = st.state(static_cast<uint32_t>(b));
            for (uint32_t t = 0; t < T; ++t) {
                const size_t tok = b * T + t;
                const float* B = &xdb[tok * n_xdb + rank];
                const float* C = B + ds;
                for (size_t i = 0; i < di; ++i) {
                    const float d = softplus(dt[tok * di + i] + L.dt_b[i]);
                    const float x_dt = xc[tok * di + i] * d;
                    float* si = &s[i * ds];
                    const float* a = &L.a[i * ds];
                    float sum = 0.0f;
                    for (size_t j = 0; j < ds; ++j) {
                        si[j] = si[j] * std::exp(d * a[j]) + B[j] * x_dt;
                        sum += si[j] * C[j];
                    }
                    y[tok * di + i] = sum;
                }
                st.store(static_cast<uint32_t>(b), t);
            }
        }
    });
    st.finish();

    // skip connection through D, gate by SiLU(z), out-projection
    for (size_t t = 0; t < n; ++t)
        for (size_t i = 0; i < di; ++i) {
            const float yi = y[t * di + i] + xc[t * di + i] * L.d[i];
            y[t * di + i] = yi * silu(xz[t * 2 * di + di + i]);
        }
    matmul(pool, L.ssm_out, y.data(), n, out);
}

}  // namespace kvc
