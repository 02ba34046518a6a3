#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include <gtest/gtest.h>
#include <kvcache/kv_cache.h>

namespace kvc {
namespace {

// One layer, 2 KV heads of 4 values (E = 8), normal RoPE.
kv_cache_params small_params(uint32_t kv_size, uint32_t n_seq_max = 1) {
    kv_cache_params p;
    p.layers = {layer_desc{.n_head_kv = 2, .n_embd_head_k = 4, .n_embd_head_v = 4}};
    p.type_k = dtype::f32;
    p.type_v = dtype::f32;
    p.kv_size = kv_size;
    p.n_seq_max = n_seq_max;
    return p;
}

// A ubatch of single-sequence tokens (seq ids given per token), positions given.
ubatch make_ub(std::vector<pos_t> pos, std::vector<seq_id_t> seqs, uint32_t n_pos = 1) {
    ubatch u;
    u.n_tokens = static_cast<uint32_t>(seqs.size());
    u.n_seq_tokens = 1;
    u.n_seqs = u.n_tokens;
    u.n_pos = n_pos;
    u.pos = std::move(pos);
    u.seq_id_begin.push_back(0);
    for (seq_id_t s : seqs) {
        u.n_seq_id.push_back(1);
        u.seq_id_data.push_back(s);
        u.seq_id_begin.push_back(static_cast<uint32_t>(u.seq_id_data.size()));
        u.output.push_back(0);
    }
    u.seq_id_unq = seqs;
    std::sort(u.seq_id_unq.begin(), u.seq_id_unq.end());
    u.seq_id_unq.erase(std::unique(u.seq_id_unq.begin(), u.seq_id_unq.end()), u.seq_id_unq.end());
    u.n_seqs_unq = static_cast<uint32_t>(u.seq_id_unq.size());
    return u;
}

slot_info slot(std::vector<uint32_t> cells, uint32_t stream = 0) {
    slot_info s;
    s.s0 = s.s1 = stream;
    s.strm = {stream};
    s.idxs = {std::move(cells)};
    return s;
}

// Places tokens of one sequence at the given cells.
void place(kv_cache& c, std::vector<uint32_t> cells, std::vector<pos_t> pos, seq_id_t s = 0) {
    c.apply_ubatch(slot(std::move(cells)), make_ub(std::move(pos), std::vector<seq_id_t>(pos.size(), s)));
}

std::vector<float> mask_of(const kv_cache& c, const ubatch& ub, const slot_info& si, uint32_t n_kv,
                           bool causal = true) {
    std::vector<float> m(size_t{n_kv} * ub.n_tokens);
    c.set_input_kq_mask(
        tensor_view::contiguous(dtype::f32, reinterpret_cast<std::byte*>(m.data()), n_kv, ub.n_tokens), ub,
        si, n_kv, causal);
    return m;
}

constexpr float ninf = -std::numeric_limits<float>::infinity();

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
    EXPECT_EQ(c.layer_k_bytes(0), row_size(dtype::q8_0, 128) * 256 * 2);
    EXPECT_EQ(c.layer_v_bytes(2), row_size(dtype::f16, 32) * 256 * 2);
    EXPECT_EQ(c.size_bytes(), (row_size(dtype::q8_0, 128) + row_size(dtype::q8_0, 64) + 256 + 64) * 512);
    EXPECT_THROW((void)c.layer_k_bytes(1), error);
}

// -- spec Appendix B --

TEST(kv_cache, b1_ring_search_starts_at_the_head) {
    kv_cache c(small_params(16));
    place(c, {1, 3}, {0, 1});
    EXPECT_EQ(c.head(0), 4u);
    const ubatch ub = make_ub({2, 3, 4}, {0, 0, 0});
    slot_info s = c.find_slot(ub);  // (a) head 4 <= used + 2n = 8
    EXPECT_EQ(s.idxs[0], (std::vector<uint32_t>{4, 5, 6}));
    c.apply_ubatch(s, ub);
    EXPECT_EQ(c.head(0), 7u);
}

TEST(kv_cache, b1_head_far_beyond_the_used_cells_restarts_at_zero) {
    kv_cache c(small_params(16, 2));
    place(c, {1, 3}, {0, 1});
    place(c, {8}, {0}, 1);  // head 9, used 3
    c.seq_rm(1, -1, -1);    // frees cell 8: head lowered to 8, used 2
    EXPECT_EQ(c.head(0), 8u);
    // (c) head 8 is not > used + 2n = 8: the search starts there
    EXPECT_EQ(c.find_slot(make_ub({2, 3, 4}, {0, 0, 0})).idxs[0], (std::vector<uint32_t>{8, 9, 10}));
    // with n = 2 the threshold is 6 < 8: restart at 0 and fill the holes
    EXPECT_EQ(c.find_slot(make_ub({2, 3}, {0, 0})).idxs[0], (std::vector<uint32_t>{0, 2}));
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
    const slot_info s = c.find_slot(ub);
    ASSERT_FALSE(s.empty());
    EXPECT_EQ(s.idxs[0], (std::vector<uint32_t>{0}));
    c.apply_ubatch(s, ub);
    EXPECT_EQ(c.cells(0).pos_get(0), 6);
    EXPECT_EQ(c.seq_pos_min(0), 1);
    const auto m = mask_of(c, ub, s, 6);
    EXPECT_EQ(m, (std::vector<float>{0, ninf, ninf, 0, 0, 0}));
}

TEST(kv_cache, b3_reusing_an_old_position_purges_older_ones) {
    kv_cache c(swa_params(6));
    place(c, {1, 0, 2, 3, 4, 5}, {0, 1, 2, 3, 4, 5});  // cell 0 holds pos 1, cell 1 holds pos 0
    EXPECT_EQ(c.head(0), 6u);
    const ubatch ub = make_ub({6}, {0});
    const slot_info s = c.find_slot(ub);
    EXPECT_EQ(s.idxs[0], (std::vector<uint32_t>{0}));
    c.apply_ubatch(s, ub);
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
    c.apply_ubatch(slot({0, 1, 2}), img);
    EXPECT_EQ(c.cells(0).ext_get(2), (cell_ext{0, 1}));
    const ubatch q = make_ub({5, 0, 1, 0}, {0}, 4);  // pos 5, y 0, x 1
    const auto m = mask_of(c, q, slot({1}), 3);
    EXPECT_EQ(m, (std::vector<float>{0, 0, ninf}));
    const ubatch later = make_ub({6, 0, 0, 0}, {0}, 4);
    EXPECT_EQ(mask_of(c, later, slot({3}), 3), (std::vector<float>{0, 0, 0}));
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
    auto* ctx = dynamic_cast<kv_cache_context*>(base.get());
    ASSERT_NE(ctx, nullptr);
    EXPECT_EQ(ctx->n_ubatches(), 3u);
    EXPECT_EQ(std::vector<int32_t>(ctx->out_ids().begin(), ctx->out_ids().end()), (std::vector<int32_t>{9}));
    ctx->apply();
    EXPECT_EQ(ctx->get_n_kv(), 256u);
    EXPECT_THROW(ctx->apply(), error);
    EXPECT_TRUE(ctx->next());
    ctx->apply();
    EXPECT_TRUE(ctx->next());
    ctx->apply();
    EXPECT_FALSE(ctx->next());
    EXPECT_EQ(c.seq_pos_max(0), 9);
    auto full = c.init_full();
    EXPECT_EQ(dynamic_cast<kv_cache_context&>(*full).get_n_kv(), 1024u);
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

TEST(kv_cache, malformed_slots_and_ubatches_are_errors_that_change_nothing) {
    kv_cache c(small_params(8));
    place(c, {0}, {0});
    const std::string before = c.cells(0).picture();
    slot_info empty_group = slot({});
    EXPECT_THROW(c.apply_ubatch(empty_group, make_ub({}, {})), error);
    EXPECT_THROW(c.apply_ubatch(slot({1, 2}), make_ub({1}, {0})), error);  // 2 cells for 1 token
    EXPECT_THROW(c.apply_ubatch(slot({9}), make_ub({1}, {0})), error);     // cell outside
    EXPECT_THROW(c.apply_ubatch(slot({1}, 3), make_ub({1}, {0})), error);  // stream outside
    ubatch short_pos = make_ub({1}, {0});
    short_pos.pos.clear();
    EXPECT_THROW(c.apply_ubatch(slot({1}), short_pos), error);
    EXPECT_THROW((void)c.find_slot(short_pos), error);
    ubatch no_seq = make_ub({1}, {0});
    no_seq.seq_id_begin = {0, 0};
    no_seq.seq_id_data.clear();
    EXPECT_THROW(c.apply_ubatch(slot({1}), no_seq), error);
    EXPECT_EQ(c.cells(0).picture(), before);
    std::vector<float> row(8);
    EXPECT_THROW(
        c.cpy_k(0,
                const_tensor_view::contiguous(dtype::f32, reinterpret_cast<const std::byte*>(row.data()), 8),
                empty_group),
        error);
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
    auto& ctx = dynamic_cast<kv_cache_context&>(*base);
    ASSERT_EQ(ctx.get_status(), memory_status::success);
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
        tensor_view::contiguous(dtype::f32, reinterpret_cast<std::byte*>(m.data()), n_kv, 4), true);
    EXPECT_EQ(m[0], 0);
    EXPECT_EQ(m[1], ninf);          // token 0 (pos 0) does not see pos 1
    EXPECT_EQ(m[3 * n_kv + 1], 0);  // token 3 = seq 1 pos 1 sees its stream's cell 1
    EXPECT_EQ(m[3 * n_kv + 2], ninf);
    // seq_keep removes every other sequence from every stream (decision 9)
    c.seq_keep(1);
    EXPECT_EQ(c.cells(0).get_used(), 0u);
    EXPECT_EQ(c.seq_pos_max(1), 1);
}

TEST(kv_cache, seq_cp_across_streams_copies_rows_and_pending_shift) {
    auto p = small_params(8, 2);
    p.unified = false;
    kv_cache c(p);
    slot_info si = slot({2, 3});
    const ubatch ub = make_ub({0, 1}, {0, 0});
    c.apply_ubatch(si, ub);
    std::vector<float> rows(16);
    for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i) + 0.5f;
    const auto view =
        const_tensor_view::contiguous(dtype::f32, reinterpret_cast<const std::byte*>(rows.data()), 8, 2);
    c.cpy_k(0, view, si);
    c.cpy_v(0, view, si);
    c.seq_add(0, 1, 2, 5);  // pos 1 -> 6, pending shift 5
    c.seq_cp(0, 1, -1, -1);
    EXPECT_EQ(c.seq_pos_min(1), 0);
    EXPECT_EQ(c.seq_pos_max(1), 6);
    std::vector<float> k(8), v(8);
    const auto& to = c.cells(1);
    for (uint32_t cell = 0; cell < 8; ++cell) {
        if (to.is_empty(cell)) continue;
        c.read_k_row(0, 1, cell, k);
        c.read_v_row(0, 1, cell, v);
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
        const slot_info si = slot({5, 2});
        c.apply_ubatch(si, make_ub({0, 1}, {0, 0}));
        std::vector<float> rows(16);
        for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i) * 0.25f;
        const auto view = const_tensor_view::contiguous(
            dtype::f32, reinterpret_cast<const std::byte*>(rows.data()), 4, 2, 2);
        c.cpy_k(0, view, si);
        c.cpy_v(0, view, si);
        // K view [4, 2 heads, n_kv, 1]: token 1 (cell 2), head 1, dim 3 = rows[8 + 4 + 3]
        const tensor_view k = c.get_k(0, 8, si);
        std::vector<float> out(4);
        k.row_to_f32(out, 1, 2);
        EXPECT_EQ(out[3], rows[15]);
        const tensor_view v = c.get_v(0, 8, si);
        if (!trans) {
            v.row_to_f32(out, 0, 5);
            EXPECT_EQ(out[2], rows[2]);
        } else {
            // [n_kv, 2 heads, 4 dims, 1]: row (head 1, dim 2) holds every cell's value of channel 6
            std::vector<float> cellrow(8);
            v.row_to_f32(cellrow, 1, 2);
            EXPECT_EQ(cellrow[5], rows[6]);
            EXPECT_EQ(cellrow[2], rows[8 + 6]);
            const auto vi = c.v_idxs(0, si);
            EXPECT_EQ(vi.size(), 16u);
            EXPECT_EQ(vi[8 + 6], 6 * 8 + 2);  // token 1, channel 6, cell 2
        }
        EXPECT_EQ(c.k_idxs(si), (std::vector<int64_t>{5, 2}));
        EXPECT_THROW(c.cpy_k(0,
                             const_tensor_view::contiguous(
                                 dtype::f32, reinterpret_cast<const std::byte*>(rows.data()), 8, 1),
                             si),
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
            const slot_info si = slot({3});
            c.apply_ubatch(si, make_ub({p0}, {0}));
            c.cpy_k(0,
                    const_tensor_view::contiguous(dtype::f32, reinterpret_cast<const std::byte*>(key.data()),
                                                  128),
                    si);
            std::vector<float> stored(128);
            c.read_k_row(0, 0, 3, stored);
            c.seq_add(0, -1, -1, d);
            auto up = c.init_update(false);
            ASSERT_EQ(up->get_status(), memory_status::success);
            up->apply();
            EXPECT_FALSE(c.get_has_shift());
            EXPECT_EQ(c.cells(0).pos_get(3), p0 + d);
            std::vector<float> got(128);
            c.read_k_row(0, 0, 3, got);
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

// -- named rules of spec kv-core §3-6 --

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
    EXPECT_EQ(c.get_n_kv(slot({300})), 512u);
    auto p = small_params(64);
    p.n_kv_pad = 16;
    kv_cache d(p);
    place(d, {17}, {0});
    EXPECT_EQ(d.get_n_kv(slot({17})), 32u);
    kv_cache e(small_params(100));
    place(e, {99}, {0});
    EXPECT_EQ(e.get_n_kv(slot({99})), 100u);
}

TEST(kv_cache, find_slot_contiguous_mode_wants_one_run) {
    kv_cache c(small_params(16));
    place(c, {1, 5}, {0, 1});
    const slot_info s = c.find_slot(make_ub({2, 3, 4, 5}, {0, 0, 0, 0}), true);
    ASSERT_FALSE(s.empty());
    EXPECT_TRUE(s.is_contiguous());
    EXPECT_EQ(s.idxs[0], (std::vector<uint32_t>{6, 7, 8, 9}));
    c.seq_rm(0, -1, -1);
    place(c, {0, 2, 4, 6, 8, 10, 12}, {0, 1, 2, 3, 4, 5, 6});  // every other cell: no run of 2 from the head
    EXPECT_TRUE(c.find_slot(make_ub({7, 8}, {0, 0}), true).idxs[0] == (std::vector<uint32_t>{13, 14}));
    EXPECT_TRUE(c.find_slot(make_ub({7, 8, 9, 10}, {0, 0, 0, 0}), true).empty());
    EXPECT_FALSE(c.find_slot(make_ub({7, 8, 9, 10}, {0, 0, 0, 0})).empty()) << "scattered cells still fit";
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
    const ubatch ub = make_ub({3}, {0});
    const slot_info si = slot({3});
    c.apply_ubatch(si, ub);
    std::vector<float> m(8);
    c.set_input_kq_mask(tensor_view::contiguous(dtype::f32, reinterpret_cast<std::byte*>(m.data()), 8), ub,
                        si, 8, true, true);
    EXPECT_EQ(m, (std::vector<float>{-3, -2, -1, 0, ninf, ninf, ninf, ninf}));
    std::vector<uint16_t> h(8);
    c.set_input_kq_mask(tensor_view::contiguous(dtype::f16, reinterpret_cast<std::byte*>(h.data()), 8), ub,
                        si, 8, true, true);
    for (size_t j = 0; j < 8; ++j) EXPECT_EQ(fp16_to_fp32(h[j]), m[j]);
    // non-causal: the whole sequence is visible
    c.set_input_kq_mask(tensor_view::contiguous(dtype::f32, reinterpret_cast<std::byte*>(m.data()), 8),
                        make_ub({1}, {0}), slot({1}), 8, false);
    EXPECT_EQ(m, (std::vector<float>{0, 0, 0, 0, ninf, ninf, ninf, ninf}));
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
    std::vector<int32_t> b(4);
    c.set_input_pos_bucket(b, make_ub({7}, {0}), 4, 32);
    EXPECT_EQ(b, (std::vector<int32_t>{7, 1, 0, 8})) << "an empty cell counts as position -1";
}

// -- compaction --

TEST(kv_cache, compaction_moves_cells_down_and_changes_nothing_visible) {
    auto p = small_params(64, 4);
    kv_cache c(p);
    // 4 sequences x 8 tokens, interleaved; K and V rows carry (seq, pos)
    for (pos_t pos = 0; pos < 8; ++pos) {
        const ubatch ub = make_ub({pos, pos, pos, pos}, {0, 1, 2, 3});
        const slot_info si = c.find_slot(ub);
        c.apply_ubatch(si, ub);
        std::vector<float> rows(32);
        for (uint32_t t = 0; t < 4; ++t)
            for (uint32_t e = 0; e < 8; ++e) rows[t * 8 + e] = static_cast<float>(t * 100 + pos) + 0.01f * e;
        const auto view =
            const_tensor_view::contiguous(dtype::f32, reinterpret_cast<const std::byte*>(rows.data()), 8, 4);
        c.cpy_k(0, view, si);
        c.cpy_v(0, view, si);
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
                c.read_v_row(0, 0, cell, v);
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

// -- masks against a naive reference --

TEST(kv_cache_property, masks_match_a_naive_reference) {
    std::mt19937 rng(99);
    for (int iter = 0; iter < 300; ++iter) {
        const swa_type sw = static_cast<swa_type>(iter % 4);
        auto p = small_params(64, 3);
        p.swa = sw;
        p.n_swa = sw == swa_type::none ? 0 : 2 + rng() % 6;
        p.n_kv_pad = 16;
        kv_cache c(p);
        // random occupancy: three sequences with random positions in random cells, some shared
        std::vector<uint32_t> cells(64);
        std::iota(cells.begin(), cells.end(), 0u);
        std::shuffle(cells.begin(), cells.end(), rng);
        std::vector<pos_t> next(3, 0);
        for (uint32_t k = 0; k < 24; ++k) {
            const auto s = static_cast<seq_id_t>(rng() % 3);
            place(c, {cells[k]}, {next[s]++}, s);
            if (rng() % 5 == 0) {
                const auto o = static_cast<seq_id_t>(rng() % 3);
                if (o != s) c.seq_cp(s, o, next[s] - 1, next[s]);
            }
        }
        const auto q = static_cast<seq_id_t>(rng() % 3);
        const ubatch ub = make_ub({next[q], next[q] + 1}, {q, q});
        const slot_info si = slot({cells[40], cells[41]});
        c.apply_ubatch(si, ub);
        const uint32_t n_kv = c.get_n_kv(si);
        for (bool causal : {true, false}) {
            for (dtype mt : {dtype::f32, dtype::f16}) {
                std::vector<std::byte> buf(size_t{n_kv} * 2 * type_size(mt));
                c.set_input_kq_mask(tensor_view::contiguous(mt, buf.data(), n_kv, 2), ub, si, n_kv, causal);
                std::vector<float> got(size_t{n_kv} * 2);
                to_f32(mt, buf.data(), got.data(), static_cast<int64_t>(got.size()));
                for (uint32_t i = 0; i < 2; ++i)
                    for (uint32_t j = 0; j < n_kv; ++j) {
                        const kv_cells& cs = c.cells(0);
                        bool keep = !cs.is_empty(j) && cs.seq_has(j, q);
                        if (keep && causal && cs.pos_get(j) > ub.pos[i]) keep = false;
                        if (keep && is_masked_swa(p.n_swa, sw, cs.pos_get(j), ub.pos[i])) keep = false;
                        ASSERT_EQ(got[i * n_kv + j], keep ? 0.0f : ninf)
                            << "iter " << iter << " swa " << to_string(sw) << " row " << i << " cell " << j;
                    }
            }
        }
    }
}

// -- property: what every sequence sees --

// The model: a list of token records (position, tag, sequences holding it). The tag is the value of the
// V row written with the token; V is never rotated, so tags survive shifts. A unified cache shares
// records between sequences (seq_cp), a split cache copies them.
struct record {
    pos_t pos;
    float tag;
    std::set<seq_id_t> seqs;
};
using seen_t = std::map<seq_id_t, std::multiset<std::pair<pos_t, float>>>;

seen_t seen_by_model(const std::vector<record>& recs) {
    seen_t out;
    for (const record& r : recs)
        for (seq_id_t s : r.seqs) out[s].insert({r.pos, r.tag});
    return out;
}

seen_t seen_by_cache(const kv_cache& c, uint32_t n_seq) {
    seen_t out;
    std::vector<float> v(8);
    for (seq_id_t s = 0; s < static_cast<seq_id_t>(n_seq); ++s) {
        const uint32_t stream = c.seq_to_stream(s);
        for (const auto& [pos, cell] : c.cells(stream).seq_entries(s, -1, -1)) {
            c.read_v_row(0, stream, cell, v);
            out[s].insert({pos, v[0]});
        }
    }
    return out;
}

void drop_empty(std::vector<record>& recs) {
    recs.erase(
        std::remove_if(recs.begin(), recs.end(), [](const record& r) { return r.seqs.empty() || r.pos < 0; }),
        recs.end());
}

TEST(kv_cache_property, sequences_see_what_a_simple_model_says) {
    std::mt19937 rng(7);
    for (bool unified : {true, false}) {
        const uint32_t n_seq = 4;
        auto p = small_params(48, n_seq);
        p.unified = unified;
        kv_cache c(p);
        std::vector<record> recs;
        float tag = 1;
        for (int step = 0; step < 3000; ++step) {
            const auto s = static_cast<seq_id_t>(rng() % n_seq);
            const int op = static_cast<int>(rng() % 8);
            if (op <= 2) {  // decode 1-6 tokens of 1-2 sequences
                batch_storage b = batch::init(12, 0, static_cast<int32_t>(n_seq));
                std::map<seq_id_t, pos_t> next;
                const int n = 1 + static_cast<int>(rng() % 6);
                const std::vector<seq_id_t> who = {s, static_cast<seq_id_t>(rng() % n_seq)};
                std::vector<record> added;
                for (int k = 0; k < n; ++k) {
                    const seq_id_t q = who[rng() % 2];
                    if (!next.count(q)) next[q] = c.seq_pos_max(q) + 1;
                    added.push_back({next[q], tag + static_cast<float>(k), {q}});
                    b.add(1, next[q]++, std::vector<seq_id_t>{q}, false);
                }
                batch_allocr a;
                a.init(b.view(), positions_of(c), {.n_seq_max = n_seq});
                auto ctx = c.init_batch(a, 4, false);
                if (!is_fail(ctx->get_status())) {
                    auto& kc = dynamic_cast<kv_cache_context&>(*ctx);
                    do {
                        kc.apply();
                        const ubatch& ub = kc.get_ubatch();
                        std::vector<float> rows(size_t{ub.n_tokens} * 8);
                        for (uint32_t t = 0; t < ub.n_tokens; ++t)
                            std::fill_n(rows.begin() + t * 8, 8, tag + static_cast<float>(ub.batch_idx[t]));
                        const auto view = const_tensor_view::contiguous(
                            dtype::f32, reinterpret_cast<const std::byte*>(rows.data()), 8, ub.n_tokens);
                        kc.cpy_k(0, view);
                        kc.cpy_v(0, view);
                    } while (kc.next());
                    recs.insert(recs.end(), added.begin(), added.end());
                }  // else: the model is unchanged and the check below proves the cache is too
                tag += 100;
            } else if (op == 3) {
                const pos_t p0 = static_cast<pos_t>(rng() % 20) - 1, p1 = static_cast<pos_t>(rng() % 24) - 1;
                c.seq_rm(s, p0, p1);
                const pos_t lo = p0 < 0 ? 0 : p0, hi = p1 < 0 ? std::numeric_limits<pos_t>::max() : p1;
                for (record& r : recs)
                    if (r.pos >= lo && r.pos < hi) r.seqs.erase(s);
                drop_empty(recs);
            } else if (op == 4) {
                const auto d = static_cast<seq_id_t>(rng() % n_seq);
                if (d == s || c.seq_pos_max(d) >= 0) continue;  // copy onto an empty sequence, as engines do
                try {
                    c.seq_cp(s, d, -1, -1);
                } catch (const error&) {  // split streams: no room in d's stream; nothing changed
                    ASSERT_EQ(seen_by_cache(c, n_seq), seen_by_model(recs));
                    continue;
                }
                std::vector<record> copies;
                for (record& r : recs) {
                    if (!r.seqs.count(s)) continue;
                    if (unified)
                        r.seqs.insert(d);  // the same cells
                    else
                        copies.push_back({r.pos, r.tag, {d}});
                }
                recs.insert(recs.end(), copies.begin(), copies.end());
            } else if (op == 5) {
                if (step % 50 != 0) continue;
                c.seq_keep(s);
                for (record& r : recs)
                    r.seqs = r.seqs.count(s) ? std::set<seq_id_t>{s} : std::set<seq_id_t>{};
                drop_empty(recs);
            } else if (op == 6) {  // a context shift: drop positions 0-1, move the rest down by 2
                if (c.seq_pos_max(s) < 4) continue;
                c.seq_rm(s, 0, 2);
                c.seq_add(s, 2, -1, -2);
                for (record& r : recs)
                    if (r.pos < 2) r.seqs.erase(s);
                drop_empty(recs);
                for (record& r : recs)  // whole cells move, for every sequence sharing them
                    if (r.seqs.count(s) && r.pos >= 2) r.pos -= 2;
            } else if (step % 3 == 0) {  // compaction: invisible to every sequence
                auto up = c.init_update(true);
                if (up->get_status() == memory_status::success) up->apply();
                ASSERT_EQ(c.fragmentation(), 0.0f);
            } else {
                c.update();
            }
            const seen_t want = seen_by_model(recs);
            ASSERT_EQ(seen_by_cache(c, n_seq), want)
                << "step " << step << " op " << op << (unified ? " unified" : " split");
            for (seq_id_t q = 0; q < static_cast<seq_id_t>(n_seq); ++q) {
                const auto it = want.find(q);
                const bool empty = it == want.end() || it->second.empty();
                ASSERT_EQ(c.seq_pos_min(q), empty ? -1 : it->second.begin()->first);
                ASSERT_EQ(c.seq_pos_max(q), empty ? -1 : it->second.rbegin()->first);
            }
        }
    }
}

}  // namespace
}  // namespace kvc
