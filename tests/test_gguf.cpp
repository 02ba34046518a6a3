#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <kvcache/limits.h>
#include <kvcache/runtime/gguf.h>
#include <kvcache/state.h>

namespace kvc {
namespace {

namespace fs = std::filesystem;

// -- hand-made files, for what the writer refuses to produce --

struct raw {
    std::vector<uint8_t> b;
    template <class T>
    raw& put(T v) {
        const auto* p = reinterpret_cast<const uint8_t*>(&v);
        b.insert(b.end(), p, p + sizeof v);
        return *this;
    }
    raw& u32(uint32_t v) { return put(v); }
    raw& u64(uint64_t v) { return put(v); }
    raw& str(std::string_view s) {
        u64(s.size());
        b.insert(b.end(), s.begin(), s.end());
        return *this;
    }
    raw& bytes(const std::vector<uint8_t>& v) {
        b.insert(b.end(), v.begin(), v.end());
        return *this;
    }
    raw& pad(size_t alignment = 32) {
        b.resize((b.size() + alignment - 1) / alignment * alignment, 0);
        return *this;
    }
    raw& zeros(size_t n) {
        b.resize(b.size() + n, 0);
        return *this;
    }
};

raw header(uint64_t n_tensors, uint64_t n_kv, uint32_t version = 3) {
    raw r;
    r.b = {'G', 'G', 'U', 'F'};
    r.u32(version).u64(n_tensors).u64(n_kv);
    return r;
}

// A tensor info: name, dims, type, offset.
std::vector<uint8_t> info(std::string_view name, const std::vector<uint64_t>& ne, uint32_t type,
                          uint64_t offset) {
    raw r;
    r.str(name).u32(static_cast<uint32_t>(ne.size()));
    for (const uint64_t d : ne) r.u64(d);
    r.u32(type).u64(offset);
    return r.b;
}

// The error parse throws, or a failure when it accepts.
error parse_error(const std::vector<uint8_t>& bytes) {
    try {
        gguf_file::parse(bytes);
    } catch (const error& e) {
        return e;
    }
    ADD_FAILURE() << "accepted";
    return error(errc::invalid_argument, "accepted");
}

// Parsing must fail with `code` and a message containing every piece of `want`.
void expect_rejected(const std::vector<uint8_t>& bytes, const std::vector<std::string>& want,
                     errc code = errc::corrupt_data) {
    const error e = parse_error(bytes);
    EXPECT_EQ(e.code(), code) << e.what();
    for (const auto& w : want) EXPECT_NE(std::string(e.what()).find(w), std::string::npos) << e.what();
}

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<uint8_t> v(n);
    for (auto& x : v) x = static_cast<uint8_t>(rng());
    return v;
}

std::vector<uint8_t> f32_bytes(const std::vector<float>& v) {
    std::vector<uint8_t> b(v.size() * sizeof(float));
    std::memcpy(b.data(), v.data(), b.size());
    return b;
}

// A small valid file whose last tensor ends exactly at the end of the file, so that every shorter
// prefix loses something the reader needs.
std::vector<uint8_t> small_file() {
    gguf_writer w;
    w.set_string("general.architecture", "llama");
    w.set_u32("n", 7);
    w.set_string_array("names", {"a", "bc"});
    w.set_f32_array("floats", {1.5f, -2.0f});
    w.add_tensor("a", {4, 2}, 0, f32_bytes({1, 2, 3, 4, 5, 6, 7, 8}));  // 32 bytes
    w.add_tensor("b", {32}, 8, random_bytes(34, 1));                    // q8_0: 34 bytes, padded to 64
    w.add_tensor("c", {8}, 0, f32_bytes({0, 1, 2, 3, 4, 5, 6, 7}));     // 32 bytes, ends the file
    return w.bytes();
}

// -- names and sizes --

TEST(gguf, type_names) {
    EXPECT_STREQ(to_string(gguf_type::u8), "u8");
    EXPECT_STREQ(to_string(gguf_type::boolean), "bool");
    EXPECT_STREQ(to_string(gguf_type::string), "string");
    EXPECT_STREQ(to_string(gguf_type::array), "array");
    EXPECT_STREQ(to_string(gguf_type::f64), "f64");
    EXPECT_STREQ(to_string(static_cast<gguf_type>(13)), "unknown");
}

TEST(gguf, ggml_type_info_knows_the_listed_types) {
    struct want {
        uint32_t id;
        const char* name;
        int64_t block;
        size_t size;
    };
    for (const want& w : std::vector<want>{
             {0, "f32", 1, 4},       {1, "f16", 1, 2},       {2, "q4_0", 32, 18},    {3, "q4_1", 32, 20},
             {6, "q5_0", 32, 22},    {7, "q5_1", 32, 24},    {8, "q8_0", 32, 34},    {9, "q8_1", 32, 36},
             {10, "q2_K", 256, 84},  {11, "q3_K", 256, 110}, {12, "q4_K", 256, 144}, {13, "q5_K", 256, 176},
             {14, "q6_K", 256, 210}, {15, "q8_K", 256, 292}, {24, "i8", 1, 1},       {25, "i16", 1, 2},
             {26, "i32", 1, 4},      {27, "i64", 1, 8},      {28, "f64", 1, 8},      {30, "bf16", 1, 2}}) {
        const auto t = ggml_type_info(w.id);
        ASSERT_TRUE(t) << w.id;
        EXPECT_STREQ(t->name, w.name);
        EXPECT_EQ(t->block_size, w.block);
        EXPECT_EQ(t->type_size, w.size);
    }
    for (const uint32_t id : {4u, 5u, 31u, 32u, 33u, 36u, 40u, 1000u, 0xffffffffu})
        EXPECT_FALSE(ggml_type_info(id));
}

// -- round trips --

TEST(gguf, round_trip_every_metadata_type) {
    gguf_writer w;
    w.set_u32("u32", 0xfffffff0u);
    w.set_i32("i32", -123456);
    w.set_u64("u64", 0xfedcba9876543210ull);
    w.set_f32("f32", 0.1f);
    w.set_bool("yes", true);
    w.set_bool("no", false);
    w.set_string("str", std::string("h\0llo", 5));
    w.set_string("empty", "");
    w.set_string_array("strs", {"", "x", "long string with spaces"});
    w.set_f32_array("f32s", {1.0f, -0.5f, 3.25f});
    w.set_i32_array("i32s", {-1, 0, 2147483647});
    w.set_string_array("no_strs", {});
    const auto bytes = w.bytes();
    const auto f = gguf_file::parse(bytes);
    EXPECT_EQ(f.version(), 3u);
    EXPECT_EQ(f.alignment(), 32u);
    EXPECT_EQ(f.file_size(), bytes.size());
    EXPECT_EQ(f.data_offset(), (bytes.size() + 31) / 32 * 32);
    EXPECT_TRUE(f.tensors().empty());
    ASSERT_EQ(f.metadata().size(), 12u);
    EXPECT_EQ(f.metadata()[0].key, "u32");
    EXPECT_EQ(f.metadata()[4].key, "yes");
    EXPECT_EQ(f.metadata()[11].key, "no_strs");

    EXPECT_EQ(f.find("u32")->type, gguf_type::u32);
    EXPECT_EQ(std::get<uint64_t>(f.find("u32")->value), 0xfffffff0u);
    EXPECT_EQ(f.find("i32")->type, gguf_type::i32);
    EXPECT_EQ(std::get<int64_t>(f.find("i32")->value), -123456);
    EXPECT_EQ(f.find("u64")->type, gguf_type::u64);
    EXPECT_EQ(std::get<uint64_t>(f.find("u64")->value), 0xfedcba9876543210ull);
    EXPECT_EQ(f.find("f32")->type, gguf_type::f32);
    EXPECT_EQ(std::get<double>(f.find("f32")->value), static_cast<double>(0.1f));
    EXPECT_EQ(f.find("yes")->type, gguf_type::boolean);
    EXPECT_TRUE(std::get<bool>(f.find("yes")->value));
    EXPECT_FALSE(std::get<bool>(f.find("no")->value));
    EXPECT_EQ(std::get<std::string>(f.find("str")->value), std::string("h\0llo", 5));
    EXPECT_EQ(std::get<std::string>(f.find("empty")->value), "");
    const gguf_value* strs = f.find("strs");
    EXPECT_EQ(strs->type, gguf_type::array);
    EXPECT_EQ(strs->elem_type, gguf_type::string);
    EXPECT_EQ(std::get<std::vector<std::string>>(strs->value),
              (std::vector<std::string>{"", "x", "long string with spaces"}));
    EXPECT_EQ(f.find("f32s")->elem_type, gguf_type::f32);
    EXPECT_EQ(std::get<gguf_array>(f.find("f32s")->value).floats(), (std::vector<double>{1.0, -0.5, 3.25}));
    EXPECT_EQ(f.find("i32s")->elem_type, gguf_type::i32);
    EXPECT_EQ(std::get<gguf_array>(f.find("i32s")->value).ints(), (std::vector<int64_t>{-1, 0, 2147483647}));
    EXPECT_THROW((void)std::get<gguf_array>(f.find("i32s")->value).uints(), error) << "not unsigned";
    EXPECT_TRUE(std::get<std::vector<std::string>>(f.find("no_strs")->value).empty());
    EXPECT_EQ(f.find("absent"), nullptr);
}

// The writer has no setter for the narrow and 64-bit signed types: they are hand-made here.
TEST(gguf, reads_every_scalar_and_array_type) {
    raw kv;
    kv.str("u8").u32(0).put<uint8_t>(200);
    kv.str("i8").u32(1).put<int8_t>(-100);
    kv.str("u16").u32(2).put<uint16_t>(60000);
    kv.str("i16").u32(3).put<int16_t>(-30000);
    kv.str("i64").u32(11).put<int64_t>(std::numeric_limits<int64_t>::min());
    kv.str("f64").u32(12).put<double>(1e300);
    kv.str("u8s").u32(9).u32(0).u64(3).put<uint8_t>(1).put<uint8_t>(2).put<uint8_t>(255);
    kv.str("i16s").u32(9).u32(3).u64(2).put<int16_t>(-1).put<int16_t>(7);
    kv.str("u64s").u32(9).u32(10).u64(1).u64(~uint64_t{0});
    kv.str("f64s").u32(9).u32(12).u64(2).put<double>(0.25).put<double>(-8);
    kv.str("bools").u32(9).u32(7).u64(3).put<uint8_t>(1).put<uint8_t>(0).put<uint8_t>(1);
    kv.str("u32s").u32(9).u32(4).u64(0);
    const auto bytes = header(0, 12, 2).bytes(kv.b).b;
    const auto f = gguf_file::parse(bytes);
    EXPECT_EQ(f.version(), 2u);
    EXPECT_EQ(f.find("u8")->type, gguf_type::u8);
    EXPECT_EQ(f.get_uint("u8"), 200u);
    EXPECT_EQ(f.get_int("i8"), -100);
    EXPECT_EQ(f.get_uint("u16"), 60000u);
    EXPECT_EQ(f.get_int("i16"), -30000);
    EXPECT_EQ(f.get_int("i64"), std::numeric_limits<int64_t>::min());
    EXPECT_EQ(f.get_float("f64"), 1e300);
    const auto array = [&](const char* key) { return std::get<gguf_array>(f.find(key)->value); };
    EXPECT_EQ(array("u8s").uints(), (std::vector<uint64_t>{1, 2, 255}));
    EXPECT_EQ(array("u8s").bytes, (std::vector<uint8_t>{1, 2, 255})) << "held as the file stores them";
    EXPECT_EQ(f.find("u8s")->elem_type, gguf_type::u8);
    EXPECT_EQ(array("i16s").ints(), (std::vector<int64_t>{-1, 7}));
    EXPECT_EQ(array("i16s").size(), 2u);
    EXPECT_EQ(array("u64s").uints(), (std::vector<uint64_t>{~uint64_t{0}}));
    EXPECT_EQ(array("f64s").floats(), (std::vector<double>{0.25, -8}));
    EXPECT_EQ(array("bools").bools(), (std::vector<bool>{true, false, true}));
    EXPECT_TRUE(array("u32s").uints().empty());
    // no tensors and no padding after the metadata: still a file
    EXPECT_EQ(f.file_size(), bytes.size());
}

// kvc::limits::metadata_bytes (issue 21): the metadata section is bounded before the value that would pass
// the limit is allocated, by a string, an array or the count of entries; the limit and both values are
// named. The tensors and their data do not count.
TEST(gguf, metadata_over_the_limit_is_refused) {
    raw kv;
    kv.str("a").u32(8).str(std::string(100, 'x'));  // 8 + 1 + 4 + 8 + 100 = 121 bytes
    kv.str("b").u32(9).u32(0).u64(200).zeros(200);  // 8 + 1 + 4 + 4 + 8 + 200 = 225 bytes
    const auto bytes = header(0, 2).bytes(kv.b).b;
    const limits saved = get_limits();
    limits l = saved;
    l.metadata_bytes = 346;  // exactly both entries
    set_limits(l);
    EXPECT_NO_THROW(gguf_file::parse(bytes));
    l.metadata_bytes = 345;
    set_limits(l);
    expect_rejected(
        bytes, {"array: metadata bytes: 346, over the limit metadata_bytes of 345 (kvc::limits)", "key 'b'"},
        errc::out_of_range);
    l.metadata_bytes = 100;
    set_limits(l);
    expect_rejected(bytes, {"string value: metadata bytes: 121, over the limit metadata_bytes of 100"},
                    errc::out_of_range);
    l.metadata_bytes = 20;  // 2 entries of at least 13 bytes each cannot fit
    set_limits(l);
    expect_rejected(bytes, {"the metadata count: metadata bytes: 26, over the limit metadata_bytes of 20"},
                    errc::out_of_range);
    set_limits(saved);
}

TEST(gguf, round_trip_every_tensor_type) {
    gguf_writer w;
    std::vector<std::pair<std::string, std::vector<uint8_t>>> want;
    for (uint32_t id = 0; id < 64; ++id) {
        const auto t = ggml_type_info(id);
        if (!t) continue;
        const std::string name = fmt::format("t.{}", t->name);
        const std::vector<int64_t> ne = {t->block_size * 2, 3};
        auto data = random_bytes(t->type_size * 2 * 3, id);
        want.emplace_back(name, data);
        w.add_tensor(name, ne, id, data);
    }
    w.add_tensor("four_dims", {2, 3, 4, 5}, 26, random_bytes(4 * 120, 99));
    const auto bytes = w.bytes();
    const auto f = gguf_file::parse(bytes);
    ASSERT_EQ(f.tensors().size(), want.size() + 1);
    for (size_t i = 0; i < want.size(); ++i) {
        const gguf_tensor_info& t = f.tensors()[i];
        EXPECT_EQ(t.name, want[i].first);
        EXPECT_EQ(f.find_tensor(t.name), &t);
        const auto traits = ggml_type_info(t.ggml_type);
        ASSERT_TRUE(traits);
        EXPECT_EQ(t.ne, (std::vector<int64_t>{traits->block_size * 2, 3}));
        EXPECT_EQ(t.n_elements(), traits->block_size * 6);
        EXPECT_EQ(t.n_bytes, want[i].second.size());
        EXPECT_EQ(t.offset % 32, 0u);
        ASSERT_NE(t.data, nullptr);
        EXPECT_EQ(std::memcmp(t.data, want[i].second.data(), t.n_bytes), 0) << t.name;
    }
    const gguf_tensor_info* four = f.find_tensor("four_dims");
    ASSERT_NE(four, nullptr);
    EXPECT_EQ(four->ne, (std::vector<int64_t>{2, 3, 4, 5}));
    EXPECT_EQ(four->n_elements(), 120);
    EXPECT_EQ(f.find_tensor("nope"), nullptr);
}

TEST(gguf, custom_alignment) {
    gguf_writer w(64);
    w.set_u32("general.alignment", 64);
    w.add_tensor("a", {3}, 0, f32_bytes({1, 2, 3}));
    w.add_tensor("b", {1}, 0, f32_bytes({4}));
    const auto bytes = w.bytes();
    const auto f = gguf_file::parse(bytes);
    EXPECT_EQ(f.alignment(), 64u);
    EXPECT_EQ(f.data_offset() % 64, 0u);
    EXPECT_EQ(f.find_tensor("b")->offset, 64u);
    float x = 0;
    std::memcpy(&x, f.find_tensor("b")->data, sizeof x);
    EXPECT_EQ(x, 4.0f);
    EXPECT_EQ(bytes.size() % 64, 0u);
}

// -- typed getters --

TEST(gguf, typed_getters_convert_and_name_the_key) {
    raw kv;
    kv.str("u8").u32(0).put<uint8_t>(5);
    kv.str("neg").u32(5).put<int32_t>(-5);
    kv.str("big").u32(10).u64(~uint64_t{0});
    kv.str("f").u32(6).put<float>(2.5f);
    kv.str("s").u32(8).str("text");
    kv.str("b").u32(7).put<uint8_t>(1);
    kv.str("strs").u32(9).u32(8).u64(1).str("x");
    kv.str("ints").u32(9).u32(5).u64(1).put<int32_t>(1);
    const auto f = gguf_file::parse(header(0, 8).bytes(kv.b).b);

    EXPECT_EQ(f.get_uint("u8"), 5u);
    EXPECT_EQ(f.get_int("u8"), 5);
    EXPECT_EQ(f.get_float("u8"), 5.0);
    EXPECT_EQ(f.get_int("neg"), -5);
    EXPECT_EQ(f.get_float("neg"), -5.0);
    EXPECT_EQ(f.get_uint("big"), ~uint64_t{0});
    EXPECT_EQ(f.get_float("f"), 2.5);
    EXPECT_EQ(f.get_string("s"), "text");
    EXPECT_EQ(f.get_bool("b"), true);
    EXPECT_EQ(f.get_string_array("strs"), (std::vector<std::string>{"x"}));

    EXPECT_FALSE(f.get_uint("absent"));
    EXPECT_FALSE(f.get_int("absent"));
    EXPECT_FALSE(f.get_float("absent"));
    EXPECT_FALSE(f.get_bool("absent"));
    EXPECT_FALSE(f.get_string("absent"));
    EXPECT_FALSE(f.get_string_array("absent"));

    const auto expect_throw = [](auto fn, const std::string& want) {
        try {
            fn();
            ADD_FAILURE() << "no error, expected " << want;
        } catch (const error& e) {
            EXPECT_EQ(e.code(), errc::corrupt_data);
            EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
        }
    };
    expect_throw([&] { (void)f.get_uint("neg"); }, "key 'neg' is i32 -5");
    expect_throw([&] { (void)f.get_int("big"); }, "key 'big' is u64 18446744073709551615");
    expect_throw([&] { (void)f.get_uint("s"); },
                 "key 's' holds a value of type string, not an unsigned integer");
    expect_throw([&] { (void)f.get_int("f"); }, "key 'f'");
    expect_throw([&] { (void)f.get_float("s"); }, "key 's'");
    expect_throw([&] { (void)f.get_float("b"); }, "key 'b'");
    expect_throw([&] { (void)f.get_bool("u8"); }, "key 'u8' holds a value of type u8, not a bool");
    expect_throw([&] { (void)f.get_string("strs"); }, "key 'strs' holds an array, not a string");
    expect_throw([&] { (void)f.get_string_array("s"); }, "key 's'");
    expect_throw([&] { (void)f.get_string_array("ints"); }, "key 'ints' holds an array of i32");
}

// -- malformed files --

TEST(gguf, every_truncation_is_rejected) {
    const auto bytes = small_file();
    ASSERT_NO_THROW(gguf_file::parse(bytes));
    for (size_t n = 0; n < bytes.size(); ++n) {
        const std::vector<uint8_t> cut(bytes.begin(), bytes.begin() + static_cast<ptrdiff_t>(n));
        try {
            gguf_file::parse(cut);
            ADD_FAILURE() << "a prefix of " << n << " bytes was accepted";
        } catch (const error& e) {
            EXPECT_EQ(e.code(), errc::corrupt_data) << n << ": " << e.what();
            EXPECT_EQ(std::string(e.what()).rfind("gguf: at byte ", 0), 0u) << e.what();
        }
    }
}

TEST(gguf, bad_magic) {
    auto bytes = small_file();
    bytes[0] = 'g';
    expect_rejected(bytes, {"gguf: at byte 0: bad magic 67 47 55 46"});
    expect_rejected({}, {"at byte 0: the magic needs 4 bytes, the file has 0 left"});
}

TEST(gguf, unsupported_versions) {
    expect_rejected(header(0, 0, 1).b, {"at byte 4: version 1 is not supported"}, errc::unsupported);
    expect_rejected(header(0, 0, 4).b, {"at byte 4: version 4 is not supported (only 2 and 3)"},
                    errc::unsupported);
    expect_rejected(header(0, 0, 0x03000000).b, {"big-endian"}, errc::unsupported);
    EXPECT_NO_THROW(gguf_file::parse(header(0, 0, 2).b));
    EXPECT_NO_THROW(gguf_file::parse(header(0, 0, 3).b));
}

TEST(gguf, huge_counts) {
    expect_rejected(header(uint64_t{1} << 60, 0).b,
                    {"at byte 8: tensor count 1152921504606846976 cannot fit in the 0 bytes left"});
    expect_rejected(header(0, uint64_t{1} << 60).b, {"at byte 16: metadata count 1152921504606846976"});
    expect_rejected(header(~uint64_t{0}, ~uint64_t{0}).b, {"at byte 8: tensor count"});
    // an array count that the bytes left cannot hold
    raw kv;
    kv.str("a").u32(9).u32(4).u64(uint64_t{1} << 60);
    expect_rejected(header(0, 1).bytes(kv.b).b,
                    {"at byte 41: array of 1152921504606846976 elements", "key 'a'"});
    raw strs;
    strs.str("a").u32(9).u32(8).u64(uint64_t{1} << 61).zeros(64);
    expect_rejected(header(0, 1).bytes(strs.b).b, {"at byte 41: array of"});
}

TEST(gguf, huge_string_lengths) {
    raw key;
    key.u64(uint64_t{1} << 62).zeros(16);
    expect_rejected(
        header(0, 1).bytes(key.b).b,
        {"at byte 24: metadata key of 4611686018427387904 bytes is longer than the 16 bytes left"});
    raw value;
    value.str("k").u32(8).u64(~uint64_t{0});
    expect_rejected(header(0, 1).bytes(value.b).b,
                    {"at byte 37: string value of 18446744073709551615 bytes"});
    raw name;
    name.u64(1000).zeros(40);
    expect_rejected(header(1, 0).bytes(name.b).b, {"at byte 24: tensor name of 1000 bytes"});
}

TEST(gguf, bad_alignment) {
    const auto with_alignment = [](uint32_t type, uint64_t v) {
        raw kv;
        kv.str("general.alignment").u32(type);
        if (type == 4)
            kv.u32(static_cast<uint32_t>(v));
        else
            kv.u64(v);
        return header(0, 1).bytes(kv.b).b;
    };
    expect_rejected(with_alignment(4, 0), {"at byte 53: general.alignment 0 is not a power of two"});
    expect_rejected(with_alignment(4, 48), {"general.alignment 48 is not a power of two"});
    expect_rejected(with_alignment(10, 32), {"at byte 49: general.alignment must be a u32, not u64"});
    EXPECT_EQ(gguf_file::parse(with_alignment(4, 1)).alignment(), 1u);
    EXPECT_EQ(gguf_file::parse(with_alignment(4, 4096)).alignment(), 4096u);
}

TEST(gguf, tensor_offsets) {
    // two f32 tensors of 8 values (32 bytes each)
    const auto file = [](uint64_t off_a, uint64_t off_b, size_t data_bytes) {
        raw r = header(2, 0);
        r.bytes(info("a", {8}, 0, off_a)).bytes(info("b", {8}, 0, off_b)).pad().zeros(data_bytes);
        return r.b;
    };
    EXPECT_NO_THROW(gguf_file::parse(file(0, 32, 64)));
    EXPECT_NO_THROW(gguf_file::parse(file(32, 0, 64)));
    EXPECT_NO_THROW(gguf_file::parse(file(0, 32, 100)));  // trailing bytes are allowed
    // "a" starts at byte 24; its offset field at 24 + 8 + 1 + 4 + 8 + 4 = 49, "b"'s at 57 + 8 + 1 + 4 + 8 + 4
    // = 82
    expect_rejected(file(4, 32, 64),
                    {"at byte 49: tensor 'a': offset 4 is not a multiple of the alignment 32"});
    expect_rejected(file(0, 0, 64), {"at byte 82: tensor 'b': data [0, 32) overlaps tensor 'a' at [0, 32)"});
    expect_rejected(file(0, 32, 63),
                    {"at byte 82: tensor 'b': data [32, 64) of the data section ends past its 63"});
    expect_rejected(file(0, uint64_t{1} << 63, 64), {"tensor 'b'", "ends past"});
    expect_rejected(file(~uint64_t{31}, 0, 64), {"at byte 49: tensor 'a'", "ends past"});
    // overlap of a larger tensor with a later one
    raw r = header(2, 0);
    r.bytes(info("big", {16}, 0, 0)).bytes(info("small", {1}, 0, 32)).pad().zeros(96);
    expect_rejected(r.b, {"tensor 'small': data [32, 36) overlaps tensor 'big' at [0, 64)"});
}

TEST(gguf, tensor_dims) {
    const auto one = [](const std::vector<uint64_t>& ne, uint32_t type = 0) {
        return header(1, 0).bytes(info("t", ne, type, 0)).pad().zeros(64).b;
    };
    expect_rejected(one({}), {"at byte 33: tensor 't': 0 dimensions (must be 1..4)"});
    expect_rejected(one({1, 1, 1, 1, 1}), {"at byte 33: tensor 't': 5 dimensions"});
    expect_rejected(one({0}), {"at byte 37: tensor 't': ne[0] = 0"});
    expect_rejected(one({2, ~uint64_t{0}}), {"at byte 45: tensor 't': ne[1] = -1"});
    expect_rejected(one({uint64_t{1} << 32, uint64_t{1} << 32}),
                    {"at byte 45: tensor 't': the element count overflows at ne[1] = 4294967296"});
    expect_rejected(one({uint64_t{1} << 62, 2}), {"element count overflows"});
    expect_rejected(one({uint64_t{1} << 40, uint64_t{1} << 20}), {"ends past"});
    // bytes overflow though elements fit: 2^62 elements of i64
    expect_rejected(one({uint64_t{1} << 62}, 27), {"tensor 't': the byte size overflows"});
    expect_rejected(one({16}, 8),
                    {"at byte 45: tensor 't': ne[0] = 16 is not a multiple of q8_0's block size 32"});
    expect_rejected(one({4}, 4), {"at byte 45: tensor 't': unknown ggml type 4"});
    expect_rejected(one({4}, 1000), {"unknown ggml type 1000"});
    EXPECT_NO_THROW(gguf_file::parse(one({1, 1, 1, 1})));
}

TEST(gguf, unknown_value_types) {
    raw kv;
    kv.str("k").u32(13).u32(0);
    expect_rejected(header(0, 1).bytes(kv.b).b, {"at byte 33: key 'k': unknown value type 13"});
    raw arr;
    arr.str("k").u32(9).u32(99).u64(0);
    expect_rejected(header(0, 1).bytes(arr.b).b, {"at byte 37: unknown array element type 99", "key 'k'"});
    raw nested;
    nested.str("k").u32(9).u32(9).u64(0);
    expect_rejected(header(0, 1).bytes(nested.b).b, {"at byte 37: arrays of arrays are not supported"},
                    errc::unsupported);
    raw b;
    b.str("k").u32(7).put<uint8_t>(2);
    expect_rejected(header(0, 1).bytes(b.b).b, {"at byte 37: bool value is 2, not 0 or 1"});
}

TEST(gguf, duplicates) {
    raw kv;
    kv.str("k").u32(4).u32(1).str("k").u32(4).u32(2);
    expect_rejected(header(0, 2).bytes(kv.b).b, {"at byte 41: duplicate metadata key 'k'"});
    raw r = header(2, 0);
    r.bytes(info("t", {8}, 0, 0)).bytes(info("t", {8}, 0, 32)).pad().zeros(64);
    expect_rejected(r.b, {"at byte 57: duplicate tensor name 't'"});
}

TEST(gguf, data_section_past_the_end) {
    raw r = header(1, 0);
    r.bytes(info("t", {1}, 0, 0));
    expect_rejected(
        r.b, {"at byte 57: the data section would start at byte 64, past the end of the 57-byte file"});
}

// -- writer refusals --

TEST(gguf, writer_refuses_bad_input) {
    const auto expect_invalid = [](auto fn, const std::string& want) {
        try {
            fn();
            ADD_FAILURE() << "no error, expected " << want;
        } catch (const error& e) {
            EXPECT_EQ(e.code(), errc::invalid_argument);
            EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
        }
    };
    expect_invalid([] { gguf_writer w(48); }, "alignment 48");
    expect_invalid([] { gguf_writer w(0); }, "alignment 0");
    expect_invalid(
        [] {
            gguf_writer w;
            w.set_u32("k", 1);
            w.set_string("k", "x");
        },
        "duplicate metadata key 'k'");
    expect_invalid([] { gguf_writer().set_u32("general.alignment", 64); }, "differs");
    expect_invalid([] { gguf_writer().set_u64("general.alignment", 32); }, "must be a u32");
    expect_invalid([] { (void)gguf_writer(64).bytes(); }, "needs general.alignment = 64");
    expect_invalid(
        [] {
            gguf_writer w;
            w.add_tensor("t", {1}, 0, {0, 0, 0, 0});
            w.add_tensor("t", {1}, 0, {0, 0, 0, 0});
        },
        "duplicate tensor name 't'");
    expect_invalid([] { gguf_writer().add_tensor("t", {}, 0, {}); }, "0 dimensions");
    expect_invalid([] { gguf_writer().add_tensor("t", {1, 1, 1, 1, 1}, 0, {0, 0, 0, 0}); }, "5 dimensions");
    expect_invalid([] { gguf_writer().add_tensor("t", {0}, 0, {}); }, "ne[0] = 0");
    expect_invalid([] { gguf_writer().add_tensor("t", {-1}, 0, {}); }, "ne[0] = -1");
    expect_invalid([] { gguf_writer().add_tensor("t", {1}, 4, {}); }, "unknown ggml type 4");
    expect_invalid([] { gguf_writer().add_tensor("t", {16}, 8, {}); },
                   "not a multiple of q8_0's block size 32");
    expect_invalid([] { gguf_writer().add_tensor("t", {2}, 0, {0, 0, 0, 0}); }, "4 bytes of data");
    expect_invalid(
        [] {
            gguf_writer().add_tensor("t", {int64_t{1} << 40, int64_t{1} << 40}, 0, {});
        },
        "overflows");
}

// -- files --

class gguf_files : public ::testing::Test {
protected:
    void SetUp() override {
        dir_ = fs::temp_directory_path() /
               fmt::format("kvc-gguf-{}-{}", ::getpid(),
                           ::testing::UnitTest::GetInstance()->current_test_info()->name());
        fs::remove_all(dir_);
        fs::create_directories(dir_);
    }
    void TearDown() override { fs::remove_all(dir_); }
    std::string path(const char* name) const { return (dir_ / name).string(); }
    fs::path dir_;
};

TEST_F(gguf_files, open_missing_file_is_io) {
    try {
        gguf_file::open(path("missing.gguf"));
        ADD_FAILURE() << "opened";
    } catch (const error& e) {
        EXPECT_EQ(e.code(), errc::io);
        EXPECT_NE(std::string(e.what()).find("missing.gguf"), std::string::npos) << e.what();
    }
    try {
        gguf_file::open(dir_.string());
        ADD_FAILURE() << "opened a directory";
    } catch (const error& e) {
        EXPECT_EQ(e.code(), errc::io);
    }
}

TEST_F(gguf_files, open_equals_parse) {
    gguf_writer w;
    w.set_string("general.architecture", "llama");
    w.set_i32_array("ids", {1, 2, 3});
    w.add_tensor("a", {32, 2}, 8, random_bytes(68, 5));
    w.add_tensor("b", {3}, 0, f32_bytes({1, 2, 3}));
    const std::string p = path("m.gguf");
    const uint64_t size = w.write(p);
    const auto bytes = w.bytes();
    EXPECT_EQ(size, bytes.size());
    EXPECT_EQ(read_file_bytes(p), bytes);
    EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 1);  // no temporary left

    auto opened = gguf_file::open(p);
    const auto parsed = gguf_file::parse(bytes);
    EXPECT_EQ(opened.version(), parsed.version());
    EXPECT_EQ(opened.alignment(), parsed.alignment());
    EXPECT_EQ(opened.data_offset(), parsed.data_offset());
    EXPECT_EQ(opened.file_size(), parsed.file_size());
    ASSERT_EQ(opened.metadata().size(), parsed.metadata().size());
    for (size_t i = 0; i < parsed.metadata().size(); ++i) {
        EXPECT_EQ(opened.metadata()[i].key, parsed.metadata()[i].key);
        EXPECT_EQ(opened.metadata()[i].value.type, parsed.metadata()[i].value.type);
        EXPECT_EQ(opened.metadata()[i].value.value, parsed.metadata()[i].value.value);
    }
    ASSERT_EQ(opened.tensors().size(), parsed.tensors().size());
    for (size_t i = 0; i < parsed.tensors().size(); ++i) {
        const auto& a = opened.tensors()[i];
        const auto& b = parsed.tensors()[i];
        EXPECT_EQ(a.name, b.name);
        EXPECT_EQ(a.ne, b.ne);
        EXPECT_EQ(a.ggml_type, b.ggml_type);
        EXPECT_EQ(a.offset, b.offset);
        EXPECT_EQ(a.n_bytes, b.n_bytes);
        EXPECT_EQ(std::memcmp(a.data, b.data, a.n_bytes), 0);
    }
    // moves keep the mapping and the pointers into it
    const std::byte* data = opened.find_tensor("b")->data;
    gguf_file moved = std::move(opened);
    EXPECT_EQ(moved.find_tensor("b")->data, data);
    float x = 0;
    std::memcpy(&x, data + 8, sizeof x);
    EXPECT_EQ(x, 3.0f);

    // overwriting is atomic and the new content is what open sees
    gguf_writer w2;
    w2.set_u32("n", 1);
    w2.write(p);
    EXPECT_EQ(gguf_file::open(p).get_uint("n"), 1u);
    EXPECT_EQ(moved.find_tensor("b")->data, data);  // the old mapping stays valid
}

TEST_F(gguf_files, open_reports_corruption_with_the_path) {
    const std::string p = path("bad.gguf");
    auto bytes = small_file();
    bytes.resize(bytes.size() - 1);
    {
        std::ofstream f(p, std::ios::binary);
        f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    }
    try {
        gguf_file::open(p);
        ADD_FAILURE() << "accepted";
    } catch (const error& e) {
        EXPECT_EQ(e.code(), errc::corrupt_data);
        EXPECT_NE(std::string(e.what()).find("bad.gguf': at byte"), std::string::npos) << e.what();
    }
    const std::string empty = path("empty.gguf");
    std::ofstream(empty).close();
    try {
        gguf_file::open(empty);
        ADD_FAILURE() << "accepted";
    } catch (const error& e) {
        EXPECT_EQ(e.code(), errc::corrupt_data) << e.what();
    }
}

TEST_F(gguf_files, write_to_a_missing_directory_is_io) {
    try {
        gguf_writer().write(path("no/such/dir.gguf"));
        ADD_FAILURE() << "written";
    } catch (const error& e) {
        EXPECT_EQ(e.code(), errc::io);
    }
}

}  // namespace
}  // namespace kvc
