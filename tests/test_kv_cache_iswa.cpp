// kv_cache_iswa: design/kv-cache.md §8 (split by layer, SWA size, batches in both caches or neither, combined
// context, positions and shifting from the SWA cache, state of both parts, transactional restores).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>
#include <kvcache/batch.h>
#include <kvcache/kv_cache_iswa.h>
#include <kvcache/state.h>

#include "memory_test_util.h"

namespace kvc {
namespace {

using test::whole;

// Four layers: 0 and 2 slide a window, 1 and 3 see everything.
kv_cache_iswa_params make_params(uint32_t kv_size, uint32_t n_swa, uint32_t n_seq_max, bool swa_full,
                                 uint32_t n_ubatch = 8) {
    kv_cache_iswa_params p;
    for (uint32_t il = 0; il < 4; ++il)
        p.kv.layers.push_back(
            layer_desc{.n_head_kv = 1, .n_embd_head_k = 32, .n_embd_head_v = 32, .is_swa = il % 2 == 0});
    p.kv.kv_size = kv_size;
    p.kv.n_seq_max = n_seq_max;
    p.kv.type_k = dtype::f16;
    p.kv.type_v = dtype::f16;
    p.kv.v_trans = false;
    p.kv.n_swa = n_swa;
    p.kv.swa = swa_type::standard;
    p.sizing = {.swa_full = swa_full, .n_ubatch = n_ubatch};
    return p;
}

// One decode: the groups' tokens (sequence, first position, count) through init_batch / apply, every
// layer's K/V rows written through the child context of its cache. Returns the status.
memory_status decode(kv_cache_iswa& m, const std::vector<test::run>& groups, uint32_t n_ubatch = 512) {
    memory_context_ptr ctx = test::init_runs(m, m.params().kv.n_seq_max, groups, n_ubatch);
    if (is_fail(ctx->get_status())) return ctx->get_status();
    do {
        ctx->apply();
        const ubatch& ub = ctx->get_ubatch();
        for (uint32_t il = 0; il < 4; ++il) {
            std::vector<float> rows(size_t{32} * ub.n_tokens);
            for (uint32_t t = 0; t < ub.n_tokens; ++t)
                for (uint32_t d = 0; d < 32; ++d)
                    rows[t * 32 + d] = static_cast<float>(ub.primary_seq(t) * 1000 + ub.pos[t]) * 0.001f +
                                       static_cast<float>(il * 32 + d) * 1e-4f;
            const auto view = const_tensor_view::contiguous(
                dtype::f32, reinterpret_cast<const std::byte*>(rows.data()), 32, ub.n_tokens);
            ctx->get_attn(il)->cpy_k(il, view);
            ctx->get_attn(il)->cpy_v(il, view);
        }
    } while (ctx->next());
    return memory_status::success;
}

TEST(kv_cache_iswa, swa_size_follows_the_formula) {
    // min(kv_size, roundup(n_swa * (unified ? n_seq_max : 1) + n_ubatch + n_swa_retain, 256))
    EXPECT_EQ(iswa_swa_size(make_params(4096, 1024, 2, false, 512)), 2560u);
    EXPECT_EQ(iswa_swa_size(make_params(4096, 1000, 2, false, 512)), 2560u);  // 2512 padded
    EXPECT_EQ(iswa_swa_size(make_params(4096, 8, 1, false, 8)), 256u);        // at least one pad
    EXPECT_EQ(iswa_swa_size(make_params(1024, 4096, 4, false, 512)), 1024u);  // never more than needed
    EXPECT_EQ(iswa_swa_size(make_params(32, 8, 1, false, 8)), 32u);           // nor more than the base cache
    EXPECT_EQ(iswa_swa_size(make_params(4096, 1024, 2, true, 512)), 4096u);   // swa_full
    kv_cache_iswa_params retain = make_params(4096, 1024, 2, false, 512);
    retain.sizing.n_swa_retain = 300;  // room for the windows of cached prefixes: 2860 padded
    EXPECT_EQ(iswa_swa_size(retain), 3072u);
    kv_cache_iswa_params split = make_params(4096, 1024, 4, false, 512);
    split.kv.unified = false;  // one stream per sequence: each stream holds one sequence's window
    EXPECT_EQ(iswa_swa_size(split), 1536u);
    const kv_cache_iswa m(make_params(4096, 1024, 2, false, 512));
    EXPECT_EQ(m.get_base().get_size(), 4096u);
    EXPECT_EQ(m.get_swa().get_size(), 2560u);
}

TEST(kv_cache_iswa, layers_split_by_is_swa_and_the_filter) {
    kv_cache_iswa_params p = make_params(256, 8, 1, true);
    p.kv.filter = [](uint32_t il) { return il != 3; };
    const kv_cache_iswa m(p);
    EXPECT_EQ(std::vector<uint32_t>(m.get_base().layer_ids().begin(), m.get_base().layer_ids().end()),
              std::vector<uint32_t>{1});
    EXPECT_EQ(std::vector<uint32_t>(m.get_swa().layer_ids().begin(), m.get_swa().layer_ids().end()),
              (std::vector<uint32_t>{0, 2}));
    EXPECT_EQ(m.get_base().params().swa, swa_type::none);
    EXPECT_EQ(m.get_swa().params().swa, swa_type::standard);
    EXPECT_EQ(m.get_swa().params().n_swa, 8u);
    EXPECT_EQ(m.size_bytes(), m.get_base().size_bytes() + m.get_swa().size_bytes());
    EXPECT_EQ(m.state_layout(),
              "iswa base=" + m.get_base().state_layout() + " swa=" + m.get_swa().state_layout());
}

TEST(kv_cache_iswa, invalid_configurations_are_refused) {
    kv_cache_iswa_params p = make_params(256, 8, 1, true);
    p.kv.swa = swa_type::none;
    EXPECT_THROW(kv_cache_iswa{p}, error);
    p = make_params(256, 0, 1, true);
    EXPECT_THROW(kv_cache_iswa{p}, error);
    p = make_params(256, 8, 1, true);
    for (layer_desc& d : p.kv.layers) d.is_swa = false;
    EXPECT_THROW(kv_cache_iswa{p}, error);
    p = make_params(256, 8, 1, true);
    p.kv.filter = [](uint32_t il) { return il % 2 == 0; };  // SWA layers only
    try {
        kv_cache_iswa m(p);
        FAIL();
    } catch (const error& e) {
        EXPECT_NE(std::string(e.what()).find("full-attention"), std::string::npos) << e.what();
    }
}

TEST(kv_cache_iswa, children_get_their_own_masks) {
    kv_cache_iswa m(make_params(256, 4, 1, true));
    ASSERT_EQ(decode(m, {{0, 0, 10}}), memory_status::success);
    // one more token at position 10: the SWA child masks keys at positions <= 6, the base child none
    batch_storage b = batch::init(1, 0, 1);
    const seq_id_t ids[] = {0};
    b.add(1, 10, ids, true);
    batch_allocr a;
    a.init(b.view(), positions_of(m), {.n_seq_max = 1});
    memory_context_ptr ctx = m.init_batch(a, 512, false);
    auto& ic = dynamic_cast<kv_cache_iswa_context&>(*ctx);
    ic.apply();
    EXPECT_EQ(ctx->get_attn(0), &ic.get_swa());
    EXPECT_EQ(ctx->get_attn(1), &ic.get_base());
    EXPECT_EQ(ctx->get_attn(9), nullptr);
    EXPECT_EQ(ctx->get_recr(), nullptr);
    for (kv_cache_context* c : {&ic.get_base(), &ic.get_swa()}) {
        const bool swa = c == &ic.get_swa();
        const size_t n = c->kq_mask_elements();
        std::vector<float> mask(n);
        c->set_input_kq_mask(tensor_view::contiguous(dtype::f32, reinterpret_cast<std::byte*>(mask.data()),
                                                     static_cast<int64_t>(n), 1));
        const kv_cells& cells = c->cache().cells(0);
        for (uint32_t i = 0; i < c->get_n_kv(); ++i) {
            const bool visible = !cells.is_empty(i) && (!swa || cells.pos_get(i) > 10 - 4);
            EXPECT_EQ(std::isinf(mask[i]), !visible) << (swa ? "swa" : "base") << " cell " << i;
        }
    }
}

TEST(kv_cache_iswa, the_swa_cache_slides_and_reports_positions) {
    kv_cache_iswa m(make_params(1024, 8, 1, false));
    ASSERT_EQ(m.get_swa().get_size(), 256u);
    for (pos_t p = 0; p < 400; p += 50) ASSERT_EQ(decode(m, {{0, p, 50}}, 64), memory_status::success);
    // the base cache keeps all 400 positions; the SWA cache reused the cells of the slid-out keys
    EXPECT_EQ(m.get_base().seq_pos_min(0), 0);
    EXPECT_EQ(m.get_base().cells(0).get_used(), 400u);
    EXPECT_LE(m.get_swa().cells(0).get_used(), 256u);
    EXPECT_GT(m.seq_pos_min(0), 0);
    EXPECT_EQ(m.seq_pos_min(0), m.get_swa().seq_pos_min(0));
    EXPECT_EQ(m.seq_pos_max(0), 399);
    EXPECT_FALSE(m.get_can_shift());  // sizes differ
    EXPECT_TRUE(kv_cache_iswa(make_params(1024, 8, 1, true)).get_can_shift());
}

// auto_update: the pair applies both caches' pending shifts once both placed a batch; one that does not
// fit leaves them pending and the K rows as they were.
TEST(kv_cache_iswa, auto_update_shifts_both_caches_only_for_a_batch_that_fits) {
    kv_cache_iswa_params p = make_params(64, 8, 1, true);
    p.kv.auto_update = true;
    kv_cache_iswa m(p);
    ASSERT_EQ(decode(m, {{0, 0, 10}}), memory_status::success);
    m.seq_add(0, 0, -1, 4);
    const std::vector<uint8_t> before = whole(m);
    EXPECT_EQ(decode(m, {{0, 14, 60}}), memory_status::failed_prepare);  // 10 + 60 > 64 cells
    EXPECT_TRUE(m.get_base().get_has_shift());
    EXPECT_TRUE(m.get_swa().get_has_shift());
    EXPECT_EQ(whole(m), before);
    ASSERT_EQ(decode(m, {{0, 14, 2}}), memory_status::success);
    EXPECT_FALSE(m.get_base().get_has_shift());
    EXPECT_FALSE(m.get_swa().get_has_shift());
}

TEST(kv_cache_iswa, a_batch_goes_to_both_caches_or_neither) {
    kv_cache_iswa m(make_params(1024, 8, 1, false));  // SWA cache: 256 cells
    ASSERT_EQ(decode(m, {{0, 0, 20}}), memory_status::success);
    const std::vector<uint8_t> before = whole(m);
    const uint32_t base_head = m.get_base().head(0), swa_head = m.get_swa().head(0);
    // 300 tokens in one ubatch: the base cache has room, the SWA cache cannot hold them at once
    EXPECT_EQ(decode(m, {{0, 20, 300}}, 512), memory_status::failed_prepare);
    EXPECT_EQ(whole(m), before);
    EXPECT_EQ(m.get_base().head(0), base_head);
    EXPECT_EQ(m.get_swa().head(0), swa_head);
    // in ubatches of 64 they fit: the window frees cells as it slides
    EXPECT_EQ(decode(m, {{0, 20, 300}}, 64), memory_status::success);
    EXPECT_EQ(m.seq_pos_max(0), 319);
}

TEST(kv_cache_iswa, sequence_operations_reach_both_caches) {
    kv_cache_iswa m(make_params(256, 4, 3, true));
    ASSERT_EQ(decode(m, {{0, 0, 10}, {1, 0, 5}}), memory_status::success);
    m.seq_cp(0, 2, 0, 6);
    for (const kv_cache* c : {&m.get_base(), &m.get_swa()}) {
        EXPECT_EQ(c->seq_pos_min(2), 0);
        EXPECT_EQ(c->seq_pos_max(2), 5);
    }
    EXPECT_TRUE(m.seq_rm(0, 8, -1));
    EXPECT_EQ(m.get_base().seq_pos_max(0), 7);
    EXPECT_EQ(m.get_swa().seq_pos_max(0), 7);
    m.seq_add(1, 0, -1, 3);
    EXPECT_EQ(m.get_base().seq_pos_max(1), 7);
    EXPECT_EQ(m.get_swa().seq_pos_max(1), 7);
    m.seq_div(1, 0, -1, 2);
    EXPECT_EQ(m.seq_pos_max(1), 3);
    m.seq_keep(1);
    EXPECT_EQ(m.seq_pos_max(0), -1);
    EXPECT_EQ(m.get_base().seq_pos_max(0), -1);
    EXPECT_THROW(m.seq_rm(3, 0, -1), error);  // out of range: nothing changed in either
    EXPECT_EQ(m.seq_pos_max(1), 3);
    // pending shifts of both caches come through one update context
    memory_context_ptr up = m.init_update(false);
    EXPECT_EQ(up->get_status(), memory_status::success);
    up->apply();
    EXPECT_FALSE(m.get_base().get_has_shift());
    EXPECT_FALSE(m.get_swa().get_has_shift());
    EXPECT_EQ(m.init_update(false)->get_status(), memory_status::no_update);
    m.clear(true);
    EXPECT_EQ(m.get_base().cells(0).get_used() + m.get_swa().cells(0).get_used(), 0u);
}

TEST(kv_cache_iswa, init_full_reserves_both) {
    kv_cache_iswa m(make_params(256, 4, 1, true));
    memory_context_ptr ctx = m.init_full();
    auto& ic = dynamic_cast<kv_cache_iswa_context&>(*ctx);
    EXPECT_EQ(ic.get_status(), memory_status::success);
    ic.apply();
    EXPECT_EQ(&ic.get_base().cache(), &m.get_base());
    EXPECT_EQ(&ic.get_swa().cache(), &m.get_swa());
    kv_cache_iswa_context failed(memory_status::failed_prepare);
    EXPECT_THROW(failed.get_base(), error);
    EXPECT_EQ(failed.get_attn(0), nullptr);
}

TEST(kv_cache_iswa, state_round_trips_whole_one_sequence_and_partial) {
    kv_cache_iswa m(make_params(1024, 8, 2, false));
    ASSERT_EQ(decode(m, {{0, 0, 40}, {1, 0, 12}}, 64), memory_status::success);
    const std::vector<uint8_t> all = whole(m);
    // whole memory: base state then SWA state
    std::vector<uint8_t> base, swa;
    io_vector_writer wb(base), ws(swa);
    m.get_base().state_write(wb, seq_all, 0);
    m.get_swa().state_write(ws, seq_all, 0);
    std::vector<uint8_t> both = base;
    both.insert(both.end(), swa.begin(), swa.end());
    EXPECT_EQ(std::vector<uint8_t>(all.begin() + 8, all.end()), both);  // after the buffer header
    kv_cache_iswa fresh(make_params(1024, 8, 2, false));
    state_seq_set_data(fresh, all, seq_all);
    EXPECT_EQ(whole(fresh), all);

    // one sequence into another; the SWA part holds only the window's cells
    const std::vector<uint8_t> seq0 = state_seq_get_data(m, 0);
    state_seq_set_data(m, seq0, 1);
    EXPECT_EQ(m.get_base().seq_pos_min(1), 0);
    EXPECT_EQ(m.get_base().seq_pos_max(1), 39);
    EXPECT_EQ(m.seq_pos_max(1), 39);
    EXPECT_GT(m.seq_pos_min(1), 0);

    // partial: the SWA part alone, the base cache untouched
    const std::vector<uint8_t> part = state_seq_get_data(m, 0, state_seq_flag_partial_only);
    EXPECT_LT(part.size(), seq0.size());
    kv_cache_iswa other(make_params(1024, 8, 2, false));
    state_seq_set_data(other, part, 0, state_seq_flag_partial_only);
    EXPECT_EQ(other.get_base().seq_pos_max(0), -1);
    EXPECT_EQ(other.seq_pos_max(0), 39);
    // a partial state is not a full one, and the reverse
    const std::vector<uint8_t> before = whole(other);
    EXPECT_THROW(state_seq_set_data(other, part, 1), error);
    EXPECT_THROW(state_seq_set_data(other, seq0, 1, state_seq_flag_partial_only), error);
    EXPECT_EQ(whole(other), before);
}

TEST(kv_cache_iswa, a_failed_restore_changes_neither_cache) {
    // the source's window is wide, so its sequence's SWA part holds 200 cells
    kv_cache_iswa wide(make_params(1024, 1000, 2, true));
    ASSERT_EQ(decode(wide, {{0, 0, 200}}), memory_status::success);
    const std::vector<uint8_t> seq0 = state_seq_get_data(wide, 0);

    // the destination's SWA cache (256 cells) holds 99 live cells of seq 1: the base part would fit,
    // the SWA part does not
    kv_cache_iswa m(make_params(1024, 100, 2, false));
    ASSERT_EQ(m.get_swa().get_size(), 256u);
    ASSERT_EQ(decode(m, {{1, 0, 100}}), memory_status::success);
    ASSERT_EQ(decode(m, {{0, 0, 30}}), memory_status::success);
    const std::vector<uint8_t> before = whole(m);
    try {
        state_seq_set_data(m, seq0, 0);
        FAIL() << "the SWA part cannot fit";
    } catch (const error& e) {
        EXPECT_EQ(e.code(), errc::invalid_state) << e.what();
    }
    EXPECT_EQ(whole(m), before);
    EXPECT_EQ(m.get_base().seq_pos_max(0), 29);

    // a corrupt SWA part is found before the base part is restored
    std::vector<uint8_t> bad = state_seq_get_data(m, 1);
    bad.resize(bad.size() - 3);
    EXPECT_THROW(state_seq_set_data(m, bad, 0), error);
    EXPECT_EQ(whole(m), before);

    // every truncation of a valid state is refused with both caches unchanged
    const std::vector<uint8_t> good = state_seq_get_data(m, 1);
    for (size_t len = 0; len < good.size(); len += 29) {
        EXPECT_THROW(state_seq_set_data(m, std::span(good).first(len), 0), error) << len;
        ASSERT_EQ(whole(m), before) << len;
    }
}

// -- prefix cache: events of both caches --

// seq decodes `tokens` from position 0 in batches of 8 (bookkeeping only: the rows are not written).
void decode_prompt(kv_cache_iswa& m, seq_id_t seq, const std::vector<token_t>& tokens) {
    for (size_t i0 = 0; i0 < tokens.size(); i0 += 8) {
        const size_t n = std::min<size_t>(8, tokens.size() - i0);
        batch_storage b = batch::init(static_cast<int32_t>(n), 0, 1);
        const seq_id_t ids[] = {seq};
        for (size_t i = i0; i < i0 + n; ++i) b.add(tokens[i], static_cast<pos_t>(i), ids, i + 1 == i0 + n);
        batch_allocr a;
        a.init(b.view(), positions_of(m), {.n_seq_max = m.params().kv.n_seq_max});
        memory_context_ptr ctx = m.init_batch(a, 8, false);
        ASSERT_EQ(ctx->get_status(), memory_status::success);
        do ctx->apply();
        while (ctx->next());
    }
}

// The listener hears the SWA cache's blocks too, tagged swa: as many stored and removed as the SWA
// counters say (a router mirrors both caches), and the base cache's tagged kv; clear() empties both.
TEST(kv_cache_iswa, prefix_events_name_the_cache_of_each_block) {
    kv_cache_iswa_params p = make_params(1024, 8, 2, false);
    p.kv.prefix = {.enabled = true, .block_size = 4};
    // [part][kind]: stored, removed, cleared
    uint64_t seen[3][3] = {};
    p.kv.prefix.on_event = [&seen](const prefix_event& e) {
        ASSERT_LE(static_cast<int>(e.part), 2);
        ++seen[static_cast<int>(e.part)][static_cast<int>(e.type)];
    };
    kv_cache_iswa m(p);
    ASSERT_EQ(m.get_swa().get_size(), 256u);
    std::vector<std::vector<token_t>> prompts;
    for (int k = 0; k < 12; ++k) {  // 480 tokens: the SWA cache evicts the oldest windows
        std::vector<token_t> t(40);
        for (size_t j = 0; j < t.size(); ++j) t[j] = static_cast<token_t>(1000 * k + static_cast<int>(j));
        ASSERT_EQ(m.prefix_cache()->prefix_attach(0, t), 0u);
        decode_prompt(m, 0, t);
        ASSERT_TRUE(m.seq_rm(0, -1, -1));
        prompts.push_back(t);
    }
    m.prefix_cache()->prefix_publish();
    const prefix_stats st = m.prefix_cache()->get_prefix_stats();
    ASSERT_GT(st.swa_evicted_blocks, 0u);
    EXPECT_EQ(seen[1][0], st.swa_published_blocks);
    EXPECT_EQ(seen[1][1], st.swa_evicted_blocks);
    EXPECT_EQ(seen[1][0] - seen[1][1], st.swa_blocks);
    EXPECT_EQ(seen[0][0], st.published_blocks);
    EXPECT_EQ(seen[0][1], st.evicted_blocks + st.unpublished_blocks);
    EXPECT_EQ(seen[0][0] - seen[0][1], st.blocks);
    EXPECT_EQ(seen[2][0] + seen[2][1], 0u) << "no snapshots in a KV cache";
    m.clear(false);
    EXPECT_EQ(seen[0][2], 1u);
    EXPECT_EQ(seen[1][2], 1u);
}

// -- property: the caches against an oracle of per-sequence positions --

// Random decodes, suffix removals, shares and restores into a memory whose SWA cache (256 cells) is much
// smaller than what the sequences hold. After every operation: the base cache holds exactly each
// sequence's positions; the SWA cache holds a subset of them that includes every key a token after the
// highest position the sequence ever reached would see. (Not every key its next token sees: a removed
// suffix re-exposes keys that had slid out and may have been overwritten, as upstream; engines that
// roll back further than n_ubatch tokens on SWA models use swa_full.)
TEST(kv_cache_iswa_property, the_swa_cache_keeps_every_key_a_window_can_see) {
    for (const swa_type type : {swa_type::standard, swa_type::chunked})
        for (uint32_t seed = 1; seed <= 3; ++seed) {
            std::mt19937 rng(seed);
            const uint32_t n_seq = 3;
            kv_cache_iswa_params p = make_params(2048, 16, n_seq, false, 16);
            p.kv.swa = type;
            kv_cache_iswa m(p);
            ASSERT_EQ(m.get_swa().get_size(), 256u);
            std::vector<std::vector<pos_t>> o(n_seq);
            std::vector<pos_t> high(n_seq, 0);  // the highest position + 1 each sequence reached
            const auto cells_of = [](const kv_cache& c, seq_id_t s) {
                std::vector<uint32_t> idx;
                c.cells(0).seq_cells(s, -1, -1, idx);
                std::vector<pos_t> pos;
                for (uint32_t i : idx) pos.push_back(c.cells(0).pos_get(i));
                std::sort(pos.begin(), pos.end());
                return pos;
            };
            for (int step = 0; step < 200; ++step) {
                const auto s = static_cast<seq_id_t>(rng() % n_seq);
                std::vector<pos_t>& x = o[static_cast<size_t>(s)];
                const uint32_t op = rng() % 8;
                if (op < 5) {
                    const uint32_t n = 1 + rng() % 40;
                    if (m.get_base().cells(0).get_used() + n > 2000) break;
                    const pos_t p0 = x.empty() ? 0 : x.back() + 1;
                    ASSERT_EQ(decode(m, {{s, p0, n}}, 16), memory_status::success) << "step " << step;
                    for (uint32_t i = 0; i < n; ++i) x.push_back(p0 + static_cast<pos_t>(i));
                    high[static_cast<size_t>(s)] = std::max(high[static_cast<size_t>(s)], x.back() + 1);
                } else if (op < 7) {  // the last few tokens, within the window
                    if (x.empty()) continue;
                    const pos_t cut = x.back() - static_cast<pos_t>(rng() % 4);
                    EXPECT_TRUE(m.seq_rm(s, cut, -1));
                    while (!x.empty() && x.back() >= cut) x.pop_back();
                } else {  // a share, or a restore into another sequence
                    const auto d = static_cast<seq_id_t>(rng() % n_seq);
                    if (d == s) continue;
                    if (rng() % 2) {
                        m.seq_rm(d, -1, -1);
                        m.seq_cp(s, d, -1, -1);
                    } else {
                        state_seq_set_data(m, state_seq_get_data(m, s), d);
                    }
                    o[static_cast<size_t>(d)] = x;  // a restored SWA part holds the source's window
                    high[static_cast<size_t>(d)] = high[static_cast<size_t>(s)];
                }
                for (seq_id_t q = 0; q < static_cast<seq_id_t>(n_seq); ++q) {
                    const std::vector<pos_t>& want = o[static_cast<size_t>(q)];
                    ASSERT_EQ(cells_of(m.get_base(), q), want) << "step " << step << " seq " << q;
                    const std::vector<pos_t> swa = cells_of(m.get_swa(), q);
                    ASSERT_TRUE(std::includes(want.begin(), want.end(), swa.begin(), swa.end()))
                        << "step " << step << " seq " << q;
                    if (want.empty()) continue;
                    for (pos_t pos : want) {
                        if (!is_masked_swa(16, type, pos, high[static_cast<size_t>(q)])) {
                            ASSERT_TRUE(std::binary_search(swa.begin(), swa.end(), pos))
                                << "step " << step << " seq " << q << " lost key " << pos;
                        }
                    }
                    // positions come from the SWA cache: rolled back past its window, it has none left
                    EXPECT_EQ(m.seq_pos_max(q), swa.empty() ? -1 : want.back()) << "step " << step;
                }
            }
        }
}

}  // namespace
}  // namespace kvc
