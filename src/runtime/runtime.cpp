// Decoding through a kv_cache: the cache path of the forward pass.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include <fmt/format.h>

#include "model_impl.h"

namespace kvc {

namespace {

struct group_scratch {
    std::vector<float> scores;   // [group][n_kv]
    std::vector<float> row;      // one head's key or value, or a chunk of a transposed channel
    std::vector<float> acc;      // [group][hd]
    std::vector<uint32_t> live;  // unmasked cells
    group_scratch(size_t group, size_t hd, size_t n_kv)
        : scores(group * n_kv), row(std::max<size_t>(hd, 256)), acc(group * hd) {
        live.reserve(n_kv);
    }
};

float dot(const float* a, const float* b, size_t n) {
    float s[8] = {};
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; ++j) s[j] += a[i + j] * b[i + j];
    float r = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    for (; i < n; ++i) r += a[i] * b[i];
    return r;
}

// Attention of the `group` query heads sharing KV head g (q: group x hd values) over the n_kv cells of
// view stream s, with mask row `mask`; writes group x hd values to out.
void attend_group(const tensor_view& kv, const tensor_view& vv, bool v_trans, size_t s, size_t g, size_t n_kv,
                  const float* mask, const float* q, float* out, group_scratch& sc) {
    const auto hd = static_cast<size_t>(kv.ne[0]);
    const size_t group = sc.acc.size() / hd;
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    sc.live.clear();
    for (uint32_t j = 0; j < n_kv; ++j)
        if (!std::isinf(mask[j])) sc.live.push_back(j);
    std::fill(out, out + group * hd, 0.0f);
    if (sc.live.empty()) return;
    const std::byte* kbase = kv.data + s * kv.nb[3] + g * kv.nb[1];
    const size_t n_live = sc.live.size();
    std::vector<float> max(group, -std::numeric_limits<float>::infinity());
    for (size_t l = 0; l < n_live; ++l) {
        const uint32_t j = sc.live[l];
        to_f32(kv.type, kbase + j * kv.nb[2], sc.row.data(), static_cast<int64_t>(hd));
        for (size_t h = 0; h < group; ++h) {
            const float x = dot(q + h * hd, sc.row.data(), hd) * scale + mask[j];
            sc.scores[h * n_live + l] = x;
            max[h] = std::max(max[h], x);
        }
    }
    std::vector<float> inv(group);
    for (size_t h = 0; h < group; ++h) {
        double sum = 0;
        float* p = &sc.scores[h * n_live];
        for (size_t l = 0; l < n_live; ++l) {
            p[l] = std::exp(p[l] - max[h]);
            sum += p[l];
        }
        inv[h] = static_cast<float>(1.0 / sum);
    }
    if (!v_trans) {
        const std::byte* vbase = vv.data + s * vv.nb[3] + g * vv.nb[1];
        for (size_t l = 0; l < n_live; ++l) {
            to_f32(vv.type, vbase + sc.live[l] * vv.nb[2], sc.row.data(), static_cast<int64_t>(hd));
            for (size_t h = 0; h < group; ++h) {
                const float p = sc.scores[h * n_live + l];
                float* o = out + h * hd;
                for (size_t e = 0; e < hd; ++e) o[e] += p * sc.row[e];
            }
        }
    } else {  // channel e of head g: n_kv contiguous cells; read in chunks, gathering the live ones
        const bool dense = n_live == n_kv;
        std::vector<float> chunk(dense ? 0 : n_kv);
        for (size_t e = 0; e < hd; ++e) {
            const std::byte* ch = vv.data + s * vv.nb[3] + g * vv.nb[1] + e * vv.nb[2];
            if (dense) {
                for (size_t j0 = 0; j0 < n_kv; j0 += 256) {
                    const size_t m = std::min<size_t>(256, n_kv - j0);
                    to_f32(vv.type, ch + j0 * static_cast<size_t>(vv.nb[0]), sc.row.data(),
                           static_cast<int64_t>(m));
                    for (size_t h = 0; h < group; ++h)
                        out[h * hd + e] += dot(&sc.scores[h * n_live + j0], sc.row.data(), m);
                }
                continue;
            }
            to_f32(vv.type, ch, chunk.data(), static_cast<int64_t>(n_kv));
            for (size_t h = 0; h < group; ++h) {
                float a = 0;
                for (size_t l = 0; l < n_live; ++l) a += sc.scores[h * n_live + l] * chunk[sc.live[l]];
                out[h * hd + e] = a;
            }
        }
    }
    for (size_t h = 0; h < group; ++h)
        for (size_t e = 0; e < hd; ++e) out[h * hd + e] *= inv[h];
}

}  // namespace

runtime::runtime(const model& m, kv_cache& cache, runtime_params params)
    : model_(&m), cache_(&cache), params_(params), pool_(params.n_threads) {
    const model_hparams& hp = m.hparams();
    const auto& layers = cache.params().layers;
    if (layers.size() != hp.n_layer || cache.layer_ids().size() != hp.n_layer)
        throw error(errc::invalid_argument,
                    fmt::format("runtime: the cache has {} layers with K/V, the model {}",
                                cache.layer_ids().size(), hp.n_layer));
    for (uint32_t il = 0; il < hp.n_layer; ++il)
        if (layers[il].n_head_kv != hp.n_head_kv || layers[il].n_embd_head_k != hp.n_embd_head ||
            layers[il].n_embd_head_v != hp.n_embd_head)
            throw error(errc::invalid_argument,
                        fmt::format("runtime: cache layer {} is {} heads x {}/{} values, the model's {} x {}",
                                    il, layers[il].n_head_kv, layers[il].n_embd_head_k,
                                    layers[il].n_embd_head_v, hp.n_head_kv, hp.n_embd_head));
    if (params_.n_ubatch == 0) throw error(errc::invalid_argument, "runtime: n_ubatch must be positive");
}

runtime::~runtime() = default;

decode_result runtime::decode(const batch& b) {
    const model::impl& m = model_->get();
    const model_hparams& hp = m.hp;
    // the memory's pending work first (K-shift, compaction), as llama_decode does
    if (auto up = cache_->init_update(false); up->get_status() == memory_status::success) up->apply();

    batch_allocr balloc;
    balloc.init(b, cache_,
                {.n_seq_max = cache_->params().n_seq_max, .n_vocab = static_cast<int32_t>(hp.n_vocab)});
    decode_result res;
    auto ctx = cache_->init_batch(balloc, params_.n_ubatch, false);
    if (is_fail(ctx->get_status())) {
        res.status = ctx->get_status();
        return res;
    }
    auto& kc = dynamic_cast<kv_cache_context&>(*ctx);
    const size_t hd = hp.n_embd_head, e_kv = size_t{hp.n_head_kv} * hd, n_q = size_t{hp.n_head} * hd;
    const uint32_t group = hp.n_head / hp.n_head_kv;
    const bool v_trans = cache_->params().v_trans;

    std::vector<std::pair<int32_t, size_t>> rows;  // (batch index, row in `logits`)
    std::vector<float> logits, mask;
    do {
        if (!kc.apply()) throw error(errc::invalid_state, "runtime: the cache could not apply a ubatch");
        ++res.n_ubatches;
        const ubatch& ub = kc.get_ubatch();
        const uint32_t n = ub.n_tokens, n_kv = kc.get_n_kv();
        const slot_info& si = kc.get_sinfo();
        mask.resize(cache_->kq_mask_elements(ub, n_kv));
        kc.set_input_kq_mask(
            tensor_view::contiguous(dtype::f32, reinterpret_cast<std::byte*>(mask.data()), n_kv, n), true);
        std::vector<uint32_t> stream_of(n);  // index of each token's stream in the views
        for (uint32_t t = 0; t < n; ++t) stream_of[t] = cache_->seq_to_stream(ub.primary_seq(t)) - si.s0;

        const rt::attend_fn attend = [&](uint32_t il, const float* q, const float* k, const float*,
                                         const float* v, float* out) {
            kc.cpy_k(il, const_tensor_view::contiguous(dtype::f32, reinterpret_cast<const std::byte*>(k),
                                                       e_kv, n));
            kc.cpy_v(il, const_tensor_view::contiguous(dtype::f32, reinterpret_cast<const std::byte*>(v),
                                                       e_kv, n));
            // Per (token, KV head): the query heads of its group attend together, reading each cell's K and
            // V in the cache's type once (no f32 copy of the cache), skipping masked cells.
            const tensor_view kv = kc.get_k(il), vv = kc.get_v(il);
            pool_.parallel_for(size_t{n} * hp.n_head_kv, [&](size_t w0, size_t w1) {
                group_scratch sc(group, hd, n_kv);
                for (size_t w = w0; w < w1; ++w) {
                    const size_t t = w / hp.n_head_kv, g = w % hp.n_head_kv;
                    attend_group(kv, vv, v_trans, stream_of[t], g, n_kv, &mask[t * n_kv],
                                 q + t * n_q + g * group * hd, out + t * n_q + g * group * hd, sc);
                }
            });
        };
        const size_t before = logits.size() / hp.n_vocab;
        m.forward(pool_, ub.token, std::span(ub.pos).first(n), ub.output, attend, logits);
        for (uint32_t t = 0, r = 0; t < n; ++t)
            if (ub.output[t]) rows.emplace_back(ub.batch_idx[t], before + r++);
    } while (kc.next());

    std::sort(rows.begin(), rows.end());
    res.logits.resize(rows.size() * hp.n_vocab);
    for (size_t i = 0; i < rows.size(); ++i) {
        res.output_ids.push_back(rows[i].first);
        std::copy_n(&logits[rows[i].second * hp.n_vocab], hp.n_vocab, &res.logits[i * hp.n_vocab]);
    }
    return res;
}

}  // namespace kvc
