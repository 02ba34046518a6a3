// The synthetic engine of `kvcache replay` (replay_engine.h).
#include "replay_engine.h"

#include <vector>

#include <kvcache/batch.h>
#include <kvcache/kv_cache.h>
#include <kvcache/recurrent_engine.h>

namespace kvc::cli {
namespace {

uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// Deterministic K/V or state value of (layer, sequence set, position, dim, K/s or V/r) in [-1, 1).
float synth_value(uint32_t layer, uint64_t seq_key, pos_t pos, uint32_t dim, bool is_v) {
    uint64_t h = splitmix64(layer * 0x100000001b3ull ^ splitmix64(seq_key));
    h = splitmix64(h ^ (static_cast<uint64_t>(static_cast<uint32_t>(pos)) << 20) ^ (uint64_t{dim} << 1) ^
                   (is_v ? 1 : 0));
    return static_cast<float>(h >> 40) / static_cast<float>(1 << 23) - 1.0f;
}

// An attention layer: synthetic K/V rows of the ubatch's tokens.
void write_kv(kv_cache_context& kc, uint32_t il, std::span<const uint64_t> seq_key) {
    const ubatch& ub = kc.get_ubatch();
    const layer_desc& d = kc.cache().params().layers[il];
    const uint32_t e_k = d.n_head_kv * d.n_embd_head_k, e_v = d.n_head_kv * d.n_embd_head_v;
    std::vector<float> k(size_t{ub.n_tokens} * e_k), v(size_t{ub.n_tokens} * e_v);
    for (uint32_t t = 0; t < ub.n_tokens; ++t) {
        const uint64_t key = seq_key[static_cast<size_t>(ub.batch_idx[t])];
        for (uint32_t i = 0; i < e_k; ++i) k[t * e_k + i] = synth_value(il, key, ub.pos[t], i, false);
        for (uint32_t i = 0; i < e_v; ++i) v[t * e_v + i] = synth_value(il, key, ub.pos[t], i, true);
    }
    kc.cpy_k(il, const_tensor_view::contiguous(dtype::f32, reinterpret_cast<const std::byte*>(k.data()), e_k,
                                               ub.n_tokens));
    kc.cpy_v(il, const_tensor_view::contiguous(dtype::f32, reinterpret_cast<const std::byte*>(v.data()), e_v,
                                               ub.n_tokens));
}

// The recurrent layers: each token folds a synthetic value into the state, new = old / 2 + v, so that
// the state depends on the whole history.
void write_states(memory_recurrent_context& rc, std::span<const uint64_t> seq_key) {
    const ubatch& ub = rc.get_ubatch();
    run_recurrent_ubatch(rc, [&](uint32_t il, rs_tensor which, uint32_t tok, std::span<float> x) {
        const uint64_t key = seq_key[static_cast<size_t>(ub.batch_idx[tok])];
        for (size_t d = 0; d < x.size(); ++d)
            x[d] = 0.5f * x[d] +
                   synth_value(il, key, ub.pos[tok], static_cast<uint32_t>(d), which == rs_tensor::s);
    });
}

}  // namespace

uint64_t seq_set_key(std::span<const seq_id_t> seqs) {
    uint64_t key = 0;
    for (seq_id_t s : seqs) key = splitmix64(key ^ static_cast<uint64_t>(static_cast<uint32_t>(s)));
    return key;
}

void run_synthetic_ubatch(memory_context_i& ctx, uint32_t n_layer, std::span<const uint64_t> seq_key) {
    if (memory_recurrent_context* rc = ctx.get_recr()) write_states(*rc, seq_key);
    for (uint32_t il = 0; il < n_layer; ++il)
        if (kv_cache_context* kc = ctx.get_attn(il)) write_kv(*kc, il, seq_key);
}

}  // namespace kvc::cli
