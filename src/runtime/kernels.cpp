// The forward pass's hot loops, cloned per instruction set (model_impl.h).
#include "model_impl.h"

namespace kvc::rt {

#define KVC_CLONES __attribute__((target_clones("avx2", "default")))

KVC_CLONES void head_scores(const float* q, const float* row, size_t n_head, size_t group, size_t hd,
                            float scale, float m, float* out, size_t out_stride) {
    for (size_t h = 0; h < n_head; ++h)
        out[h * out_stride] = dot(q + h * hd, row + (h / group) * hd, hd) * scale + m;
}

KVC_CLONES void axpy(float w, const float* x, float* y, size_t n) {
    for (size_t i = 0; i < n; ++i) y[i] += w * x[i];
}

KVC_CLONES float dot_cloned(const float* a, const float* b, size_t n) {
    return dot(a, b, n);
}

KVC_CLONES void row_times_tokens(const float* row, const float* x, size_t n_tok, size_t n_in, float* y,
                                 size_t stride) {
    for (size_t t = 0; t < n_tok; ++t) y[t * stride] = dot(row, x + t * n_in, n_in);
}

}  // namespace kvc::rt
