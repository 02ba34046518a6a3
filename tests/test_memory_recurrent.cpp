// memory_recurrent: design/recurrent.md §4 (cells, find_slot, engine contract, sequence operations, state)
// and the rollback extension. The engine is the oracle of recurrent_oracle.h (`engine_step`), which follows
// the contract of memory_recurrent.h to the letter: states are hash chains of (sequence, position), so a
// gather from the wrong row or plane shows up as a wrong value.
#include <algorithm>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <kvcache/batch.h>
#include <kvcache/memory_recurrent.h>
#include <kvcache/state.h>

#include "memory_recurrent_test_util.h"
#include "recurrent_oracle.h"

namespace kvc {
namespace {

using namespace test;  // the oracle engine (recurrent_oracle.h) and the helpers

// -- construction and sizes --

TEST(memory_recurrent, rejects_invalid_configurations) {
    auto p = params(0);
    EXPECT_THROW(memory_recurrent{p}, error);
    p = params(2);
    p.type_s = dtype::q8_0;
    EXPECT_THROW(memory_recurrent{p}, error);
    p = params(2);
    p.layers.clear();
    EXPECT_THROW(memory_recurrent{p}, error);
    p = params(2);
    p.layers = {{}, {}};
    EXPECT_THROW(memory_recurrent{p}, error);
    p = params(2);
    p.filter = [](uint32_t) { return false; };
    EXPECT_THROW(memory_recurrent{p}, error);
    p = params(2);
    p.type_r = dtype::f16;
    p.type_s = dtype::bf16;
    EXPECT_NO_THROW(memory_recurrent{p});
}

TEST(memory_recurrent, size_accounting_counts_every_rollback_plane) {
    auto p = params(4, 3);
    p.type_s = dtype::f16;
    memory_recurrent m(p);
    EXPECT_EQ(m.get_size(), 4u);
    EXPECT_EQ(std::vector<uint32_t>(m.layer_ids().begin(), m.layer_ids().end()),
              (std::vector<uint32_t>{0, 2}));
    EXPECT_TRUE(m.has_r(0));
    EXPECT_FALSE(m.has_r(2));
    EXPECT_TRUE(m.has_s(2));
    EXPECT_FALSE(m.has_s(1));
    // rows x cells x (1 + n_rs_seq) planes
    EXPECT_EQ(m.size_r_bytes(), 4u * 4 * 4 * 4);
    EXPECT_EQ(m.size_s_bytes(), (6u * 2 + 3u * 2) * 4 * 4);
    EXPECT_EQ(m.size_bytes(), m.size_r_bytes() + m.size_s_bytes());
    EXPECT_THROW((void)m.get_r(2), error);
    EXPECT_THROW((void)m.get_s(1), error);
    const tensor_view v = m.get_s(0);
    EXPECT_EQ(v.type, dtype::f16);
    EXPECT_EQ(v.ne[0], 6);
    EXPECT_EQ(v.ne[1], 4);
    EXPECT_EQ(v.ne[2], 4);
    // the filter drops layers like a hybrid model's attention layers
    p.filter = [](uint32_t il) { return il != 0; };
    memory_recurrent f(p);
    EXPECT_EQ(std::vector<uint32_t>(f.layer_ids().begin(), f.layer_ids().end()), (std::vector<uint32_t>{2}));
    EXPECT_EQ(f.size_r_bytes(), 0u);
}

TEST(memory_recurrent, buffers_start_zeroed_and_clear_data_zeroes_them) {
    memory_recurrent m(params(2, 2));
    const auto zero = [&] {
        for (const auto& [il, is_s] : tensors(m)) {
            const tensor_view v = view_of(m, il, is_s);
            for (int64_t i = 0; i < v.nrows(); ++i)
                for (size_t b = 0; b < v.row_bytes(); ++b)
                    if (row_ptr(v, i)[b] != std::byte{0}) return false;
        }
        return true;
    };
    EXPECT_TRUE(zero());
    ASSERT_EQ(decode(m, run(0, 0, 5)), 1);
    EXPECT_FALSE(zero());
    m.clear(false);  // the rows are left to the storage (host memory may give their pages back)
    EXPECT_EQ(m.get_used(), 0u);
    m.clear(true);
    EXPECT_TRUE(zero());
}

// -- find_slot (design/recurrent.md §4.5) --

TEST(memory_recurrent, new_sequence_starts_from_the_zero_row) {
    memory_recurrent m(params(3));
    const rs_slot sl = step(m, {{{1}, {0, 1, 2}}});
    EXPECT_EQ(sl.n, 1u);
    EXPECT_EQ(sl.n_seqs, 1u);
    EXPECT_EQ(sl.rs_z, static_cast<int32_t>(sl.head));  // nobody reads the fresh cell's row
    EXPECT_EQ(sl.s_copy[0], sl.rs_z);
    EXPECT_TRUE(sl.hist_copy.empty());
    EXPECT_EQ(m.seq_tail(1), static_cast<int32_t>(sl.head));
    EXPECT_EQ(m.seq_pos_max(1), 2);
    EXPECT_EQ(m.seq_pos_min(1), 2);  // I4: one position is present
    EXPECT_EQ(state_of(m, 1), chain(0, 1, 0, 3).back());
    EXPECT_EQ(m.get_used(), 1u);
    m.validate();
}

TEST(memory_recurrent, own_cell_is_reused_reading_its_own_row) {
    memory_recurrent m(params(3));
    const rs_slot a = step(m, {{{0}, {0, 1}}});
    const rs_slot b = step(m, {{{0}, {2}}});
    EXPECT_EQ(b.head, a.head);
    EXPECT_EQ(b.s_copy[0], b.head);
    EXPECT_EQ(b.rs_z, -1);  // the only row of the range is read
    EXPECT_EQ(state_of(m, 0), chain(0, 0, 0, 3).back());
    m.validate();
}

TEST(memory_recurrent, copy_on_write_after_seq_cp) {
    for (const seq_id_t writer : {0, 1}) {
        memory_recurrent m(params(3));
        step(m, {{{0}, {0, 1, 2}}});
        const uint64_t h = state_of(m, 0);
        const int32_t shared = m.seq_tail(0);
        m.seq_cp(0, 1, -1, -1);
        EXPECT_EQ(m.seq_tail(1), shared);
        EXPECT_EQ(m.cell(static_cast<uint32_t>(shared)).seqs, (std::vector<seq_id_t>{0, 1}));
        EXPECT_EQ(m.get_used(), 1u);  // sharing costs no cell
        EXPECT_EQ(m.seq_pos_max(1), 2);
        // the next batch for either sequence gives it its own cell, reading the shared row
        const rs_slot sl = step(m, {{{writer}, {3}}});
        EXPECT_NE(m.seq_tail(writer), shared);
        EXPECT_EQ(m.seq_tail(1 - writer), shared);
        EXPECT_EQ(sl.s_copy[static_cast<size_t>(m.seq_tail(writer)) - sl.head], shared);
        EXPECT_EQ(m.get_used(), 2u);
        EXPECT_EQ(state_of(m, writer), mix(h, writer, 3));
        EXPECT_EQ(state_of(m, 1 - writer), h);  // never sees the other's update
        m.validate();
    }
}

TEST(memory_recurrent, blocks_are_gathered_into_a_contiguous_range_by_swapping_metadata) {
    memory_recurrent m(params(3));
    step(m, {{{1}, {0}}});  // seq 1 -> cell 0
    step(m, {{{0}, {0}}});  // seq 0 -> cell 1
    ASSERT_EQ(m.seq_tail(1), 0);
    ASSERT_EQ(m.seq_tail(0), 1);
    const rs_slot sl = step(m, {{{0}, {1}}, {{1}, {1}}});
    EXPECT_EQ(sl.head, 0u);
    EXPECT_EQ(sl.n, 2u);
    EXPECT_EQ(m.seq_tail(0), 0);  // block b lives in cell head + b
    EXPECT_EQ(m.seq_tail(1), 1);
    EXPECT_EQ(sl.s_copy, (std::vector<int64_t>{1, 0}));  // the data was not moved by the swap: gathered
    EXPECT_EQ(state_of(m, 0), chain(0, 0, 0, 2).back());
    EXPECT_EQ(state_of(m, 1), chain(0, 1, 0, 2).back());
    m.validate();
}

TEST(memory_recurrent, extra_cells_inside_the_range_are_moved) {
    memory_recurrent m(params(3));
    step(m, {{{0}, {0}}});  // cell 0
    step(m, {{{2}, {0}}});  // cell 1
    step(m, {{{1}, {0}}});  // cell 2
    ASSERT_EQ(m.picture(), "021");
    const rs_slot sl = step(m, {{{0}, {1}}, {{1}, {1}}});
    EXPECT_EQ(sl.head, 0u);
    EXPECT_EQ(sl.n, 3u);  // cell 1 went to seq 1, seq 2 was swapped to cell 2: an extra cell
    EXPECT_EQ(sl.n_seqs, 2u);
    EXPECT_EQ(m.picture(), "012");
    EXPECT_EQ(sl.s_copy, (std::vector<int64_t>{0, 2, 1}));
    EXPECT_EQ(state_of(m, 2), chain(0, 2, 0, 1).back());  // moved unchanged
    EXPECT_EQ(state_of(m, 1), chain(0, 1, 0, 2).back());
    m.validate();
}

TEST(memory_recurrent, free_cell_inside_the_range_reads_the_zero_row) {
    memory_recurrent m(params(3));
    step(m, {{{0}, {0}}});
    step(m, {{{2}, {0}}});
    step(m, {{{1}, {0}}});
    ASSERT_TRUE(m.seq_rm(2, -1, -1));  // frees cell 1
    const rs_slot sl = step(m, {{{0}, {1}}, {{1}, {1}}});
    // seq 1 moves from cell 2 to cell 1 (a swap with the free cell), which stays in the range [0, 3)
    EXPECT_EQ(sl.n, 3u);
    EXPECT_EQ(m.picture(), "01.");
    EXPECT_EQ(sl.rs_z, 1);  // the row nobody reads: the free cell gets zeros
    EXPECT_EQ(sl.s_copy, (std::vector<int64_t>{0, 2, 1}));
    EXPECT_EQ(state_of(m, 1), chain(0, 1, 0, 2).back());
    // a fresh sequence after that starts from zeros again
    step(m, {{{2}, {5}}});
    EXPECT_EQ(state_of(m, 2), mix(0, 2, 5));
    m.validate();
}

TEST(memory_recurrent, coupled_secondary_sequences_share_the_block_result) {
    memory_recurrent m(params(3));
    step(m, {{{1}, {0, 1}}});  // seq 1 has a state of its own
    const rs_slot sl = step(m, {{{0, 1}, {0, 1, 2}}});
    (void)sl;
    EXPECT_EQ(m.seq_tail(0), m.seq_tail(1));
    EXPECT_EQ(m.cell(static_cast<uint32_t>(m.seq_tail(0))).seqs, (std::vector<seq_id_t>{0, 1}));
    EXPECT_EQ(m.get_used(), 1u);  // seq 1's old cell was freed
    EXPECT_EQ(state_of(m, 1), chain(0, 0, 0, 3).back());
    m.validate();
}

TEST(memory_recurrent, find_slot_rejects_what_it_cannot_place_and_changes_nothing) {
    memory_recurrent m(params(3));
    step(m, {{{0}, {0}}});
    const std::string before = snapshot(m);
    EXPECT_THROW((void)memory_recurrent_test_access::find_slot(m, make_ub({{{3}, {0}}})),
                 error);  // seq id >= n_seq_max
    EXPECT_THROW((void)memory_recurrent_test_access::find_slot(m, make_ub({{{1}, {0}}, {{1, 2}, {0}}})),
                 error);  // seq 1 in two blocks
    EXPECT_THROW((void)memory_recurrent_test_access::find_slot(m, make_ub({{{1}, {0}}, {{-1}, {0}}})), error);
    ubatch u = make_ub({{{1}, {0, 1}}});
    u.equal_seqs = false;
    EXPECT_THROW((void)memory_recurrent_test_access::find_slot(m, u), error);
    u = make_ub({{{1}, {0, 1}}});
    u.seq_id_data[1] = 2;  // the block's second token belongs to another sequence
    EXPECT_THROW((void)memory_recurrent_test_access::find_slot(m, u), error);
    EXPECT_EQ(snapshot(m), before);
}

TEST(memory_recurrent, prepare_is_a_dry_run) {
    memory_recurrent m(params(4));
    step(m, {{{0}, {0}}});
    step(m, {{{1}, {0}}});
    m.seq_cp(1, 2, -1, -1);
    const std::string before = snapshot(m);
    const std::vector<ubatch> ubs = {make_ub({{{1}, {1}}, {{2}, {1}}}), make_ub({{{3}, {0}}})};
    memory_recurrent_test_access::prepare(m, ubs);
    EXPECT_EQ(snapshot(m), before);
    const std::vector<ubatch> bad = {make_ub({{{1}, {1}}}), make_ub({{{9}, {0}}})};
    EXPECT_THROW(memory_recurrent_test_access::prepare(m, bad),
                 error);  // the second fails after the first was placed: rolled back
    EXPECT_EQ(snapshot(m), before);
}

// -- init_batch, contexts --

TEST(memory_recurrent, init_batch_splits_sequentially_and_refuses_shared_tokens) {
    memory_recurrent m(params(4));
    // primaries 2,3 then 0,1 (design/batch.md §3.5)
    EXPECT_EQ(decode(m, {{2, 0}, {0, 0}, {1, 0}, {3, 0}}, 8), 2);
    const std::string before = snapshot(m);
    batch_storage b = batch::init(2, 0, 2);
    const seq_id_t both[] = {0, 1};
    b.add(1, 1, both, true);
    b.add(1, 2, both, true);
    batch_allocr a;
    a.init(b.view(), positions_of(m), {.n_seq_max = 4});
    testing::internal::CaptureStderr();
    auto ctx = m.init_batch(a, 8, false);
    testing::internal::GetCapturedStderr();
    EXPECT_EQ(ctx->get_status(), memory_status::failed_prepare);
    EXPECT_THROW(ctx->apply(), error);
    EXPECT_EQ(snapshot(m), before);
    // with all outputs (split_seq) the shared tokens are one block of set {0, 1}
    auto ctx2 = m.init_batch(a, 8, true);
    ASSERT_EQ(ctx2->get_status(), memory_status::success);
    EXPECT_EQ(ctx2->get_ubatch().n_seqs, 1u);
}

TEST(memory_recurrent, init_batch_rejects_sequence_ids_beyond_its_cells) {
    memory_recurrent m(params(2));
    batch_storage b = batch::init(1, 0, 1);
    const seq_id_t s[] = {3};
    b.add(1, 0, s, true);
    batch_allocr a;
    // the engine allows more sequences than the memory has cells: the allocator's position query fails
    EXPECT_THROW(a.init(b.view(), positions_of(m), {.n_seq_max = 8}), error);
    a.init(b.view(), {}, {.n_seq_max = 8});  // and so does init_batch, for a batch checked without it
    EXPECT_THROW((void)m.init_batch(a, 8, false), error);
    EXPECT_EQ(m.get_used(), 0u);
}

TEST(memory_recurrent, init_batch_keeps_the_rollback_tail_in_one_ubatch) {
    memory_recurrent m(params(1, 3));
    batch_storage b = batch::init(10, 0, 1);
    const seq_id_t s[] = {0};
    for (pos_t p = 0; p < 10; ++p) b.add(1, p, s, false);
    batch_allocr a;
    a.init(b.view(), positions_of(m), {});
    auto ctx = m.init_batch(a, 4, false);
    ASSERT_EQ(ctx->get_status(), memory_status::success);
    memory_recurrent_context& rc = *ctx->get_recr();
    std::vector<uint32_t> sizes;
    do sizes.push_back(rc.get_ubatch().n_tokens);
    while (rc.next());
    EXPECT_EQ(sizes, (std::vector<uint32_t>{4, 2, 4}));
}

TEST(memory_recurrent, full_and_update_contexts) {
    memory_recurrent m(params(3));
    auto full = m.init_full();
    EXPECT_EQ(full->get_status(), memory_status::success);
    memory_recurrent_context& f = *full->get_recr();
    EXPECT_EQ(full->get_attn(0), nullptr);
    EXPECT_EQ(f.get_n_rs(), 3u);
    EXPECT_EQ(f.get_head(), 0u);
    EXPECT_EQ(f.get_rs_z(), 0);
    EXPECT_EQ(f.s_copy(2), 2);
    EXPECT_THROW((void)f.s_copy(3), error);
    EXPECT_EQ(f.get_n_seqs(), 3u);
    EXPECT_EQ(std::vector<int64_t>(f.s_copies().begin(), f.s_copies().end()),
              (std::vector<int64_t>{0, 1, 2}));
    EXPECT_TRUE(f.hist_copies().empty());
    f.apply();
    EXPECT_FALSE(f.next());
    auto up = m.init_update(true);
    EXPECT_EQ(up->get_status(), memory_status::no_update);
    up->apply();
    EXPECT_THROW((void)up->get_recr()->get_n_rs(), error);
    EXPECT_TRUE(m.get_can_shift());
}

TEST(memory_recurrent, context_inputs_need_apply_and_apply_runs_once) {
    memory_recurrent m(params(2));
    batch_storage b = batch::init(2, 0, 1);
    const seq_id_t s0[] = {0}, s1[] = {1};
    b.add(1, 0, s0, false);
    b.add(1, 0, s1, true);
    batch_allocr a;
    a.init(b.view(), positions_of(m), {.n_seq_max = 2});
    auto ctx = m.init_batch(a, 1, false);  // two ubatches of one token
    memory_recurrent_context& rc = *ctx->get_recr();
    EXPECT_EQ(rc.n_ubatches(), 2u);
    EXPECT_THROW((void)rc.get_head(), error);
    EXPECT_THROW((void)rc.s_copies(), error);
    rc.apply();
    EXPECT_THROW(rc.apply(), error);
    EXPECT_EQ(rc.get_n_rs(), 1u);
    EXPECT_EQ(rc.get_n_seqs(), 1u);
    ASSERT_EQ(rc.s_copies().size(), 1u);
    EXPECT_EQ(rc.s_copies()[0], rc.s_copy(0));
    EXPECT_TRUE(rc.next());
    EXPECT_THROW((void)rc.s_copy(0), error);
    try {
        (void)rc.s_copies();
        ADD_FAILURE() << "s_copies before apply";
    } catch (const error& e) {
        EXPECT_NE(std::string(e.what()).find("apply() the current ubatch first"), std::string::npos)
            << e.what();
    }
    rc.apply();
    EXPECT_FALSE(rc.next());
    try {
        (void)rc.get_n_seqs();
        ADD_FAILURE() << "get_n_seqs after the last ubatch";
    } catch (const error& e) {
        EXPECT_NE(std::string(e.what()).find("no current ubatch"), std::string::npos) << e.what();
    }
    EXPECT_EQ(std::vector<int32_t>(rc.out_ids().begin(), rc.out_ids().end()), (std::vector<int32_t>{1}));
}

// -- sequence operations (design/recurrent.md §4.7) --

// Into an empty memory of 4 cells: seq 0 in its own cell at pos 4, seqs 1 and 2 sharing a cell at pos 2.
void three_sequences(memory_recurrent& m) {
    EXPECT_EQ(decode(m, run(0, 0, 5)), 1);
    EXPECT_EQ(decode(m, run(1, 0, 3)), 1);
    m.seq_cp(1, 2, -1, -1);
}

TEST(memory_recurrent, seq_rm_partial_suffix_without_rollback_is_false_and_changes_nothing) {
    memory_recurrent m(params(4));
    three_sequences(m);
    const std::string before = snapshot(m);
    EXPECT_FALSE(m.seq_rm(0, 3, -1));
    EXPECT_FALSE(m.seq_rm(0, 4, 5));
    EXPECT_FALSE(m.seq_rm(0, 1, 100));
    EXPECT_EQ(snapshot(m), before);
}

TEST(memory_recurrent, seq_rm_from_zero_removes_the_state) {
    for (const pos_t p0 : {0, -1}) {
        memory_recurrent m(params(4));
        three_sequences(m);
        const int32_t c = m.seq_tail(0);
        EXPECT_TRUE(m.seq_rm(0, p0, -1));
        EXPECT_EQ(m.seq_tail(0), -1);
        EXPECT_EQ(m.seq_pos_max(0), -1);
        EXPECT_TRUE(m.cell(static_cast<uint32_t>(c)).seqs.empty());
        EXPECT_EQ(m.get_used(), 1u);
        EXPECT_LE(m.get_head(), static_cast<uint32_t>(c));  // the head moves down to the freed cell
        m.validate();
    }
    memory_recurrent m(params(4));
    three_sequences(m);
    EXPECT_TRUE(m.seq_rm(1, 0, 3));  // [0, 3) holds the tail position 2
    EXPECT_EQ(m.seq_pos_max(1), -1);
    EXPECT_EQ(m.seq_pos_max(2), 2);  // the shared cell stays for seq 2
    EXPECT_EQ(m.get_used(), 2u);
    m.validate();
}

TEST(memory_recurrent, seq_rm_of_a_range_without_the_tail_position_is_true_and_changes_nothing) {
    memory_recurrent m(params(4));
    three_sequences(m);
    const std::string before = snapshot(m);
    EXPECT_TRUE(m.seq_rm(0, 5, -1));  // truncate nothing
    EXPECT_TRUE(m.seq_rm(0, 0, 4));   // an older prefix: the state keeps it folded in
    EXPECT_TRUE(m.seq_rm(0, 1, 3));
    EXPECT_TRUE(m.seq_rm(3, -1, -1));  // no state at all
    EXPECT_EQ(snapshot(m), before);
}

TEST(memory_recurrent, seq_rm_of_every_sequence) {
    memory_recurrent m(params(4));
    three_sequences(m);
    const std::string before = snapshot(m);
    EXPECT_FALSE(m.seq_rm(seq_all, 2, -1));  // partial: impossible
    EXPECT_FALSE(m.seq_rm(seq_all, 0, 3));
    EXPECT_TRUE(m.seq_rm(seq_all, 3, 3));  // empty range
    EXPECT_EQ(snapshot(m), before);
    EXPECT_TRUE(m.seq_rm(seq_all, -1, -1));
    EXPECT_EQ(m.get_used(), 0u);
    // design D13: no tail is left dangling; the next batch starts from a zero state
    for (seq_id_t s = 0; s < 3; ++s) EXPECT_EQ(m.seq_tail(s), -1);
    m.validate();
    ASSERT_EQ(decode(m, run(2, 7, 1)), 1);
    EXPECT_EQ(state_of(m, 2), mix(0, 2, 7));
}

TEST(memory_recurrent, sequence_ids_outside_the_cells_are_errors) {
    memory_recurrent m(params(4));
    three_sequences(m);
    const std::string before = snapshot(m);
    EXPECT_THROW((void)m.seq_rm(4, -1, -1), error);  // upstream: false
    EXPECT_THROW((void)m.seq_rm(-2, -1, -1), error);
    EXPECT_THROW(m.seq_cp(0, 4, -1, -1), error);  // upstream: no-op
    EXPECT_THROW(m.seq_cp(-1, 1, -1, -1), error);
    EXPECT_THROW(m.seq_keep(4), error);
    EXPECT_THROW(m.seq_add(4, -1, -1, 1), error);
    EXPECT_THROW(m.seq_div(4, -1, -1, 2), error);
    EXPECT_THROW((void)m.seq_pos_max(4), error);
    EXPECT_THROW((void)m.seq_pos_min(-1), error);
    EXPECT_EQ(snapshot(m), before);
}

TEST(memory_recurrent, seq_cp_shares_the_whole_state_and_ignores_the_range) {
    memory_recurrent m(params(4));
    three_sequences(m);
    m.seq_cp(0, 0, -1, -1);  // src == dst: nothing
    m.seq_cp(0, 3, 100, 200);
    EXPECT_EQ(m.seq_tail(3), m.seq_tail(0));
    EXPECT_EQ(m.seq_pos_max(3), 4);
    EXPECT_EQ(m.get_used(), 2u);
    // dst's own state is dropped first: seq 2 leaves the cell it shared with seq 1
    m.seq_cp(0, 2, -1, -1);
    EXPECT_EQ(m.cell(static_cast<uint32_t>(m.seq_tail(0))).seqs, (std::vector<seq_id_t>{0, 2, 3}));
    EXPECT_EQ(m.cell(static_cast<uint32_t>(m.seq_tail(1))).seqs, (std::vector<seq_id_t>{1}));
    // a source without state clears dst (freeing a cell dst held alone)
    m.seq_cp(1, 0, -1, -1);  // seq 0 now shares seq 1's cell
    EXPECT_TRUE(m.seq_rm(1, -1, -1));
    EXPECT_TRUE(m.seq_rm(0, -1, -1));
    const uint32_t used = m.get_used();
    m.seq_cp(1, 2, -1, -1);
    EXPECT_EQ(m.seq_tail(2), -1);
    EXPECT_EQ(m.get_used(), used);  // seq 2 shared with seq 3: the cell stays
    m.validate();
}

TEST(memory_recurrent, seq_cp_frees_the_cell_dst_held_alone) {
    memory_recurrent m(params(4));
    three_sequences(m);
    const auto old = static_cast<uint32_t>(m.seq_tail(0));
    const uint32_t head = m.get_head();
    m.seq_cp(1, 0, -1, -1);
    EXPECT_TRUE(m.cell(old).seqs.empty());
    EXPECT_EQ(m.cell(old).pos, -1);
    EXPECT_EQ(m.get_used(), 1u);
    EXPECT_EQ(m.get_head(), head);  // as upstream, seq_cp leaves the head alone
    EXPECT_EQ(m.cell(static_cast<uint32_t>(m.seq_tail(1))).seqs, (std::vector<seq_id_t>{0, 1, 2}));
    EXPECT_EQ(m.seq_pos_max(0), 2);
    m.validate();
}

TEST(memory_recurrent, seq_keep_drops_every_other_sequence) {
    memory_recurrent m(params(4));
    three_sequences(m);
    m.seq_keep(2);  // keeps the shared cell with only seq 2
    EXPECT_EQ(m.get_used(), 1u);
    EXPECT_EQ(m.cell(static_cast<uint32_t>(m.seq_tail(2))).seqs, (std::vector<seq_id_t>{2}));
    EXPECT_EQ(m.seq_tail(0), -1);
    EXPECT_EQ(m.seq_tail(1), -1);
    EXPECT_EQ(m.seq_pos_max(2), 2);
    m.validate();
    m.seq_keep(3);  // a sequence without state: everything goes
    EXPECT_EQ(m.get_used(), 0u);
    EXPECT_EQ(m.get_head(), 0u);
    m.validate();
}

TEST(memory_recurrent, seq_add_moves_the_tail_position_for_every_sharer) {
    memory_recurrent m(params(4));
    three_sequences(m);
    const std::string before = snapshot(m);
    m.seq_add(1, -1, -1, 0);  // shift 0
    m.seq_add(1, 2, 2, 5);    // empty range
    m.seq_add(1, 3, -1, 5);   // tail at 2 is outside
    EXPECT_EQ(snapshot(m), before);
    m.seq_add(1, 0, 3, 10);
    EXPECT_EQ(m.seq_pos_max(1), 12);
    EXPECT_EQ(m.seq_pos_max(2), 12);  // shared cell: moves for seq 2 too
    EXPECT_EQ(m.seq_pos_max(0), 4);
    // below zero: the state stays, with its negative position (a KV cache would free the cells)
    m.seq_add(0, -1, -1, -7);
    EXPECT_EQ(m.seq_pos_max(0), -3);
    EXPECT_EQ(m.seq_pos_min(0), -3);
    EXPECT_EQ(m.get_used(), 2u);
    m.seq_add(0, -1, -1, 3);  // a negative p0 has no lower bound: the position -3 is in range
    EXPECT_EQ(m.seq_pos_max(0), 0);
    EXPECT_THROW(m.seq_add(1, -1, -1, std::numeric_limits<pos_t>::max()), error);
    EXPECT_EQ(m.seq_pos_max(1), 12);
    m.validate();
}

TEST(memory_recurrent, seq_div_divides_the_tail_position) {
    memory_recurrent m(params(4));
    three_sequences(m);
    const std::string before = snapshot(m);
    EXPECT_THROW(m.seq_div(0, -1, -1, 0), error);  // upstream divides by zero
    EXPECT_THROW(m.seq_div(0, -1, -1, -2), error);
    m.seq_div(0, -1, -1, 1);
    m.seq_div(0, 5, -1, 2);  // tail outside
    EXPECT_EQ(snapshot(m), before);
    m.seq_div(0, 0, 10, 2);
    EXPECT_EQ(m.seq_pos_max(0), 2);
    m.seq_div(2, -1, -1, 2);
    EXPECT_EQ(m.seq_pos_max(1), 1);  // shared
}

// -- rollback --

TEST(memory_recurrent, rollback_restores_each_of_the_last_k_states) {
    constexpr uint32_t k = 4;
    const std::vector<uint64_t> h = chain(0, 0, 0, 10);  // h[p]: the state after position p
    for (uint32_t r = 1; r <= k; ++r) {
        memory_recurrent m(params(2, k));
        ASSERT_EQ(decode(m, run(0, 0, 10)), 1);
        EXPECT_EQ(state_of(m, 0), h[9]);
        const pos_t p0 = 10 - static_cast<pos_t>(r);
        EXPECT_TRUE(m.seq_rm(0, p0, -1)) << r;
        EXPECT_EQ(m.seq_pos_max(0), p0 - 1);
        EXPECT_EQ(state_of(m, 0), h[static_cast<size_t>(p0 - 1)]) << r;  // the pending plane
        m.validate();
        // the next decode continues from the restored state
        ASSERT_EQ(decode(m, run(0, p0, 1)), 1);
        EXPECT_EQ(state_of(m, 0), mix(h[static_cast<size_t>(p0 - 1)], 0, p0));
        EXPECT_EQ(m.cell(static_cast<uint32_t>(m.seq_tail(0))).rs_idx, 0u);  // consumed
    }
}

TEST(memory_recurrent, plane_r_holds_the_state_r_tokens_back) {
    constexpr uint32_t k = 3;
    memory_recurrent m(params(1, k));
    ASSERT_EQ(decode(m, run(0, 0, 6)), 1);
    const std::vector<uint64_t> h = chain(0, 0, 0, 6);
    const auto c = static_cast<uint32_t>(m.seq_tail(0));
    EXPECT_EQ(m.cell(c).depth, k);
    for (uint32_t r = 0; r <= k; ++r)
        for (const auto& [il, is_s] : tensors(m)) {
            const tensor_view v = view_of(m, il, is_s);
            EXPECT_EQ(read_row(v.row(c, r), v.row_bytes(), il, is_s), h[5 - r]) << "plane " << r;
        }
}

TEST(memory_recurrent, rollback_works_after_one_token_steps) {
    // each step is a ubatch of one token: the history comes from the engine's history copies
    constexpr uint32_t k = 4;
    memory_recurrent m(params(3, k));
    ASSERT_EQ(decode(m, run(1, 0, 2)), 1);
    for (pos_t p = 2; p < 8; ++p) ASSERT_EQ(decode(m, {{0, p - 2}, {1, p}}), 1);  // seq 1 swaps cells once
    const std::vector<uint64_t> h = chain(0, 1, 0, 8);
    EXPECT_EQ(state_of(m, 1), h[7]);
    EXPECT_FALSE(m.seq_rm(1, 3, -1));  // 5 tokens > k
    EXPECT_TRUE(m.seq_rm(1, 4, -1));   // 4 tokens back: the state after position 3
    EXPECT_EQ(state_of(m, 1), h[3]);
    EXPECT_EQ(state_of(m, 0), chain(0, 0, 0, 6).back());
    m.validate();
}

TEST(memory_recurrent, rollbacks_compose_until_the_history_runs_out) {
    constexpr uint32_t k = 4;
    memory_recurrent m(params(2, k));
    ASSERT_EQ(decode(m, run(0, 0, 10)), 1);
    const std::vector<uint64_t> h = chain(0, 0, 0, 10);
    EXPECT_TRUE(m.seq_rm(0, 8, -1));  // 2 back
    EXPECT_TRUE(m.seq_rm(0, 7, -1));  // 1 more
    EXPECT_EQ(m.seq_pos_max(0), 6);
    EXPECT_EQ(state_of(m, 0), h[6]);
    const auto c = static_cast<uint32_t>(m.seq_tail(0));
    EXPECT_EQ(m.cell(c).rs_idx, 3u);
    EXPECT_EQ(m.cell(c).depth, 1u);
    const std::string before = snapshot(m);
    EXPECT_FALSE(m.seq_rm(0, 5, -1));  // 2 more: only 1 left
    EXPECT_EQ(snapshot(m), before);
    EXPECT_TRUE(m.seq_rm(0, 6, -1));
    EXPECT_EQ(state_of(m, 0), h[5]);
    // a state with a pending rollback is written as its logical state and copies share it
    m.seq_cp(0, 1, -1, -1);
    EXPECT_EQ(payload(m, 0), payload(m, 1));
    ASSERT_EQ(decode(m, run(1, 6, 2)), 1);
    EXPECT_EQ(state_of(m, 1), chain(h[5], 1, 6, 2).back());
    EXPECT_EQ(state_of(m, 0), h[5]);
    ASSERT_EQ(decode(m, run(0, 6, 1)), 1);
    EXPECT_EQ(state_of(m, 0), mix(h[5], 0, 6));
    m.validate();
}

TEST(memory_recurrent, rollback_limits) {
    constexpr uint32_t k = 3;
    memory_recurrent m(params(2, k));
    ASSERT_EQ(decode(m, run(0, 0, 8)), 1);
    const std::string before = snapshot(m);
    EXPECT_FALSE(m.seq_rm(0, 4, -1));  // k + 1 tokens
    EXPECT_TRUE(m.seq_rm(0, 5, 7));    // does not reach the tail: nothing to remove
    EXPECT_EQ(snapshot(m), before);
    // a shared state is not rolled back (the position is the cell's, shared with the copy)
    m.seq_cp(0, 1, -1, -1);
    EXPECT_FALSE(m.seq_rm(0, 7, -1));
    EXPECT_TRUE(m.seq_rm(1, -1, -1));
    EXPECT_TRUE(m.seq_rm(0, 7, -1));
    // p0 == 0 is a removal, not a rollback
    EXPECT_TRUE(m.seq_rm(0, 0, -1));
    EXPECT_EQ(m.seq_pos_max(0), -1);
    // without rollback planes, upstream's false
    memory_recurrent plain(params(1));
    ASSERT_EQ(decode(plain, run(0, 0, 4)), 1);
    EXPECT_FALSE(plain.seq_rm(0, 3, -1));
}

TEST(memory_recurrent, restored_states_have_no_history) {
    constexpr uint32_t k = 3;
    memory_recurrent m(params(2, k));
    ASSERT_EQ(decode(m, run(0, 0, 8)), 1);
    const uint64_t h7 = state_of(m, 0);
    state_set_payload(m, payload(m, 0), 1);
    EXPECT_FALSE(m.seq_rm(1, 7, -1));
    ASSERT_EQ(decode(m, run(1, 8, 2)), 1);  // two tokens: back to the restored state at most
    EXPECT_FALSE(m.seq_rm(1, 7, -1));
    EXPECT_TRUE(m.seq_rm(1, 8, -1));
    EXPECT_EQ(state_of(m, 1), h7);
    EXPECT_EQ(m.seq_pos_max(1), 7);
}

// -- state (design/recurrent.md §4.9) --

TEST(memory_recurrent, sequence_state_size_follows_the_formula) {
    memory_recurrent m(params(4));
    three_sequences(m);
    // 4 + (4 + 4) + 4 + 4 + per r layer (4 + 8 + row) + per s layer (4 + 8 + row)
    const size_t want = 4 + 8 + 4 + 4 + (12 + 16) + (12 + 24) + (12 + 12);
    EXPECT_EQ(payload(m, 0).size(), want);
    EXPECT_EQ(state_seq_get_size(m, 0), 8 + want);
    // the whole memory: two cells, the shared one listing both sequences
    EXPECT_EQ(payload(m, seq_all).size(), 4 + (4 + 4 + 4) + (4 + 4 + 8) + 8 + 3 * 12 + 2 * (16 + 24 + 12));
    // no state: the header only
    EXPECT_EQ(payload(m, 3).size(), 4 + 4 + 4 + 12 * 3u);
}

TEST(memory_recurrent, state_layout_is_canonical) {
    auto p = params(4, 2);
    p.layers.push_back({.n_embd_r = 0, .n_embd_s = 3});
    p.layers.push_back({.n_embd_r = 4, .n_embd_s = 6});
    memory_recurrent m(p);
    EXPECT_EQ(m.state_layout(), "recurrent n_layer=5 layers=0:r=f32x4,s=f32x6;2-3:s=f32x3;4:r=f32x4,s=f32x6");
    EXPECT_EQ(memory_recurrent(params(1)).state_layout(), memory_recurrent(params(8, 4)).state_layout());
}

TEST(memory_recurrent, whole_state_round_trip_compacts_cells) {
    memory_recurrent m(params(4, 2));
    ASSERT_EQ(decode(m, run(3, 0, 2)), 1);
    ASSERT_EQ(decode(m, run(1, 0, 4)), 1);
    ASSERT_TRUE(m.seq_rm(1, 3, -1));  // pending rollback: written as the logical state
    m.seq_cp(1, 2, -1, -1);
    ASSERT_TRUE(m.seq_rm(3, -1, -1));  // leaves a hole before seq 1's cell
    const auto bytes = payload(m, seq_all);
    const uint64_t h1 = state_of(m, 1);
    memory_recurrent r(params(6));  // more cells, no rollback: the layout matches all the same
    ASSERT_EQ(r.state_layout(), m.state_layout());
    state_set_payload(r, bytes, seq_all);
    EXPECT_EQ(r.picture(), "M.....");
    EXPECT_EQ(r.cell(0).seqs, (std::vector<seq_id_t>{1, 2}));
    EXPECT_EQ(r.seq_pos_max(2), 2);
    EXPECT_EQ(state_of(r, 2), h1);
    EXPECT_EQ(payload(r, seq_all), bytes);
    r.validate();
    // and it continues like the original
    ASSERT_EQ(decode(r, run(2, 3, 1)), 1);
    EXPECT_EQ(state_of(r, 2), mix(h1, 2, 3));
    EXPECT_EQ(state_of(r, 1), h1);
}

TEST(memory_recurrent, sequence_state_restores_into_another_sequence) {
    memory_recurrent m(params(4));
    three_sequences(m);
    const uint64_t h0 = state_of(m, 0);
    const auto buf = state_seq_get_data(m, 0);
    state_seq_set_data(m, buf, 2);  // seq 2 leaves the cell it shared with seq 1
    EXPECT_EQ(m.seq_pos_max(2), 4);
    EXPECT_EQ(state_of(m, 2), h0);
    EXPECT_NE(m.seq_tail(2), m.seq_tail(0));
    EXPECT_EQ(m.cell(static_cast<uint32_t>(m.seq_tail(1))).seqs, (std::vector<seq_id_t>{1}));
    EXPECT_EQ(m.get_used(), 3u);
    m.validate();
    // into a memory of another size
    memory_recurrent other(params(2));
    state_seq_set_data(other, buf, 1);
    EXPECT_EQ(state_of(other, 1), h0);
    EXPECT_EQ(other.seq_pos_max(1), 4);
    // a state without cells clears the destination
    state_seq_set_data(other, state_seq_get_data(other, 0), 1);
    EXPECT_EQ(other.seq_pos_max(1), -1);
    EXPECT_EQ(other.get_used(), 0u);
}

// Restoring bytes into dest must fail with an error containing `want` and leave m exactly as it was.
void expect_rejected(memory_recurrent& m, std::span<const uint8_t> bytes, seq_id_t dest,
                     const std::string& want) {
    const std::string before = snapshot(m);
    try {
        state_set_payload(m, bytes, dest);
        ADD_FAILURE() << "accepted, expected: " << want;
    } catch (const error& e) {
        EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
    EXPECT_EQ(snapshot(m), before) << "after: " << want;
}

TEST(memory_recurrent, every_truncation_is_rejected_and_changes_nothing) {
    memory_recurrent m(params(4, 2));
    three_sequences(m);
    for (const seq_id_t s : {seq_all, seq_id_t{0}}) {
        const auto bytes = payload(m, s);
        memory_recurrent target(params(4, 2));
        three_sequences(target);
        ASSERT_TRUE(target.seq_rm(0, 4, -1));  // something to keep intact
        for (size_t n = 0; n < bytes.size(); ++n)
            expect_rejected(target, std::span(bytes).first(n), s == seq_all ? seq_all : 3, "state:");
        auto longer = bytes;
        longer.push_back(0);
        expect_rejected(target, longer, s == seq_all ? seq_all : 3, "trailing");
    }
}

// A payload with one field overwritten: the u32/i32 at byte `at`.
std::vector<uint8_t> patched(std::vector<uint8_t> bytes, size_t at, uint32_t value) {
    std::memcpy(bytes.data() + at, &value, 4);
    return bytes;
}

TEST(memory_recurrent, corrupt_states_are_rejected_and_change_nothing) {
    memory_recurrent m(params(4));
    three_sequences(m);
    const auto whole = payload(m, seq_all);  // cells: [pos 4, 1 id: 0], [pos 2, 2 ids: 1 2]
    const auto one = payload(m, 0);          // [pos 4, 0 ids]
    memory_recurrent small(params(1));
    expect_rejected(small, whole, seq_all, "holds 2 cells, this memory has 1");
    expect_rejected(m, whole, 3, "at most one cell");
    expect_rejected(m, patched(one, 8, 1), 3, "seq-agnostic");
    expect_rejected(m, patched(whole, 12, 7), seq_all, "seq_id 7 not in [0, 4)");
    expect_rejected(m, patched(whole, 28, 0), seq_all, "seq_id 0 has a state in two cells");
    expect_rejected(m, patched(whole, 20, 0), seq_all, "cell 1 belongs to no sequence");
    expect_rejected(m, patched(whole, 20, 5), seq_all, "cell 1 lists 5 sequence ids, more than n_seq_max 4");
    const size_t data = one.size() - (12 + 16) - (12 + 24) - (12 + 12) - 8;  // s_trans, n_layer
    expect_rejected(m, patched(one, data, 1), 0, "transposed s rows");
    expect_rejected(m, patched(one, data + 4, 2), 0, "the state has 2 layers, this memory 3");
    expect_rejected(m, patched(one, data + 8, 1), 0, "layer 0 r type 1");
    expect_rejected(m, patched(one, data + 12, 20), 0, "layer 0 r rows of 20 bytes, this memory 16");
    expect_rejected(m, patched(one, data + 8 + 28, 30), 0, "layer 0 s type 30");
    expect_rejected(m, patched(one, data + 8 + 28 + 36 + 4, 8), 0, "layer 2 s rows of 8 bytes");
    // state_check agrees with state_read and changes nothing either
    io_span_reader good(one, true);
    EXPECT_NO_THROW(m.state_check(good, 0, 0));
    const auto bad_layers = patched(one, data + 4, 2);
    io_span_reader bad(bad_layers, true);
    EXPECT_THROW(m.state_check(bad, 0, 0), error);
}

}  // namespace
}  // namespace kvc
