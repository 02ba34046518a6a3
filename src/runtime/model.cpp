// llama models from GGUF files, and the forward pass shared by the runtime and the reference.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include <fmt/format.h>

#include "model_impl.h"

namespace kvc {

namespace {

[[noreturn]] void bad_model(errc code, const std::string& what) {
    throw error(code, fmt::format("model: {}", what));
}

uint32_t need_u32(const gguf_file& f, const std::string& key) {
    const auto v = f.get_uint(key);
    if (!v) bad_model(errc::corrupt_data, fmt::format("key '{}' is missing", key));
    if (*v == 0 || *v > (1u << 30)) bad_model(errc::corrupt_data, fmt::format("key '{}' is {}", key, *v));
    return static_cast<uint32_t>(*v);
}

const gguf_tensor_info& need_tensor(const gguf_file& f, const std::string& name, std::vector<int64_t> ne) {
    const gguf_tensor_info* t = f.find_tensor(name);
    if (!t) bad_model(errc::corrupt_data, fmt::format("tensor '{}' is missing", name));
    std::vector<int64_t> have = t->ne;
    while (have.size() > ne.size() && have.back() == 1) have.pop_back();
    if (have != ne)
        bad_model(errc::corrupt_data, fmt::format("tensor '{}' is [{}], expected [{}]", name,
                                                  fmt::join(t->ne, ", "), fmt::join(ne, ", ")));
    return *t;
}

rt::weight matrix(const gguf_file& f, const std::string& name, int64_t n_in, int64_t n_out) {
    const gguf_tensor_info& t = need_tensor(f, name, {n_in, n_out});
    const auto type = dtype_from_ggml(static_cast<int32_t>(t.ggml_type));
    if (!type)
        bad_model(errc::unsupported,
                  fmt::format("tensor '{}' has ggml type {}; the runtime reads f32, f16, bf16, "
                              "q8_0 and q4_0",
                              name, t.ggml_type));
    if (n_in % block_size(*type) != 0)
        bad_model(errc::corrupt_data, fmt::format("tensor '{}': rows of {} values are not whole {} blocks",
                                                  name, n_in, to_string(*type)));
    rt::weight w;
    w.type = *type;
    w.n_in = n_in;
    w.n_out = n_out;
    w.row_bytes = row_size(*type, n_in);
    w.data = t.data;
    return w;
}

std::vector<float> vector_f32(const gguf_file& f, const std::string& name, int64_t n) {
    const gguf_tensor_info& t = need_tensor(f, name, {n});
    const auto type = dtype_from_ggml(static_cast<int32_t>(t.ggml_type));
    if (!type || is_quantized(*type))
        bad_model(
            errc::unsupported,
            fmt::format("tensor '{}' has ggml type {}; norms must be f32, f16 or bf16", name, t.ggml_type));
    std::vector<float> out(static_cast<size_t>(n));
    to_f32(*type, t.data, out.data(), n);
    return out;
}

void rms_norm(const float* x, const std::vector<float>& w, float eps, size_t n, float* out) {
    double ss = 0;
    for (size_t i = 0; i < n; ++i) ss += double{x[i]} * x[i];
    const float scale = 1.0f / std::sqrt(static_cast<float>(ss / static_cast<double>(n)) + eps);
    for (size_t i = 0; i < n; ++i) out[i] = x[i] * scale * w[i];
}

}  // namespace

namespace rt {

void attend_head(const float* q, uint32_t hd, size_t n_keys, const float* k, size_t k_stride, const float* v,
                 size_t v_stride, bool v_transposed, const float* mask, float* out,
                 std::vector<float>& scratch) {
    scratch.resize(n_keys);
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    float max = -std::numeric_limits<float>::infinity();
    for (size_t j = 0; j < n_keys; ++j) {
        if (mask && std::isinf(mask[j])) {
            scratch[j] = -std::numeric_limits<float>::infinity();
            continue;
        }
        scratch[j] = dot(q, k + j * k_stride, hd) * scale + (mask ? mask[j] : 0.0f);
        max = std::max(max, scratch[j]);
    }
    std::fill(out, out + hd, 0.0f);
    if (std::isinf(max)) return;  // nothing visible
    double sum = 0;
    for (size_t j = 0; j < n_keys; ++j) {
        scratch[j] = std::isinf(scratch[j]) ? 0.0f : std::exp(scratch[j] - max);
        sum += scratch[j];
    }
    const auto inv = static_cast<float>(1.0 / sum);
    if (v_transposed) {
        for (uint32_t e = 0; e < hd; ++e) out[e] = dot(scratch.data(), v + e * v_stride, n_keys) * inv;
        return;
    }
    for (size_t j = 0; j < n_keys; ++j) {
        if (scratch[j] == 0.0f) continue;
        const float p = scratch[j] * inv;
        const float* vj = v + j * v_stride;
        for (uint32_t e = 0; e < hd; ++e) out[e] += p * vj[e];
    }
}

}  // namespace rt

void model::impl::matmul(thread_pool& pool, const rt::weight& w, const float* x, size_t n_tok, float* y) {
    const auto n_in = static_cast<size_t>(w.n_in);
    const auto n_out = static_cast<size_t>(w.n_out);
    pool.parallel_for(
        n_out,
        [&](size_t o0, size_t o1) {
            std::vector<float> row(w.type == dtype::f32 ? 0 : n_in);
            for (size_t o = o0; o < o1; ++o) {
                const float* r = nullptr;
                if (w.type == dtype::f32) {
                    r = reinterpret_cast<const float*>(w.data + o * w.row_bytes);
                } else {
                    to_f32(w.type, w.data + o * w.row_bytes, row.data(), w.n_in);
                    r = row.data();
                }
                rt::row_times_tokens(r, x, n_tok, n_in, y + o, n_out);
            }
        },
        16);
}

void model::impl::forward(thread_pool& pool, std::span<const token_t> tokens, std::span<const pos_t> pos,
                          std::span<const int8_t> out, const rt::attend_fn& attend,
                          std::vector<float>& logits) const {
    const size_t n = tokens.size();
    const size_t n_embd = hp.n_embd, hd = hp.n_embd_head;
    const size_t n_q = hp.n_head * hd, n_kv = hp.n_head_kv * hd, n_ff = hp.n_ff;
    std::vector<float> x(n * n_embd), h(n * n_embd), q(n * n_q), k(n * n_kv), k_raw(n * n_kv), v(n * n_kv),
        attn(n * n_q), o(n * n_embd), g(n * n_ff), u(n * n_ff);
    for (size_t t = 0; t < n; ++t) {
        if (tokens[t] < 0 || static_cast<uint32_t>(tokens[t]) >= hp.n_vocab)
            throw error(errc::out_of_range,
                        fmt::format("forward: token {} not in [0, {})", tokens[t], hp.n_vocab));
        to_f32(tok_embd.type, tok_embd.data + static_cast<size_t>(tokens[t]) * tok_embd.row_bytes,
               &x[t * n_embd], static_cast<int64_t>(n_embd));
    }
    for (uint32_t il = 0; il < hp.n_layer; ++il) {
        const rt::layer_weights& L = layers[il];
        for (size_t t = 0; t < n; ++t)
            rms_norm(&x[t * n_embd], L.attn_norm, hp.rms_eps, n_embd, &h[t * n_embd]);
        matmul(pool, L.wq, h.data(), n, q.data());
        matmul(pool, L.wk, h.data(), n, k.data());
        matmul(pool, L.wv, h.data(), n, v.data());
        k_raw = k;
        for (size_t t = 0; t < n; ++t) {
            ops::rope(std::span(&q[t * n_q], n_q), hp.n_head, static_cast<uint32_t>(hd), pos[t], hp.rope);
            ops::rope(std::span(&k[t * n_kv], n_kv), hp.n_head_kv, static_cast<uint32_t>(hd), pos[t],
                      hp.rope);
        }
        attend(il, q.data(), k.data(), k_raw.data(), v.data(), attn.data());
        matmul(pool, L.wo, attn.data(), n, o.data());
        for (size_t i = 0; i < x.size(); ++i) x[i] += o[i];
        for (size_t t = 0; t < n; ++t)
            rms_norm(&x[t * n_embd], L.ffn_norm, hp.rms_eps, n_embd, &h[t * n_embd]);
        matmul(pool, L.gate, h.data(), n, g.data());
        matmul(pool, L.up, h.data(), n, u.data());
        for (size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];  // SwiGLU
        matmul(pool, L.down, g.data(), n, o.data());
        for (size_t i = 0; i < x.size(); ++i) x[i] += o[i];
    }
    std::vector<float> rows;
    for (size_t t = 0; t < n; ++t) {
        if (!out[t]) continue;
        rows.resize(rows.size() + n_embd);
        rms_norm(&x[t * n_embd], output_norm, hp.rms_eps, n_embd, &rows[rows.size() - n_embd]);
    }
    const size_t n_rows = rows.size() / n_embd;
    const size_t before = logits.size();
    logits.resize(before + n_rows * hp.n_vocab);
    matmul(pool, output, rows.data(), n_rows, logits.data() + before);
}

model::model(std::unique_ptr<impl> p) : p_(std::move(p)) {}
model::model(model&&) noexcept = default;
model& model::operator=(model&&) noexcept = default;
model::~model() = default;

const model_hparams& model::hparams() const {
    return p_->hp;
}

model model::load(const std::string& path) {
    auto p = std::make_unique<impl>(gguf_file::open(path));
    const gguf_file& f = p->file;
    model_hparams& hp = p->hp;
    const auto arch = f.get_string("general.architecture");
    if (!arch) bad_model(errc::corrupt_data, "key 'general.architecture' is missing");
    if (*arch != "llama")
        bad_model(errc::unsupported, fmt::format("architecture '{}' (the runtime runs llama models)", *arch));
    hp.name = f.get_string("general.name").value_or("");
    hp.n_embd = need_u32(f, "llama.embedding_length");
    hp.n_layer = need_u32(f, "llama.block_count");
    hp.n_ff = need_u32(f, "llama.feed_forward_length");
    hp.n_head = need_u32(f, "llama.attention.head_count");
    hp.n_head_kv =
        f.find("llama.attention.head_count_kv") ? need_u32(f, "llama.attention.head_count_kv") : hp.n_head;
    hp.n_ctx_train = f.find("llama.context_length") ? need_u32(f, "llama.context_length") : 0;
    if (hp.n_embd % hp.n_head != 0)
        bad_model(errc::corrupt_data, fmt::format("embedding length {} is not a multiple of head count {}",
                                                  hp.n_embd, hp.n_head));
    if (hp.n_head % hp.n_head_kv != 0)
        bad_model(errc::corrupt_data, fmt::format("head count {} is not a multiple of head count kv {}",
                                                  hp.n_head, hp.n_head_kv));
    hp.n_embd_head = hp.n_embd / hp.n_head;
    const gguf_tensor_info* embd = f.find_tensor("token_embd.weight");
    if (!embd || embd->ne.size() < 2) bad_model(errc::corrupt_data, "tensor 'token_embd.weight' is missing");
    hp.n_vocab =
        f.find("llama.vocab_size") ? need_u32(f, "llama.vocab_size") : static_cast<uint32_t>(embd->ne[1]);
    hp.rms_eps = static_cast<float>(f.get_float("llama.attention.layer_norm_rms_epsilon").value_or(1e-5));
    hp.rope.type = rope_type::normal;
    hp.rope.n_rot = f.find("llama.rope.dimension_count")
                        ? static_cast<int32_t>(need_u32(f, "llama.rope.dimension_count"))
                        : static_cast<int32_t>(hp.n_embd_head);
    if (hp.rope.n_rot > static_cast<int32_t>(hp.n_embd_head) || hp.rope.n_rot % 2 != 0)
        bad_model(errc::corrupt_data,
                  fmt::format("rope dimension count {} (head size {})", hp.rope.n_rot, hp.n_embd_head));
    hp.rope.freq_base = static_cast<float>(f.get_float("llama.rope.freq_base").value_or(10000.0));
    const auto scaling = f.get_string("llama.rope.scaling.type").value_or("none");
    if (scaling == "linear") {
        const double factor = f.get_float("llama.rope.scaling.factor").value_or(1.0);
        if (!(factor > 0)) bad_model(errc::corrupt_data, fmt::format("rope scaling factor {}", factor));
        hp.rope.freq_scale = static_cast<float>(1.0 / factor);
    } else if (scaling != "none") {
        bad_model(errc::unsupported,
                  fmt::format("rope scaling '{}' (the runtime knows none and linear)", scaling));
    }
    hp.rope.n_ctx_orig = static_cast<int32_t>(hp.n_ctx_train);

    const int64_t E = hp.n_embd, Q = int64_t{hp.n_head} * hp.n_embd_head,
                  KV = int64_t{hp.n_head_kv} * hp.n_embd_head, F = hp.n_ff, V = hp.n_vocab;
    p->tok_embd = matrix(f, "token_embd.weight", E, V);
    p->output_norm = vector_f32(f, "output_norm.weight", E);
    p->output = f.find_tensor("output.weight") ? matrix(f, "output.weight", E, V) : p->tok_embd;  // tied
    for (uint32_t il = 0; il < hp.n_layer; ++il) {
        const std::string b = fmt::format("blk.{}.", il);
        rt::layer_weights L;
        L.attn_norm = vector_f32(f, b + "attn_norm.weight", E);
        L.wq = matrix(f, b + "attn_q.weight", E, Q);
        L.wk = matrix(f, b + "attn_k.weight", E, KV);
        L.wv = matrix(f, b + "attn_v.weight", E, KV);
        L.wo = matrix(f, b + "attn_output.weight", Q, E);
        L.ffn_norm = vector_f32(f, b + "ffn_norm.weight", E);
        L.gate = matrix(f, b + "ffn_gate.weight", E, F);
        L.up = matrix(f, b + "ffn_up.weight", E, F);
        L.down = matrix(f, b + "ffn_down.weight", F, E);
        p->layers.push_back(std::move(L));
    }
    hp.weight_type = p->layers.empty() ? p->tok_embd.type : p->layers[0].wq.type;
    return model(std::move(p));
}

std::vector<layer_desc> model::layers() const {
    const model_hparams& hp = p_->hp;
    std::vector<layer_desc> out(hp.n_layer);
    for (layer_desc& d : out) {
        d.n_head_kv = hp.n_head_kv;
        d.n_embd_head_k = hp.n_embd_head;
        d.n_embd_head_v = hp.n_embd_head;
        d.rope = hp.rope;
    }
    return out;
}

kv_cache_params model::cache_params(uint32_t kv_size, uint32_t n_seq_max) const {
    kv_cache_params p;
    p.layers = layers();
    p.kv_size = kv_size;
    p.n_seq_max = n_seq_max;
    return p;
}

float max_abs_diff(std::span<const float> a, std::span<const float> b) {
    if (a.size() != b.size())
        throw error(errc::invalid_argument, fmt::format("max_abs_diff: {} vs {} values", a.size(), b.size()));
    float m = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        const float d = std::fabs(a[i] - b[i]);
        if (!(d <= m)) m = d;  // NaN wins
    }
    return m;
}

double logits_tolerance(dtype type) {
    switch (type) {
        case dtype::f32:
            return 1e-5;
        case dtype::f16:
            return 2e-3;
        case dtype::bf16:
            return 1.5e-2;
        case dtype::q8_0:
            return 3e-2;
        case dtype::q4_0:
            return 3e-1;
    }
    return 0;
}

}  // namespace kvc
