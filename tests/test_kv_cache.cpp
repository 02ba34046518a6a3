#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <kvcache/kv_cache.h>

#include "kv_cache_test_util.h"

namespace kvc {
namespace {

// -- construction and sizes --

TEST(kv_cache, rejects_invalid_configurations) {
    auto p = small_params(16);
    p.type_v = dtype::q8_0;  // quantized V must not be transposed
    EXPECT_THROW(kv_cache{p}, error);
    p = small_params(16);
    p.n_pad = 5;
    EXPECT_THROW(kv_cache{p}, error);
    p = small_params(16);
    p.type_k = dtype::q4_0;  // heads of 4 values are not whole q4_0 blocks
    EXPECT_THROW(kv_cache{p}, error);
    p = small_params(16);
    p.filter = [](uint32_t) { return false; };
    EXPECT_THROW(kv_cache{p}, error);
    p = small_params(0);
    EXPECT_THROW(kv_cache{p}, error);
}

TEST(kv_cache, size_accounting_per_layer_and_type) {
    kv_cache_params p;
    p.layers = {layer_desc{.n_head_kv = 2, .n_embd_head_k = 64, .n_embd_head_v = 64},
                layer_desc{.n_head_kv = 2, .n_embd_head_k = 64, .n_embd_head_v = 64, .has_kv = false},
                layer_desc{.n_head_kv = 1, .n_embd_head_k = 64, .n_embd_head_v = 32}};
    p.type_k = dtype::q8_0;
    p.type_v = dtype::f16;
    p.v_trans = false;
    p.kv_size = 256;
    p.n_seq_max = 2;
    p.unified = false;
    kv_cache c(p);
    EXPECT_EQ(c.get_n_stream(), 2u);
    EXPECT_EQ(std::vector<uint32_t>(c.layer_ids().begin(), c.layer_ids().end()),
              (std::vector<uint32_t>{0, 2}));
    EXPECT_EQ(c.layer_bytes(kv_part::k, 0), row_size(dtype::q8_0, 128) * 256 * 2);
    EXPECT_EQ(c.layer_bytes(kv_part::v, 2), row_size(dtype::f16, 32) * 256 * 2);
    EXPECT_EQ(c.size_bytes(), (row_size(dtype::q8_0, 128) + row_size(dtype::q8_0, 64) + 256 + 64) * 512);
    EXPECT_THROW((void)c.layer_bytes(kv_part::k, 1), error);
}

// -- design/kv-cache.md Appendix B --

TEST(kv_cache, b1_ring_search_starts_at_the_head) {
    kv_cache c(small_params(16));
    place(c, {1, 3}, {0, 1});
    EXPECT_EQ(c.head(0), 4u);
    const ubatch ub = make_ub({2, 3, 4}, {0, 0, 0});
    slot_info s = peer::find_slot(c, ub);  // (a) head 4 <= used + 2n = 8
    EXPECT_EQ(s.idxs[0], (std::vector<uint32_t>{4, 5, 6}));
    peer::place(c, s, ub);
    EXPECT_EQ(c.head(0), 7u);
}

TEST(kv_cache, b1_head_far_beyond_the_used_cells_restarts_at_zero) {
    kv_cache c(small_params(16, 2));
    place(c, {1, 3}, {0, 1});
    place(c, {8}, {0}, 1);  // head 9, used 3
    c.seq_rm(1, -1, -1);    // frees cell 8: head lowered to 8, used 2
    EXPECT_EQ(c.head(0), 8u);
    // (c) head 8 is not > used + 2n = 8: the search starts there
    EXPECT_EQ(peer::find_slot(c, make_ub({2, 3, 4}, {0, 0, 0})).idxs[0], (std::vector<uint32_t>{8, 9, 10}));
    // with n = 2 the threshold is 6 < 8: restart at 0 and fill the holes
    EXPECT_EQ(peer::find_slot(c, make_ub({2, 3}, {0, 0})).idxs[0], (std::vector<uint32_t>{0, 2}));
}

kv_cache_params swa_params(uint32_t kv_size) {
    auto p = small_params(kv_size);
    p.swa = swa_type::standard;
    p.n_swa = 4;
    return p;
}

TEST(kv_cache, b2_swa_dead_cells_are_reused) {
    kv_cache c(swa_params(6));
    place(c, {0, 1, 2, 3, 4, 5}, {0, 1, 2, 3, 4, 5});
    const ubatch ub = make_ub({6}, {0});
    const slot_info s = peer::find_slot(c, ub);
    ASSERT_FALSE(s.empty());
    EXPECT_EQ(s.idxs[0], (std::vector<uint32_t>{0}));
    peer::place(c, s, ub);
    EXPECT_EQ(c.cells(0).pos_get(0), 6);
    EXPECT_EQ(c.seq_pos_min(0), 1);
    const auto m = mask_of(c, ub, 6);
    EXPECT_EQ(m, (std::vector<float>{0, ninf, ninf, 0, 0, 0}));
}

TEST(kv_cache, b3_reusing_an_old_position_purges_older_ones) {
    kv_cache c(swa_params(6));
    place(c, {1, 0, 2, 3, 4, 5}, {0, 1, 2, 3, 4, 5});  // cell 0 holds pos 1, cell 1 holds pos 0
    EXPECT_EQ(c.head(0), 6u);
    const ubatch ub = make_ub({6}, {0});
    const slot_info s = peer::find_slot(c, ub);
    EXPECT_EQ(s.idxs[0], (std::vector<uint32_t>{0}));
    peer::place(c, s, ub);
    EXPECT_TRUE(c.cells(0).is_empty(1)) << "pos 0 purged: the sequence stays gap-free";
    EXPECT_EQ(c.cells(0).pos_get(0), 6);
    EXPECT_EQ(c.seq_pos_min(0), 2);
}

TEST(kv_cache, b4_mrope_mask_orders_patches_of_one_position) {
    auto p = small_params(8);
    p.n_pos = 4;
    kv_cache c(p);
    // three image patches at temporal pos 5: A (x0, y0), B (x1, y0), C (x0, y1); sections t, y, x, other
    ubatch img = make_ub({5, 5, 5, /*y*/ 0, 0, 1, /*x*/ 0, 1, 0, /*o*/ 0, 0, 0}, {0, 0, 0}, 4);
    peer::place(c, slot({0, 1, 2}), img);
    EXPECT_EQ(c.cells(0).ext_get(2), (cell_ext{0, 1}));
    const ubatch q = make_ub({5, 0, 1, 0}, {0}, 4);  // pos 5, y 0, x 1
    const auto m = mask_of(c, q, 3);
    EXPECT_EQ(m, (std::vector<float>{0, 0, ninf}));
    const ubatch later = make_ub({6, 0, 0, 0}, {0}, 4);
    EXPECT_EQ(mask_of(c, later, 3), (std::vector<float>{0, 0, 0}));
}

TEST(kv_cache, b5_position_defaults_of_sequence_operations) {
    kv_cache c(small_params(32));
    std::vector<uint32_t> cells;
    std::vector<pos_t> pos;
    for (uint32_t i = 0; i <= 20; ++i) cells.push_back(i), pos.push_back(static_cast<pos_t>(i));
    place(c, cells, pos);
    c.seq_add(0, 0, 10, -3);
    EXPECT_EQ(c.seq_pos_min(0), 0);
    EXPECT_TRUE(c.cells(0).is_empty(0));
    EXPECT_TRUE(c.cells(0).is_empty(2));
    EXPECT_EQ(c.cells(0).pos_get(3), 0);
    EXPECT_EQ(c.cells(0).get_shift(9), -3);
    EXPECT_EQ(c.cells(0).pos_get(10), 10);
    EXPECT_EQ(c.head(0), 0u);
    c.seq_rm(0, 10, -1);
    EXPECT_EQ(c.seq_pos_max(0), 6);
    c.seq_rm(0, -1, -1);
    EXPECT_EQ(c.seq_pos_max(0), -1);
    EXPECT_EQ(c.cells(0).get_used(), 0u);
}

// Regression (issue 21): p1 < 0 reaches the last position, INT32_MAX included, for every sequence
// operation; seq_add stopped one short of it.
TEST(kv_cache, open_ranges_include_the_largest_position) {
    constexpr pos_t top = std::numeric_limits<pos_t>::max();
    for (int op = 0; op < 3; ++op) {
        kv_cache c(small_params(8));
        place(c, {0, 1}, {top - 1, top});
        if (op == 0) c.seq_add(0, 0, -1, -10);
        if (op == 1) c.seq_div(0, 0, -1, 2);
        if (op == 2) c.seq_rm(0, top - 1, -1);
        const pos_t want[] = {top - 10, top / 2, -1};
        EXPECT_EQ(c.seq_pos_max(0), want[op]) << "op " << op;
    }
}

// -- batches through init_batch --

std::vector<token_t> tokens(size_t n) {
    return std::vector<token_t>(n, 1);
}

TEST(kv_cache, a_batch_that_does_not_fit_changes_nothing) {
    kv_cache c(small_params(8, 2));
    batch_allocr a;
    const auto t6 = tokens(6);
    a.init(batch::get_one(t6), positions_of(c), {.n_seq_max = 2});
    auto ctx = c.init_batch(a, 4, false);
    ASSERT_EQ(ctx->get_status(), memory_status::success);
    EXPECT_EQ(c.cells(0).get_used(), 0u) << "creating a context changes nothing";
    do ctx->apply();
    while (ctx->next());
    EXPECT_EQ(c.seq_pos_max(0), 5);
    const std::string before = c.cells(0).picture();
    const uint32_t head = c.head(0);
    a.init(batch::get_one(tokens(3)), positions_of(c), {.n_seq_max = 2});  // 6 + 3 > 8
    auto fail = c.init_batch(a, 4, false);
    EXPECT_EQ(fail->get_status(), memory_status::failed_prepare);
    EXPECT_EQ(c.cells(0).picture(), before);
    EXPECT_EQ(c.head(0), head);
    EXPECT_THROW(fail->apply(), error);
}

TEST(kv_cache, context_applies_each_ubatch_once_and_reports_n_kv) {
    auto p = small_params(1024);
    kv_cache c(p);
    batch_allocr a;
    const auto t = tokens(10);
    a.init(batch::get_one(t), positions_of(c), {});
    auto base = c.init_batch(a, 4, false);
    kv_cache_context* ctx = base->get_attn(0);
    ASSERT_NE(ctx, nullptr);
    EXPECT_EQ(base->get_attn(1), nullptr) << "no layer 1";
    EXPECT_EQ(base->get_recr(), nullptr);
    EXPECT_EQ(ctx->n_ubatches(), 3u);
    EXPECT_EQ(std::vector<int32_t>(ctx->out_ids().begin(), ctx->out_ids().end()), (std::vector<int32_t>{9}));
    ctx->apply();
    EXPECT_EQ(ctx->get_n_kv(), 256u);
    EXPECT_THROW(ctx->apply(), error);
    EXPECT_TRUE(ctx->next());
    EXPECT_EQ(ctx->get_n_kv(), 0u) << "nothing of the next ubatch is known before its apply()";
    std::vector<float> row(32);
    EXPECT_THROW(ctx->cpy_k(0, const_tensor_view::contiguous(
                                   dtype::f32, reinterpret_cast<const std::byte*>(row.data()), 32)),
                 error);
    ctx->apply();
    EXPECT_TRUE(ctx->next());
    ctx->apply();
    EXPECT_FALSE(ctx->next());
    EXPECT_EQ(c.seq_pos_max(0), 9);
    auto full = c.init_full();
    EXPECT_EQ(full->get_attn(0)->get_n_kv(), 1024u);
    EXPECT_EQ(c.init_update(false)->get_status(), memory_status::no_update);
}

TEST(kv_cache, seq_ids_beyond_the_cache_are_errors) {
    kv_cache c(small_params(8, 2));
    batch_allocr a;
    const std::vector<token_t> t = {1};
    const seq_id_t three = 3;
    const seq_id_t* rows[] = {&three};
    const int32_t one = 1;
    batch b = batch::get_one(t);
    b.seq_id = rows;
    b.n_seq_id = &one;
    a.init(b, {}, {.n_seq_max = 4});  // the allocator was told 4 sequences, the cache has 2
    EXPECT_THROW(c.init_batch(a, 8, false), error);
    EXPECT_THROW(c.seq_rm(2, -1, -1), error);
    EXPECT_THROW(c.seq_cp(0, 2, -1, -1), error);
    EXPECT_THROW(c.seq_keep(-1), error);
    EXPECT_THROW(c.seq_add(5, 0, 1, 1), error);
    EXPECT_THROW((void)c.seq_pos_max(-1), error);
    EXPECT_TRUE(c.seq_rm(-1, -1, -1)) << "-1 means every sequence for seq_rm";
    try {
        c.seq_div(7, 0, 1, 2);
        FAIL();
    } catch (const error& e) {
        EXPECT_STREQ(e.what(), "seq_div: seq_id 7 not in [0, 2)");
    }
}

TEST(kv_cache, malformed_ubatches_are_errors_that_change_nothing) {
    auto p = small_params(8, 2);
    kv_cache c(p);
    place(c, {0}, {0});
    const std::string before = c.cells(0).picture();
    const auto rejected = [&](ubatch ub, const char* what) {
        SCOPED_TRACE(what);
        EXPECT_THROW(c.init_ubatches({make_ub({5}, {0}), std::move(ub)}, {}), error);
        EXPECT_EQ(c.cells(0).picture(), before);
        EXPECT_EQ(c.head(0), 1u);
    };
    ubatch short_pos = make_ub({1}, {0});
    short_pos.pos.clear();
    rejected(short_pos, "positions missing");
    ubatch no_seq = make_ub({1}, {0});
    no_seq.seq_id_begin = {0, 0};
    no_seq.seq_id_data.clear();
    rejected(no_seq, "a token without a sequence");
    rejected(make_ub({1}, {2}), "seq_id 2 of 2");
    rejected(make_ub({-1}, {0}), "a negative position");
    // one stream per sequence: a group of tokens must be one sequence
    p.unified = false;
    kv_cache split(p);
    ubatch mixed = make_ub({0, 0}, {0, 1});
    mixed.n_seqs_unq = 1;
    mixed.seq_id_unq = {0};
    EXPECT_THROW(split.init_ubatches({mixed}, {}), error);
    ubatch uneven = make_ub({0, 1, 0}, {0, 0, 1});
    EXPECT_THROW(split.init_ubatches({uneven}, {}), error);
    EXPECT_EQ(split.cells(0).get_used() + split.cells(1).get_used(), 0u);
    // rows of the wrong shape or type, and data before apply
    auto ctx = c.init_ubatches({make_ub({1}, {0})}, {});
    kv_cache_context& kc = *ctx->get_attn(0);
    std::vector<float> row(16);
    const auto one =
        const_tensor_view::contiguous(dtype::f32, reinterpret_cast<const std::byte*>(row.data()), 8);
    EXPECT_THROW(kc.cpy_k(0, one), error) << "not applied yet";
    ctx->apply();
    EXPECT_THROW(kc.cpy_k(0, const_tensor_view::contiguous(
                                 dtype::f32, reinterpret_cast<const std::byte*>(row.data()), 16)),
                 error);
    EXPECT_THROW(kc.cpy_k(0, const_tensor_view::contiguous(
                                 dtype::q8_0, reinterpret_cast<const std::byte*>(row.data()), 32)),
                 error);
    EXPECT_THROW(kc.cpy_k(1, one), error) << "no layer 1";
    EXPECT_NO_THROW(kc.cpy_k(0, one));
}

// -- streams --

TEST(kv_cache, one_stream_per_sequence) {
    auto p = small_params(16, 2);
    p.unified = false;
    kv_cache c(p);
    batch_allocr a;
    const std::vector<token_t> t = {1, 2, 3, 4};
    const seq_id_t s0 = 0, s1 = 1;
    const seq_id_t* rows[] = {&s0, &s1, &s0, &s1};
    const int32_t ones[] = {1, 1, 1, 1};
    batch b = batch::get_one(t);
    b.seq_id = rows;
    b.n_seq_id = ones;
    a.init(b, positions_of(c), {.n_seq_max = 2});
    auto base = c.init_batch(a, 8, false);
    ASSERT_EQ(base->get_status(), memory_status::success);
    kv_cache_context& ctx = *base->get_attn(0);
    ctx.apply();
    const slot_info& si = ctx.get_sinfo();
    EXPECT_EQ(si.n_stream(), 2u);
    EXPECT_EQ(si.strm, (std::vector<uint32_t>{0, 1}));
    EXPECT_EQ(c.cells(0).picture().substr(0, 3), "00.");
    EXPECT_EQ(c.cells(1).picture().substr(0, 3), "11.");
    // mask: [n_kv, n_tps = 2, 1, n_stream_mask = 2]; seq 1's rows look at stream 1
    const uint32_t n_kv = ctx.get_n_kv();
    EXPECT_EQ(n_kv, 16u) << "padding is capped by kv_size";
    std::vector<float> m(size_t{n_kv} * 4);
    ctx.set_input_kq_mask(
        tensor_view::contiguous(dtype::f32, reinterpret_cast<std::byte*>(m.data()), n_kv, 4));
    EXPECT_EQ(m[0], 0);
    EXPECT_EQ(m[1], ninf);          // token 0 (pos 0) does not see pos 1
    EXPECT_EQ(m[3 * n_kv + 1], 0);  // token 3 = seq 1 pos 1 sees its stream's cell 1
    EXPECT_EQ(m[3 * n_kv + 2], ninf);
    // seq_keep removes every other sequence from every stream (design D9)
    c.seq_keep(1);
    EXPECT_EQ(c.cells(0).get_used(), 0u);
    EXPECT_EQ(c.seq_pos_max(1), 1);
}

TEST(kv_cache, seq_cp_across_streams_copies_rows_and_pending_shift) {
    auto p = small_params(8, 2);
    p.unified = false;
    kv_cache c(p);
    auto ctx = peer::placed(c, slot({2, 3}), make_ub({0, 1}, {0, 0}));
    std::vector<float> rows(16);
    for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i) + 0.5f;
    const auto view =
        const_tensor_view::contiguous(dtype::f32, reinterpret_cast<const std::byte*>(rows.data()), 8, 2);
    ctx->get_attn(0)->cpy_k(0, view);
    ctx->get_attn(0)->cpy_v(0, view);
    c.seq_add(0, 1, 2, 5);  // pos 1 -> 6, pending shift 5
    c.seq_cp(0, 1, -1, -1);
    EXPECT_EQ(c.seq_pos_min(1), 0);
    EXPECT_EQ(c.seq_pos_max(1), 6);
    std::vector<float> k(8), v(8);
    const auto& to = c.cells(1);
    for (uint32_t cell = 0; cell < 8; ++cell) {
        if (to.is_empty(cell)) continue;
        c.read_row(kv_part::k, 0, 1, cell, k);
        c.read_row(kv_part::v, 0, 1, cell, v);
        const size_t tok = to.pos_get(cell) == 0 ? 0 : 1;
        EXPECT_EQ(k[0], rows[tok * 8]);
        EXPECT_EQ(v[7], rows[tok * 8 + 7]);
        EXPECT_EQ(to.get_shift(cell), tok == 1 ? 5 : 0);
    }
}

// -- data --

TEST(kv_cache, rows_land_in_their_cells_and_views_read_them) {
    for (bool trans : {false, true}) {
        auto p = small_params(8);
        p.v_trans = trans;
        p.type_k = dtype::f16;
        p.type_v = dtype::f16;
        kv_cache c(p);
        auto ctx = peer::placed(c, slot({5, 2}), make_ub({0, 1}, {0, 0}));
        kv_cache_context& kc = *ctx->get_attn(0);
        std::vector<float> rows(16);
        for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i) * 0.25f;
        const auto view = const_tensor_view::contiguous(
            dtype::f32, reinterpret_cast<const std::byte*>(rows.data()), 4, 2, 2);
        kc.cpy_k(0, view);
        kc.cpy_v(0, view);
        // K view [4, 2 heads, n_kv, 1]: token 1 (cell 2), head 1, dim 3 = rows[8 + 4 + 3]
        ASSERT_EQ(kc.get_n_kv(), 8u);
        const tensor_view k = kc.get_k(0);
        std::vector<float> out(4);
        k.row_to_f32(out, 1, 2);
        EXPECT_EQ(out[3], rows[15]);
        const tensor_view v = kc.get_v(0);
        if (!trans) {
            v.row_to_f32(out, 0, 5);
            EXPECT_EQ(out[2], rows[2]);
        } else {
            // [n_kv, 2 heads, 4 dims, 1]: row (head 1, dim 2) holds every cell's value of channel 6
            std::vector<float> cellrow(8);
            v.row_to_f32(cellrow, 1, 2);
            EXPECT_EQ(cellrow[5], rows[6]);
            EXPECT_EQ(cellrow[2], rows[8 + 6]);
            const auto vi = kc.v_idxs(0);
            EXPECT_EQ(vi.size(), 16u);
            EXPECT_EQ(vi[8 + 6], 6 * 8 + 2);  // token 1, channel 6, cell 2
        }
        EXPECT_EQ(kc.k_idxs(), (std::vector<int64_t>{5, 2}));
        EXPECT_THROW(kc.cpy_k(0, const_tensor_view::contiguous(
                                     dtype::f32, reinterpret_cast<const std::byte*>(rows.data()), 8, 1)),
                     error);
    }
}

// -- K-shift --

TEST(kv_cache, shifted_keys_equal_keys_computed_at_the_new_position) {
    std::mt19937 rng(5);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (dtype t : {dtype::f32, dtype::f16, dtype::bf16, dtype::q8_0, dtype::q4_0}) {
        for (rope_type rt : {rope_type::normal, rope_type::neox}) {
            kv_cache_params p;
            rope_params rope{.type = rt,
                             .n_rot = 32,
                             .freq_base = 10000.0f,
                             .freq_scale = 0.5f,
                             .ext_factor = 0.5f,
                             .attn_factor = 1.2f,
                             .n_ctx_orig = 64};
            p.layers = {layer_desc{.n_head_kv = 2, .n_embd_head_k = 64, .n_embd_head_v = 32, .rope = rope}};
            p.type_k = t;
            p.kv_size = 16;
            kv_cache c(p);
            const pos_t p0 = 7, d = 13;
            std::vector<float> raw(128), key(128), want(128);
            for (float& x : raw) x = normal(rng);
            key = raw;
            ops::rope(key, 2, 64, p0, rope);  // as the model wrote it (with YaRN magnitude)
            want = raw;
            ops::rope(want, 2, 64, p0 + d, rope);
            peer::placed(c, slot({3}), make_ub({p0}, {0}))
                ->get_attn(0)
                ->cpy_k(0, const_tensor_view::contiguous(
                               dtype::f32, reinterpret_cast<const std::byte*>(key.data()), 128));
            std::vector<float> stored(128);
            c.read_row(kv_part::k, 0, 0, 3, stored);
            c.seq_add(0, -1, -1, d);
            auto up = c.init_update(false);
            ASSERT_EQ(up->get_status(), memory_status::success);
            up->apply();
            EXPECT_FALSE(c.get_has_shift());
            EXPECT_EQ(c.cells(0).pos_get(3), p0 + d);
            std::vector<float> got(128);
            c.read_row(kv_part::k, 0, 0, 3, got);
            // tolerance: one re-encoding of the type on top of the stored key's own error
            float tol = 1e-4f;
            if (t == dtype::f16) tol = 4e-3f;
            if (t == dtype::bf16) tol = 3e-2f;
            if (t == dtype::q8_0) tol = 6e-2f;
            if (t == dtype::q4_0) tol = 1.2f;
            float err = 0;
            for (size_t i = 0; i < 128; ++i) err = std::max(err, std::fabs(got[i] - want[i]));
            EXPECT_LT(err, tol) << to_string(t) << " " << to_string(rt);
            // dims past n_rot are untouched (up to re-encoding)
            for (size_t i = 32; i < 64; ++i) EXPECT_NEAR(got[i], stored[i], tol);
        }
    }
}

// -- named rules of design/kv-cache.md §3-6 --

TEST(kv_cache, is_masked_swa_rules) {
    // standard: a query at p1 sees (p1 - n_swa, p1]
    EXPECT_FALSE(is_masked_swa(4, swa_type::standard, 7, 10));
    EXPECT_TRUE(is_masked_swa(4, swa_type::standard, 6, 10));
    // chunked: from the start of the query's chunk of n_swa positions
    EXPECT_FALSE(is_masked_swa(4, swa_type::chunked, 8, 10));
    EXPECT_TRUE(is_masked_swa(4, swa_type::chunked, 7, 10));
    // symmetric: within n_swa / 2 on either side
    EXPECT_FALSE(is_masked_swa(4, swa_type::symmetric, 12, 10));
    EXPECT_TRUE(is_masked_swa(4, swa_type::symmetric, 13, 10));
    EXPECT_TRUE(is_masked_swa(4, swa_type::symmetric, 7, 10));
    EXPECT_FALSE(is_masked_swa(4, swa_type::none, 0, 1000));
}

TEST(kv_cache, get_n_kv_pads_to_256_and_caps_at_kv_size) {
    kv_cache c(small_params(1024));
    place(c, {0, 300}, {0, 1});
    EXPECT_EQ(peer::n_kv(c, slot({300})), 512u);
    auto p = small_params(64);
    p.n_kv_pad = 16;
    kv_cache d(p);
    place(d, {17}, {0});
    EXPECT_EQ(peer::n_kv(d, slot({17})), 32u);
    kv_cache e(small_params(100));
    place(e, {99}, {0});
    EXPECT_EQ(peer::n_kv(e, slot({99})), 100u);
}

TEST(kv_cache, find_slot_contiguous_mode_wants_one_run) {
    kv_cache c(small_params(16));
    place(c, {1, 5}, {0, 1});
    const slot_info s = peer::find_slot(c, make_ub({2, 3, 4, 5}, {0, 0, 0, 0}), true);
    ASSERT_FALSE(s.empty());
    EXPECT_TRUE(s.is_contiguous());
    EXPECT_EQ(s.idxs[0], (std::vector<uint32_t>{6, 7, 8, 9}));
    c.seq_rm(0, -1, -1);
    place(c, {0, 2, 4, 6, 8, 10, 12}, {0, 1, 2, 3, 4, 5, 6});  // every other cell: no run of 2 from the head
    EXPECT_TRUE(peer::find_slot(c, make_ub({7, 8}, {0, 0}), true).idxs[0] == (std::vector<uint32_t>{13, 14}));
    EXPECT_TRUE(peer::find_slot(c, make_ub({7, 8, 9, 10}, {0, 0, 0, 0}), true).empty());
    EXPECT_FALSE(peer::find_slot(c, make_ub({7, 8, 9, 10}, {0, 0, 0, 0})).empty())
        << "scattered cells still fit";
}

TEST(kv_cache, seq_cp_in_one_stream_shares_cells_idempotently) {
    kv_cache c(small_params(8, 2));
    place(c, {0, 1, 2}, {0, 1, 2});
    c.seq_cp(0, 1, 1, -1);
    c.seq_cp(0, 1, 1, -1);
    EXPECT_EQ(c.cells(0).picture().substr(0, 4), "0MM.");
    EXPECT_EQ(c.seq_pos_min(1), 1);
    c.seq_cp(0, 0, -1, -1);  // src == dst: nothing
    EXPECT_EQ(c.cells(0).get_used(), 3u);
}

TEST(kv_cache, seq_keep_in_one_stream_keeps_shared_cells_for_that_sequence_only) {
    kv_cache c(small_params(8, 3));
    place(c, {0, 1}, {0, 1}, 0);
    c.seq_cp(0, 1, -1, -1);
    place(c, {2}, {0}, 2);
    c.seq_keep(1);
    EXPECT_EQ(c.cells(0).picture().substr(0, 4), "11..");
    EXPECT_EQ(c.head(0), 2u) << "head lowered to the first freed cell";
}

TEST(kv_cache, seq_div_moves_whole_cells_and_keeps_the_head) {
    kv_cache c(small_params(8));
    place(c, {0, 1, 2, 3}, {0, 1, 2, 3});
    const uint32_t head = c.head(0);
    c.seq_div(0, 2, -1, 2);
    EXPECT_EQ(c.cells(0).pos_get(2), 1);
    EXPECT_EQ(c.cells(0).pos_get(3), 1);
    EXPECT_EQ(c.cells(0).get_shift(3), -2);
    EXPECT_EQ(c.head(0), head);
    EXPECT_THROW(c.seq_div(0, -1, -1, 0), error);
}

// Two caches whose sequence 0 holds one K row at position 0, shifted by 5 and not yet updated; `c` with
// auto_update as given, `want` to run the update explicitly.
struct pending_shift {
    kv_cache c, want;
    explicit pending_shift(bool automatic) : c(params(automatic)), want(small_params(16)) {
        std::vector<float> key(8);
        std::iota(key.begin(), key.end(), 1.0f);
        const auto src =
            const_tensor_view::contiguous(dtype::f32, reinterpret_cast<const std::byte*>(key.data()), 8);
        for (kv_cache* k : {&c, &want}) {
            peer::placed(*k, slot({0}), make_ub({0}, {0}))->get_attn(0)->cpy_k(0, src);
            k->seq_add(0, -1, -1, 5);
        }
    }
    static kv_cache_params params(bool automatic) {
        kv_cache_params p = small_params(16);
        p.auto_update = automatic;
        return p;
    }
    // c's K row 0 has the bytes of want's after its explicit update
    bool rotated() {
        want.update();
        std::vector<float> got(8), expect(8);
        c.read_row(kv_part::k, 0, 0, 0, got);
        want.read_row(kv_part::k, 0, 0, 0, expect);
        return got == expect;
    }
};

// auto_update: init_batch runs the pending K-shift (as llama.cpp's decode), with the bytes of an explicit
// update; without it the shift stays pending (regression, issue 20).
TEST(kv_cache, auto_update_applies_pending_shifts_before_a_batch) {
    for (const bool automatic : {false, true}) {
        pending_shift t(automatic);
        auto ctx = t.c.init_ubatches({make_ub({6}, {0})}, {});
        ASSERT_EQ(ctx->get_status(), memory_status::success);
        EXPECT_EQ(t.c.get_has_shift(), !automatic);
        EXPECT_EQ(t.rotated(), automatic);
    }
}

// With auto_update, a batch that does not fit leaves the memory unchanged, the pending shift included:
// still pending, the K rows unrotated; the next batch that fits applies it (regression: the shift was
// applied before the placement failed).
TEST(kv_cache, auto_update_leaves_the_shift_pending_when_a_batch_does_not_fit) {
    pending_shift t(true);
    std::vector<float> before(8), got(8);
    t.c.read_row(kv_part::k, 0, 0, 0, before);
    std::vector<pos_t> pos(16);
    std::iota(pos.begin(), pos.end(), 6);
    auto fail = t.c.init_ubatches({make_ub(pos, std::vector<seq_id_t>(16, 0))}, {});  // 1 + 16 > 16 cells
    ASSERT_EQ(fail->get_status(), memory_status::failed_prepare);
    EXPECT_TRUE(t.c.get_has_shift());
    t.c.read_row(kv_part::k, 0, 0, 0, got);
    EXPECT_EQ(got, before);
    auto ctx = t.c.init_ubatches({make_ub({6}, {0})}, {});
    ASSERT_EQ(ctx->get_status(), memory_status::success);
    EXPECT_FALSE(t.c.get_has_shift());
    EXPECT_TRUE(t.rotated());
}

// The K-shift's rows split into pieces on an executor (two threads, pieces of 3 rows, out of order)
// leave exactly the bytes of one thread, for several deltas at once (seq_add and seq_div).
TEST(kv_cache, k_shift_on_an_executor_gives_the_bytes_of_one_thread) {
    for (dtype t : {dtype::f16, dtype::q8_0}) {
        kv_cache_params p;
        const rope_params normal{.type = rope_type::normal, .freq_base = 10000.0f};
        const rope_params neox{.type = rope_type::neox, .freq_base = 10000.0f};
        p.layers = {layer_desc{.n_head_kv = 2, .n_embd_head_k = 32, .n_embd_head_v = 32, .rope = normal},
                    layer_desc{.n_head_kv = 2, .n_embd_head_k = 32, .n_embd_head_v = 32, .rope = neox}};
        p.type_k = t;
        p.kv_size = 64;
        kv_cache one(p);
        std::atomic<size_t> pieces{0};
        p.exec = [&pieces](size_t n, const std::function<void(size_t, size_t)>& fn) {
            std::vector<std::pair<size_t, size_t>> parts;
            for (size_t b = 0; b < n; b += 3) parts.emplace_back(b, std::min(n, b + 3));
            pieces += parts.size();
            std::thread other([&] {
                for (size_t i = 0; i < parts.size(); i += 2) fn(parts[i].first, parts[i].second);
            });
            for (size_t i = parts.size(); i-- > 0;)
                if (i % 2 == 1) fn(parts[i].first, parts[i].second);
            other.join();
        };
        kv_cache many(p);
        std::mt19937 rng(21);
        std::normal_distribution<float> normal_dist(0.0f, 1.0f);
        std::vector<float> rows(size_t{40} * 64);
        for (float& x : rows) x = normal_dist(rng);
        const auto view = const_tensor_view::contiguous(
            dtype::f32, reinterpret_cast<const std::byte*>(rows.data()), 64, 40);
        std::vector<pos_t> pos(40);
        std::iota(pos.begin(), pos.end(), 0);
        for (kv_cache* c : {&one, &many}) {
            auto ctx = c->init_ubatches({make_ub(pos, std::vector<seq_id_t>(40, 0))}, {});
            ctx->apply();
            for (uint32_t il : {0u, 1u}) {
                ctx->get_attn(il)->cpy_k(il, view);
                ctx->get_attn(il)->cpy_v(il, view);
            }
            c->seq_add(0, 20, -1, 7);  // one delta for the suffix
            c->seq_div(0, 0, 20, 3);   // a delta per cell for the prefix
            ASSERT_TRUE(c->update());
        }
        EXPECT_GT(pieces.load(), 2u);
        std::vector<float> a(64), b(64);
        for (uint32_t il : {0u, 1u})
            for (uint32_t cell = 0; cell < 40; ++cell) {
                one.read_row(kv_part::k, il, 0, cell, a);
                many.read_row(kv_part::k, il, 0, cell, b);
                ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
                    << to_string(t) << " layer " << il << " cell " << cell;
            }
    }
}

TEST(kv_cache, mrope_caches_refuse_shifts) {
    auto p = small_params(8);
    p.n_pos = 4;
    kv_cache c(p);
    EXPECT_FALSE(c.get_can_shift());
    EXPECT_THROW(c.seq_add(0, -1, -1, 1), error);
    EXPECT_THROW(c.seq_div(0, -1, -1, 2), error);
}

TEST(kv_cache, alibi_mask_holds_minus_distance_and_f16_matches_f32) {
    kv_cache c(small_params(8));
    place(c, {0, 1, 2}, {0, 1, 2});
    auto ctx = peer::placed(c, slot({3}), make_ub({3}, {0}));
    kv_cache_context& kc = *ctx->get_attn(0);
    ASSERT_EQ(kc.get_n_kv(), 8u);
    ASSERT_EQ(kc.kq_mask_elements(), 8u);
    std::vector<float> m(8);
    kc.set_input_kq_mask(tensor_view::contiguous(dtype::f32, reinterpret_cast<std::byte*>(m.data()), 8),
                         {.alibi = true});
    EXPECT_EQ(m, (std::vector<float>{-3, -2, -1, 0, ninf, ninf, ninf, ninf}));
    std::vector<uint16_t> h(8);
    kc.set_input_kq_mask(tensor_view::contiguous(dtype::f16, reinterpret_cast<std::byte*>(h.data()), 8),
                         {.alibi = true});
    for (size_t j = 0; j < 8; ++j) EXPECT_EQ(fp16_to_fp32(h[j]), m[j]);
    EXPECT_THROW(
        kc.set_input_kq_mask(tensor_view::contiguous(dtype::f32, reinterpret_cast<std::byte*>(m.data()), 7)),
        error);
    // non-causal: the whole sequence is visible
    auto later = peer::placed(c, slot({4}), make_ub({4}, {0}));
    later->get_attn(0)->set_input_kq_mask(
        tensor_view::contiguous(dtype::f32, reinterpret_cast<std::byte*>(m.data()), 8), {.causal = false});
    EXPECT_EQ(m, (std::vector<float>{0, 0, 0, 0, 0, ninf, ninf, ninf}));
}

TEST(kv_cache, k_shift_input_and_position_buckets) {
    kv_cache c(small_params(4));
    place(c, {0, 1, 2}, {0, 1, 2});
    c.seq_add(0, 1, -1, 5);
    std::vector<int32_t> shift(4);
    c.set_input_k_shift(shift);
    EXPECT_EQ(shift, (std::vector<int32_t>{0, 5, 5, 0}));
    EXPECT_THROW(c.set_input_k_shift(std::span<int32_t>(shift.data(), 3)), error);
    // buckets of keys at pos 0, 6, 7 and an empty cell for a query at pos 7 (32 buckets, causal)
    kv_cache d(small_params(4, 2));
    place(d, {0, 1, 2}, {0, 6, 7});
    auto ctx = peer::placed(d, slot({3}), make_ub({7}, {1}));  // another sequence: its own row
    d.seq_rm(1, -1, -1);                                       // cell 3 empty again: it counts as position -1
    std::vector<int32_t> b(4);
    ctx->get_attn(0)->set_input_pos_bucket(b, 32);
    EXPECT_EQ(b, (std::vector<int32_t>{7, 1, 0, 8})) << "an empty cell counts as position -1";
}

// -- compaction --

TEST(kv_cache, compaction_moves_cells_down_and_changes_nothing_visible) {
    auto p = small_params(64, 4);
    kv_cache c(p);
    // 4 sequences x 8 tokens, interleaved; K and V rows carry (seq, pos)
    for (pos_t pos = 0; pos < 8; ++pos) {
        const ubatch ub = make_ub({pos, pos, pos, pos}, {0, 1, 2, 3});
        auto ctx = c.init_ubatches({ub}, {});
        ctx->apply();
        std::vector<float> rows(32);
        for (uint32_t t = 0; t < 4; ++t)
            for (uint32_t e = 0; e < 8; ++e) rows[t * 8 + e] = static_cast<float>(t * 100 + pos) + 0.01f * e;
        const auto view =
            const_tensor_view::contiguous(dtype::f32, reinterpret_cast<const std::byte*>(rows.data()), 8, 4);
        ctx->get_attn(0)->cpy_k(0, view);
        ctx->get_attn(0)->cpy_v(0, view);
    }
    c.seq_rm(1, -1, -1);
    c.seq_rm(3, -1, -1);
    c.seq_add(2, 4, -1, 3);  // a pending shift travels with the moved cells
    EXPECT_GT(c.fragmentation(), 0.4f);
    EXPECT_EQ(c.init_update(false)->get_status(), memory_status::success) << "the shift is pending";
    const auto before = [&] {
        std::map<std::pair<seq_id_t, pos_t>, std::vector<float>> m;
        std::vector<float> v(8);
        for (seq_id_t s : {0, 2})
            for (const auto& [pos, cell] : c.cells(0).seq_entries(s, -1, -1)) {
                c.read_row(kv_part::v, 0, 0, cell, v);
                m[{s, pos}] = v;
            }
        return m;
    };
    const auto seen = before();
    auto up = c.init_update(true);
    ASSERT_EQ(up->get_status(), memory_status::success);
    up->apply();
    EXPECT_EQ(before(), seen);
    EXPECT_EQ(c.fragmentation(), 0.0f);
    EXPECT_EQ(c.cells(0).used_max_p1(), 16u);
    EXPECT_EQ(c.cells(0).picture().find('.'), 16u) << c.cells(0).picture();
    EXPECT_FALSE(c.get_has_shift());
    EXPECT_EQ(c.init_update(true)->get_status(), memory_status::no_update);
    c.cells(0).validate();
}

TEST(kv_cache, compaction_by_threshold) {
    auto p = small_params(64, 2);
    p.compact_threshold = 0.3f;
    kv_cache c(p);
    place(c, {0, 1, 2, 3}, {0, 1, 2, 3}, 0);
    place(c, {4, 5, 6, 7}, {0, 1, 2, 3}, 1);
    c.seq_rm(0, -1, -1);  // half of [0, 8) is empty now
    auto up = c.init_update(false);
    ASSERT_EQ(up->get_status(), memory_status::success);
    up->apply();
    EXPECT_EQ(c.cells(0).picture().substr(0, 5), "1111.");
    c.seq_rm(1, 3, 4);  // a hole at the end only: nothing to move
    EXPECT_EQ(c.init_update(false)->get_status(), memory_status::no_update);
}

}  // namespace
}  // namespace kvc
