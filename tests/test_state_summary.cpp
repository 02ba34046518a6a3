#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <kvcache/kv_cache.h>
#include <kvcache/memory_recurrent.h>
#include <kvcache/state.h>
#include <kvcache/state_summary.h>

#include "state_test_util.h"

namespace kvc {
namespace {

using namespace kvc::test;

std::span<const uint8_t> payload_of(const std::vector<uint8_t>& buffer) {
    return std::span(buffer).subspan(8);
}

TEST(state_summary, counts_cells_positions_and_bytes_of_every_stream_and_layer) {
    std::mt19937 rng(1);
    const auto p = params_for(dtype::q8_0, dtype::f16, true, false);  // one stream per sequence
    kv_cache c(p);
    decode(c, 0, 0, 5, rng);
    decode(c, 2, 7, 3, rng);
    const auto buf = whole(c);
    const state_summary s = summarize_kv_state(payload_of(buf), false);
    ASSERT_EQ(s.streams.size(), 4u);
    EXPECT_EQ(s.streams[0].n_cells, 5u);
    EXPECT_EQ(s.streams[1].n_cells, 0u);
    ASSERT_EQ(s.streams[2].seqs.size(), 1u);
    EXPECT_EQ(s.streams[2].seqs[0].seq, 2);
    EXPECT_EQ(s.streams[2].seqs[0].n_cells, 3u);
    EXPECT_EQ(s.streams[2].seqs[0].pos_min, 7);
    EXPECT_EQ(s.streams[2].seqs[0].pos_max, 9);
    EXPECT_TRUE(s.v_trans);
    EXPECT_EQ(s.bytes, buf.size() - 8);
    ASSERT_EQ(s.layers.size(), 2u);
    // layer 0: E_k = 64 (2 q8_0 blocks of 34 bytes), E_v = 64 f16; layer 1: E_k = 64, E_v = 32
    EXPECT_EQ(s.layers[0].k_bytes, 8u * 68);
    EXPECT_EQ(s.layers[0].v_bytes, 8u * 128);
    EXPECT_EQ(s.layers[1].v_bytes, 8u * 64);
    const auto per_type = s.bytes_per_type();
    ASSERT_EQ(per_type.size(), 2u);
    EXPECT_EQ(per_type[0], (std::pair<dtype, uint64_t>{dtype::q8_0, 16u * 68}));
    EXPECT_EQ(per_type[1], (std::pair<dtype, uint64_t>{dtype::f16, 8u * 192}));
}

TEST(state_summary, shared_cells_count_for_every_sequence_and_mrope_is_found) {
    std::mt19937 rng(2);
    auto p = params_for(dtype::f16, dtype::f16, false, true);
    kv_cache c(p);
    decode(c, 0, 0, 4, rng);
    c.seq_cp(0, 1, 1, 3);
    const state_summary s = summarize_kv_state(payload_of(whole(c)), false);
    ASSERT_EQ(s.streams[0].seqs.size(), 2u);
    EXPECT_EQ(s.streams[0].n_cells, 4u);
    EXPECT_EQ(s.streams[0].seqs[1].n_cells, 2u);
    EXPECT_EQ(s.streams[0].seqs[1].pos_min, 1);
    EXPECT_EQ(s.streams[0].seqs[1].pos_max, 2);

    p.n_pos = 4;
    kv_cache m(p);
    decode(m, 0, 0, 3, rng, 4);
    const auto buf = whole(m);
    EXPECT_THROW(summarize_kv_state(payload_of(buf), false), error);
    EXPECT_TRUE(summarize_kv_state_any(payload_of(buf)).mrope);
}

TEST(state_summary, malformed_payloads_are_errors_never_crashes) {
    std::mt19937 rng(3);
    kv_cache c(params_for(dtype::q4_0, dtype::q8_0, false, true));
    decode(c, 1, 0, 3, rng);
    const auto buf = whole(c);
    const auto payload = payload_of(buf);
    for (size_t n = 0; n < payload.size(); ++n)
        EXPECT_THROW(summarize_kv_state(payload.first(n), false), error) << "truncated at " << n;
    std::vector<uint8_t> bad(payload.begin(), payload.end());
    bad.push_back(0);
    EXPECT_THROW(summarize_kv_state(bad, false), error);
    bad.pop_back();
    const uint64_t huge = ~uint64_t{0} / 2;
    std::memcpy(bad.data() + 8 + 3 * 12 + 8 + 4, &huge, 8);  // layer 0's K row size
    EXPECT_THROW(summarize_kv_state(bad, false), error);
}

// -- recurrent payloads --

// One block of n tokens of s from position p0, placed by find_slot (the summary reads no row data).
void place(memory_recurrent& m, seq_id_t s, pos_t p0, uint32_t n) {
    ubatch u;
    u.equal_seqs = true;
    u.n_tokens = u.n_seq_tokens = n;
    u.n_seqs = u.n_seqs_unq = 1;
    u.seq_id_begin.push_back(0);
    for (uint32_t i = 0; i < n; ++i) {
        u.token.push_back(0);
        u.pos.push_back(p0 + static_cast<pos_t>(i));
        u.n_seq_id.push_back(1);
        u.seq_id_data.push_back(s);
        u.seq_id_begin.push_back(i + 1);
        u.output.push_back(0);
        u.batch_idx.push_back(static_cast<int32_t>(i));
    }
    u.seq_id_unq = {s};
    m.find_slot(u);
}

std::vector<uint8_t> rs_payload(const memory_recurrent& m, seq_id_t s) {
    std::vector<uint8_t> out;
    io_vector_writer w(out);
    m.state_write(w, s, 0);
    return out;
}

// Three model layers: r f16 x 4 and s f32 x 6, nothing, s f32 x 3 (so one r and two s tensors); seqs 0
// (positions 0..2), 1 (0..1) and 2 sharing 1's cell.
memory_recurrent three_layers() {
    recurrent_params p;
    p.layers = {{.n_embd_r = 4, .n_embd_s = 6}, {}, {.n_embd_r = 0, .n_embd_s = 3}};
    p.type_r = dtype::f16;
    p.n_seq_max = 3;
    p.n_rs_seq = 1;
    return memory_recurrent(p);
}

void fill_three(memory_recurrent& m) {
    place(m, 0, 0, 3);
    place(m, 1, 0, 2);
    m.seq_cp(1, 2, -1, -1);
}

using rs = recurrent_state_summary;

TEST(state_summary, recurrent_whole_memory_every_field_matches_the_memory) {
    memory_recurrent m = three_layers();
    fill_three(m);
    const auto bytes = rs_payload(m, seq_all);
    const rs s = summarize_recurrent_state(bytes, m.state_layout());
    EXPECT_EQ(s.bytes, bytes.size());
    ASSERT_EQ(s.cells.size(), 2u);
    for (uint32_t c = 0; c < 2; ++c) {  // the memory's used cells are 0 and 1, written in that order
        EXPECT_EQ(s.cells[c].pos, m.cell(c).pos);
        EXPECT_EQ(s.cells[c].seqs, m.cell(c).seqs);
    }
    ASSERT_EQ(s.seqs.size(), 3u);
    for (seq_id_t q = 0; q < 3; ++q) {
        EXPECT_EQ(s.seqs[q].seq, q);
        EXPECT_EQ(static_cast<int32_t>(s.seqs[q].cell), m.seq_tail(q));
        EXPECT_EQ(s.seqs[q].pos, m.seq_pos_max(q));
    }
    EXPECT_EQ(s.n_layer, 3u);
    EXPECT_EQ(s.rs_split, rs::split::layout);
    ASSERT_EQ(s.tensors.size(), 3u);
    const struct {
        rs::kind k;
        int32_t il;
        dtype type;
        uint64_t row_bytes;
    } want[] = {
        {rs::kind::r, 0, dtype::f16, 8}, {rs::kind::s, 0, dtype::f32, 24}, {rs::kind::s, 2, dtype::f32, 12}};
    for (size_t i = 0; i < 3; ++i) {
        EXPECT_EQ(s.tensors[i].k, want[i].k) << i;
        EXPECT_EQ(s.tensors[i].il, want[i].il) << i;
        EXPECT_EQ(s.tensors[i].type, want[i].type) << i;
        EXPECT_EQ(s.tensors[i].row_bytes, want[i].row_bytes) << i;
        EXPECT_EQ(s.tensors[i].bytes, 2 * want[i].row_bytes) << i;
    }
    EXPECT_EQ(s.bytes_per_type(),
              (std::vector<std::pair<dtype, uint64_t>>{{dtype::f16, 16}, {dtype::f32, 72}}));

    // without the layout, 3 tensors of 3 layers do not say which is which
    const rs bare = summarize_recurrent_state(bytes);
    EXPECT_EQ(bare.rs_split, rs::split::unknown);
    for (const auto& t : bare.tensors) {
        EXPECT_EQ(t.k, rs::kind::unknown);
        EXPECT_EQ(t.il, -1);
    }
    EXPECT_EQ(bare.tensors[0].row_bytes, 8u);
}

TEST(state_summary, recurrent_sequence_state_is_one_cell_without_ids) {
    memory_recurrent m = three_layers();
    fill_three(m);
    const rs s = summarize_recurrent_state(rs_payload(m, 2), m.state_layout());
    ASSERT_EQ(s.cells.size(), 1u);
    EXPECT_EQ(s.cells[0].pos, 1);
    EXPECT_TRUE(s.cells[0].seqs.empty());
    EXPECT_TRUE(s.seqs.empty());
    EXPECT_EQ(s.tensors[2].bytes, 12u);

    m.seq_rm(0, -1, -1);  // no state: no cell, every tensor still listed
    const rs empty = summarize_recurrent_state(rs_payload(m, 0), m.state_layout());
    EXPECT_TRUE(empty.cells.empty());
    ASSERT_EQ(empty.tensors.size(), 3u);
    EXPECT_EQ(empty.tensors[1].bytes, 0u);
}

TEST(state_summary, recurrent_split_is_known_when_every_layer_has_both_tensors) {
    recurrent_params p;
    p.layers = {{.n_embd_r = 2, .n_embd_s = 8}, {.n_embd_r = 2, .n_embd_s = 8}};
    p.type_s = dtype::bf16;
    p.n_seq_max = 2;
    memory_recurrent m(p);
    place(m, 1, 5, 1);
    const rs s = summarize_recurrent_state(rs_payload(m, seq_all));
    EXPECT_EQ(s.rs_split, rs::split::all_layers);
    ASSERT_EQ(s.tensors.size(), 4u);
    EXPECT_EQ(s.tensors[1].k, rs::kind::r);
    EXPECT_EQ(s.tensors[1].il, 1);
    EXPECT_EQ(s.tensors[2].k, rs::kind::s);
    EXPECT_EQ(s.tensors[2].il, 0);
    EXPECT_EQ(s.tensors[3].type, dtype::bf16);
    EXPECT_EQ(s.tensors[3].row_bytes, 16u);
    ASSERT_EQ(s.seqs.size(), 1u);
    EXPECT_EQ(s.seqs[0].seq, 1);
    EXPECT_EQ(s.seqs[0].pos, 5);
}

// kvc::error(corrupt_data) that names the byte reached.
void expect_bad(std::span<const uint8_t> bytes, std::string_view layout, const std::string& what) {
    try {
        summarize_recurrent_state(bytes, layout);
        ADD_FAILURE() << what << ": accepted";
    } catch (const error& e) {
        EXPECT_EQ(e.code(), errc::corrupt_data) << what;
        EXPECT_NE(std::string(e.what()).find("at byte "), std::string::npos) << what << ": " << e.what();
    }
}

std::vector<uint8_t> patched(std::vector<uint8_t> bytes, size_t at, uint32_t value) {
    std::memcpy(bytes.data() + at, &value, 4);
    return bytes;
}

TEST(state_summary, recurrent_truncations_and_corruptions_are_errors_naming_the_byte) {
    memory_recurrent m = three_layers();
    fill_three(m);
    const auto bytes = rs_payload(m, seq_all);
    const std::string layout = m.state_layout();
    for (size_t n = 0; n < bytes.size(); ++n) {
        const auto part = std::span(bytes).first(n);
        expect_bad(part, layout, "truncated at " + std::to_string(n));
        // without the layout, a payload ending between tensors is one of a memory with fewer tensors
        if (n == 40 || n == 40 + 12 + 16 || n == 40 + 28 + 12 + 48)
            EXPECT_LT(summarize_recurrent_state(part).tensors.size(), 3u);
        else
            expect_bad(part, {}, "truncated at " + std::to_string(n) + ", no layout");
    }
    auto longer = bytes;
    longer.push_back(0);
    expect_bad(longer, layout, "trailing byte");
    longer.resize(bytes.size() + 12);  // a 4th tensor header in 3 layers: fine without the layout
    expect_bad(longer, layout, "a tensor more than the layout");

    // layout: u32 count, cell 0 (pos, 1, 0), cell 1 (pos, 2, 1, 2), s_trans, n_layer, tensors at 40
    expect_bad(patched(bytes, 0, 1000), layout, "more cells than bytes");
    expect_bad(patched(bytes, 8, 0), layout, "a cell without ids among several");
    expect_bad(patched(bytes, 12, 2), layout, "seq 2 in two cells");
    expect_bad(patched(bytes, 12, ~0u), layout, "a negative seq id");
    expect_bad(patched(bytes, 32, 1), layout, "transposed s");
    expect_bad(patched(bytes, 36, 4), layout, "n_layer differs from the layout");
    expect_bad(patched(bytes, 40, 99), layout, "not an element type");
    expect_bad(patched(bytes, 40, 0), layout, "f32 where the layout says f16");
    expect_bad(patched(bytes, 44, 9), layout, "row size differs from the layout");
    expect_bad(patched(bytes, 48, 1), {}, "a huge row size");
    expect_bad(bytes, "recurrent n_layer=3 layers=0:r=f16x4;0-2:s=f32x6", "a layout of other widths");
    expect_bad(bytes, "recurrent n_layer=3 layers=0:r=f16x4,s=f32x6", "a layout of fewer tensors");
    for (const char* junk :
         {"kv streams=1", "recurrent n_layer=3 layers=0-9:s=f32x6", "recurrent n_layer=3 layers=0:x",
          "recurrent n_layer=3 layers=0:s=q8_0x6", "recurrent n_layer=3 layers=0:s=f32x6 junk"})
        EXPECT_THROW(summarize_recurrent_state(bytes, junk), error) << junk;
}

}  // namespace
}  // namespace kvc
