// The memory budget (creation refuses what could outgrow it, before allocating) and memory_breakdown.
#include <limits>
#include <string>

#include <gtest/gtest.h>
#include <kvcache/kv_cache.h>
#include <kvcache/kv_cache_iswa.h>
#include <kvcache/memory_budget.h>
#include <kvcache/memory_hybrid.h>
#include <kvcache/memory_recurrent.h>

#include "kv_cache_test_util.h"
#include "memory_test_util.h"

namespace kvc {
namespace {

// Decodes toks into s after what it holds (one ubatch; the rows stay zero).
void decode(kv_cache& c, seq_id_t s, const std::vector<token_t>& toks) {
    const pos_t p0 = c.seq_pos_max(s) + 1;
    std::vector<pos_t> pos;
    for (size_t i = 0; i < toks.size(); ++i) pos.push_back(p0 + static_cast<pos_t>(i));
    ubatch ub = make_ub(pos, std::vector<seq_id_t>(toks.size(), s));
    ub.token = toks;
    auto ctx = c.init_ubatches({ub}, {});
    ASSERT_EQ(ctx->get_status(), memory_status::success);
    ctx->apply();
}

// Runs make(), expecting kvc::error(out_of_memory) whose message names the need and the budget.
template <class F>
void expect_over_budget(F make, uint64_t need, uint64_t budget) {
    try {
        make();
        FAIL() << "created over the budget";
    } catch (const error& e) {
        EXPECT_EQ(e.code(), errc::out_of_memory) << e.what();
        const std::string msg = e.what();
        EXPECT_NE(msg.find(std::to_string(need) + " bytes"), std::string::npos) << msg;
        EXPECT_NE(msg.find(std::to_string(budget) + " bytes"), std::string::npos) << msg;
    }
}

TEST(memory_budget, saturating_arithmetic) {
    constexpr uint64_t max = std::numeric_limits<uint64_t>::max();
    EXPECT_EQ(mul_sat(uint64_t{1} << 32, uint64_t{1} << 32), max);
    EXPECT_EQ(mul_sat(6, 7), 42u);
    EXPECT_EQ(add_sat(max, 1), max);
    EXPECT_EQ(add_sat(40, 2), 42u);
    EXPECT_GT(physical_memory_bytes(), uint64_t{1} << 20);
}

TEST(memory_budget, kv_cache_refuses_what_could_outgrow_it) {
    kv_cache_params p = small_params(256, 4);  // 1 layer, K and V rows of 8 f32
    p.unified = false;
    const uint64_t need = kv_cache::reserve_bytes(p);
    EXPECT_EQ(need, uint64_t{256} * 4 * (32 + 32));
    p.memory_budget = need - 1;
    expect_over_budget([&] { kv_cache c(p); }, need, need - 1);
    p.memory_budget = need;
    kv_cache c(p);
    EXPECT_EQ(c.size_bytes(), need);
    EXPECT_EQ(c.get_memory_breakdown().reserved, need);
}

TEST(memory_budget, the_default_budget_is_physical_memory) {
    kv_cache_params p = small_params(1 << 24);
    p.layers.assign(1 << 16, p.layers[0]);  // 2^16 layers x 2^24 cells x 64 bytes: 64 PiB
    const uint64_t need = kv_cache::reserve_bytes(p);
    EXPECT_EQ(need, uint64_t{64} << 40);
    expect_over_budget([&] { kv_cache c(p); }, need, physical_memory_bytes());
}

TEST(memory_budget, sizes_that_overflow_are_refused) {
    kv_cache_params p = small_params(1u << 31);
    p.layers[0].n_head_kv = 1u << 12;
    p.layers[0].n_embd_head_k = p.layers[0].n_embd_head_v = 1u << 12;  // rows of 2^24 values
    p.layers.assign(256, p.layers[0]);
    EXPECT_EQ(kv_cache::reserve_bytes(p), std::numeric_limits<uint64_t>::max());
    try {
        kv_cache c(p);
        FAIL();
    } catch (const error& e) {
        EXPECT_NE(std::string(e.what()).find("more than 16 EiB"), std::string::npos) << e.what();
    }
    p.layers.resize(1);
    p.layers[0].n_head_kv = (1u << 12) + 1;  // a row over 2^24 values
    try {
        kv_cache c(p);
        FAIL();
    } catch (const error& e) {
        EXPECT_EQ(e.code(), errc::invalid_argument);
        EXPECT_NE(std::string(e.what()).find("over the limit of 16777216 values per row"), std::string::npos);
    }
}

TEST(memory_budget, composite_memories_count_every_part) {
    kv_cache_iswa_params ip;
    ip.kv = small_params(1024, 2);
    ip.kv.layers.push_back(ip.kv.layers[0]);
    ip.kv.layers[1].is_swa = true;
    ip.kv.swa = swa_type::standard;
    ip.kv.n_swa = 64;
    const uint64_t iswa_need = kv_cache_iswa::reserve_bytes(ip);
    EXPECT_EQ(iswa_need, uint64_t{1024} * 64 + uint64_t{iswa_swa_size(ip)} * 64);
    ip.kv.memory_budget = iswa_need - 1;
    expect_over_budget([&] { kv_cache_iswa m(ip); }, iswa_need, iswa_need - 1);
    ip.kv.memory_budget = iswa_need;
    EXPECT_EQ(kv_cache_iswa(ip).get_memory_breakdown().reserved, iswa_need);

    recurrent_params rp;
    rp.layers = {{.n_embd_r = 6, .n_embd_s = 10}, {.n_embd_r = 0, .n_embd_s = 0}};
    rp.n_seq_max = 3;
    rp.n_rs_seq = 2;
    const uint64_t recr_need = memory_recurrent::reserve_bytes(rp);
    EXPECT_EQ(recr_need, uint64_t{(6 + 10) * 4} * 3 * 3);
    rp.memory_budget = recr_need - 1;
    expect_over_budget([&] { memory_recurrent m(rp); }, recr_need, recr_need - 1);
    rp.memory_budget = 0;

    memory_hybrid_params hp;
    hp.attn = small_params(256, 3);
    hp.recr = rp;
    const uint64_t hyb_need = kv_cache::reserve_bytes(hp.attn) + recr_need;
    hp.memory_budget = hyb_need - 1;
    expect_over_budget([&] { memory_hybrid m(hp); }, hyb_need, hyb_need - 1);
    hp.memory_budget = hyb_need;
    EXPECT_EQ(memory_hybrid(hp).get_memory_breakdown().reserved, hyb_need);
}

// used + cached + free = committed; per sequence: the cells it holds (shared cells count for each).
TEST(memory_breakdown, counts_sequences_cached_and_pinned_cells) {
    kv_cache_params p = small_params(256, 3);
    p.prefix.enabled = true;
    p.prefix.block_size = 4;
    p.prefix.n_vocab = 100;
    kv_cache c(p);
    const uint64_t cell = 64;
    const std::vector<token_t> prompt = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    decode(c, 0, prompt);  // 9 cells of seq 0; blocks [0,4) and [4,8) published
    c.prefix_cache()->prefix_publish();
    EXPECT_EQ(c.prefix_cache()->prefix_attach(1, prompt), 8u);  // seq 1 shares 8 cells
    memory_breakdown b = c.get_memory_breakdown();
    EXPECT_EQ(b.used, 9 * cell);
    EXPECT_EQ(b.cached, 0u);
    EXPECT_EQ(b.seq, (std::vector<uint64_t>{9 * cell, 8 * cell, 0}));
    EXPECT_EQ(c.prefix_cache()->prefix_pin(prompt), 8u);
    EXPECT_EQ(c.get_memory_breakdown().pinned, 8 * cell);
    c.prefix_cache()->prefix_unpin(prompt);
    c.seq_rm(0, -1, -1);
    c.seq_rm(1, -1, -1);  // the blocks stay cached, the 9th cell is freed
    b = c.get_memory_breakdown();
    EXPECT_EQ(b.used, 0u);
    EXPECT_EQ(b.cached, 8 * cell);
    EXPECT_EQ(b.pinned, 0u);
    EXPECT_EQ(b.committed, b.used + b.cached + b.free);
    EXPECT_EQ(b.seq, (std::vector<uint64_t>(3, 0)));
}

TEST(memory_breakdown, recurrent_cells_count_every_plane) {
    recurrent_params rp;
    rp.layers = {{.n_embd_r = 4, .n_embd_s = 4}};
    rp.n_seq_max = 4;
    rp.n_rs_seq = 1;
    memory_recurrent m(rp);
    auto ctx = test::init_runs(m, 4, {{2, 0, 3}}, 8);  // seq 2: one cell
    ASSERT_EQ(ctx->get_status(), memory_status::success);
    do ctx->apply();
    while (ctx->next());
    const memory_breakdown b = m.get_memory_breakdown();
    const uint64_t cell = 2 * 32;  // (r + s) rows of 16 bytes, 2 planes
    EXPECT_EQ(b.reserved, 4 * cell);
    EXPECT_EQ(b.committed, cell);  // rows up to the last used cell (cell 0)
    EXPECT_EQ(b.used, cell);
    EXPECT_EQ(b.free, 0u);
    EXPECT_EQ(b.seq, (std::vector<uint64_t>{0, 0, cell, 0}));
    m.seq_rm(2, -1, -1);
    EXPECT_EQ(m.get_memory_breakdown().committed, 0u);
}

}  // namespace
}  // namespace kvc
