// Block records (include/kvcache/block_record.h): round trips, the key format, and every refusal of a
// damaged or foreign value, each with its message.
#include <cstring>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <xxhash.h>

#include <kvcache/block_record.h>
#include "counting_new.h"

namespace kvc {
namespace {

block_layout layout2() {
    block_layout l;
    l.model_id = 0x1234;
    l.type_k = dtype::f16;
    l.type_v = dtype::q8_0;
    l.block_size = 4;
    l.layers = {{.il = 0, .n_k = 8, .n_v = 32}, {.il = 2, .n_k = 8, .n_v = 64}};
    return l;
}

struct sample {
    block_layout layout = layout2();
    std::vector<token_t> tokens{5, 6, 7, 8};
    block_id id;
    std::vector<uint8_t> rows;
    std::vector<uint8_t> value;

    explicit sample(uint32_t depth = 1, uint64_t key = 9) {
        id.key = key;
        id.depth = depth;
        id.parent_hash = depth == 0 ? key : 0xabcdef;
        id.hash = block_chain_hash(id.parent_hash, tokens);
        rows.resize(layout.row_bytes());
        std::mt19937 rng(7);
        for (uint8_t& b : rows) b = static_cast<uint8_t>(rng());
        value = encode_block(layout, id, tokens, rows);
    }
};

// Recomputes the checksum of a value changed by a test, so that a later check is the one that refuses.
void reseal(std::vector<uint8_t>& v) {
    const uint64_t sum = XXH3_64bits(v.data(), v.size() - 8);
    std::memcpy(v.data() + v.size() - 8, &sum, 8);
}

template <typename T>
void poke(std::vector<uint8_t>& v, size_t off, T x) {
    std::memcpy(v.data() + off, &x, sizeof x);
}

std::string refusal(std::span<const uint8_t> v, const block_layout& l, const block_id* expect = nullptr) {
    try {
        (void)decode_block(v, l, expect);
    } catch (const error& e) {
        return std::string(to_string(e.code())) + ": " + e.what();
    }
    return "accepted";
}

TEST(block_record, round_trip) {
    const sample s;
    // 64 header + 4 tokens + per layer K 4x16 + V 4x34 / 4x68 + 8 checksum
    EXPECT_EQ(s.layout.row_bytes(), uint64_t{4 * 16 + 4 * 34 + 4 * 16 + 4 * 68});
    EXPECT_EQ(s.value.size(), s.layout.record_bytes());
    EXPECT_EQ(s.value.size(), 64u + 16 + s.layout.row_bytes() + 8);
    const block_view v = decode_block(s.value, s.layout, &s.id);
    EXPECT_EQ(v.id.key, s.id.key);
    EXPECT_EQ(v.id.hash, s.id.hash);
    EXPECT_EQ(v.id.parent_hash, s.id.parent_hash);
    EXPECT_EQ(v.id.depth, s.id.depth);
    EXPECT_EQ(std::vector(v.tokens.begin(), v.tokens.end()), s.tokens);
    EXPECT_EQ(std::vector(v.rows.begin(), v.rows.end()), s.rows);
    // per layer: K then V, in layout order
    EXPECT_EQ(v.k(0).size(), 64u);
    EXPECT_EQ(v.v(0).size(), 136u);
    EXPECT_EQ(v.k(1).size(), 64u);
    EXPECT_EQ(v.v(1).size(), 272u);
    EXPECT_EQ(v.v(1).data() + v.v(1).size(), s.rows.size() + v.rows.data());
    EXPECT_EQ(std::memcmp(v.v(0).data(), s.rows.data() + 64, 136), 0);
    // the fill callback sees each piece once, in order
    std::vector<std::pair<uint32_t, bool>> seen;
    const auto again =
        encode_block(s.layout, s.id, s.tokens, [&](uint32_t l, bool is_v, std::span<uint8_t> dst) {
            seen.emplace_back(l, is_v);
            std::memcpy(dst.data(), (is_v ? v.v(l) : v.k(l)).data(), dst.size());
        });
    EXPECT_EQ(again, s.value);
    EXPECT_EQ(seen, (std::vector<std::pair<uint32_t, bool>>{{0, false}, {0, true}, {1, false}, {1, true}}));
    // a root: its parent hash is its key
    const sample root(0, 77);
    EXPECT_EQ(decode_block(root.value, root.layout).id.parent_hash, 77u);
}

TEST(block_record, chain_hash_is_the_prefix_caches) {
    // XXH3-64 of the int32 tokens seeded with the parent's hash (prefix_event::hash, a router's formula)
    const std::vector<token_t> t{1, 2, 3, 4};
    EXPECT_EQ(block_chain_hash(42, t), XXH3_64bits_withSeed(t.data(), 16, 42));
}

TEST(block_record, fingerprint_covers_every_field) {
    const block_layout base = layout2();
    std::vector<block_layout> changed(10, base);
    changed[0].model_id = 0x1235;
    changed[1].type_k = dtype::f32;
    changed[2].type_v = dtype::q4_0;
    changed[3].type_v = dtype::f16;
    changed[3].v_trans = true;
    changed[4].block_size = 8;
    changed[5].layers[1].il = 3;
    changed[6].layers[0].n_k = 16;
    changed[7].layers[1].n_v = 96;
    changed[8].layers.pop_back();
    changed[9].per_block = true;
    std::set<uint64_t> fps{base.fingerprint()};
    for (const block_layout& l : changed) EXPECT_TRUE(fps.insert(l.fingerprint()).second);
    // and a value of one is foreign to every other
    const sample s;
    for (const block_layout& l : changed)
        EXPECT_NE(refusal(s.value, l).find("corrupt_data: block record: layout fingerprint"),
                  std::string::npos);
}

// A recurrent snapshot: one row of each state per layer, whatever the block size; a layer may have none.
TEST(block_record, per_block_layouts_hold_one_state_row_per_layer) {
    block_layout l;
    l.type_k = dtype::f32;
    l.type_v = dtype::f16;
    l.block_size = 16;
    l.per_block = true;
    l.layers = {{.il = 0, .n_k = 12, .n_v = 64}, {.il = 1, .n_k = 0, .n_v = 8}};
    EXPECT_EQ(l.row_bytes(), uint64_t{12 * 4 + 64 * 2 + 0 + 8 * 2});
    std::vector<token_t> toks(16, 3);
    const block_id id{.key = 1, .hash = block_chain_hash(1, toks), .parent_hash = 1, .depth = 0};
    std::vector<uint8_t> rows(l.row_bytes(), 0x42);
    const std::vector<uint8_t> v = encode_block(l, id, toks, rows);
    const block_view view = decode_block(v, l, &id);
    EXPECT_EQ(view.k(0).size(), 48u);
    EXPECT_EQ(view.v(0).size(), 128u);
    EXPECT_EQ(view.k(1).size(), 0u);
    EXPECT_EQ(view.v(1).size(), 16u);
    l.v_trans = true;
    EXPECT_THROW((void)l.row_bytes(), error);
    block_layout kv = l;  // the same widths as K/V rows: a width of 0 is refused, and the bytes differ
    kv.per_block = false;
    kv.v_trans = false;
    EXPECT_THROW((void)kv.row_bytes(), error);
}

TEST(block_record, layout_refusals) {
    block_layout l = layout2();
    l.layers[0].n_v = 33;  // not whole q8_0 blocks
    EXPECT_THROW((void)l.row_bytes(), error);
    l = layout2();
    l.v_trans = true;  // channel-major V of a quantised type
    EXPECT_THROW((void)l.row_bytes(), error);
    l = layout2();
    l.block_size = 0;
    EXPECT_THROW((void)l.row_bytes(), error);
    l = layout2();
    l.layers.clear();
    EXPECT_THROW((void)l.row_bytes(), error);
}

TEST(block_record, encode_refusals) {
    const sample s;
    EXPECT_THROW((void)encode_block(s.layout, s.id, std::span(s.tokens).first(3), s.rows), error);
    block_id bad = s.id;
    bad.hash ^= 1;
    EXPECT_THROW((void)encode_block(s.layout, bad, s.tokens, s.rows), error);
    bad = s.id;
    bad.depth = 0;  // a root whose parent hash is not its key
    EXPECT_THROW((void)encode_block(s.layout, bad, s.tokens, s.rows), error);
    EXPECT_THROW((void)encode_block(s.layout, s.id, s.tokens, std::span(s.rows).first(s.rows.size() - 1)),
                 error);
}

TEST(block_record, every_refusal_names_the_problem) {
    const sample s;
    auto v = s.value;
    EXPECT_EQ(refusal(std::span(v).first(71), s.layout),
              "corrupt_data: block record: 71 bytes, fewer than a header and a checksum (72)");
    v = s.value;
    v[0] ^= 1;
    EXPECT_NE(refusal(v, s.layout).find("magic 0x4243564a, not \"KVCB\""), std::string::npos);
    v = s.value;
    poke<uint16_t>(v, 4, 2);
    EXPECT_EQ(refusal(v, s.layout), "unsupported: block record: version 2, this build reads 1");
    v = s.value;
    poke<uint16_t>(v, 6, 1);
    EXPECT_NE(refusal(v, s.layout).find("reserved header fields are not zero"), std::string::npos);
    v = s.value;
    poke<uint32_t>(v, 44, 5);
    EXPECT_NE(refusal(v, s.layout).find("block of 5 tokens and 2 layers, the layout has 4 and 2"),
              std::string::npos);
    v = s.value;
    poke<uint32_t>(v, 48, 3);
    EXPECT_NE(refusal(v, s.layout).find("block of 4 tokens and 3 layers"), std::string::npos);
    v = s.value;
    poke<uint64_t>(v, 56, uint64_t{1} << 60);  // declares a huge row section: refused, nothing allocated
    EXPECT_NE(refusal(v, s.layout).find("1152921504606846976 row bytes, the layout has 536"),
              std::string::npos);
    v = s.value;
    v.push_back(0);
    EXPECT_NE(refusal(v, s.layout).find("625 bytes, a record of this layout has 624"), std::string::npos);
    v = s.value;
    v.pop_back();
    EXPECT_NE(refusal(v, s.layout).find("623 bytes"), std::string::npos);
    v = s.value;
    v[200] ^= 0x10;  // a row byte
    EXPECT_NE(refusal(v, s.layout).find("checksum mismatch"), std::string::npos);
    v = s.value;
    v[64] ^= 1;  // a token, resealed: the hash no longer matches the tokens
    reseal(v);
    EXPECT_NE(refusal(v, s.layout).find("the tokens seeded with parent 0000000000abcdef hash to"),
              std::string::npos);
    // a root whose parent hash is not its key (resealed, hash consistent with the parent)
    const sample root(0, 77);
    v = root.value;
    poke<uint64_t>(v, 16, 78);
    reseal(v);
    EXPECT_NE(
        refusal(v, root.layout).find("a root's parent hash 000000000000004d is not its key 000000000000004e"),
        std::string::npos);
    // another block than the one expected
    block_id other = s.id;
    other.depth = 2;
    EXPECT_NE(refusal(s.value, s.layout, &other).find("expected key"), std::string::npos);
    EXPECT_EQ(refusal(s.value, s.layout, &s.id), "accepted");
}

TEST(block_record, every_single_bit_flip_is_refused) {
    const sample s;
    for (size_t i = 0; i < s.value.size(); ++i) {
        auto v = s.value;
        v[i] ^= static_cast<uint8_t>(1u << (i % 8));
        ASSERT_NE(refusal(v, s.layout), "accepted") << "byte " << i;
    }
}

// Nothing a value declares sizes an allocation: decoding hostile headers (huge row bytes, block sizes,
// layer counts) allocates no more than a valid record does, a few hundred bytes for offsets and messages.
TEST(block_record, decoding_allocates_nothing_the_value_declares) {
    const sample s;
    std::vector<std::vector<uint8_t>> hostile;
    for (const auto& [off, value] : std::vector<std::pair<size_t, uint64_t>>{
             {56, uint64_t{1} << 62}, {44, 0xffffffffu}, {48, 0xffffffffu}, {40, 0xffffffffu}}) {
        auto v = s.value;
        std::memcpy(v.data() + off, &value, off == 56 ? 8 : 4);
        reseal(v);
        hostile.push_back(std::move(v));
    }
    hostile.push_back(s.value);
    for (const auto& v : hostile) {
        reset_peak_bytes();
        const uint64_t before = g_live_bytes;
        (void)refusal(v, s.layout);
        EXPECT_LT(g_peak_bytes - before, 4096u);
    }
}

TEST(block_record, keys) {
    const std::string k = block_key(0x0123456789abcdefull, 0, 0xffffffffffffffffull);
    EXPECT_EQ(k, "kvcb1-0123456789abcdef-0000000000000000-ffffffffffffffff");
    const auto f = parse_block_key(k);
    ASSERT_TRUE(f);
    EXPECT_EQ(f->fingerprint, 0x0123456789abcdefull);
    EXPECT_EQ(f->key, 0u);
    EXPECT_EQ(f->hash, 0xffffffffffffffffull);
    for (const std::string& bad :
         std::vector<std::string>{"", "kvcb1-", k + "0", k.substr(0, k.size() - 1), "kvcb2" + k.substr(5),
                                  "kvcb1-0123456789ABCDEF-0000000000000000-ffffffffffffffff",
                                  "kvcb1-0123456789abcdef_0000000000000000-ffffffffffffffff",
                                  "kvcb1-+123456789abcdef-0000000000000000-ffffffffffffffff"})
        EXPECT_FALSE(parse_block_key(bad)) << bad;
}

TEST(block_record, value_check) {
    const sample s;
    const auto check = block_value_check(s.layout);
    const std::string key = block_key(s.layout.fingerprint(), s.id.key, s.id.hash);
    EXPECT_TRUE(check(key, s.value));
    EXPECT_FALSE(
        check(block_key(s.layout.fingerprint(), s.id.key, s.id.hash + 1), s.value));  // another block's
    EXPECT_FALSE(check(block_key(s.layout.fingerprint(), s.id.key + 1, s.id.hash), s.value));
    EXPECT_FALSE(check(block_key(s.layout.fingerprint() + 1, s.id.key, s.id.hash), s.value));
    EXPECT_FALSE(check("not-a-key", s.value));
    auto v = s.value;
    v[100] ^= 1;
    EXPECT_FALSE(check(key, v));
}

}  // namespace
}  // namespace kvc
