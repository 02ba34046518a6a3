#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <kvcache/kv_cache.h>
#include <kvcache/state.h>

#include "detail/copy.h"
#include "state_test_util.h"

namespace kvc {
namespace {

using namespace kvc::test;

// Restoring `bytes` into dest must fail with an error containing `want` and leave c byte for byte as it was.
void expect_rejected(kv_cache& c, std::span<const uint8_t> bytes, seq_id_t dest, const std::string& want) {
    const auto before = whole(c);
    try {
        state_seq_set_data(c, bytes, dest);
        ADD_FAILURE() << "accepted, expected: " << want;
    } catch (const error& e) {
        EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
    EXPECT_EQ(whole(c), before) << "after: " << want;
}

// The streaming copy (large state runs) copies exactly, whatever the alignment and length: the line
// before alignment, whole four-page blocks, the tail.
TEST(state, streaming_copy_is_exact) {
    std::mt19937 rng(3);
    std::vector<uint8_t> src(size_t{3} << 20), dst(src.size() + 64);
    for (auto& b : src) b = static_cast<uint8_t>(rng());
    for (const size_t n : {size_t{0}, size_t{1}, size_t{63}, size_t{16383}, size_t{16384}, size_t{1} << 20,
                           (size_t{1} << 20) + 4097, src.size() - 5})
        for (const size_t a : {size_t{0}, size_t{1}, size_t{17}}) {
            std::fill(dst.begin(), dst.end(), uint8_t{0xee});
            detail::copy_streaming(dst.data() + a, src.data() + 5, n);
            ASSERT_EQ(std::memcmp(dst.data() + a, src.data() + 5, n), 0) << n << " at +" << a;
            ASSERT_EQ(dst[a + n], 0xee) << "wrote past the end: " << n << " at +" << a;
            if (a > 0) {
                ASSERT_EQ(dst[a - 1], 0xee) << "wrote before the start: " << n << " at +" << a;
            }
        }
}

TEST(state, b6_per_sequence_buffer_is_byte_exact) {
    kv_cache_params p;
    p.layers = {layer_desc{.n_head_kv = 1, .n_embd_head_k = 8, .n_embd_head_v = 8}};
    p.type_k = dtype::f16;
    p.type_v = dtype::f16;
    p.v_trans = false;
    p.kv_size = 16;
    p.n_seq_max = 3;
    kv_cache c(p);
    c.init_ubatches({make_ub({0, 1, 2, 3}, 0)}, {})->apply();  // seq 2 goes to cells 4 and 5
    auto ctx = c.init_ubatches({make_ub({0, 1}, 2)}, {});
    ctx->apply();
    ASSERT_EQ(ctx->get_attn(0)->get_sinfo().idxs[0], (std::vector<uint32_t>{4, 5}));
    std::vector<float> rows(16);
    for (size_t i = 0; i < 16; ++i) rows[i] = static_cast<float>(i);
    const auto view =
        const_tensor_view::contiguous(dtype::f32, reinterpret_cast<const std::byte*>(rows.data()), 8, 2);
    ctx->get_attn(0)->cpy_k(0, view);
    ctx->get_attn(0)->cpy_v(0, view);
    const auto buf = state_seq_get_data(c, 2);
    ASSERT_EQ(buf.size(), 136u);
    EXPECT_EQ(state_seq_get_size(c, 2), 136u);
    size_t at = 0;
    const auto u32 = [&] {
        uint32_t v;
        std::memcpy(&v, buf.data() + at, 4);
        at += 4;
        return v;
    };
    EXPECT_EQ(u32(), 0xaf143cd8u);  // io magic
    EXPECT_EQ(u32(), 2u);           // source seq
    EXPECT_EQ(u32(), 1u);           // n_stream
    EXPECT_EQ(u32(), 2u);           // cell_count
    EXPECT_EQ(u32(), 0u);           // cell 4: pos 0, 1 seq id, seq 2
    EXPECT_EQ(u32(), 1u);
    EXPECT_EQ(u32(), 2u);
    EXPECT_EQ(u32(), 1u);  // cell 5: pos 1
    EXPECT_EQ(u32(), 1u);
    EXPECT_EQ(u32(), 2u);
    EXPECT_EQ(u32(), 0u);  // v_trans
    EXPECT_EQ(u32(), 1u);  // n_layer
    EXPECT_EQ(u32(), 1u);  // K type f16
    uint64_t row;
    std::memcpy(&row, buf.data() + at, 8);
    at += 8;
    EXPECT_EQ(row, 16u);
    uint16_t h;
    std::memcpy(&h, buf.data() + at + 2 * 9, 2);  // K of token 1, dim 1 = 9.0
    EXPECT_EQ(fp16_to_fp32(h), 9.0f);
    at += 32;
    EXPECT_EQ(u32(), 1u);  // V type f16
    std::memcpy(&row, buf.data() + at, 8);
    EXPECT_EQ(row, 16u);
    EXPECT_EQ(at + 8 + 32, 136u);
}

struct layout_case {
    dtype tk, tv;
    bool v_trans, unified;
};

TEST(state, whole_memory_round_trips_for_every_type_and_layout) {
    const layout_case cases[] = {
        {dtype::f32, dtype::f32, true, true},     {dtype::f16, dtype::f16, true, true},
        {dtype::bf16, dtype::bf16, false, true},  {dtype::q8_0, dtype::q8_0, false, true},
        {dtype::q4_0, dtype::q4_0, false, false}, {dtype::q8_0, dtype::f16, true, false},
        {dtype::f16, dtype::q4_0, false, false},
    };
    std::mt19937 rng(1);
    for (const layout_case& lc : cases) {
        kv_cache a(params_for(lc.tk, lc.tv, lc.v_trans, lc.unified));
        decode(a, 0, 0, 5, rng);
        decode(a, 2, 0, 9, rng);
        decode(a, 3, 0, 1, rng);
        if (lc.unified) a.seq_cp(2, 1, 3, 7);
        const auto bytes = whole(a);
        kv_cache b(params_for(lc.tk, lc.tv, lc.v_trans, lc.unified));
        decode(b, 1, 0, 3, rng);  // replaced by the restore
        EXPECT_EQ(state_seq_set_data(b, bytes, seq_all), bytes.size());
        EXPECT_EQ(whole(b), bytes) << to_string(lc.tk) << "/" << to_string(lc.tv);
        for (seq_id_t s = 0; s < 4; ++s) {
            EXPECT_EQ(b.seq_pos_min(s), a.seq_pos_min(s));
            EXPECT_EQ(b.seq_pos_max(s), a.seq_pos_max(s));
        }
        // and the restored memory takes new tokens where they belong
        decode(b, 0, 5, 2, rng);
        EXPECT_EQ(b.seq_pos_max(0), 6);
    }
}

TEST(state, a_sequence_restores_into_any_destination) {
    std::mt19937 rng(2);
    for (bool unified : {true, false}) {
        kv_cache a(params_for(dtype::f16, dtype::f16, true, unified));
        decode(a, 1, 0, 7, rng);
        decode(a, 0, 0, 3, rng);
        const auto seq1 = state_seq_get_data(a, 1);
        kv_cache b(params_for(dtype::f16, dtype::f16, true, unified));
        decode(b, 3, 0, 2, rng);  // dest's old contents go
        decode(b, 2, 0, 4, rng);  // others stay
        state_seq_set_data(b, seq1, 3);
        EXPECT_EQ(b.seq_pos_min(3), 0);
        EXPECT_EQ(b.seq_pos_max(3), 6);
        EXPECT_EQ(b.seq_pos_max(2), 3);
        // the restored rows are the saved ones: moved back into seq 1 of a fresh cache, the payload is
        // the one that was saved (cells and streams may differ in between)
        kv_cache c(params_for(dtype::f16, dtype::f16, true, unified));
        state_seq_set_data(c, state_seq_get_data(b, 3), 1);
        EXPECT_EQ(state_seq_get_data(c, 1), seq1);
        // empty sequences save and restore as empty
        const auto empty = state_seq_get_data(a, 2);
        state_seq_set_data(b, empty, 2);
        EXPECT_EQ(b.seq_pos_max(2), -1);
    }
}

// Regression (issue 21): a restore with flags 0xFFFFFFFF was accepted. Unknown flag bits are refused on
// every read and write, naming the bits, and the memory stays as it was.
TEST(state, unknown_flag_bits_are_refused_both_ways) {
    std::mt19937 rng(3);
    kv_cache a(params_for(dtype::f16, dtype::f16, true, true));
    decode(a, 0, 0, 4, rng);
    const auto saved = state_seq_get_data(a, 0);
    const auto before = state_seq_get_data(a, seq_all);
    for (const state_seq_flags bad : {state_seq_flags{2}, state_seq_flags{0xffffffff}}) {
        EXPECT_THROW((void)state_seq_get_size(a, 0, bad), error);
        EXPECT_THROW((void)state_seq_get_data(a, 0, bad), error);
        try {
            state_seq_set_data(a, saved, 1, bad);
            ADD_FAILURE() << "flags " << bad << " accepted";
        } catch (const error& e) {
            EXPECT_NE(std::string(e.what()).find("are no state_seq_flag"), std::string::npos) << e.what();
        }
        EXPECT_EQ(state_seq_get_data(a, seq_all), before);
    }
    state_seq_set_data(a, saved, 1,
                       state_seq_flag_partial_only);  // the known flag (ignored by a plain cache)
    EXPECT_EQ(a.seq_pos_max(1), 3);
}

TEST(state, swa_and_mrope_states) {
    std::mt19937 rng(3);
    auto p = params_for(dtype::f16, dtype::f16, false, true);
    p.swa = swa_type::standard;
    p.n_swa = 4;
    kv_cache a(p);
    decode(a, 0, 0, 10, rng);
    // a sequence's state keeps only the cells it still sees (positions 6..9) plus one (5: bound pos_max)
    const auto seq0 = state_seq_get_data(a, 0);
    kv_cache b(p);
    state_seq_set_data(b, seq0, 0);
    EXPECT_EQ(b.seq_pos_min(0), 6) << "masked at the bound pos_max = 9: 9 - 5 >= 4";
    EXPECT_EQ(b.seq_pos_max(0), 9);

    auto m = params_for(dtype::f32, dtype::f32, true, true);
    m.n_pos = 4;
    kv_cache c(m);
    decode(c, 1, 0, 6, rng, 4);
    const auto all = whole(c);
    kv_cache d(m);
    state_seq_set_data(d, all, seq_all);
    EXPECT_EQ(whole(d), all);
    EXPECT_EQ(d.cells(0).ext_get(1), c.cells(0).ext_get(1));
    const auto seq1 = state_seq_get_data(c, 1);
    kv_cache e(m);
    state_seq_set_data(e, seq1, 2);
    std::vector<uint32_t> cells;
    e.cells(0).seq_cells(2, 4, 5, cells);
    ASSERT_EQ(cells.size(), 1u);
    EXPECT_EQ(e.cells(0).ext_get(cells[0]), (cell_ext{0, 1})) << "pos 4: x = 4 % 2, y = 4 % 3";
}

TEST(state, many_sequences_and_streams) {
    std::mt19937 rng(4);
    auto p = params_for(dtype::f16, dtype::f16, true, false, 40);
    p.kv_size = 16;
    kv_cache a(p);
    for (seq_id_t s = 0; s < 40; s += 3) decode(a, s, 0, 1 + static_cast<uint32_t>(s % 5), rng);
    const auto all = whole(a);
    kv_cache b(p);
    state_seq_set_data(b, all, seq_all);
    EXPECT_EQ(whole(b), all) << "every stream is restored (design D2)";
}

TEST(state, a_pending_shift_is_saved_as_applied) {
    // design D8: restore-then-attend equals attend-without-restore after a seq_add
    std::mt19937 rng(5);
    auto p = params_for(dtype::q8_0, dtype::f16, true, true);
    for (layer_desc& l : p.layers) l.rope = {.type = rope_type::neox};
    kv_cache a(p);
    decode(a, 0, 0, 12, rng);
    a.seq_rm(0, 0, 4);
    a.seq_add(0, 4, -1, -4);
    ASSERT_TRUE(a.get_has_shift());
    const auto saved = whole(a);
    a.update();
    EXPECT_EQ(whole(a), saved) << "the saved keys are the keys after the shift";
    kv_cache b(p);
    state_seq_set_data(b, saved, seq_all);
    EXPECT_FALSE(b.get_has_shift());
    EXPECT_EQ(whole(b), whole(a));
}

TEST(state, every_truncation_and_corruption_is_rejected_without_change) {
    std::mt19937 rng(6);
    const auto p = params_for(dtype::q8_0, dtype::f16, true, true);
    kv_cache a(p);
    decode(a, 0, 0, 3, rng);
    decode(a, 1, 0, 2, rng);
    const auto all = whole(a);
    const auto seq1 = state_seq_get_data(a, 1);
    kv_cache b(p);
    decode(b, 2, 0, 4, rng);
    const auto before = whole(b);
    for (size_t n = 0; n < all.size(); ++n) {
        EXPECT_THROW(state_seq_set_data(b, std::span(all.data(), n), seq_all), error) << n;
        ASSERT_EQ(whole(b), before) << "truncated at " << n;
    }
    for (size_t n = 0; n < seq1.size(); ++n) {
        EXPECT_THROW(state_seq_set_data(b, std::span(seq1.data(), n), 2), error) << n;
        ASSERT_EQ(whole(b), before) << "truncated at " << n;
    }
    auto longer = all;
    longer.push_back(0);
    expect_rejected(b, longer, seq_all, "1 trailing bytes");
    const auto corrupt = [&](size_t at, uint32_t value, const char* want) {
        auto bad = all;
        std::memcpy(bad.data() + at, &value, 4);
        expect_rejected(b, bad, seq_all, want);
    };
    corrupt(0, 0x12345678, "not a sequence state");
    corrupt(8, 2, "the state has 2 streams");
    corrupt(12, 1000, "holds 1000 cells");
    corrupt(16, static_cast<uint32_t>(-5), "has position -5");
    corrupt(24, 9, "seq_id 9 not in [0, 4)");
    // whole-memory data: after 5 cells of meta (cell: pos, n, id -> 12 bytes) come v_trans and n_layer
    const size_t data_at = 16 + 5 * 12;
    corrupt(data_at, 0, "V is not transposed");
    corrupt(data_at + 4, 3, "the state has 3 layers");
    corrupt(data_at + 8, 1, "layer 0 K type 1");
    // a whole-memory state with shared cells cannot go into one sequence: cells list two ids
    kv_cache shared(p);
    decode(shared, 0, 0, 2, rng);
    shared.seq_cp(0, 1, -1, -1);
    expect_rejected(b, whole(shared), 2, "has 2 sequence ids");
    EXPECT_EQ(whole(b), before);
}

// >= 10,000 random single-byte corruptions of a whole-memory state and of a sequence's state: each is
// rejected with the memory unchanged, or accepted and leaves a valid memory that saves what was loaded.
TEST(state, random_byte_corruptions_are_rejected_or_give_a_valid_memory) {
    std::mt19937 rng(61);
    for (const bool unified : {true, false}) {
        const auto p = params_for(dtype::q8_0, dtype::f16, true, unified);
        kv_cache a(p);
        decode(a, 0, 0, 3, rng);
        decode(a, 1, 4, 2, rng);
        if (unified) a.seq_cp(0, 2, 1, 3);
        const auto all = whole(a);
        const auto seq1 = state_seq_get_data(a, 1);
        kv_cache b(p);
        decode(b, 3, 0, 4, rng);
        const auto before = whole(b);
        size_t accepted = 0, rejected = 0;
        for (int i = 0; i < 6000; ++i) {
            const bool one = i % 2 == 1;
            auto bad = one ? seq1 : all;
            const size_t at = std::uniform_int_distribution<size_t>(0, bad.size() - 1)(rng);
            bad[at] ^= static_cast<uint8_t>(std::uniform_int_distribution<int>(1, 255)(rng));
            const seq_id_t dest = one ? 3 : seq_all;
            try {
                state_seq_set_data(b, bad, dest);
            } catch (const error&) {
                ++rejected;
                ASSERT_EQ(whole(b), before) << "rejected corruption at byte " << at << " changed the memory";
                continue;
            }
            ++accepted;  // only data bytes and harmless metadata get here
            for (uint32_t s = 0; s < b.get_n_stream(); ++s) ASSERT_NO_THROW(b.cells(s).validate()) << at;
            kv_cache c(p);
            if (!one) {
                state_seq_set_data(c, whole(b), seq_all);
                ASSERT_EQ(whole(c), whole(b)) << "corruption at byte " << at;
            }
            state_seq_set_data(b, before, seq_all);
        }
        EXPECT_GT(accepted, 0u);
        EXPECT_GT(rejected, 0u);
    }
}

TEST(state, buffers_into_caller_memory_and_raw_payloads) {
    std::mt19937 rng(12);
    const auto p = params_for(dtype::f16, dtype::f16, true, true);
    kv_cache a(p);
    decode(a, 0, 0, 4, rng);
    const auto buf = state_seq_get_data(a, 0);
    std::vector<uint8_t> into(buf.size() + 10, 0xee);
    EXPECT_EQ(state_seq_get_data(a, 0, std::span(into)), buf.size());
    EXPECT_TRUE(std::equal(buf.begin(), buf.end(), into.begin()));
    try {
        state_seq_get_data(a, 0, std::span(into.data(), buf.size() - 1));
        ADD_FAILURE() << "a buffer one byte short was accepted";
    } catch (const error& e) {
        EXPECT_EQ(e.code(), errc::out_of_range);
    }
    // the payload alone (what llama.cpp's 'ggsq' files and other engines keep) restores the same way
    const std::span<const uint8_t> payload(buf.data() + 8, buf.size() - 8);
    kv_cache b(p);
    EXPECT_EQ(state_set_payload(b, payload, 2), payload.size());
    EXPECT_EQ(b.seq_pos_max(2), 3);
    std::vector<uint8_t> longer(payload.begin(), payload.end());
    longer.push_back(7);
    const auto before = whole(b);
    try {
        state_set_payload(b, longer, 1);
        ADD_FAILURE() << "a trailing byte was accepted";
    } catch (const error& e) {
        EXPECT_NE(std::string(e.what()).find("1 trailing bytes after the state at byte"), std::string::npos)
            << e.what();
    }
    EXPECT_EQ(whole(b), before);
}

TEST(state, a_whole_memory_state_of_several_sequences_is_not_one_sequence) {
    std::mt19937 rng(9);
    const auto p = params_for(dtype::f16, dtype::f16, true, true);
    kv_cache a(p);
    decode(a, 0, 0, 2, rng);
    decode(a, 1, 0, 2, rng);
    kv_cache b(p);
    expect_rejected(b, whole(a), 2, "cells of seq 0 and seq 1");
    kv_cache one(p);
    decode(one, 3, 0, 2, rng);
    EXPECT_NO_THROW(state_seq_set_data(b, whole(one), 2)) << "one sequence's cells are fine";
    EXPECT_EQ(b.seq_pos_max(2), 1);
}

TEST(state, duplicate_ids_in_a_cell_are_rejected) {
    std::mt19937 rng(8);
    const auto p = params_for(dtype::f16, dtype::f16, true, true);
    kv_cache a(p);
    decode(a, 0, 0, 1, rng);
    a.seq_cp(0, 1, -1, -1);
    auto bytes = whole(a);  // cell 0: pos 0, 2 ids (0, 1) at bytes 24 and 28
    const int32_t zero = 0;
    std::memcpy(bytes.data() + 28, &zero, 4);
    kv_cache b(p);
    expect_rejected(b, bytes, seq_all, "lists seq_id 0 twice");
    EXPECT_EQ(b.cells(0).get_used(), 0u);
}

TEST(state, no_room_for_a_sequence_leaves_the_destination_as_it_was) {
    std::mt19937 rng(7);
    auto p = params_for(dtype::f16, dtype::f16, true, true);
    p.kv_size = 16;
    kv_cache a(p);
    decode(a, 0, 0, 12, rng);
    const auto seq0 = state_seq_get_data(a, 0);
    kv_cache b(p);
    decode(b, 1, 0, 3, rng);
    decode(b, 2, 0, 10, rng);
    const auto before = whole(b);
    EXPECT_THROW(state_seq_set_data(b, seq0, 1), error);  // 12 cells, 6 free once seq 1 goes
    EXPECT_EQ(whole(b), before);
}

// The error of restoring `bytes` into dest, read from memory (cells decoded from one span) and, when
// `file` is set, field by field from a file (io_file_reader); "" when accepted.
std::string restore_error(kv_cache& c, std::span<const uint8_t> bytes, seq_id_t dest, const char* file) {
    try {
        if (file == nullptr) {
            state_seq_set_data(c, bytes, dest);
        } else {
            {
                std::FILE* f = std::fopen(file, "wb");
                EXPECT_NE(f, nullptr);
                EXPECT_EQ(std::fwrite(bytes.data(), 1, bytes.size(), f), bytes.size());
                std::fclose(f);
            }
            io_file_reader r(file);
            uint32_t header[2];
            r.read(header, 8);  // magic and source id, as state_seq_set_data skips them
            c.state_read(r, dest, 0);
        }
    } catch (const error& e) {
        std::string what = e.what();
        if (file != nullptr && what.starts_with(fmt::format("'{}' truncated", file)))
            what.replace(0, std::strlen(file) + 2, "state:");  // the file reader names the file
        return what;
    }
    return "";
}

// Regression: the cells of a one-sequence state are decoded from one span when the reader holds the
// bytes; errors, their byte offsets and the memory left must be those of reading field by field.
TEST(state, a_sequence_state_fails_alike_from_memory_and_field_by_field) {
    std::mt19937 rng(13);
    const std::string file = ::testing::TempDir() + "kvc_state_fields.bin";
    for (const uint32_t n_pos : {1u, 4u}) {
        auto p = params_for(dtype::f16, dtype::f16, true, true);
        p.n_pos = n_pos;
        kv_cache a(p);
        decode(a, 1, 0, 5, rng, n_pos);
        const auto seq1 = state_seq_get_data(a, 1);
        kv_cache b(p);
        decode(b, 2, 0, 4, rng, n_pos);
        const auto before = whole(b);
        const size_t stride = n_pos > 1 ? 20 : 12;  // pos, n_ids, [x, y], id
        const auto check = [&](const std::vector<uint8_t>& bytes, const std::string& want) {
            const std::string from_memory = restore_error(b, bytes, 2, nullptr);
            EXPECT_EQ(whole(b), before) << from_memory;
            const std::string from_file = restore_error(b, bytes, 2, file.c_str());
            EXPECT_EQ(whole(b), before) << from_file;
            EXPECT_EQ(from_memory, from_file);
            EXPECT_NE(from_memory.find(want), std::string::npos) << from_memory;
        };
        const auto with = [&](size_t at, int32_t value) {
            auto bytes = seq1;
            std::memcpy(bytes.data() + at, &value, 4);
            return bytes;
        };
        for (size_t j : {size_t{0}, size_t{3}, size_t{4}}) {
            const size_t cell = 16 + j * stride;
            check(with(cell, -3),
                  fmt::format("at byte {}: cell {} of stream 0 has position -3", cell + 4, j));
            check(with(cell + 4, 2),
                  fmt::format("at byte {}: cell {} has 2 sequence ids", cell + stride - 4, j));
            check(with(cell + 4, 0), fmt::format("cell {} has 0 sequence ids", j));
            if (j > 0)
                check(with(cell + stride - 4, 3),
                      fmt::format("at byte {}: cells of seq 1 and seq 3", cell + stride));
        }
        // truncated within the cells: read field by field either way
        for (size_t n = 17; n < 16 + 5 * stride; n += 3)
            check(std::vector<uint8_t>(seq1.begin(), seq1.begin() + static_cast<std::ptrdiff_t>(n)),
                  "truncated");
        // a good state is read alike too
        EXPECT_EQ(restore_error(b, seq1, 2, file.c_str()), "");
        const auto by_file = whole(b);
        EXPECT_EQ(restore_error(b, seq1, 2, nullptr), "");
        EXPECT_EQ(whole(b), by_file);
    }
    std::remove(file.c_str());
}

// Regression: a sequence restored into a cache without SWA is placed by a shortcut (room counted before
// anything changes, find_slot's search, empty cells filled in place). An SWA cache whose window never
// masks anything takes find_slot + apply_ubatch with a snapshot: both must choose the same cells, move
// the head alike and refuse alike.
TEST(state, a_sequence_is_placed_as_find_slot_places_it) {
    std::mt19937 rng(14);
    for (const bool unified : {true, false}) {
        auto p = params_for(dtype::f16, dtype::f16, false, unified);
        p.kv_size = 16;
        auto w = p;
        w.swa = swa_type::standard;
        w.n_swa = 1 << 30;
        kv_cache fast(p), slow(w);
        for (kv_cache* c : {&fast, &slow}) {
            std::mt19937 same(15);
            decode(*c, 0, 0, 5, same);
            decode(*c, 1, 0, 3, same);
            decode(*c, 0, 5, 2, same);
            decode(*c, 2, 0, 4, same);
            c->seq_rm(0, 1, 3);                  // holes below the head
            if (unified) c->seq_cp(2, 0, 0, 2);  // cells shared by 0 and 2 stay when 0 is replaced
        }
        ASSERT_EQ(whole(fast), whole(slow));
        kv_cache src(p);
        for (const uint32_t n : {1u, 3u, 6u, 9u, 12u}) {
            src.clear(true);
            decode(src, 3, 10, n, rng);
            const auto state = state_seq_get_data(src, 3);
            const std::string e_fast = restore_error(fast, state, 0, nullptr);
            const std::string e_slow = restore_error(slow, state, 0, nullptr);
            EXPECT_EQ(e_fast, e_slow) << n;
            ASSERT_EQ(whole(fast), whole(slow)) << n << " cells: " << e_fast;
            const uint32_t s = fast.seq_to_stream(0);
            EXPECT_EQ(fast.cells(s).picture(), slow.cells(s).picture()) << n;
            EXPECT_EQ(fast.head(s), slow.head(s)) << n;
            ASSERT_NO_THROW(fast.cells(s).validate());
        }
        if (!unified) continue;  // seq 0 has its stream to itself: 16 cells always fit
        // refused when even the destination's own cells do not make room, changing nothing
        src.clear(true);
        decode(src, 3, 0, 16, rng);
        const auto full = state_seq_get_data(src, 3);
        const auto before = whole(fast);
        const std::string e = restore_error(fast, full, 0, nullptr);
        EXPECT_NE(e.find("no room for the 16 cells"), std::string::npos) << e;
        EXPECT_EQ(e, restore_error(slow, full, 0, nullptr));
        EXPECT_EQ(whole(fast), before);
        EXPECT_EQ(whole(slow), before);
    }
}

}  // namespace
}  // namespace kvc
