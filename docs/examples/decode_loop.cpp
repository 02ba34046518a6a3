// docs/examples/decode_loop.cpp: the engine side of a decode loop, without a model. A prompt and a few
// single-token steps go through batch_allocr and init_batch; per ubatch the engine writes each token's
// K/V rows (cpy_k / cpy_v), builds the KQ mask and attends over the cache's views (K rows, transposed V).
// The result is checked against attention computed directly from every row the "model" produced.
// Exit status 0 when every check passed.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <span>
#include <vector>

#include <kvcache/batch.h>
#include <kvcache/kv_cache.h>

namespace {

constexpr uint32_t n_layer = 2, n_head_kv = 2, head_dim = 8;
constexpr uint32_t n_embd_kv = n_head_kv * head_dim;  // values per K (or V) row of a token

int failures = 0;
void check(bool ok, const char* what) {
    if (!ok) {
        std::printf("FAILED: %s\n", what);
        ++failures;
    }
}

// What the model would compute for channel e of a token: multiples of 1/8, exact in f16.
float kv_value(kvc::token_t tok, kvc::pos_t pos, uint32_t il, uint32_t e, bool is_v) {
    const int x = (tok * 7 + pos * 3 + static_cast<int>(il * 5 + e) + (is_v ? 11 : 0)) % 16;
    return static_cast<float>(x - 8) / 8.0f;
}

struct entry {
    kvc::pos_t pos;
    std::vector<float> k, v;  // [n_embd_kv]
};

// Attention of one query head (kv head h) at row `t` of the mask, over the cache's views.
std::vector<float> attend_cache(const kvc::tensor_view& k, const kvc::tensor_view& v, const float* mask_row,
                                uint32_t n_kv, uint32_t h, const std::vector<float>& q) {
    std::vector<float> w(n_kv, 0.0f), key(head_dim), out(head_dim, 0.0f), cells(n_kv);
    float wmax = -INFINITY, sum = 0.0f;
    for (uint32_t c = 0; c < n_kv; ++c) {
        if (std::isinf(mask_row[c])) continue;  // -inf: not visible
        k.row_to_f32(key, h, c);                // K view [head_dim, n_head_kv, n_kv, streams]
        float s = 0.0f;
        for (uint32_t d = 0; d < head_dim; ++d) s += q[d] * key[d];
        w[c] = s / std::sqrt(float{head_dim}) + mask_row[c];
        wmax = std::max(wmax, w[c]);
    }
    for (uint32_t c = 0; c < n_kv; ++c) {
        w[c] = std::isinf(mask_row[c]) ? 0.0f : std::exp(w[c] - wmax);
        sum += w[c];
    }
    for (uint32_t d = 0; d < head_dim; ++d) {
        v.row_to_f32(cells, h, d);  // transposed V [n_kv, n_head_kv, head_dim, streams]: cells fastest
        for (uint32_t c = 0; c < n_kv; ++c) out[d] += w[c] / sum * cells[c];
    }
    return out;
}

// The same attention from the rows kept by the "model" (every entry at or before pos).
std::vector<float> attend_direct(const std::vector<entry>& hist, kvc::pos_t pos, uint32_t h,
                                 const std::vector<float>& q) {
    std::vector<float> w, out(head_dim, 0.0f);
    float wmax = -INFINITY, sum = 0.0f;
    for (const entry& en : hist) {
        float s = 0.0f;
        for (uint32_t d = 0; d < head_dim; ++d) s += q[d] * en.k[h * head_dim + d];
        w.push_back(en.pos <= pos ? s / std::sqrt(float{head_dim}) : -INFINITY);
        wmax = std::max(wmax, w.back());
    }
    for (float& x : w) sum += (x = std::exp(x - wmax));
    for (size_t i = 0; i < hist.size(); ++i)
        for (uint32_t d = 0; d < head_dim; ++d) out[d] += w[i] / sum * hist[i].v[h * head_dim + d];
    return out;
}

// One llama_decode: pending work, validation, placement, then per ubatch K/V rows, mask and attention.
void decode(kvc::kv_cache& cache, const kvc::batch& b, std::vector<std::vector<entry>>& hist) {
    if (auto up = cache.init_update(/*optimize=*/false); up->get_status() == kvc::memory_status::success)
        up->apply();
    kvc::batch_allocr balloc;
    balloc.init(b, kvc::positions_of(cache),
                {.n_seq_max = cache.params().n_seq_max, .n_vocab = 1000});  // throws if invalid
    kvc::memory_context_ptr ctx = cache.init_batch(balloc, /*n_ubatch=*/4, /*embd_all=*/false);
    if (kvc::is_fail(ctx->get_status())) throw kvc::error(kvc::errc::invalid_state, "no room");
    do {
        ctx->apply();                                   // the ubatch's cells now hold its tokens
        kvc::kv_cache_context& kc = *ctx->get_attn(0);  // the cache holding layer 0 (here: every layer)
        const kvc::ubatch& ub = ctx->get_ubatch();
        const uint32_t n = ub.n_tokens, n_kv = kc.get_n_kv();
        std::vector<float> mask(size_t{n_kv} * n);  // [n_kv, n_tokens], row t = token t
        kc.set_input_kq_mask(kvc::tensor_view::contiguous(
            kvc::dtype::f32, reinterpret_cast<std::byte*>(mask.data()), n_kv, n));
        for (uint32_t t = 0; t < n; ++t) {
            size_t open = 0;
            for (uint32_t c = 0; c < n_kv; ++c) open += mask[size_t{t} * n_kv + c] == 0.0f;
            check(open == static_cast<size_t>(ub.pos[t]) + 1, "a token sees every earlier position");
        }
        for (uint32_t il = 0; il < n_layer; ++il) {
            std::vector<float> k(size_t{n} * n_embd_kv), v(k.size());  // [n_embd_kv, n_tokens]
            for (uint32_t t = 0; t < n; ++t) {
                entry en{ub.pos[t], {}, {}};
                for (uint32_t e = 0; e < n_embd_kv; ++e) {
                    en.k.push_back(k[t * n_embd_kv + e] = kv_value(ub.token[t], ub.pos[t], il, e, false));
                    en.v.push_back(v[t * n_embd_kv + e] = kv_value(ub.token[t], ub.pos[t], il, e, true));
                }
                hist[il].push_back(std::move(en));
            }
            kc.cpy_k(il, kvc::const_tensor_view::contiguous(
                             kvc::dtype::f32, reinterpret_cast<const std::byte*>(k.data()), n_embd_kv, n));
            kc.cpy_v(il, kvc::const_tensor_view::contiguous(
                             kvc::dtype::f32, reinterpret_cast<const std::byte*>(v.data()), n_embd_kv, n));
            const kvc::tensor_view kview = kc.get_k(il), vview = kc.get_v(il);
            for (uint32_t t = 0; t < n; ++t)
                for (uint32_t h = 0; h < n_head_kv; ++h) {
                    const std::vector<float> q(head_dim, 0.25f * static_cast<float>(h + 1));
                    const auto a = attend_cache(kview, vview, &mask[size_t{t} * n_kv], n_kv, h, q);
                    const auto r = attend_direct(hist[il], ub.pos[t], h, q);
                    float err = 0.0f;
                    for (uint32_t d = 0; d < head_dim; ++d) err = std::max(err, std::fabs(a[d] - r[d]));
                    check(err < 1e-5f, "attention over the cache == attention over the model's rows");
                }
        }
    } while (ctx->next());
}

}  // namespace

int main() {
    kvc::kv_cache_params p;
    kvc::layer_desc layer;  // every layer alike: 2 KV heads of 8 values, NeoX RoPE over the whole head
    layer.n_head_kv = n_head_kv;
    layer.n_embd_head_k = head_dim;
    layer.n_embd_head_v = head_dim;
    layer.rope = {.type = kvc::rope_type::neox, .n_rot = head_dim};
    p.layers.assign(n_layer, layer);
    p.type_k = kvc::dtype::f16;
    p.type_v = kvc::dtype::f16;
    p.v_trans = true;  // attention without flash attention reads V with cells fastest
    p.kv_size = 128;
    p.n_kv_pad = 32;  // attention reads a multiple of 32 cells
    kvc::kv_cache cache(p);
    std::vector<std::vector<entry>> hist(n_layer);

    // the prompt: explicit positions, an output for the last token (3 ubatches of at most 4 tokens)
    const kvc::token_t prompt[] = {1, 15, 42, 7, 99, 3, 18, 250, 64, 5};
    kvc::batch_storage b = kvc::batch::init(10, /*n_embd=*/0, /*n_seq_max=*/1);
    const kvc::seq_id_t seq0[] = {0};
    for (int i = 0; i < 10; ++i) b.add(prompt[i], i, seq0, /*output=*/i == 9);
    decode(cache, b.view(), hist);

    // generation: one token per step, positions filled in by batch_allocr
    for (kvc::token_t next : {17, 23, 31, 47}) {
        const kvc::token_t one[] = {next};
        decode(cache, kvc::batch::get_one(one), hist);
    }
    check(cache.seq_pos_min(0) == 0 && cache.seq_pos_max(0) == 13, "sequence 0 holds positions 0-13");
    check(cache.cells(0).get_used() == 14, "14 cells used");

    // K rows read back as written (f16 holds these values exactly)
    std::vector<float> row(n_embd_kv);
    cache.read_row(kvc::kv_part::k, 1, /*stream=*/0, /*cell=*/3, row);
    check(row[5] == kv_value(prompt[3], 3, 1, 5, false), "cell 3 holds token 3's K row");

    std::printf("%u cells used of %u, %s\n", cache.cells(0).get_used(), cache.get_size(),
                failures == 0 ? "every check passed" : "FAILED");
    return failures == 0 ? 0 : 1;
}
