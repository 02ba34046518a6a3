// Helpers of the kv_cache tests: a one-layer cache, hand-made ubatches and slots, and the test peer that
// places ubatches at chosen cells.
#pragma once

#include <algorithm>
#include <limits>
#include <vector>

#include <kvcache/kv_cache.h>

namespace kvc {

// What an engine cannot do through a context, for tests that draw cells exactly as the design notes'
// examples do: place a ubatch at chosen cells, ask find_slot or n_kv alone, mask a ubatch not placed.
// (kv_cache's friend; everything else here goes through contexts.)
struct kv_cache_test_access {
    static void place(kv_cache& c, const slot_info& s, const ubatch& ub) {
        c.check_ubatch(ub);
        c.apply_ubatch(s, ub);
    }
    static slot_info find_slot(const kv_cache& c, const ubatch& ub, bool cont = false) {
        c.check_ubatch(ub);
        return c.find_slot(ub, cont);
    }
    static uint32_t n_kv(const kv_cache& c, const slot_info& s) { return c.get_n_kv(s); }
    static void mask(const kv_cache& c, tensor_view dst, const ubatch& ub, uint32_t n_kv, bool causal) {
        c.set_input_kq_mask(dst, ub, n_kv, {.causal = causal});
    }
    // A batch context over ub placed at the slot's cells, applied.
    static memory_context_ptr placed(kv_cache& c, const slot_info& s, const ubatch& ub) {
        c.check_ubatch(ub);
        memory_context_ptr ctx(new kv_cache_context(c, {ub}, {s}, {}));
        ctx->apply();
        return ctx;
    }
};

using peer = kv_cache_test_access;

// One layer, 2 KV heads of 4 values (E = 8), normal RoPE.
inline kv_cache_params small_params(uint32_t kv_size, uint32_t n_seq_max = 1) {
    kv_cache_params p;
    p.layers = {layer_desc{.n_head_kv = 2, .n_embd_head_k = 4, .n_embd_head_v = 4}};
    p.type_k = dtype::f32;
    p.type_v = dtype::f32;
    p.kv_size = kv_size;
    p.n_seq_max = n_seq_max;
    return p;
}

// A ubatch of single-sequence tokens (seq ids given per token), positions given.
inline ubatch make_ub(std::vector<pos_t> pos, std::vector<seq_id_t> seqs, uint32_t n_pos = 1) {
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

inline slot_info slot(std::vector<uint32_t> cells, uint32_t stream = 0) {
    slot_info s;
    s.s0 = s.s1 = stream;
    s.strm = {stream};
    s.idxs = {std::move(cells)};
    return s;
}

// Places tokens of one sequence at the given cells.
inline void place(kv_cache& c, std::vector<uint32_t> cells, std::vector<pos_t> pos, seq_id_t s = 0) {
    std::vector<seq_id_t> seqs(pos.size(), s);  // before pos is moved from
    peer::place(c, slot(std::move(cells)), make_ub(std::move(pos), std::move(seqs)));
}

inline std::vector<float> mask_of(const kv_cache& c, const ubatch& ub, uint32_t n_kv, bool causal = true) {
    std::vector<float> m(size_t{n_kv} * ub.n_tokens);
    peer::mask(c,
               tensor_view::contiguous(dtype::f32, reinterpret_cast<std::byte*>(m.data()), n_kv, ub.n_tokens),
               ub, n_kv, causal);
    return m;
}

inline constexpr float ninf = -std::numeric_limits<float>::infinity();

}  // namespace kvc
