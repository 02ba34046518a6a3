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

// A norm or other small tensor of dimensions ne, as f32 values.
std::vector<float> values_f32(const gguf_file& f, const std::string& name, std::vector<int64_t> ne) {
    const gguf_tensor_info& t = need_tensor(f, name, std::move(ne));
    const auto type = dtype_from_ggml(static_cast<int32_t>(t.ggml_type));
    if (!type || is_quantized(*type))
        bad_model(errc::unsupported, fmt::format("tensor '{}' has ggml type {}; norms and SSM parameters "
                                                 "must be f32, f16 or bf16",
                                                 name, t.ggml_type));
    std::vector<float> out(static_cast<size_t>(t.n_elements()));
    to_f32(*type, t.data, out.data(), t.n_elements());
    return out;
}

std::vector<float> vector_f32(const gguf_file& f, const std::string& name, int64_t n) {
    return values_f32(f, name, {n});
}

// A per-layer key: an array of n_layer integers, or one integer for every layer.
std::vector<uint32_t> per_layer_u32(const gguf_file& f, const std::string& key, uint32_t n_layer) {
    const gguf_value* v = f.find(key);
    if (!v) bad_model(errc::corrupt_data, fmt::format("key '{}' is missing", key));
    constexpr uint64_t max = uint64_t{1} << 30;
    if (v->type != gguf_type::array) {
        const auto one = f.get_uint(key);
        if (!one || *one > max) bad_model(errc::corrupt_data, fmt::format("key '{}' is not a count", key));
        return std::vector<uint32_t>(n_layer, static_cast<uint32_t>(*one));
    }
    std::vector<uint64_t> vals;
    const auto* a = std::get_if<gguf_array>(&v->value);
    if (a && a->elem_type != gguf_type::boolean && a->elem_type != gguf_type::f32 &&
        a->elem_type != gguf_type::f64) {
        if (a->elem_type == gguf_type::u8 || a->elem_type == gguf_type::u16 ||
            a->elem_type == gguf_type::u32 || a->elem_type == gguf_type::u64)
            vals = a->uints();
        else
            for (const int64_t x : a->ints()) vals.push_back(x < 0 ? max + 1 : static_cast<uint64_t>(x));
    } else {
        bad_model(errc::corrupt_data,
                  fmt::format("key '{}' is an array of {}, not of integers", key, to_string(v->elem_type)));
    }
    if (vals.size() != n_layer)
        bad_model(errc::corrupt_data,
                  fmt::format("key '{}' has {} values for {} layers", key, vals.size(), n_layer));
    std::vector<uint32_t> out;
    for (const uint64_t x : vals) {
        if (x > max) bad_model(errc::corrupt_data, fmt::format("key '{}' holds {}", key, x));
        out.push_back(static_cast<uint32_t>(x));
    }
    return out;
}

}  // namespace

namespace rt {

void rms_norm(const float* x, const std::vector<float>& w, float eps, size_t n, float* out) {
    double ss = 0;
    for (size_t i = 0; i < n; ++i) ss += double{x[i]} * x[i];
    const float scale = 1.0f / std::sqrt(static_cast<float>(ss / static_cast<double>(n)) + eps);
    for (size_t i = 0; i < n; ++i) out[i] = x[i] * scale * w[i];
}

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
    // no tokens (a ubatch without outputs): y may be null, and y + o undefined
    if (n_tok == 0) return;
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
                          std::span<const int8_t> out, const rt::attend_fn& attend, rt::ssm_states* ssm,
                          std::vector<float>& logits) const {
    using rt::rms_norm;
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
        if (hp.is_recurrent(il)) {
            if (!ssm)
                throw error(errc::invalid_state, fmt::format("forward: Mamba layer {} has no states", il));
            mamba_mix(pool, il, h.data(), n, *ssm, o.data());
        } else {
            matmul(pool, L.wq, h.data(), n, q.data());
            matmul(pool, L.wk, h.data(), n, k.data());
            matmul(pool, L.wv, h.data(), n, v.data());
            k_raw = k;
            if (hp.rope.type != rope_type::none)
                for (size_t t = 0; t < n; ++t) {
                    ops::rope(std::span(&q[t * n_q], n_q), hp.n_head, static_cast<uint32_t>(hd), pos[t],
                              hp.rope);
                    ops::rope(std::span(&k[t * n_kv], n_kv), hp.n_head_kv, static_cast<uint32_t>(hd), pos[t],
                              hp.rope);
                }
            attend(il, q.data(), k.data(), k_raw.data(), v.data(), attn.data());
            matmul(pool, L.wo, attn.data(), n, o.data());
        }
        for (size_t i = 0; i < x.size(); ++i) x[i] += o[i];
        if (L.ffn_norm.empty()) continue;  // Mamba-1: the mixer is the whole layer
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

namespace {

// llama: attention layers with RoPE and a SwiGLU feed-forward.
void load_llama(model::impl& m) {
    const gguf_file& f = m.file;
    model_hparams& hp = m.hp;
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
    hp.recurrent.assign(hp.n_layer, false);
}

// The SSM keys of a mamba or jamba file (Mamba-1: no groups, no weightless dt/B/C norms).
void load_ssm_hparams(model::impl& m, const std::string& arch) {
    const gguf_file& f = m.file;
    model_hparams& hp = m.hp;
    hp.ssm_d_conv = need_u32(f, arch + ".ssm.conv_kernel");
    hp.ssm_d_inner = need_u32(f, arch + ".ssm.inner_size");
    hp.ssm_d_state = need_u32(f, arch + ".ssm.state_size");
    hp.ssm_dt_rank = need_u32(f, arch + ".ssm.time_step_rank");
    if (f.get_uint(arch + ".ssm.group_count").value_or(0) != 0)
        bad_model(
            errc::unsupported,
            fmt::format("key '{}.ssm.group_count' is set: Mamba-2 layers (the runtime runs Mamba-1)", arch));
    if (f.get_bool(arch + ".ssm.dt_b_c_rms").value_or(false))
        bad_model(errc::unsupported,
                  fmt::format("key '{}.ssm.dt_b_c_rms' is set: weightless dt/B/C norms are not run", arch));
    hp.rms_eps = static_cast<float>(f.get_float(arch + ".attention.layer_norm_rms_epsilon").value_or(1e-5));
    hp.n_ctx_train = f.find(arch + ".context_length") ? need_u32(f, arch + ".context_length") : 0;
}

// A Mamba layer's tensors; jamba adds the dt, B and C norms.
void load_mamba_layer(const gguf_file& f, const model_hparams& hp, uint32_t il, bool norms,
                      rt::layer_weights& L) {
    const std::string b = fmt::format("blk.{}.", il);
    const int64_t E = hp.n_embd, DI = hp.ssm_d_inner, DS = hp.ssm_d_state, DC = hp.ssm_d_conv,
                  R = hp.ssm_dt_rank;
    L.ssm_in = matrix(f, b + "ssm_in.weight", E, 2 * DI);
    L.conv = values_f32(f, b + "ssm_conv1d.weight", {DC, DI});
    L.conv_b = vector_f32(f, b + "ssm_conv1d.bias", DI);
    L.ssm_x = matrix(f, b + "ssm_x.weight", DI, R + 2 * DS);
    L.ssm_dt = matrix(f, b + "ssm_dt.weight", R, DI);
    L.dt_b = vector_f32(f, b + "ssm_dt.bias", DI);
    L.a = values_f32(f, b + "ssm_a", {DS, DI});
    L.d = vector_f32(f, b + "ssm_d", DI);
    L.ssm_out = matrix(f, b + "ssm_out.weight", DI, E);
    if (norms) {
        L.dt_norm = vector_f32(f, b + "ssm_dt_norm.weight", R);
        L.b_norm = vector_f32(f, b + "ssm_b_norm.weight", DS);
        L.c_norm = vector_f32(f, b + "ssm_c_norm.weight", DS);
    }
}

void load_mamba(model::impl& m) {
    const gguf_file& f = m.file;
    model_hparams& hp = m.hp;
    hp.n_embd = need_u32(f, "mamba.embedding_length");
    hp.n_layer = need_u32(f, "mamba.block_count");
    load_ssm_hparams(m, "mamba");
    hp.recurrent.assign(hp.n_layer, true);
    hp.rope.type = rope_type::none;
}

// jamba: head_count_kv per layer, 0 for a Mamba layer; attention without RoPE; dense feed-forward only.
void load_jamba(model::impl& m) {
    const gguf_file& f = m.file;
    model_hparams& hp = m.hp;
    hp.n_embd = need_u32(f, "jamba.embedding_length");
    hp.n_layer = need_u32(f, "jamba.block_count");
    hp.n_head = need_u32(f, "jamba.attention.head_count");
    load_ssm_hparams(m, "jamba");
    if (const uint64_t n = f.get_uint("jamba.expert_count").value_or(0); n != 0)
        bad_model(errc::unsupported,
                  fmt::format("key 'jamba.expert_count' is {}: mixture-of-experts layers are not run", n));
    const std::vector<uint32_t> ff = per_layer_u32(f, "jamba.feed_forward_length", hp.n_layer);
    hp.n_ff = ff[0];
    for (const uint32_t x : ff)
        if (x != hp.n_ff || x == 0)
            bad_model(errc::unsupported, "key 'jamba.feed_forward_length' is 0 or differs between layers");
    const std::vector<uint32_t> kv = per_layer_u32(f, "jamba.attention.head_count_kv", hp.n_layer);
    for (uint32_t il = 0; il < hp.n_layer; ++il) {
        hp.recurrent.push_back(kv[il] == 0);
        if (kv[il] == 0) continue;
        if (hp.n_head_kv != 0 && kv[il] != hp.n_head_kv)
            bad_model(errc::unsupported,
                      "key 'jamba.attention.head_count_kv': attention layers with different KV head counts");
        hp.n_head_kv = kv[il];
    }
    if (hp.n_embd % hp.n_head != 0)
        bad_model(errc::corrupt_data, fmt::format("embedding length {} is not a multiple of head count {}",
                                                  hp.n_embd, hp.n_head));
    if (hp.n_head_kv != 0 && hp.n_head % hp.n_head_kv != 0)
        bad_model(errc::corrupt_data, fmt::format("head count {} is not a multiple of head count kv {}",
                                                  hp.n_head, hp.n_head_kv));
    hp.n_embd_head = hp.n_embd / hp.n_head;
    hp.rope.type = rope_type::none;  // Jamba's attention has no positional encoding
    hp.rope.n_rot = 0;
}

}  // namespace

model model::load(const std::string& path) {
    auto p = std::make_unique<impl>(gguf_file::open(path));
    const gguf_file& f = p->file;
    model_hparams& hp = p->hp;
    const auto arch = f.get_string("general.architecture");
    if (!arch) bad_model(errc::corrupt_data, "key 'general.architecture' is missing");
    if (*arch == "llama") {
        hp.arch = model_arch::llama;
        load_llama(*p);
    } else if (*arch == "mamba") {
        hp.arch = model_arch::mamba;
        load_mamba(*p);
    } else if (*arch == "jamba") {
        hp.arch = model_arch::jamba;
        load_jamba(*p);
    } else {
        bad_model(errc::unsupported,
                  fmt::format("architecture '{}' (the runtime runs llama, mamba and jamba models)", *arch));
    }
    hp.name = f.get_string("general.name").value_or("");
    const gguf_tensor_info* embd = f.find_tensor("token_embd.weight");
    if (!embd || embd->ne.size() < 2) bad_model(errc::corrupt_data, "tensor 'token_embd.weight' is missing");
    hp.n_vocab = f.find(*arch + ".vocab_size") ? need_u32(f, *arch + ".vocab_size")
                                               : static_cast<uint32_t>(embd->ne[1]);

    const int64_t E = hp.n_embd, Q = int64_t{hp.n_head} * hp.n_embd_head,
                  KV = int64_t{hp.n_head_kv} * hp.n_embd_head, F = hp.n_ff, V = hp.n_vocab;
    p->tok_embd = matrix(f, "token_embd.weight", E, V);
    p->output_norm = vector_f32(f, "output_norm.weight", E);
    p->output = f.find_tensor("output.weight") ? matrix(f, "output.weight", E, V) : p->tok_embd;  // tied
    for (uint32_t il = 0; il < hp.n_layer; ++il) {
        const std::string b = fmt::format("blk.{}.", il);
        rt::layer_weights L;
        L.attn_norm = vector_f32(f, b + "attn_norm.weight", E);
        if (hp.is_recurrent(il)) {
            load_mamba_layer(f, hp, il, hp.arch == model_arch::jamba, L);
        } else {
            L.wq = matrix(f, b + "attn_q.weight", E, Q);
            L.wk = matrix(f, b + "attn_k.weight", E, KV);
            L.wv = matrix(f, b + "attn_v.weight", E, KV);
            L.wo = matrix(f, b + "attn_output.weight", Q, E);
        }
        if (hp.arch != model_arch::mamba) {
            if (f.find_tensor(b + "ffn_gate_inp.weight"))
                bad_model(
                    errc::unsupported,
                    fmt::format("tensor '{}ffn_gate_inp.weight': layer {} is a mixture-of-experts layer "
                                "(not run)",
                                b, il));
            L.ffn_norm = vector_f32(f, b + "ffn_norm.weight", E);
            L.gate = matrix(f, b + "ffn_gate.weight", E, F);
            L.up = matrix(f, b + "ffn_up.weight", E, F);
            L.down = matrix(f, b + "ffn_down.weight", F, E);
        }
        p->layers.push_back(std::move(L));
    }
    hp.weight_type = p->tok_embd.type;
    for (uint32_t il = 0; il < hp.n_layer; ++il)
        if (!hp.is_recurrent(il)) {
            hp.weight_type = p->layers[il].wq.type;
            break;
        }
    return model(std::move(p));
}

std::vector<layer_desc> model::layers() const {
    const model_hparams& hp = p_->hp;
    std::vector<layer_desc> out(hp.n_layer);
    for (uint32_t il = 0; il < hp.n_layer; ++il) {
        layer_desc& d = out[il];
        d.has_kv = !hp.is_recurrent(il);
        d.n_head_kv = d.has_kv ? hp.n_head_kv : 1;
        d.n_embd_head_k = d.has_kv ? hp.n_embd_head : 0;
        d.n_embd_head_v = d.has_kv ? hp.n_embd_head : 0;
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

model_memory model::memory_kind() const {
    switch (p_->hp.arch) {
        case model_arch::llama:
            return model_memory::kv;
        case model_arch::mamba:
            return model_memory::recurrent;
        case model_arch::jamba:
            return model_memory::hybrid;
    }
    return model_memory::kv;
}

recurrent_params model::recr_params(uint32_t n_seq_max) const {
    const model_hparams& hp = p_->hp;
    recurrent_params p;
    for (uint32_t il = 0; il < hp.n_layer; ++il)
        p.layers.push_back(hp.is_recurrent(il)
                               ? recurrent_layer_desc{.n_embd_r = hp.n_embd_r(), .n_embd_s = hp.n_embd_s()}
                               : recurrent_layer_desc{});
    p.n_seq_max = n_seq_max;
    return p;
}

memory_hybrid_params model::hybrid_params(uint32_t kv_size, uint32_t n_seq_max) const {
    memory_hybrid_params p;
    p.attn = cache_params(kv_size, n_seq_max);
    p.recr = recr_params(n_seq_max);
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

double relative_diff(std::span<const float> a, std::span<const float> ref) {
    float scale = 0;
    for (float x : ref) scale = std::max(scale, std::fabs(x));
    return static_cast<double>(max_abs_diff(a, ref)) / std::max(scale, 1e-6f);
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
