// The inside of a model and the pieces of the forward pass shared by the cache path (runtime) and the
// oracle (reference_memory), so the two differ only in where keys and values come from.
#pragma once

#include <functional>
#include <span>
#include <string>
#include <vector>

#include <kvcache/recurrent_engine.h>
#include <kvcache/runtime/gguf.h>
#include <kvcache/runtime/runtime.h>

namespace kvc::rt {

// Eight partial sums: vectorised, they map to the same lanes whatever the instruction set, so callers
// cloned per instruction set (target_clones) give the same result in every clone.
[[gnu::always_inline]] inline float dot(const float* a, const float* b, size_t n) {
    float s[8] = {};
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; ++j) s[j] += a[i + j] * b[i + j];
    float r = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    for (; i < n; ++i) r += a[i] * b[i];
    return r;
}

// The hot loops of the forward pass (kernels.cpp), cloned per instruction set: the library builds for
// baseline x86-64, and these run the AVX2 clone where the CPU has it, with the same results.
// Scores of every query head (q: n_head x hd) against one cell's key row (row: n_head_kv x hd):
// out[h * out_stride] = q_h . row_{h / group} * scale + m.
void head_scores(const float* q, const float* row, size_t n_head, size_t group, size_t hd, float scale,
                 float m, float* out, size_t out_stride);
void axpy(float w, const float* x, float* y, size_t n);  // y += w * x
float dot_cloned(const float* a, const float* b, size_t n);
// y[t * stride] = row . x[t] for n_tok tokens of n_in values.
void row_times_tokens(const float* row, const float* x, size_t n_tok, size_t n_in, float* y, size_t stride);

// out = x / rms(x) * w over n values (the sum of squares in double, as ggml).
void rms_norm(const float* x, const std::vector<float>& w, float eps, size_t n, float* out);

// A 2-D weight: n_out rows of n_in values of `type`, row-major in the mapped file.
struct weight {
    dtype type = dtype::f32;
    int64_t n_in = 0, n_out = 0;
    size_t row_bytes = 0;
    const std::byte* data = nullptr;
};

struct layer_weights {
    std::vector<float> attn_norm, ffn_norm;  // ffn_norm empty: no feed-forward (Mamba-1)
    weight wq, wk, wv, wo, gate, up, down;
    // Mamba layers: projections, conv [d_inner][d_conv], A [d_inner][d_state], dt/B/C norms (Jamba)
    weight ssm_in, ssm_x, ssm_dt, ssm_out;
    std::vector<float> conv, conv_b, dt_b, a, d, dt_norm, b_norm, c_norm;
};

// Where a Mamba layer's states come from and go for the tokens of one forward: n_blocks() blocks of
// n_block_tokens() consecutive tokens, each block one state. The cache path wraps recurrent_step (the
// memory's rows), the oracle a sequence's own arrays. A layer runs its conv over every token (r), then
// its scan (s): begin, state / store per block and token, finish, once per tensor.
class ssm_states {
public:
    virtual ~ssm_states() = default;
    virtual uint32_t n_blocks() const = 0;
    virtual uint32_t n_block_tokens() const = 0;
    virtual void begin(uint32_t il, rs_tensor which) = 0;
    virtual std::span<float> state(uint32_t b) = 0;  // block b's working state
    virtual void store(uint32_t b, uint32_t t) = 0;  // the state after token t of block b
    virtual void finish() = 0;
};

// Attention of n query tokens of one layer: q [n][n_head * hd] and k [n][n_head_kv * hd] already rotated,
// k_raw the keys before rotation, v [n][n_head_kv * hd]; writes out [n][n_head * hd].
using attend_fn = std::function<void(uint32_t il, const float* q, const float* k, const float* k_raw,
                                     const float* v, float* out)>;

// Scaled dot-product attention of one query head (q: hd values) over n_keys keys: key j at
// k + j * k_stride; value j at v + j * v_stride, or with v_transposed channel e of value j at
// v + e * v_stride + j; mask[j] is 0 or -inf (null: all visible). Writes hd values to out.
void attend_head(const float* q, uint32_t hd, size_t n_keys, const float* k, size_t k_stride, const float* v,
                 size_t v_stride, bool v_transposed, const float* mask, float* out,
                 std::vector<float>& scratch);

}  // namespace kvc::rt

namespace kvc {

struct model::impl {
    gguf_file file;
    model_hparams hp;
    rt::weight tok_embd;
    std::vector<float> output_norm;
    rt::weight output;
    std::vector<rt::layer_weights> layers;

    explicit impl(gguf_file f) : file(std::move(f)) {}

    // Runs the layers over n tokens (embedding rows of their ids) at their positions; attend is called
    // once per attention layer after Q/K/V, ssm gives the Mamba layers their states (null: a model
    // without them); appends logits [rows][n_vocab] for the tokens with out[i] != 0.
    void forward(thread_pool& pool, std::span<const token_t> tokens, std::span<const pos_t> pos,
                 std::span<const int8_t> out, const rt::attend_fn& attend, rt::ssm_states* ssm,
                 std::vector<float>& logits) const;
    // The mixer of Mamba layer il over n tokens of normed input h [n][n_embd]: writes out [n][n_embd]
    // (mamba.cpp).
    void mamba_mix(thread_pool& pool, uint32_t il, const float* h, size_t n, rt::ssm_states& st,
                   float* out) const;
    // y[t][o] = dot(w row o, x[t]) for n_tok tokens.
    static void matmul(thread_pool& pool, const rt::weight& w, const float* x, size_t n_tok, float* y);
};

}  // namespace kvc
