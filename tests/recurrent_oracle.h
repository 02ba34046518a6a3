// The independent oracle of the recurrent engine contract (memory_recurrent.h and
// design/recurrent.md §4.6), for tests: `engine_step` follows the contract to the letter, with no code in
// common with the library's reference (recurrent_engine.h), which tests/test_recurrent_engine.cpp checks
// against it. States are hash chains of (sequence, position) filling whole rows, so a gather from the wrong
// row or plane, or a missed copy, shows up as a wrong value or a malformed row.
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <kvcache/batch.h>
#include <kvcache/memory_recurrent.h>

namespace kvc::test {

inline uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// The state after folding the token at position p of sequence s into state h (never 0: 0 is the fresh state).
inline uint64_t mix(uint64_t h, seq_id_t s, pos_t p) {
    return splitmix64(h ^ splitmix64((uint64_t{static_cast<uint32_t>(s)} << 32) | static_cast<uint32_t>(p))) |
           1u;
}

// A row holding state h: h in its first 8 bytes, then bytes that depend on (h, layer, tensor); state 0 is
// all zeros (what a zeroed row holds).
inline void fill_row(std::byte* row, size_t bytes, uint64_t h, uint32_t il, bool is_s) {
    if (h == 0) {
        std::memset(row, 0, bytes);
        return;
    }
    std::memcpy(row, &h, 8);
    for (size_t i = 8; i < bytes; ++i)
        row[i] =
            static_cast<std::byte>(splitmix64(h ^ (uint64_t{il} << 40) ^ (is_s ? 1ull << 39 : 0) ^ i) & 0xff);
}

// The state a row holds; fails the test when the row is not a well-formed state row.
inline uint64_t read_row(const std::byte* row, size_t bytes, uint32_t il, bool is_s) {
    uint64_t h = 0;
    std::memcpy(&h, row, 8);
    std::vector<std::byte> want(bytes);
    fill_row(want.data(), bytes, h, il, is_s);
    EXPECT_EQ(std::memcmp(want.data(), row, bytes), 0) << "row of layer " << il << (is_s ? " s" : " r");
    return h;
}

// Every (layer, tensor) of the memory, as (il, is_s).
inline std::vector<std::pair<uint32_t, bool>> tensors(const memory_recurrent& m) {
    std::vector<std::pair<uint32_t, bool>> out;
    for (uint32_t il : m.layer_ids()) {
        if (m.has_r(il)) out.emplace_back(il, false);
        if (m.has_s(il)) out.emplace_back(il, true);
    }
    return out;
}

inline tensor_view view_of(memory_recurrent& m, uint32_t il, bool is_s) {
    return is_s ? m.get_s(il) : m.get_r(il);
}

inline std::byte* row_ptr(const tensor_view& v, int64_t row) {
    return v.data + static_cast<size_t>(row) * v.nb[1];
}

// One applied ubatch, exactly as the contract in memory_recurrent.h says.
inline void engine_step(memory_recurrent& m, const rs_slot& sl, const ubatch& ub) {
    const uint32_t k = m.get_n_rs_seq(), T = ub.n_seq_tokens;
    for (const auto& [il, is_s] : tensors(m)) {
        const tensor_view v = view_of(m, il, is_s);
        const size_t bytes = v.row_bytes();
        // 1. the zero row
        if (sl.rs_z >= 0) std::memset(row_ptr(v, sl.rs_z), 0, bytes);
        // 2. gather everything before writing anything
        std::vector<std::vector<std::byte>> g(sl.n), hc(sl.hist_copy.size());
        for (uint32_t i = 0; i < sl.n; ++i)
            g[i].assign(row_ptr(v, sl.s_copy[i]), row_ptr(v, sl.s_copy[i]) + bytes);
        for (size_t j = 0; j < hc.size(); ++j)
            hc[j].assign(row_ptr(v, sl.hist_copy[j].src), row_ptr(v, sl.hist_copy[j].src) + bytes);
        // 3. extra cells move
        for (uint32_t i = sl.n_seqs; i < sl.n; ++i) std::memcpy(row_ptr(v, sl.head + i), g[i].data(), bytes);
        // 4. main cells compute
        for (uint32_t b = 0; b < sl.n_seqs; ++b) {
            uint64_t h = read_row(g[b].data(), bytes, il, is_s);
            std::vector<uint64_t> after(T);
            for (uint32_t t = 0; t < T; ++t)
                after[t] = h = mix(h, ub.primary_seq(b * T + t), ub.pos[b * T + t]);
            fill_row(row_ptr(v, sl.head + b), bytes, after[T - 1], il, is_s);
            for (uint32_t r = 1; r <= k && r < T; ++r)
                fill_row(row_ptr(v, int64_t{r} * m.get_size() + sl.head + b), bytes, after[T - 1 - r], il,
                         is_s);
        }
        // 5. history copies
        for (size_t j = 0; j < hc.size(); ++j)
            std::memcpy(row_ptr(v, sl.hist_copy[j].dst), hc[j].data(), bytes);
    }
}

// The slot of rc's applied ubatch as an engine sees it: rebuilt from the context's accessors.
inline rs_slot slot_of(const memory_recurrent_context& rc) {
    rs_slot sl;
    sl.head = rc.get_head();
    sl.n = rc.get_n_rs();
    sl.n_seqs = rc.get_ubatch().n_seqs;
    sl.rs_z = rc.get_rs_z();
    for (uint32_t i = 0; i < sl.n; ++i) sl.s_copy.push_back(rc.s_copy(i));
    sl.hist_copy.assign(rc.hist_copies().begin(), rc.hist_copies().end());
    return sl;
}

// The logical state of seq s (0: none), checked in every tensor.
inline uint64_t state_of(memory_recurrent& m, seq_id_t s) {
    const int32_t c = m.seq_tail(s);
    if (c < 0) return 0;
    const auto info = m.cell(static_cast<uint32_t>(c));
    const int64_t row = int64_t{info.rs_idx} * m.get_size() + c;
    uint64_t h = 0;
    bool first = true;
    for (const auto& [il, is_s] : tensors(m)) {
        const tensor_view v = view_of(m, il, is_s);
        const uint64_t x = read_row(row_ptr(v, row), v.row_bytes(), il, is_s);
        if (!first) {
            EXPECT_EQ(x, h) << "seq " << s << " layer " << il;
        }
        h = x;
        first = false;
    }
    return h;
}

}  // namespace kvc::test
