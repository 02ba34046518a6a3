// Helpers shared by the state and session tests: caches filled with random rows, their whole state.
#pragma once

#include <random>
#include <vector>

#include <gtest/gtest.h>
#include <kvcache/kv_cache.h>
#include <kvcache/state.h>

namespace kvc::test {

inline ubatch make_ub(std::vector<pos_t> pos, seq_id_t s, uint32_t n_pos = 1) {
    ubatch u;
    u.n_tokens = static_cast<uint32_t>(pos.size() / n_pos);
    u.n_seq_tokens = 1;
    u.n_seqs = u.n_tokens;
    u.n_pos = n_pos;
    u.pos = std::move(pos);
    for (uint32_t i = 0; i <= u.n_tokens; ++i) u.seq_id_begin.push_back(i);
    u.n_seq_id.assign(u.n_tokens, 1);
    u.seq_id_data.assign(u.n_tokens, s);
    u.output.assign(u.n_tokens, 0);
    u.seq_id_unq = {s};
    u.n_seqs_unq = 1;
    return u;
}

// Places n tokens of s (positions from p0) as an engine does (a context) and writes random K/V rows.
inline void decode(kv_cache& c, seq_id_t s, pos_t p0, uint32_t n, std::mt19937& rng, uint32_t n_pos = 1) {
    std::vector<pos_t> pos(size_t{n} * n_pos, 0);
    for (uint32_t i = 0; i < n; ++i) {
        pos[i] = p0 + static_cast<pos_t>(i);
        if (n_pos >= 3) pos[i + n] = static_cast<pos_t>(i % 3), pos[i + 2 * n] = static_cast<pos_t>(i % 2);
    }
    auto ctx = c.init_ubatches({make_ub(pos, s, n_pos)}, {});
    ASSERT_EQ(ctx->get_status(), memory_status::success);
    ctx->apply();
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (uint32_t il : c.layer_ids()) {
        const layer_desc& d = c.params().layers[il];
        for (bool is_v : {false, true}) {
            const uint32_t e = d.n_head_kv * (is_v ? d.n_embd_head_v : d.n_embd_head_k);
            std::vector<float> rows(size_t{e} * n);
            for (float& x : rows) x = normal(rng);
            const auto view = const_tensor_view::contiguous(
                dtype::f32, reinterpret_cast<const std::byte*>(rows.data()), e, n);
            if (is_v)
                ctx->get_attn(il)->cpy_v(il, view);
            else
                ctx->get_attn(il)->cpy_k(il, view);
        }
    }
}

inline kv_cache_params params_for(dtype tk, dtype tv, bool v_trans, bool unified, uint32_t n_seq_max = 4) {
    kv_cache_params p;
    p.layers = {layer_desc{.n_head_kv = 2, .n_embd_head_k = 32, .n_embd_head_v = 32},
                layer_desc{.n_head_kv = 1, .n_embd_head_k = 64, .n_embd_head_v = 32}};
    p.type_k = tk;
    p.type_v = tv;
    p.v_trans = v_trans;
    p.unified = unified;
    p.kv_size = 64;
    p.n_seq_max = n_seq_max;
    return p;
}

inline std::vector<uint8_t> whole(const kv_cache& c) {
    return state_seq_get_data(c, seq_all);
}

}  // namespace kvc::test
