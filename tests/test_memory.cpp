// memory_i's capabilities (memory.h): every kind of memory answers, through the interface alone, what
// code serving any memory asks (sequences, positions, layers, the cache keeping each layer, the recurrent
// part, the prefix cache and what it offers).
#include <vector>

#include <gtest/gtest.h>
#include <kvcache/kv_cache.h>
#include <kvcache/kv_cache_iswa.h>
#include <kvcache/memory_hybrid.h>
#include <kvcache/memory_recurrent.h>
#include <kvcache/prefix_cache.h>

namespace kvc {
namespace {

layer_desc attn_layer(bool is_swa = false, bool has_kv = true) {
    return layer_desc{
        .n_head_kv = 1, .n_embd_head_k = 8, .n_embd_head_v = 8, .is_swa = is_swa, .has_kv = has_kv};
}

kv_cache_params kv_params(uint32_t n_layer, bool prefix) {
    kv_cache_params p;
    for (uint32_t il = 0; il < n_layer; ++il) p.layers.push_back(attn_layer());
    p.kv_size = 64;
    p.n_seq_max = 3;
    p.prefix = {.enabled = prefix, .block_size = 4};
    return p;
}

recurrent_params recr_params(uint32_t n_layer, bool prefix) {
    recurrent_params p;
    for (uint32_t il = 0; il < n_layer; ++il) p.layers.push_back({.n_embd_r = 2, .n_embd_s = 4});
    p.n_seq_max = 2;
    p.prefix = {.enabled = prefix, .block_size = 4};
    return p;
}

// The layer -> cache map through memory_i, the one a binding sees.
std::vector<const kv_cache*> caches_of(const memory_i& m) {
    std::vector<const kv_cache*> v;
    for (uint32_t il = 0; il < m.n_layer(); ++il) v.push_back(m.layer_cache(il));
    return v;
}

TEST(memory_capabilities, a_kv_cache_is_its_own_layer_cache_and_prefix_cache) {
    kv_cache_params p = kv_params(3, true);
    p.layers[1].has_kv = false;
    p.n_pos = 1;
    kv_cache c(p);
    memory_i& m = c;
    EXPECT_EQ(m.n_seq_max(), 3u);
    EXPECT_EQ(m.n_pos(), 1u);
    EXPECT_EQ(m.n_layer(), 3u);
    EXPECT_EQ(caches_of(m), (std::vector<const kv_cache*>{&c, nullptr, &c}));
    EXPECT_EQ(m.layer_cache(3), nullptr);  // no such layer
    EXPECT_EQ(m.recurrent(), nullptr);
    ASSERT_NE(m.prefix_cache(), nullptr);
    EXPECT_EQ(m.prefix_cache(), c.prefix_cache());  // the same coordinator through either type
    EXPECT_TRUE(m.prefix_cache()->prefix_can_pin());
    EXPECT_TRUE(m.prefix_cache()->get_tier_stats().empty());

    kv_cache plain(kv_params(2, false));
    EXPECT_EQ(static_cast<const memory_i&>(plain).prefix_cache(), nullptr);
    kv_cache_params mrope = kv_params(1, false);
    mrope.n_pos = 4;
    const kv_cache m4(mrope);
    EXPECT_EQ(static_cast<const memory_i&>(m4).n_pos(), 4u);
}

TEST(memory_capabilities, an_iswa_pair_gives_each_layer_its_cache) {
    kv_cache_params kv = kv_params(4, true);
    for (uint32_t il = 0; il < 4; ++il) kv.layers[il].is_swa = il % 2 == 0;
    kv.n_swa = 8;
    kv.swa = swa_type::standard;
    kv_cache_iswa m(kv_cache_iswa_params{.kv = kv, .sizing = {.swa_full = false, .n_ubatch = 8}});
    const memory_i& mi = m;
    EXPECT_EQ(mi.n_seq_max(), 3u);
    EXPECT_EQ(mi.n_layer(), 4u);
    EXPECT_EQ(caches_of(mi),
              (std::vector<const kv_cache*>{&m.get_swa(), &m.get_base(), &m.get_swa(), &m.get_base()}));
    EXPECT_EQ(m.recurrent(), nullptr);
    ASSERT_NE(m.prefix_cache(), nullptr);
    EXPECT_FALSE(m.prefix_cache()->prefix_can_pin());
    const std::vector<token_t> t{1, 2, 3, 4, 5};
    try {
        m.prefix_cache()->prefix_pin(t, 0);
        FAIL() << "an iSWA pair pinned a prefix";
    } catch (const error& e) {
        EXPECT_EQ(e.code(), errc::unsupported);
        EXPECT_NE(std::string(e.what()).find("plain KV cache"), std::string::npos) << e.what();
    }
    EXPECT_THROW(m.prefix_cache()->prefix_set_priority(t, 0, 10), error);
    EXPECT_THROW(m.prefix_cache()->prefix_unpin(t, 0), error);
}

TEST(memory_capabilities, a_recurrent_memory_is_its_own_recurrent_part) {
    memory_recurrent r(recr_params(2, true));
    memory_i& m = r;
    EXPECT_EQ(m.n_seq_max(), 2u);
    EXPECT_EQ(m.n_pos(), 1u);
    EXPECT_EQ(m.n_layer(), 2u);
    EXPECT_EQ(caches_of(m), (std::vector<const kv_cache*>{nullptr, nullptr}));
    EXPECT_EQ(m.recurrent(), &r);
    ASSERT_NE(m.prefix_cache(), nullptr);
    EXPECT_FALSE(m.prefix_cache()->prefix_can_pin());
    EXPECT_THROW(m.prefix_cache()->prefix_pin(std::vector<token_t>{1, 2, 3, 4, 5}, 0), error);
    memory_recurrent plain(recr_params(1, false));
    EXPECT_EQ(plain.prefix_cache(), nullptr);
}

TEST(memory_capabilities, a_hybrid_answers_with_its_parts) {
    memory_hybrid_params p;
    p.attn = kv_params(4, false);
    p.recr = recr_params(4, false);
    p.recr.n_seq_max = 3;
    for (uint32_t il = 0; il < 4; ++il) {
        p.attn.layers[il].has_kv = il % 2 == 1;
        if (il % 2 == 1) p.recr.layers[il] = {};
    }
    p.prefix = {.enabled = true, .block_size = 4};
    memory_hybrid h(p);
    memory_i& m = h;
    EXPECT_EQ(m.n_seq_max(), 3u);
    EXPECT_EQ(m.n_layer(), 4u);
    const kv_cache* attn = m.layer_cache(1);
    ASSERT_NE(attn, nullptr);
    EXPECT_EQ(attn, &h.get_attn());
    EXPECT_EQ(caches_of(m), (std::vector<const kv_cache*>{nullptr, attn, nullptr, attn}));
    EXPECT_EQ(m.recurrent(), &h.get_recr());
    ASSERT_NE(m.prefix_cache(), nullptr);
    EXPECT_EQ(m.prefix_cache(), h.prefix_cache());
    EXPECT_FALSE(m.prefix_cache()->prefix_can_pin());

    p.iswa = iswa_sizing{.swa_full = false, .n_ubatch = 8};
    p.attn.n_swa = 8;
    p.attn.swa = swa_type::standard;
    p.attn.layers[1].is_swa = true;
    p.prefix = {};
    memory_hybrid hi(p);
    const auto& pair = static_cast<const kv_cache_iswa&>(hi.get_attn());
    EXPECT_EQ(caches_of(hi),
              (std::vector<const kv_cache*>{nullptr, &pair.get_swa(), nullptr, &pair.get_base()}));
    EXPECT_EQ(hi.prefix_cache(), nullptr);
}

}  // namespace
}  // namespace kvc
