#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <kvcache/dtype.h>
#include <kvcache/runtime/gguf.h>
#include <kvcache/runtime/tiny_model.h>
#include <kvcache/state.h>

namespace kvc {
namespace {

namespace fs = std::filesystem;

// make_tiny_llama.py's output (sha256 3f1774a0...fee01), measured once with XXH3_64bits.
constexpr size_t reference_size = 435104;
constexpr uint64_t reference_xxh3 = 0xbcc8398f65bed714ull;

TEST(tiny_model, default_bytes_are_the_reference) {
    const auto bytes = tiny_model_bytes();
    EXPECT_EQ(bytes.size(), reference_size);
    EXPECT_EQ(XXH3_64bits(bytes.data(), bytes.size()), reference_xxh3);
}

// make_tiny_mamba.py's and make_tiny_jamba.py's outputs (sha256 5422f0ed...500693 and 2ef6cda0...bc8f72,
// `cmp`-identical to the peer's files when measured), measured once with XXH3_64bits.
TEST(tiny_model, mamba_and_jamba_bytes_are_the_reference) {
    const auto mamba = tiny_model_bytes(tiny_model_options::mamba());
    EXPECT_EQ(mamba.size(), 142944u);
    EXPECT_EQ(XXH3_64bits(mamba.data(), mamba.size()), 0xa7fa182d8020f555ull);
    const auto jamba = tiny_model_bytes(tiny_model_options::jamba());
    EXPECT_EQ(jamba.size(), 268704u);
    EXPECT_EQ(XXH3_64bits(jamba.data(), jamba.size()), 0x04b1429749425cbbull);
    const auto f = gguf_file::parse(jamba);
    EXPECT_EQ(f.get_string("general.architecture"), "jamba");
    EXPECT_EQ(f.find("jamba.attention.head_count_kv")->value,
              (gguf_value{gguf_type::array, gguf_type::u32,
                          gguf_array{gguf_type::u32, {0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0}}})
                  .value);
}

TEST(tiny_model, mamba_options_are_checked) {
    tiny_model_options o = tiny_model_options::mamba();
    o.d_state = 0;
    EXPECT_THROW(tiny_model_bytes(o), error);
    o = tiny_model_options::mamba();
    o.weight_type = dtype::q8_0;
    EXPECT_THROW(tiny_model_bytes(o), error);
    o = tiny_model_options::jamba();
    o.n_head = 3;
    EXPECT_THROW(tiny_model_bytes(o), error);
}

TEST(tiny_model, default_model_reads_back) {
    const auto f = gguf_file::parse(tiny_model_bytes());
    EXPECT_EQ(f.get_string("general.architecture"), "llama");
    EXPECT_EQ(f.get_uint("general.file_type"), 0u);
    EXPECT_EQ(f.get_uint("llama.embedding_length"), 64u);
    EXPECT_EQ(f.get_uint("llama.attention.head_count_kv"), 2u);
    EXPECT_EQ(f.get_uint("llama.rope.dimension_count"), 16u);
    EXPECT_EQ(f.get_float("llama.attention.layer_norm_rms_epsilon"), static_cast<double>(1e-5f));
    const auto tokens = f.get_string_array("tokenizer.ggml.tokens");
    ASSERT_TRUE(tokens);
    ASSERT_EQ(tokens->size(), 256u);
    EXPECT_EQ((*tokens)[0], "<unk>");
    EXPECT_EQ((*tokens)[3], "<0x00>");
    EXPECT_EQ((*tokens)[255], "<0xFC>");
    EXPECT_EQ(f.tensors().size(), 2u + 2 * 9 + 1);
    EXPECT_EQ(f.tensors()[0].name, "token_embd.weight");
    EXPECT_EQ(f.tensors().back().name, "output.weight");
}

// Every weight type: right types, dims and file type, and values close to the f32 model's.
TEST(tiny_model, weight_types) {
    const auto ref = gguf_file::parse(tiny_model_bytes());
    const std::vector<std::pair<dtype, uint32_t>> types = {
        {dtype::f32, 0}, {dtype::f16, 1}, {dtype::q4_0, 2}, {dtype::q8_0, 7}, {dtype::bf16, 32}};
    for (const auto& [t, ftype] : types) {
        SCOPED_TRACE(to_string(t));
        tiny_model_options o;
        o.weight_type = t;
        const auto f = gguf_file::parse(tiny_model_bytes(o));
        EXPECT_EQ(f.get_uint("general.file_type"), ftype);
        ASSERT_EQ(f.tensors().size(), ref.tensors().size());
        for (size_t i = 0; i < f.tensors().size(); ++i) {
            const gguf_tensor_info& a = f.tensors()[i];
            const gguf_tensor_info& r = ref.tensors()[i];
            EXPECT_EQ(a.name, r.name);
            EXPECT_EQ(a.ne, r.ne);
            const bool norm = a.ne.size() == 1;
            EXPECT_EQ(a.ggml_type, norm ? 0u : static_cast<uint32_t>(t)) << a.name;
            if (norm) continue;
            ASSERT_EQ(a.ne.size(), 2u);
            const int64_t ne0 = a.ne[0];
            std::vector<float> got(static_cast<size_t>(a.n_elements()));
            const size_t row = row_size(t, ne0);
            for (int64_t r0 = 0; r0 < a.ne[1]; ++r0) to_f32(t, a.data + r0 * row, got.data() + r0 * ne0, ne0);
            std::vector<float> want(got.size());
            std::memcpy(want.data(), r.data, r.n_bytes);
            float amax = 0;
            for (const float v : want) amax = std::max(amax, std::abs(v));
            const float tol = t == dtype::q4_0 ? amax / 6 : amax / 100;  // q4_0: 16 levels
            for (size_t k = 0; k < got.size(); ++k) ASSERT_NEAR(got[k], want[k], tol) << a.name << " " << k;
        }
    }
}

TEST(tiny_model, other_sizes) {
    tiny_model_options o;
    o.n_vocab = 300;
    o.n_embd = 96;
    o.n_head = 6;
    o.n_head_kv = 3;
    o.n_layer = 3;
    o.n_ff = 160;
    o.seed = 42;
    o.weight_type = dtype::q8_0;
    const auto f = gguf_file::parse(tiny_model_bytes(o));
    EXPECT_EQ(f.get_uint("llama.rope.dimension_count"), 16u);
    EXPECT_EQ(f.get_uint("llama.block_count"), 3u);
    EXPECT_EQ(f.find_tensor("blk.2.attn_k.weight")->ne, (std::vector<int64_t>{96, 48}));
    EXPECT_EQ(f.find_tensor("blk.2.ffn_down.weight")->ne, (std::vector<int64_t>{160, 96}));
    EXPECT_EQ(f.find_tensor("token_embd.weight")->ne, (std::vector<int64_t>{96, 300}));
    EXPECT_EQ(f.get_string_array("tokenizer.ggml.tokens")->back(), "<0x128>");
    // the seed matters, and the same options give the same bytes
    tiny_model_options o2 = o;
    o2.seed = 43;
    EXPECT_NE(tiny_model_bytes(o), tiny_model_bytes(o2));
    EXPECT_EQ(tiny_model_bytes(o), tiny_model_bytes(o));
}

TEST(tiny_model, write_equals_bytes) {
    const std::string p = (fs::temp_directory_path() / fmt::format("kvc-tiny-{}.gguf", ::getpid())).string();
    tiny_model_options o;
    o.weight_type = dtype::f16;
    const uint64_t size = write_tiny_model(p, o);
    const auto bytes = tiny_model_bytes(o);
    EXPECT_EQ(size, bytes.size());
    EXPECT_EQ(read_file_bytes(p), bytes);
    const auto f = gguf_file::open(p);
    EXPECT_EQ(f.find_tensor("output.weight")->ggml_type, 1u);
    fs::remove(p);
}

TEST(tiny_model, invalid_options) {
    const auto expect_invalid = [](tiny_model_options o, const std::string& want) {
        try {
            tiny_model_bytes(o);
            ADD_FAILURE() << "accepted, expected " << want;
        } catch (const error& e) {
            EXPECT_EQ(e.code(), errc::invalid_argument);
            EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
        }
    };
    tiny_model_options o;
    o.n_head = 5;
    expect_invalid(o, "n_embd 64 is not a multiple of n_head 5");
    o = {};
    o.n_head_kv = 3;
    expect_invalid(o, "n_head 4 is not a multiple of n_head_kv 3");
    o = {};
    o.n_head = 0;
    expect_invalid(o, "n_head must be positive");
    o = {};
    o.n_head_kv = 0;
    expect_invalid(o, "n_head_kv must be positive");
    o = {};
    o.n_layer = 0;
    expect_invalid(o, "n_layer must be positive");
    o = {};
    o.n_vocab = 2;
    expect_invalid(o, "n_vocab 2 is less than 3");
    o = {};
    o.n_embd = 48;
    o.n_head = 4;
    o.weight_type = dtype::q4_0;
    expect_invalid(o, "weight_type q4_0 needs n_embd (48) and n_ff (128) to be multiples of 32");
    o = {};
    o.n_ff = 100;
    o.weight_type = dtype::q8_0;
    expect_invalid(o, "multiples of 32");
    o = {};
    o.weight_type = static_cast<dtype>(7);
    expect_invalid(o, "weight_type 7");
    o = {};
    o.rms_eps = 0;
    expect_invalid(o, "rms_eps");
    o = {};
    o.rope_freq_base = NAN;
    expect_invalid(o, "rope_freq_base");
    o = {};
    o.n_vocab = 1u << 30;
    expect_invalid(o, "weights is more than");
    // the block rule holds only for block types
    o = {};
    o.n_embd = 48;
    o.n_ff = 100;
    o.weight_type = dtype::bf16;
    EXPECT_NO_THROW(tiny_model_bytes(o));
}

}  // namespace
}  // namespace kvc
