// What the prefix cache's tests share (test_prefix_cache.cpp, test_prefix_tiers.cpp): a cache of
// fingerprint rows, where every K row is the fingerprint of the tokens that produced it, and an engine
// that decodes through it, so any hit can be checked against what it must hold.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <vector>

#include <gtest/gtest.h>
#include <xxhash.h>
#include <kvcache/batch.h>
#include <kvcache/kv_cache.h>

namespace kvc::prefix_test {

inline constexpr uint32_t bs = 4;  // tokens per block

inline kv_cache_params prefix_params(uint32_t kv_size, uint32_t n_seq_max) {
    kv_cache_params p;
    // no RoPE: a K-shift leaves rows as they are, so fingerprints survive it
    p.layers = {layer_desc{.n_head_kv = 1,
                           .n_embd_head_k = 4,
                           .n_embd_head_v = 4,
                           .rope = rope_params{.type = rope_type::none}}};
    p.type_k = p.type_v = dtype::f32;
    p.v_trans = false;
    p.kv_size = kv_size;
    p.n_seq_max = n_seq_max;
    p.n_kv_pad = 1;
    p.prefix = {.enabled = true, .block_size = bs};
    return p;
}

// 63 bits of the tokens [0, n) as three exact floats (21 bits each) and the position.
inline std::array<float, 4> fingerprint(const std::vector<token_t>& toks, size_t n) {
    const uint64_t h = XXH3_64bits(toks.data(), n * sizeof(token_t));
    return {static_cast<float>(n - 1), static_cast<float>(h & 0x1fffff),
            static_cast<float>((h >> 21) & 0x1fffff), static_cast<float>((h >> 42) & 0x1fffff)};
}

inline ubatch tokens_ub(seq_id_t s, pos_t p0, std::span<const token_t> toks) {
    ubatch u;
    u.n_tokens = static_cast<uint32_t>(toks.size());
    u.n_seq_tokens = 1;
    u.n_seqs = u.n_tokens;
    u.n_seqs_unq = 1;
    u.seq_id_unq = {s};
    u.seq_id_begin.push_back(0);
    for (size_t i = 0; i < toks.size(); ++i) {
        u.token.push_back(toks[i]);
        u.pos.push_back(p0 + static_cast<pos_t>(i));
        u.n_seq_id.push_back(1);
        u.seq_id_data.push_back(s);
        u.seq_id_begin.push_back(static_cast<uint32_t>(i + 1));
        u.output.push_back(0);
        u.batch_idx.push_back(static_cast<int32_t>(i));
    }
    return u;
}

// An engine whose "model" writes each token's fingerprint as its K and V rows.
struct engine {
    kv_cache c;
    std::vector<std::vector<token_t>> seqs;  // what each sequence has decoded (positions 0..)

    engine(uint32_t kv_size, uint32_t n_seq_max) : engine(prefix_params(kv_size, n_seq_max)) {}
    explicit engine(const kv_cache_params& p) : c(p), seqs(p.n_seq_max) {}

    // Decodes toks after what s holds; false (nothing changed) when they do not fit. With as_embd, the
    // ubatch carries embeddings (the engine's image or audio features) instead of the token ids.
    // A step applied and written but not moved past (the engine has not finished computing it); null if
    // it did not fit.
    memory_context_ptr start(seq_id_t s, std::span<const token_t> toks, bool as_embd = false) {
        auto& h = seqs[static_cast<size_t>(s)];
        const auto p0 = static_cast<pos_t>(h.size());
        ubatch ub = tokens_ub(s, p0, toks);
        if (as_embd) {
            ub.n_embd = 2;
            ub.embd.assign(size_t{ub.n_tokens} * 2, 0.5f);
            ub.token.clear();
        }
        auto ctx = c.init_ubatches({ub}, {});
        if (ctx->get_status() != memory_status::success) return nullptr;
        ctx->apply();
        std::vector<float> rows;
        for (token_t t : toks) {
            h.push_back(t);
            const auto f = fingerprint(h, h.size());
            rows.insert(rows.end(), f.begin(), f.end());
        }
        const auto view = const_tensor_view::contiguous(
            dtype::f32, reinterpret_cast<const std::byte*>(rows.data()), 4, toks.size());
        ctx->get_attn(0)->cpy_k(0, view);
        ctx->get_attn(0)->cpy_v(0, view);
        return ctx;
    }
    bool decode(seq_id_t s, std::span<const token_t> toks, bool as_embd = false) {
        memory_context_ptr ctx = start(s, toks, as_embd);
        if (!ctx) return false;
        ctx->next();  // past the last ubatch: the step is computed, its blocks are published
        return true;
    }
    uint32_t attach(seq_id_t s, const std::vector<token_t>& prompt) {
        const uint32_t n = c.prefix_cache()->prefix_attach(s, prompt);
        seqs[static_cast<size_t>(s)].assign(prompt.begin(), prompt.begin() + n);
        return n;
    }
    uint32_t stream(seq_id_t s) const { return c.params().unified ? 0 : static_cast<uint32_t>(s); }
    // Every cell of s holds the fingerprint of s's tokens up to its position.
    void check(seq_id_t s) const {
        const auto& h = seqs[static_cast<size_t>(s)];
        const kv_cells& cells = c.cells(stream(s));
        ASSERT_EQ(cells.seq_pos_max(s), static_cast<pos_t>(h.size()) - 1) << "seq " << s;
        std::vector<float> k(4);
        for (const auto& [pos, cell] : cells.seq_entries(s, -1, -1)) {
            c.read_row(kvc::kv_part::k, 0, stream(s), cell, k);
            const auto f = fingerprint(h, static_cast<size_t>(pos) + 1);
            ASSERT_TRUE(std::equal(k.begin(), k.end(), f.begin()))
                << "seq " << s << " position " << pos << " cell " << cell << " holds position " << k[0];
        }
    }
    // Cells are free, held by sequences, or cached; a cell no sequence holds is cached or empty.
    void check_cells() const {
        uint32_t with_seqs = 0, cached = 0, total = 0;
        for (uint32_t s = 0; s < c.get_n_stream(); ++s) {
            const kv_cells& cells = c.cells(s);
            cells.validate();
            total += cells.size();
            for (uint32_t i = 0; i < cells.size(); ++i) {
                if (cells.is_empty(i)) continue;
                if (cells.seq_count(i) > 0)
                    ++with_seqs;
                else
                    ASSERT_TRUE(cells.is_held(i))
                        << "stream " << s << " cell " << i << " leaked: used, no sequence, not cached";
                cached += cells.seq_count(i) == 0;
            }
        }
        const prefix_stats st = c.prefix_cache()->get_prefix_stats();
        ASSERT_EQ(st.cached_cells, cached);
        ASSERT_EQ(st.free_cells + with_seqs + cached, total);
    }
};

inline std::vector<token_t> seq_of(std::initializer_list<token_t> t) {
    return t;
}

}  // namespace kvc::prefix_test
