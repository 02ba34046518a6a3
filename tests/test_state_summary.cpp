#include <charconv>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <kvcache/batch.h>
#include <kvcache/kv_cache.h>
#include <kvcache/kv_cache_iswa.h>
#include <kvcache/memory_hybrid.h>
#include <kvcache/memory_recurrent.h>
#include <kvcache/state.h>
#include <kvcache/state_summary.h>

#include "recurrent_test_util.h"
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

using test::place;

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

// -- composite payloads (kv_cache_iswa, memory_hybrid) --

using mss = memory_state_summary;

// One batch of n tokens of s from position p0 through init_batch / apply (the summary reads no row data,
// so the rows stay as they are).
void fill(memory_i& m, seq_id_t s, pos_t p0, uint32_t n, uint32_t n_seq_max) {
    batch_storage b = batch::init(static_cast<int32_t>(n), 0, 1);
    for (uint32_t i = 0; i < n; ++i) {
        const seq_id_t ids[] = {s};
        b.add(static_cast<token_t>(i), p0 + static_cast<pos_t>(i), ids, false);
    }
    b.set_output(static_cast<int32_t>(n) - 1, true);
    batch_allocr a;
    a.init(b.view(), positions_of(m), {.n_seq_max = n_seq_max});
    memory_context_ptr ctx = m.init_batch(a, 512, false);
    ASSERT_FALSE(is_fail(ctx->get_status()));
    do ctx->apply();
    while (ctx->next());
}

// What one memory (or one part of a composite) writes.
std::vector<uint8_t> written(const memory_i& m, seq_id_t s, state_seq_flags flags) {
    std::vector<uint8_t> out;
    io_vector_writer w(out);
    m.state_write(w, s, flags);
    return out;
}

// A part against the KV cache that wrote it: its payload's summary field by field, and the cells and
// positions the cache holds for each sequence (seq_all: every sequence of the cache).
void expect_kv_part(const mss::part& part, std::string_view name, uint64_t offset, const kv_cache& c,
                    seq_id_t s, state_seq_flags flags) {
    SCOPED_TRACE(std::string(name));
    EXPECT_EQ(part.name, name);
    EXPECT_EQ(part.offset, offset);
    ASSERT_NE(part.kv(), nullptr);
    const std::vector<uint8_t> own = written(c, s, flags);
    EXPECT_EQ(part.bytes(), own.size());
    const state_summary want = summarize_kv_state(own, c.params().n_pos > 1);
    const state_summary& got = *part.kv();
    EXPECT_EQ(got.mrope, want.mrope);
    EXPECT_EQ(got.v_trans, c.params().v_trans);
    ASSERT_EQ(got.streams.size(), want.streams.size());
    for (size_t st = 0; st < got.streams.size(); ++st) {
        EXPECT_EQ(got.streams[st].n_cells, want.streams[st].n_cells);
        ASSERT_EQ(got.streams[st].seqs.size(), want.streams[st].seqs.size());
        EXPECT_EQ(got.streams[st].seqs.empty(), got.streams[st].n_cells == 0);
        for (size_t i = 0; i < got.streams[st].seqs.size(); ++i) {
            const auto& q = got.streams[st].seqs[i];
            EXPECT_EQ(q.seq, want.streams[st].seqs[i].seq);
            EXPECT_EQ(q.pos_min, want.streams[st].seqs[i].pos_min);
            EXPECT_EQ(q.pos_max, c.seq_pos_max(s < 0 ? q.seq : s)) << q.seq;
            // a sequence's SWA part holds its window only; every other part all of its cells
            if (s < 0 || c.params().swa == swa_type::none) {
                EXPECT_EQ(q.pos_min, c.seq_pos_min(s < 0 ? q.seq : s)) << q.seq;
            }
            if (s >= 0) {
                EXPECT_EQ(q.n_cells, got.streams[st].n_cells);
            }
        }
    }
    ASSERT_EQ(got.layers.size(), c.layer_ids().size());
    for (size_t il = 0; il < got.layers.size(); ++il) {
        EXPECT_EQ(got.layers[il].k_bytes, want.layers[il].k_bytes);
        EXPECT_EQ(got.layers[il].v_bytes, want.layers[il].v_bytes);
        EXPECT_EQ(got.layers[il].type_k, c.params().type_k);
    }
}

// A part against the recurrent memory that wrote it.
void expect_recurrent_part(const mss::part& part, uint64_t offset, const memory_recurrent& m, seq_id_t s,
                           bool with_layout) {
    EXPECT_EQ(part.name, "recr");
    EXPECT_EQ(part.offset, offset);
    ASSERT_NE(part.recurrent(), nullptr);
    const std::vector<uint8_t> own = written(m, s, 0);
    EXPECT_EQ(part.bytes(), own.size());
    const rs& got = *part.recurrent();
    const rs want = summarize_recurrent_state(own, m.state_layout());
    EXPECT_EQ(got.rs_split, with_layout ? rs::split::layout : rs::split::unknown);
    ASSERT_EQ(got.cells.size(), want.cells.size());
    for (size_t c = 0; c < got.cells.size(); ++c) {
        EXPECT_EQ(got.cells[c].pos, want.cells[c].pos);
        EXPECT_EQ(got.cells[c].seqs, want.cells[c].seqs);
    }
    if (s >= 0) {
        ASSERT_EQ(got.cells.size(), 1u);
        EXPECT_EQ(got.cells[0].pos, m.seq_pos_max(s));
    }
    for (const auto& q : got.seqs) EXPECT_EQ(q.pos, m.seq_pos_max(q.seq));
    EXPECT_EQ(got.seqs.size(), want.seqs.size());
    ASSERT_EQ(got.tensors.size(), want.tensors.size());
    for (size_t i = 0; i < got.tensors.size(); ++i) {
        EXPECT_EQ(got.tensors[i].bytes, want.tensors[i].bytes) << i;
        if (with_layout) {
            EXPECT_EQ(got.tensors[i].il, want.tensors[i].il) << i;
        }
    }
}

// Layers 0 and 2 slide a window of 4 positions, 1 and 3 see everything.
kv_cache_iswa make_iswa(uint32_t n_pos = 1) {
    kv_cache_iswa_params p;
    for (uint32_t il = 0; il < 4; ++il)
        p.kv.layers.push_back(
            layer_desc{.n_head_kv = 1, .n_embd_head_k = 32, .n_embd_head_v = 16, .is_swa = il % 2 == 0});
    p.kv.kv_size = 64;
    p.kv.n_seq_max = 2;
    p.kv.type_k = dtype::q8_0;
    p.kv.type_v = dtype::f16;
    p.kv.n_pos = n_pos;
    p.kv.n_swa = 4;
    p.kv.swa = swa_type::standard;
    p.sizing.swa_full = true;
    return kv_cache_iswa(p);
}

// Layers 1 and 3 attention, 0 and 2 recurrent; with iswa, attention layer 1 slides a window.
memory_hybrid make_hybrid(bool iswa) {
    memory_hybrid_params p;
    for (uint32_t il = 0; il < 4; ++il) {
        const bool attn = il % 2 == 1;
        p.attn.layers.push_back(layer_desc{
            .n_head_kv = 1, .n_embd_head_k = 32, .n_embd_head_v = 32, .is_swa = il == 1, .has_kv = attn});
        p.recr.layers.push_back(attn ? recurrent_layer_desc{}
                                     : recurrent_layer_desc{.n_embd_r = 4, .n_embd_s = 8});
    }
    p.attn.kv_size = 64;
    p.attn.n_seq_max = 2;
    p.attn.v_trans = true;
    p.recr.n_seq_max = 2;
    if (iswa) {
        p.iswa = iswa_sizing{};
        p.attn.n_swa = 4;
        p.attn.swa = swa_type::standard;
    }
    return memory_hybrid(p);
}

TEST(state_summary, iswa_payloads_are_read_part_by_part) {
    kv_cache_iswa m = make_iswa();
    fill(m, 0, 0, 10, 2);
    fill(m, 1, 0, 3, 2);
    for (const seq_id_t s : {seq_all, seq_id_t{0}, seq_id_t{1}})
        for (const state_seq_flags flags : {state_seq_flags{0}, state_seq_flag_partial_only}) {
            SCOPED_TRACE(testing::Message() << "seq " << s << " flags " << flags);
            const std::vector<uint8_t> payload = written(m, s, flags);
            const bool partial = flags != 0;
            const mss sum = summarize_memory_state(payload, m.state_layout(), flags);
            EXPECT_EQ(sum.kind, mss::memory::iswa);
            EXPECT_EQ(sum.partial_only, partial);
            EXPECT_FALSE(sum.guessed);
            EXPECT_EQ(sum.bytes, payload.size());
            ASSERT_EQ(sum.parts.size(), partial ? 1u : 2u);
            const uint64_t base_bytes = partial ? 0 : written(m.get_base(), s, 0).size();
            if (!partial) expect_kv_part(sum.parts[0], "base", 0, m.get_base(), s, 0);
            expect_kv_part(sum.parts.back(), "swa", base_bytes, m.get_swa(), s, 0);

            // without a layout: the same parts, guessed; the SWA part alone is a KV payload
            const mss bare = summarize_memory_state(payload);
            EXPECT_TRUE(bare.guessed);
            EXPECT_EQ(bare.kind, partial ? mss::memory::kv : mss::memory::iswa);
            ASSERT_EQ(bare.parts.size(), sum.parts.size());
            if (partial) {
                EXPECT_EQ(bare.parts[0].name, "kv");
            }
            for (size_t i = 0; i < bare.parts.size(); ++i)
                EXPECT_EQ(bare.parts[i].bytes(), sum.parts[i].bytes());
        }
    // a sequence's SWA part holds its window only
    const mss seq0 = summarize_memory_state(written(m, 0, 0), m.state_layout());
    EXPECT_EQ(seq0.parts[0].kv()->streams[0].n_cells, 10u);
    EXPECT_LT(seq0.parts[1].kv()->streams[0].n_cells, 10u);
}

TEST(state_summary, hybrid_payloads_are_read_part_by_part) {
    for (const bool iswa : {false, true}) {
        memory_hybrid m = make_hybrid(iswa);
        fill(m, 0, 0, 9, 2);
        fill(m, 1, 0, 4, 2);
        for (const seq_id_t s : {seq_all, seq_id_t{0}, seq_id_t{1}})
            for (const state_seq_flags flags : {state_seq_flags{0}, state_seq_flag_partial_only}) {
                SCOPED_TRACE(testing::Message() << "iswa " << iswa << " seq " << s << " flags " << flags);
                const std::vector<uint8_t> payload = written(m, s, flags);
                const bool partial = flags != 0;
                const mss::memory kind = iswa ? mss::memory::hybrid_iswa : mss::memory::hybrid;
                const mss sum = summarize_memory_state(payload, m.state_layout(), flags);
                EXPECT_EQ(sum.kind, kind);
                EXPECT_EQ(sum.partial_only, partial);
                EXPECT_EQ(sum.bytes, payload.size());
                ASSERT_EQ(sum.parts.size(), partial ? 1u : iswa ? 3u : 2u);
                const uint64_t attn_bytes = partial ? 0 : written(m.get_attn(), s, 0).size();
                if (!partial && iswa) {
                    const auto& is = dynamic_cast<const kv_cache_iswa&>(m.get_attn());
                    expect_kv_part(sum.parts[0], "base", 0, is.get_base(), s, 0);
                    expect_kv_part(sum.parts[1], "swa", written(is.get_base(), s, 0).size(), is.get_swa(), s,
                                   0);
                } else if (!partial) {
                    expect_kv_part(sum.parts[0], "attn", 0, dynamic_cast<const kv_cache&>(m.get_attn()), s,
                                   0);
                }
                expect_recurrent_part(sum.parts.back(), attn_bytes, m.get_recr(), s, true);

                // without a layout: the same parts, guessed; the recurrent part alone is a recurrent payload
                const mss bare = summarize_memory_state(payload);
                EXPECT_TRUE(bare.guessed);
                EXPECT_EQ(bare.kind, partial ? mss::memory::recurrent : kind);
                ASSERT_EQ(bare.parts.size(), sum.parts.size());
                if (!partial) expect_recurrent_part(bare.parts.back(), attn_bytes, m.get_recr(), s, false);
            }
    }
}

TEST(state_summary, mrope_parts_are_found_with_and_without_a_layout) {
    std::mt19937 rng(4);
    kv_cache_iswa m = make_iswa(4);
    decode(m.get_base(), 0, 0, 3, rng, 4);  // each cache directly: the summary cares for cells only
    decode(m.get_swa(), 0, 0, 3, rng, 4);
    const std::vector<uint8_t> payload = written(m, seq_all, 0);
    for (const mss& sum :
         {summarize_memory_state(payload, m.state_layout()), summarize_memory_state(payload)}) {
        EXPECT_EQ(sum.kind, mss::memory::iswa);
        ASSERT_EQ(sum.parts.size(), 2u);
        EXPECT_TRUE(sum.parts[0].kv()->mrope);
        EXPECT_TRUE(sum.parts[1].kv()->mrope);
        EXPECT_EQ(sum.parts[1].offset, written(m.get_base(), seq_all, 0).size());
    }
}

// The byte an error names ("at byte N"), or -1.
long long byte_named(const error& e) {
    const std::string_view what = e.what();
    const size_t at = what.find("at byte ");
    if (at == std::string_view::npos) return -1;
    long long v = -1;
    const char* first = what.data() + at + 8;
    const auto [end, ec] = std::from_chars(first, what.data() + what.size(), v);
    return ec == std::errc() && end != first ? v : -1;
}

TEST(state_summary, composite_truncations_are_errors_naming_the_byte_and_the_part) {
    memory_hybrid m = make_hybrid(true);
    fill(m, 0, 0, 6, 2);
    fill(m, 1, 0, 2, 2);
    const std::vector<uint8_t> payload = written(m, seq_all, 0);
    const std::string layout = m.state_layout();
    const mss whole = summarize_memory_state(payload, layout);
    ASSERT_EQ(whole.parts.size(), 3u);
    const uint64_t swa_at = whole.parts[1].offset, recr_at = whole.parts[2].offset;
    for (size_t n = 0; n < payload.size(); ++n) {
        const auto part = std::span(payload).first(n);
        try {
            (void)summarize_memory_state(part, layout);
            ADD_FAILURE() << "truncated at " << n << ": accepted";
        } catch (const error& e) {
            EXPECT_EQ(e.code(), errc::corrupt_data) << n;
            const long long at = byte_named(e);
            EXPECT_GE(at, 0) << n << ": " << e.what();
            EXPECT_LE(at, static_cast<long long>(n)) << e.what();
            const char* name = n < swa_at ? "base part: " : n < recr_at ? "swa part: " : "recr part: ";
            EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << n << ": " << e.what();
            if (n >= recr_at) {  // bytes of the whole payload
                EXPECT_GE(at, static_cast<long long>(recr_at)) << e.what();
            }
        }
        // without a layout a truncation is an error naming a byte, or (at a part's or a recurrent tensor's
        // end, or by chance: cells read with M-RoPE extensions) a shorter payload whose parts use every byte
        try {
            const mss bare = summarize_memory_state(part);
            uint64_t end = 0;
            for (const auto& p : bare.parts) {
                EXPECT_EQ(p.offset, end) << n;
                end += p.bytes();
            }
            EXPECT_EQ(end, n);
        } catch (const error& e) {
            EXPECT_GE(byte_named(e), 0) << n << ": " << e.what();
        }
    }
    std::vector<uint8_t> longer = payload;
    longer.push_back(0);
    EXPECT_THROW(summarize_memory_state(longer, layout), error);
    EXPECT_THROW(summarize_memory_state(longer), error);
    // the partial-only flag says which parts follow
    EXPECT_THROW(summarize_memory_state(payload, layout, state_seq_flag_partial_only), error);
    EXPECT_THROW(summarize_memory_state(written(m, 0, state_seq_flag_partial_only), layout), error);
}

TEST(state_summary, prefix_parsers_stop_where_their_payload_ends) {
    kv_cache_iswa m = make_iswa();
    fill(m, 0, 0, 5, 2);
    const std::vector<uint8_t> payload = written(m, seq_all, 0);
    const size_t base = written(m.get_base(), seq_all, 0).size();
    EXPECT_EQ(summarize_kv_state_prefix(payload, false).bytes, base);
    EXPECT_EQ(summarize_kv_state_prefix(std::span(payload).subspan(base), false).bytes,
              payload.size() - base);
    try {  // the whole-payload parser keeps refusing what follows
        (void)summarize_kv_state(payload, false);
        ADD_FAILURE() << "accepted";
    } catch (const error& e) {
        EXPECT_EQ(byte_named(e), static_cast<long long>(base)) << e.what();
    }

    memory_recurrent r = three_layers();
    fill_three(r);
    std::vector<uint8_t> rs_bytes = rs_payload(r, seq_all);
    const size_t n = rs_bytes.size();
    rs_bytes.resize(n + 16);
    EXPECT_EQ(summarize_recurrent_state_prefix(rs_bytes, r.state_layout()).bytes, n);
    EXPECT_THROW(summarize_recurrent_state(rs_bytes, r.state_layout()), error);
}

TEST(state_summary, layouts_name_the_parts_or_are_refused) {
    kv_cache_iswa m = make_iswa();
    fill(m, 0, 0, 5, 2);
    const std::vector<uint8_t> payload = written(m, seq_all, 0);
    const auto code = [&](std::string_view layout) -> std::optional<errc> {
        try {
            (void)summarize_memory_state(payload, layout);
            return std::nullopt;
        } catch (const error& e) {
            return e.code();
        }
    };
    EXPECT_EQ(code(m.state_layout()), std::nullopt);
    EXPECT_EQ(code("mamba n_layer=4"), errc::unsupported);
    EXPECT_EQ(code("iswa base=" + m.get_base().state_layout()), errc::corrupt_data);  // no swa=
    EXPECT_EQ(code("iswa base=kv streams=1 swa=kv streams=1"), errc::corrupt_data);   // no n_pos
    EXPECT_EQ(code("hybrid attn=" + m.get_base().state_layout()), errc::corrupt_data);
    EXPECT_EQ(code(m.get_base().state_layout()), errc::corrupt_data);  // one KV payload: trailing bytes
    const kv_cache& base = m.get_base();
    EXPECT_EQ(summarize_memory_state(written(base, seq_all, 0), base.state_layout()).parts[0].name, "kv");
    EXPECT_EQ(to_string(mss::memory::hybrid_iswa), "hybrid_iswa");
}

}  // namespace
}  // namespace kvc
