// The tiny models (include/kvcache/runtime/tiny_model.h). Everything mirrors the llama-peer's
// make_tiny_llama.py, make_tiny_mamba.py and make_tiny_jamba.py step for step (metadata order, PRNG,
// scales and the double arithmetic before the f32 store), so the peer's options give the same bytes.
#include <cmath>
#include <cstring>

#include <fmt/format.h>
#include <kvcache/runtime/gguf.h>
#include <kvcache/runtime/tiny_model.h>

namespace kvc {

namespace {

// Keeps a mistaken option from asking for gigabytes: the model is for tests and demos.
constexpr uint64_t max_weights = uint64_t{1} << 28;

// make_tiny_llama.py's SplitMix64.
class splitmix64 {
public:
    explicit splitmix64(uint64_t seed) : s_(seed) {}
    uint64_t next_u64() {
        s_ += 0x9E3779B97F4A7C15ull;
        uint64_t z = s_;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }
    // [0, 1) with 24 bits, as the script: exact in double and in f32
    double uniform() { return static_cast<double>(next_u64() >> 40) / static_cast<double>(1 << 24); }

private:
    uint64_t s_;
};

[[noreturn]] void bad_option(const std::string& what) {
    throw error(errc::invalid_argument, fmt::format("tiny model: {}", what));
}

// llama.cpp's LLAMA_FTYPE for a model whose matrices are `t`.
uint32_t file_type(dtype t) {
    switch (t) {
        case dtype::f32:
            return 0;  // ALL_F32
        case dtype::f16:
            return 1;  // MOSTLY_F16
        case dtype::q4_0:
            return 2;  // MOSTLY_Q4_0
        case dtype::q8_0:
            return 7;  // MOSTLY_Q8_0
        case dtype::bf16:
            return 32;  // MOSTLY_BF16
    }
    return 0;
}

void validate(const tiny_model_options& o) {
    const auto positive = [](uint32_t v, const char* name) {
        if (v == 0) bad_option(fmt::format("{} must be positive", name));
    };
    if (o.n_vocab < 3) bad_option(fmt::format("n_vocab {} is less than 3 (<unk>, <s>, </s>)", o.n_vocab));
    positive(o.n_embd, "n_embd");
    positive(o.n_layer, "n_layer");
    if (o.arch != tiny_arch::llama) {
        positive(o.d_state, "d_state");
        positive(o.d_conv, "d_conv");
        positive(o.dt_rank, "dt_rank");
        if (o.arch == tiny_arch::jamba) positive(o.attn_period, "attn_period");
        if (o.weight_type != dtype::f32 && o.weight_type != dtype::f16 && o.weight_type != dtype::bf16)
            bad_option(fmt::format("weight_type {}: the Mamba models are written in f32, f16 or bf16",
                                   to_string(o.weight_type)));
        const uint64_t di = o.d_inner ? o.d_inner : 2 * uint64_t{o.n_embd};
        const uint64_t per_layer = 2 * o.n_embd * di + di * (o.d_conv + 4 + o.dt_rank + 2 * o.d_state) +
                                   di * o.d_state + di * o.n_embd + 4 * uint64_t{o.n_embd} * o.n_ff;
        if (2 * uint64_t{o.n_embd} * o.n_vocab + o.n_layer * per_layer > max_weights)
            bad_option(fmt::format("more weights than the {} this generator makes", max_weights));
        if (o.arch == tiny_arch::mamba) return;
    }
    positive(o.n_head, "n_head");
    positive(o.n_head_kv, "n_head_kv");
    positive(o.n_ff, "n_ff");
    positive(o.n_ctx_train, "n_ctx_train");
    if (o.n_embd % o.n_head != 0)
        bad_option(fmt::format("n_embd {} is not a multiple of n_head {}", o.n_embd, o.n_head));
    if (o.n_head % o.n_head_kv != 0)
        bad_option(fmt::format("n_head {} is not a multiple of n_head_kv {}", o.n_head, o.n_head_kv));
    if (!(std::isfinite(o.rope_freq_base) && o.rope_freq_base > 0))
        bad_option(fmt::format("rope_freq_base {} is not a positive number", o.rope_freq_base));
    if (!(std::isfinite(o.rms_eps) && o.rms_eps > 0))
        bad_option(fmt::format("rms_eps {} is not a positive number", o.rms_eps));
    if (!is_valid(o.weight_type))
        bad_option(fmt::format("weight_type {} is not one of f32, f16, bf16, q8_0, q4_0",
                               static_cast<int32_t>(o.weight_type)));
    const int64_t block = block_size(o.weight_type);
    if (o.n_embd % block != 0 || o.n_ff % block != 0)
        bad_option(fmt::format("weight_type {} needs n_embd ({}) and n_ff ({}) to be multiples of {}",
                               to_string(o.weight_type), o.n_embd, o.n_ff, block));
    const uint64_t embd = o.n_embd, n_embd_kv = uint64_t{o.n_embd} / o.n_head * o.n_head_kv;
    const uint64_t per_layer = 2 * embd + 2 * embd * embd + 2 * embd * n_embd_kv + 3 * embd * o.n_ff;
    const uint64_t total = 2 * embd * o.n_vocab + embd + uint64_t{o.n_layer} * per_layer;
    if (total > max_weights)
        bad_option(fmt::format("{} weights is more than the {} this generator makes", total, max_weights));
}

void write_tokenizer(gguf_writer& w, uint32_t n_vocab) {
    std::vector<std::string> tokens = {"<unk>", "<s>", "</s>"};
    std::vector<int32_t> token_types = {2, 3, 3};  // UNKNOWN, CONTROL, CONTROL, then BYTE
    for (uint32_t i = 0; i + 3 < n_vocab; ++i) {
        tokens.push_back(fmt::format("<0x{:02X}>", i));
        token_types.push_back(6);
    }
    w.set_string("tokenizer.ggml.model", "llama");
    w.set_string_array("tokenizer.ggml.tokens", tokens);
    w.set_f32_array("tokenizer.ggml.scores", std::vector<float>(n_vocab, 0.0f));
    w.set_i32_array("tokenizer.ggml.token_type", token_types);
    w.set_u32("tokenizer.ggml.unknown_token_id", 0);
    w.set_u32("tokenizer.ggml.bos_token_id", 1);
    w.set_u32("tokenizer.ggml.eos_token_id", 2);
    w.set_bool("tokenizer.ggml.add_bos_token", false);
    w.set_bool("tokenizer.ggml.add_eos_token", false);
}

// The script's inv: 1.0 / (n ** 0.5), Python's ** being C's pow.
double inv(uint32_t n) {
    return 1.0 / std::pow(static_cast<double>(n), 0.5);
}

// Tensors drawn from the script's PRNG in file order: rand_tensor(n, scale, offset) and ones(n).
struct tensor_maker {
    gguf_writer& w;
    splitmix64& rng;
    dtype type;  // of the 2-D weights

    std::vector<float> draw(size_t n, double scale, double offset = 0.0) {
        std::vector<float> v(n);
        for (float& x : v) x = static_cast<float>(offset + (rng.uniform() * 2.0 - 1.0) * scale);
        return v;
    }
    void f32(std::string name, std::vector<int64_t> ne, const std::vector<float>& v) {
        std::vector<uint8_t> data(v.size() * sizeof(float));
        std::memcpy(data.data(), v.data(), data.size());
        w.add_tensor(std::move(name), std::move(ne), static_cast<uint32_t>(dtype::f32), std::move(data));
    }
    void ones(std::string name, uint32_t n) { f32(std::move(name), {n}, std::vector<float>(n, 1.0f)); }
    // a vector (or small f32 2-D parameter) drawn as rand_tensor(n, scale, offset)
    void vec(std::string name, std::vector<int64_t> ne, double scale, double offset = 0.0) {
        size_t n = 1;
        for (const int64_t d : ne) n *= static_cast<size_t>(d);
        f32(std::move(name), std::move(ne), draw(n, scale, offset));
    }
    // a weight matrix ne0 x ne1, stored as `type` row by row
    void matrix(std::string name, uint32_t ne0, uint32_t ne1, double scale) {
        const std::vector<float> values = draw(size_t{ne0} * ne1, scale);
        const size_t row_bytes = row_size(type, ne0);
        std::vector<uint8_t> data(row_bytes * ne1);
        for (size_t r = 0; r < ne1; ++r)
            from_f32(type, values.data() + r * ne0, data.data() + r * row_bytes, ne0);
        w.add_tensor(std::move(name), {ne0, ne1}, static_cast<uint32_t>(type), std::move(data));
    }
};

// make_tiny_mamba.py / make_tiny_jamba.py.
gguf_writer build_ssm(const tiny_model_options& o) {
    const bool jamba = o.arch == tiny_arch::jamba;
    const uint32_t di = o.d_inner ? o.d_inner : 2 * o.n_embd;
    const uint32_t head_dim = jamba ? o.n_embd / o.n_head : 0, n_kv = head_dim * o.n_head_kv;
    const auto is_attn = [&](uint32_t il) { return jamba && il % o.attn_period == o.attn_period - 1; };
    splitmix64 rng(o.seed);
    gguf_writer w;
    const std::string arch = jamba ? "jamba" : "mamba";
    w.set_string("general.architecture", arch);
    w.set_string("general.name", jamba ? "tiny-jamba-peer" : "tiny-mamba-peer");
    w.set_u32("general.alignment", 32);
    w.set_u32("general.file_type", file_type(o.weight_type));
    w.set_u32(arch + ".vocab_size", o.n_vocab);
    w.set_u32(arch + ".context_length", o.n_ctx_train);
    w.set_u32(arch + ".embedding_length", o.n_embd);
    w.set_u32(arch + ".block_count", o.n_layer);
    w.set_u32(arch + ".feed_forward_length", jamba ? o.n_ff : 0);
    w.set_u32(arch + ".attention.head_count", jamba ? o.n_head : 0);
    if (jamba) {
        std::vector<uint32_t> kv;
        for (uint32_t il = 0; il < o.n_layer; ++il) kv.push_back(is_attn(il) ? o.n_head_kv : 0);
        w.set_u32_array(arch + ".attention.head_count_kv", kv);
    }
    w.set_f32(arch + ".attention.layer_norm_rms_epsilon", o.rms_eps);
    w.set_u32(arch + ".ssm.conv_kernel", o.d_conv);
    w.set_u32(arch + ".ssm.inner_size", di);
    w.set_u32(arch + ".ssm.state_size", o.d_state);
    w.set_u32(arch + ".ssm.time_step_rank", o.dt_rank);
    write_tokenizer(w, o.n_vocab);

    tensor_maker t{w, rng, o.weight_type};
    const uint32_t E = o.n_embd, S = o.d_state, R = o.dt_rank, F = o.n_ff;
    t.matrix("token_embd.weight", E, o.n_vocab, 1.0);
    for (uint32_t il = 0; il < o.n_layer; ++il) {
        const std::string p = fmt::format("blk.{}.", il);
        t.ones(p + "attn_norm.weight", E);
        if (!is_attn(il)) {
            t.matrix(p + "ssm_in.weight", E, 2 * di, 2.0 * inv(E));
            t.vec(p + "ssm_conv1d.weight", {o.d_conv, di}, 0.5);
            t.vec(p + "ssm_conv1d.bias", {di}, 0.1);
            t.matrix(p + "ssm_x.weight", di, R + 2 * S, 2.0 * inv(di));
            if (jamba) t.vec(p + "ssm_dt_norm.weight", {R}, 0.2, 1.0);
            t.matrix(p + "ssm_dt.weight", R, di, inv(R));
            t.vec(p + "ssm_dt.bias", {di}, 0.5, -1.0);
            if (jamba) {
                t.vec(p + "ssm_b_norm.weight", {S}, 0.2, 1.0);
                t.vec(p + "ssm_c_norm.weight", {S}, 0.2, 1.0);
            }
            // A = -exp(A_log), A_log = log(1..d_state) jittered: negative, as llama.cpp stores it
            std::vector<float> a;
            for (uint32_t i = 0; i < di; ++i)
                for (uint32_t j = 0; j < S; ++j)
                    a.push_back(static_cast<float>(-(j + 1.0) * (1.0 + 0.1 * (rng.uniform() - 0.5))));
            t.f32(p + "ssm_a", {S, di}, a);
            t.vec(p + "ssm_d", {di}, 0.5, 1.0);
            t.matrix(p + "ssm_out.weight", di, E, inv(di));
        } else {
            t.matrix(p + "attn_q.weight", E, E, 2.0 * inv(E));
            t.matrix(p + "attn_k.weight", E, n_kv, 2.0 * inv(E));
            t.matrix(p + "attn_v.weight", E, n_kv, 2.0 * inv(E));
            t.matrix(p + "attn_output.weight", E, E, inv(E));
        }
        if (jamba) {
            t.ones(p + "ffn_norm.weight", E);
            t.matrix(p + "ffn_gate.weight", E, F, 2.0 * inv(E));
            t.matrix(p + "ffn_up.weight", E, F, 2.0 * inv(E));
            t.matrix(p + "ffn_down.weight", F, E, inv(F));
        }
    }
    t.ones("output_norm.weight", E);
    t.matrix("output.weight", E, o.n_vocab, 2.0 * inv(E));
    return w;
}

gguf_writer build(const tiny_model_options& o) {
    validate(o);
    if (o.arch != tiny_arch::llama) return build_ssm(o);
    const uint32_t head_dim = o.n_embd / o.n_head;
    const uint32_t n_embd_kv = head_dim * o.n_head_kv;
    splitmix64 rng(o.seed);

    gguf_writer w;
    const std::string arch = "llama";
    w.set_string("general.architecture", arch);
    w.set_string("general.name", "tiny-llama-peer");
    w.set_u32("general.alignment", 32);
    w.set_u32("general.file_type", file_type(o.weight_type));
    w.set_u32(arch + ".vocab_size", o.n_vocab);
    w.set_u32(arch + ".context_length", o.n_ctx_train);
    w.set_u32(arch + ".embedding_length", o.n_embd);
    w.set_u32(arch + ".block_count", o.n_layer);
    w.set_u32(arch + ".feed_forward_length", o.n_ff);
    w.set_u32(arch + ".attention.head_count", o.n_head);
    w.set_u32(arch + ".attention.head_count_kv", o.n_head_kv);
    w.set_u32(arch + ".rope.dimension_count", head_dim);
    w.set_f32(arch + ".rope.freq_base", o.rope_freq_base);
    w.set_f32(arch + ".attention.layer_norm_rms_epsilon", o.rms_eps);

    write_tokenizer(w, o.n_vocab);

    // A matrix of ne0 x ne1 values, drawn in file order and stored as the weight type row by row.
    const auto matrix = [&](std::string name, uint32_t ne0, uint32_t ne1, double scale) {
        const size_t n = size_t{ne0} * ne1;
        std::vector<float> values(n);
        for (float& v : values) v = static_cast<float>((rng.uniform() * 2.0 - 1.0) * scale);
        const dtype t = o.weight_type;
        const size_t row_bytes = row_size(t, ne0);
        std::vector<uint8_t> data(row_bytes * ne1);
        for (size_t r = 0; r < ne1; ++r)
            from_f32(t, values.data() + r * ne0, data.data() + r * row_bytes, ne0);
        w.add_tensor(std::move(name), {ne0, ne1}, static_cast<uint32_t>(t), std::move(data));
    };
    const auto ones = [&](std::string name, uint32_t n) {
        std::vector<uint8_t> data(size_t{n} * sizeof(float));
        const float one = 1.0f;
        for (size_t i = 0; i < n; ++i) std::memcpy(data.data() + i * sizeof one, &one, sizeof one);
        w.add_tensor(std::move(name), {n}, static_cast<uint32_t>(dtype::f32), std::move(data));
    };

    matrix("token_embd.weight", o.n_embd, o.n_vocab, 1.0);
    for (uint32_t il = 0; il < o.n_layer; ++il) {
        const std::string p = fmt::format("blk.{}.", il);
        ones(p + "attn_norm.weight", o.n_embd);
        matrix(p + "attn_q.weight", o.n_embd, o.n_embd, 2.0 * inv(o.n_embd));
        matrix(p + "attn_k.weight", o.n_embd, n_embd_kv, 2.0 * inv(o.n_embd));
        matrix(p + "attn_v.weight", o.n_embd, n_embd_kv, 2.0 * inv(o.n_embd));
        matrix(p + "attn_output.weight", o.n_embd, o.n_embd, inv(o.n_embd));
        ones(p + "ffn_norm.weight", o.n_embd);
        matrix(p + "ffn_gate.weight", o.n_embd, o.n_ff, 2.0 * inv(o.n_embd));
        matrix(p + "ffn_up.weight", o.n_embd, o.n_ff, 2.0 * inv(o.n_embd));
        matrix(p + "ffn_down.weight", o.n_ff, o.n_embd, inv(o.n_ff));
    }
    ones("output_norm.weight", o.n_embd);
    matrix("output.weight", o.n_embd, o.n_vocab, 2.0 * inv(o.n_embd));
    return w;
}

}  // namespace

tiny_model_options tiny_model_options::mamba() {
    tiny_model_options o;
    o.arch = tiny_arch::mamba;
    o.n_embd = 32;
    o.n_layer = 2;
    o.n_head = 0;
    o.n_head_kv = 0;
    o.n_ff = 0;
    o.seed = 0x5EED4D42u;
    return o;
}

tiny_model_options tiny_model_options::jamba() {
    tiny_model_options o;
    o.arch = tiny_arch::jamba;
    o.n_embd = 32;
    o.n_layer = 4;
    o.n_head = 4;
    o.n_head_kv = 2;
    o.n_ff = 64;
    o.seed = 0x5EED7A4Bu;
    return o;
}

std::vector<uint8_t> tiny_model_bytes(const tiny_model_options& options) {
    return build(options).bytes();
}

uint64_t write_tiny_model(const std::string& path, const tiny_model_options& options) {
    return build(options).write(path);
}

}  // namespace kvc
