// The tiny llama model (include/kvcache/runtime/tiny_model.h). Everything mirrors
// /work/shared/tools/llama-peer/make_tiny_llama.py step for step (metadata order, PRNG, scales and
// the double arithmetic before the f32 store), so the default options give the same bytes.
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
    positive(o.n_head, "n_head");
    positive(o.n_head_kv, "n_head_kv");
    positive(o.n_layer, "n_layer");
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

gguf_writer build(const tiny_model_options& o) {
    validate(o);
    const uint32_t head_dim = o.n_embd / o.n_head;
    const uint32_t n_embd_kv = head_dim * o.n_head_kv;
    splitmix64 rng(o.seed);

    // the script's inv: 1.0 / (n ** 0.5), Python's ** being C's pow
    const auto inv = [](uint32_t n) { return 1.0 / std::pow(static_cast<double>(n), 0.5); };

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

    std::vector<std::string> tokens = {"<unk>", "<s>", "</s>"};
    std::vector<int32_t> token_types = {2, 3, 3};  // UNKNOWN, CONTROL, CONTROL, then BYTE
    for (uint32_t i = 0; i + 3 < o.n_vocab; ++i) {
        tokens.push_back(fmt::format("<0x{:02X}>", i));
        token_types.push_back(6);
    }
    w.set_string("tokenizer.ggml.model", "llama");
    w.set_string_array("tokenizer.ggml.tokens", tokens);
    w.set_f32_array("tokenizer.ggml.scores", std::vector<float>(o.n_vocab, 0.0f));
    w.set_i32_array("tokenizer.ggml.token_type", token_types);
    w.set_u32("tokenizer.ggml.unknown_token_id", 0);
    w.set_u32("tokenizer.ggml.bos_token_id", 1);
    w.set_u32("tokenizer.ggml.eos_token_id", 2);
    w.set_bool("tokenizer.ggml.add_bos_token", false);
    w.set_bool("tokenizer.ggml.add_eos_token", false);

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

std::vector<uint8_t> tiny_model_bytes(const tiny_model_options& options) {
    return build(options).bytes();
}

uint64_t write_tiny_model(const std::string& path, const tiny_model_options& options) {
    return build(options).write(path);
}

}  // namespace kvc
