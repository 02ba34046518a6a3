// libFuzzer target: arbitrary bytes as GGUF files. A rejected file must end in kvc::error; an accepted
// one must have every metadata value and every byte of every tensor readable (ASan catches a reader that
// lets a tensor point outside the bytes), and its lookups must agree with its lists.
#include <variant>

#include <kvcache/runtime/gguf.h>
#include <kvcache/runtime/tiny_model.h>

#include "fuzz_caches.h"

using namespace kvc;
using namespace kvc::fuzz;

extern "C" int LLVMFuzzerInitialize(int*, char***) {
    std::vector<std::vector<uint8_t>> seeds;
    gguf_writer w;
    w.set_string("general.architecture", "llama");
    w.set_u32("u32", 7);
    w.set_i32("i32", -7);
    w.set_u64("u64", 1u << 20);
    w.set_f32("f32", 0.5f);
    w.set_bool("bool", true);
    w.set_string_array("strs", {"a", "bc", ""});
    w.set_f32_array("f32s", {1.0f, 2.0f});
    w.set_i32_array("i32s", {-1, 1});
    w.add_tensor("f32", {2, 2}, 0, std::vector<uint8_t>(16, 0x3f));
    w.add_tensor("q8_0", {32}, 8, std::vector<uint8_t>(34, 1));
    w.add_tensor("q4_K", {256}, 12, std::vector<uint8_t>(144, 2));
    seeds.push_back(w.bytes());
    tiny_model_options o;
    o.n_vocab = 8;
    o.n_embd = 32;
    o.n_head = 2;
    o.n_head_kv = 1;
    o.n_layer = 1;
    o.n_ff = 32;
    seeds.push_back(tiny_model_bytes(o));
    o.weight_type = dtype::q4_0;
    seeds.push_back(tiny_model_bytes(o));
    write_seeds(seeds);
    return 0;
}

namespace {

volatile uint64_t sink;

uint64_t touch(const gguf_value& v) {
    return std::visit(
        [](const auto& x) -> uint64_t {
            using T = std::decay_t<decltype(x)>;
            if constexpr (std::is_same_v<T, std::string>) {
                uint64_t h = x.size();
                for (const char c : x) h = h * 31 + static_cast<uint8_t>(c);
                return h;
            } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
                uint64_t h = x.size();
                for (const auto& s : x)
                    for (const char c : s) h = h * 31 + static_cast<uint8_t>(c);
                return h;
            } else if constexpr (std::is_same_v<T, gguf_array>) {
                uint64_t h = x.size();
                for (const uint8_t b : x.bytes) h = h * 31 + b;
                return h;
            } else {
                return static_cast<uint64_t>(x != 0);
            }
        },
        v.value);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    std::optional<gguf_file> f;
    try {
        f.emplace(gguf_file::parse({data, size}));
    } catch (const error&) {
        return 0;
    }
    check(f->file_size() == size);
    check(f->data_offset() % f->alignment() == 0);
    uint64_t h = 0;
    for (const gguf_kv& kv : f->metadata()) {
        check(f->find(kv.key) == &kv.value);
        h += touch(kv.value);
        // typed getters either convert or throw kvc::error
        try {
            h += *f->get_uint(kv.key);
        } catch (const error&) {}
        try {
            h += static_cast<uint64_t>(*f->get_int(kv.key));
        } catch (const error&) {}
        try {
            h += *f->get_float(kv.key) != 0;
        } catch (const error&) {}
        try {
            h += *f->get_bool(kv.key);
        } catch (const error&) {}
        try {
            h += f->get_string(kv.key)->size();
        } catch (const error&) {}
        try {
            h += f->get_string_array(kv.key)->size();
        } catch (const error&) {}
    }
    for (const gguf_tensor_info& t : f->tensors()) {
        check(f->find_tensor(t.name) == &t);
        check(t.ne.size() >= 1 && t.ne.size() <= 4 && t.n_elements() >= 1);
        check(t.offset % f->alignment() == 0);
        check(f->data_offset() + t.offset + t.n_bytes <= size);
        const auto traits = ggml_type_info(t.ggml_type);
        check(traits && t.ne[0] % traits->block_size == 0);
        check(t.n_bytes == static_cast<uint64_t>(t.n_elements() / traits->block_size) * traits->type_size);
        for (uint64_t i = 0; i < t.n_bytes; ++i) h += static_cast<uint8_t>(t.data[i]);
    }
    sink = h;
    return 0;
}
