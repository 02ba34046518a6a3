// Small caches the state fuzzers restore into, and the seed corpus they start from.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <kvcache/kv_cache.h>
#include <kvcache/state.h>

namespace kvc::fuzz {

inline constexpr int n_variants = 4;

// f16 transposed / q8_0+q4_0 rows, unified / per-sequence streams; variant 3 has M-RoPE cells.
inline kv_cache_params shape(int variant) {
    kv_cache_params p;
    p.layers = {layer_desc{.n_head_kv = 1, .n_embd_head_k = 32, .n_embd_head_v = 32}};
    p.kv_size = 8;
    p.n_seq_max = 2;
    p.unified = variant % 2 == 0;
    p.type_k = variant / 2 == 0 ? dtype::f16 : dtype::q8_0;
    p.type_v = variant / 2 == 0 ? dtype::f16 : dtype::q4_0;
    p.v_trans = variant / 2 == 0;
    p.n_pos = variant == 3 ? 4 : 1;
    return p;
}

// A cache with a little content (two cells of seq 0; with seq1, also one of seq 1), so that "unchanged"
// means something and seeds hold cells.
inline std::unique_ptr<kv_cache> make(int variant, bool seq1 = false) {
    auto c = std::make_unique<kv_cache>(shape(variant));
    for (seq_id_t s = 0; s <= (seq1 ? 1 : 0); ++s) {
        ubatch u;
        u.n_tokens = s == 0 ? 2 : 1;
        u.n_seq_tokens = 1;
        u.n_seqs = u.n_tokens;
        u.n_pos = c->params().n_pos;
        u.pos.assign(size_t{u.n_tokens} * u.n_pos, 1);
        u.pos[0] = 0;
        for (uint32_t i = 0; i <= u.n_tokens; ++i) u.seq_id_begin.push_back(i);
        u.n_seq_id.assign(u.n_tokens, 1);
        u.seq_id_data.assign(u.n_tokens, s);
        u.seq_id_unq = {s};
        u.n_seqs_unq = 1;
        u.output.assign(u.n_tokens, 0);
        c->init_ubatches({u}, {})->apply();
    }
    return c;
}

inline void check(bool ok) {
    if (!ok) std::abort();
}

// With KVC_FUZZ_SEEDS=DIR (scripts/fuzz.sh sets it), writes each seed to DIR before fuzzing starts.
inline void write_seeds(const std::vector<std::vector<uint8_t>>& seeds) {
    const char* dir = std::getenv("KVC_FUZZ_SEEDS");
    if (!dir) return;
    for (size_t i = 0; i < seeds.size(); ++i) {
        const std::string path = std::string(dir) + "/seed-" + std::to_string(i);
        if (FILE* f = std::fopen(path.c_str(), "wb")) {
            std::fwrite(seeds[i].data(), 1, seeds[i].size(), f);
            std::fclose(f);
        }
    }
}

}  // namespace kvc::fuzz
