// Decoding through a kv_cache: the cache path of the forward pass.
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>

#include <fmt/format.h>

#include "model_impl.h"

namespace kvc {

namespace {

using rt::axpy;
using rt::dot_cloned;
using rt::head_scores;

// Attention of n query tokens over the cache's views, reading K and V in the cache's type in the order
// they lie in memory (cell after cell, or channel after channel for transposed V), each row decoded once
// for all the tokens of a block and all query heads: the cost is streaming the n_kv cells, not chasing
// one head's bytes across them. q and out: [n][n_head * hd]; mask: [n][n_kv]; stream_of: view stream of
// each token.
void attend_cache(thread_pool& pool, const model_hparams& hp, const tensor_view& kv, const tensor_view& vv,
                  bool v_trans, size_t n, size_t n_kv, const std::vector<uint32_t>& stream_of,
                  const float* mask, const float* q, float* out) {
    const size_t hd = hp.n_embd_head, n_head = hp.n_head, e_kv = size_t{hp.n_head_kv} * hd, n_q = n_head * hd;
    const size_t group = n_head / hp.n_head_kv;
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    constexpr size_t block = 16;   // tokens sharing one pass over the cells
    constexpr size_t chunk = 512;  // cells whose weighted values are summed together
    // scores, then weights, of a block's (token, head) rows; every entry is written before it is read
    const std::unique_ptr<float[]> p(new float[std::min(block, n) * n_head * n_kv]);
    std::vector<float> partial;
    for (size_t t0 = 0; t0 < n; t0 += block) {
        const size_t tb = std::min(block, n - t0);
        const auto score = [&](size_t t, size_t h) { return &p[(t * n_head + h) * n_kv]; };
        // 1. scores, cell by cell
        pool.parallel_for(
            n_kv,
            [&](size_t j0, size_t j1) {
                std::vector<float> row(e_kv);
                for (size_t j = j0; j < j1; ++j) {
                    int64_t have = -1;  // stream whose row is in `row`
                    for (size_t t = 0; t < tb; ++t) {
                        const float m = mask[(t0 + t) * n_kv + j];
                        if (std::isinf(m)) {
                            for (size_t h = 0; h < n_head; ++h) score(t, h)[j] = -INFINITY;
                            continue;
                        }
                        const auto s = static_cast<int64_t>(stream_of[t0 + t]);
                        if (s != have) {
                            to_f32(kv.type, kv.data + s * kv.nb[3] + j * kv.nb[2], row.data(),
                                   static_cast<int64_t>(e_kv));
                            have = s;
                        }
                        head_scores(q + (t0 + t) * n_q, row.data(), n_head, group, hd, scale, m,
                                    score(t, 0) + j, n_kv);
                    }
                }
            },
            256);
        // 2. softmax of every (token, head) row
        pool.parallel_for(tb * n_head, [&](size_t r0, size_t r1) {
            for (size_t r = r0; r < r1; ++r) {
                float* x = &p[r * n_kv];
                float mx = -INFINITY;
                for (size_t j = 0; j < n_kv; ++j) mx = std::max(mx, x[j]);
                if (std::isinf(mx)) {  // nothing visible
                    std::fill(x, x + n_kv, 0.0f);
                    continue;
                }
                double sum = 0;
                for (size_t j = 0; j < n_kv; ++j) {
                    x[j] = std::isinf(x[j]) ? 0.0f : std::exp(x[j] - mx);
                    sum += x[j];
                }
                const auto inv = static_cast<float>(1.0 / sum);
                for (size_t j = 0; j < n_kv; ++j) x[j] *= inv;
            }
        });
        float* o = out + t0 * n_q;
        std::fill(o, o + tb * n_q, 0.0f);
        if (!v_trans) {  // 3. values, cell by cell: chunks of cells sum into their own buffers, which are
                         //    then added in chunk order (the result does not depend on the thread count)
            const size_t n_chunks = (n_kv + chunk - 1) / chunk;
            partial.assign(n_chunks * tb * n_q, 0.0f);
            pool.parallel_for(n_chunks, [&](size_t k0, size_t k1) {
                std::vector<float> row(e_kv);
                for (size_t k = k0; k < k1; ++k) {
                    float* acc = &partial[k * tb * n_q];
                    for (size_t j = k * chunk; j < std::min(n_kv, (k + 1) * chunk); ++j) {
                        int64_t have = -1;
                        for (size_t t = 0; t < tb; ++t) {
                            const auto s = static_cast<int64_t>(stream_of[t0 + t]);
                            for (size_t h = 0; h < n_head; ++h) {
                                const float w = score(t, h)[j];
                                if (w == 0.0f) continue;
                                if (s != have) {
                                    to_f32(vv.type, vv.data + s * vv.nb[3] + j * vv.nb[2], row.data(),
                                           static_cast<int64_t>(e_kv));
                                    have = s;
                                }
                                axpy(w, &row[(h / group) * hd], &acc[t * n_q + h * hd], hd);
                            }
                        }
                    }
                }
            });
            pool.parallel_for(tb * n_q, [&](size_t i0, size_t i1) {
                for (size_t i = i0; i < i1; ++i)
                    for (size_t k = 0; k < n_chunks; ++k) o[i] += partial[k * tb * n_q + i];
            });
        } else {  // 3. transposed values: channel by channel, n_kv contiguous cells each
            pool.parallel_for(e_kv, [&](size_t c0, size_t c1) {
                std::vector<float> ch(n_kv);
                for (size_t c = c0; c < c1; ++c) {
                    const size_t g = c / hd, e = c % hd;
                    int64_t have = -1;
                    for (size_t t = 0; t < tb; ++t) {
                        const auto s = static_cast<int64_t>(stream_of[t0 + t]);
                        if (s != have) {
                            to_f32(vv.type, vv.data + s * vv.nb[3] + c * vv.nb[2], ch.data(),
                                   static_cast<int64_t>(n_kv));
                            have = s;
                        }
                        for (size_t h = g * group; h < (g + 1) * group; ++h)
                            o[t * n_q + h * hd + e] = dot_cloned(score(t, h), ch.data(), n_kv);
                    }
                }
            });
        }
    }
}

// The cache path's Mamba states: the memory's rows for the applied ubatch, through the library's
// reference of the recurrent engine contract (gather, planes for rollback, history copies).
class cache_states final : public rt::ssm_states {
public:
    explicit cache_states(memory_recurrent_context& rc) : rc_(rc) {}
    uint32_t n_blocks() const override { return rc_.get_ubatch().n_seqs; }
    uint32_t n_block_tokens() const override { return rc_.get_ubatch().n_seq_tokens; }
    void begin(uint32_t il, rs_tensor which) override {
        step_.reset();
        step_.emplace(rc_, il, which);
    }
    std::span<float> state(uint32_t b) override { return step_->state(b); }
    void store(uint32_t b, uint32_t t) override { step_->store(b, t); }
    void finish() override { step_->finish(); }

private:
    memory_recurrent_context& rc_;
    std::optional<recurrent_step> step_;
};

}  // namespace

runtime::runtime(const model& m, memory_i& mem, runtime_params params)
    : model_(&m), mem_(&mem), recr_(mem.recurrent()), params_(params), pool_(params.n_threads) {
    const model_hparams& hp = m.hparams();
    bool base_is_swa = false;
    for (uint32_t il = 0; il < hp.n_layer; ++il) {
        kv_cache* c = hp.is_recurrent(il) ? nullptr : mem.layer_cache(il);
        layer_cache_.push_back(c);
        if (c == nullptr) continue;
        // the base cache: the full-attention layers' (an iSWA memory's SWA cache keeps only windows)
        const bool swa = c->params().layers[il].is_swa;
        if (base_ == nullptr || (base_is_swa && !swa)) {
            base_ = c;
            base_is_swa = swa;
        }
    }
    check_layers();
}

void runtime::check_layers() {
    const model_hparams& hp = model_->hparams();
    const auto layer_count = [&](size_t n, const char* part) {
        if (n != hp.n_layer)
            throw error(
                errc::invalid_argument,
                fmt::format("runtime: the memory's {} has {} layers, the model {}", part, n, hp.n_layer));
    };
    if (base_) layer_count(base_->params().layers.size(), "KV cache");
    if (recr_) layer_count(recr_->params().layers.size(), "recurrent state");
    for (uint32_t il = 0; il < hp.n_layer; ++il) {
        if (hp.is_recurrent(il)) {
            if (!recr_ || !recr_->has_r(il) || !recr_->has_s(il))
                throw error(
                    errc::invalid_argument,
                    fmt::format("runtime: the memory keeps no recurrent state for Mamba layer {}", il));
            const recurrent_layer_desc& d = recr_->params().layers[il];
            if (d.n_embd_r != hp.n_embd_r() || d.n_embd_s != hp.n_embd_s())
                throw error(
                    errc::invalid_argument,
                    fmt::format("runtime: recurrent layer {} has rows of {}/{} values, the model's {}/{}", il,
                                d.n_embd_r, d.n_embd_s, hp.n_embd_r(), hp.n_embd_s()));
            continue;
        }
        const kv_cache* c = layer_cache_[il];
        if (!c || !c->has_layer(il))
            throw error(errc::invalid_argument,
                        fmt::format("runtime: the memory keeps no K/V for layer {}", il));
        if (c->params().engine != params_.tensors || (params_.tensors && !params_.tensors->has_layer(il)))
            throw error(
                errc::invalid_argument,
                fmt::format("runtime: layer {}'s cache {} while the runtime {} (runtime_params::tensors "
                            "must be the cache's kv_cache_params::engine)",
                            il, c->params().engine ? "has an engine-owned storage" : "owns its storage",
                            params_.tensors ? "owns the K/V tensors" : "does not"));
        const layer_desc& d = c->params().layers[il];
        if (d.n_head_kv != hp.n_head_kv || d.n_embd_head_k != hp.n_embd_head ||
            d.n_embd_head_v != hp.n_embd_head)
            throw error(
                errc::invalid_argument,
                fmt::format("runtime: cache layer {} is {} heads x {}/{} values, the model's {} x {}", il,
                            d.n_head_kv, d.n_embd_head_k, d.n_embd_head_v, hp.n_head_kv, hp.n_embd_head));
    }
    if (params_.n_ubatch == 0) throw error(errc::invalid_argument, "runtime: n_ubatch must be positive");
}

runtime::~runtime() = default;

kv_cache& runtime::cache() {
    if (!base_) throw error(errc::invalid_state, "runtime: a recurrent memory has no KV cache");
    return *base_;
}

decode_result runtime::decode(const batch& b) {
    const model::impl& m = model_->get();
    const model_hparams& hp = m.hp;
    // the memory's pending work first (K-shift, compaction), as llama_decode does
    if (auto up = mem_->init_update(/*optimize=*/false); up->get_status() == memory_status::success)
        up->apply();

    batch_allocr balloc;
    balloc.init(b, positions_of(mem_),
                {.n_seq_max = mem_->n_seq_max(), .n_vocab = static_cast<int32_t>(hp.n_vocab)});
    decode_result res;
    auto ctx = mem_->init_batch(balloc, params_.n_ubatch, params_.embd_all);
    if (is_fail(ctx->get_status())) {
        res.status = ctx->get_status();
        return res;
    }
    // the context of the cache holding each attention layer (iSWA: two caches), and one mask per cache
    std::vector<kv_cache_context*> layer_ctx(hp.n_layer);
    std::vector<kv_cache_context*> children;
    std::vector<uint32_t> child_layer;  // a layer of each child (its v_idxs)
    for (uint32_t il = 0; il < hp.n_layer; ++il) {
        if (!layer_cache_[il]) continue;
        layer_ctx[il] = ctx->get_attn(il);
        if (!layer_ctx[il])
            throw error(errc::invalid_state, fmt::format("runtime: no attention context for layer {}", il));
        if (std::find(children.begin(), children.end(), layer_ctx[il]) == children.end()) {
            children.push_back(layer_ctx[il]);
            child_layer.push_back(il);
        }
    }
    kv_tensors* const own = params_.tensors;
    std::vector<std::vector<int64_t>> k_idxs(children.size()), v_idxs(children.size());
    const size_t e_kv = size_t{hp.n_head_kv} * hp.n_embd_head;
    const bool v_trans = base_ && base_->params().v_trans;

    std::vector<std::pair<int32_t, size_t>> rows;  // (batch index, row in `logits`)
    std::vector<float> logits;
    std::vector<std::vector<float>> masks(children.size());
    do {
        ctx->apply();
        ++res.n_ubatches;
        const ubatch& ub = ctx->get_ubatch();
        const uint32_t n = ub.n_tokens;
        for (size_t c = 0; c < children.size(); ++c) {
            masks[c].resize(children[c]->kq_mask_elements());
            children[c]->set_input_kq_mask(tensor_view::contiguous(
                dtype::f32, reinterpret_cast<std::byte*>(masks[c].data()), children[c]->get_n_kv(), n));
            if (own) {  // where this ubatch's rows go in the runtime's own tensors (the same for every layer)
                k_idxs[c] = children[c]->k_idxs();
                v_idxs[c] = children[c]->v_idxs(child_layer[c]);
            }
        }
        // index of each token's stream in the views (both caches map sequences to streams alike)
        std::vector<uint32_t> stream_of(n);
        if (!children.empty()) {
            const slot_info& si = children[0]->get_sinfo();
            for (uint32_t t = 0; t < n; ++t) stream_of[t] = base_->seq_to_stream(ub.primary_seq(t)) - si.s0;
        }

        const rt::attend_fn attend = [&](uint32_t il, const float* q, const float* k, const float*,
                                         const float* v, float* out) {
            kv_cache_context& kc = *layer_ctx[il];
            const auto c =
                static_cast<size_t>(std::find(children.begin(), children.end(), &kc) - children.begin());
            if (own) {  // the engine's way: set_rows at the context's indices, attention over its tensors
                own->set_rows(il, kv_part::k, std::span(k, n * e_kv), k_idxs[c]);
                own->set_rows(il, kv_part::v, std::span(v, n * e_kv), v_idxs[c]);
                const slot_info& si = kc.get_sinfo();
                const uint32_t ns = si.s1 - si.s0 + 1;
                attend_cache(pool_, hp, own->view(il, kv_part::k, si.s0, ns, kc.get_n_kv()),
                             own->view(il, kv_part::v, si.s0, ns, kc.get_n_kv()), v_trans, n, kc.get_n_kv(),
                             stream_of, masks[c].data(), q, out);
                return;
            }
            kc.cpy_k(il, const_tensor_view::contiguous(dtype::f32, reinterpret_cast<const std::byte*>(k),
                                                       e_kv, n));
            kc.cpy_v(il, const_tensor_view::contiguous(dtype::f32, reinterpret_cast<const std::byte*>(v),
                                                       e_kv, n));
            attend_cache(pool_, hp, kc.get_k(il), kc.get_v(il), v_trans, n, kc.get_n_kv(), stream_of,
                         masks[c].data(), q, out);
        };
        std::optional<cache_states> states;
        if (recr_) {
            memory_recurrent_context* rc = ctx->get_recr();
            if (!rc) throw error(errc::invalid_state, "runtime: the memory gave no recurrent context");
            states.emplace(*rc);
        }
        const size_t before = logits.size() / hp.n_vocab;
        m.forward(pool_, ub.token, std::span(ub.pos).first(n), ub.output, attend, states ? &*states : nullptr,
                  logits);
        for (uint32_t t = 0, r = 0; t < n; ++t)
            if (ub.output[t]) rows.emplace_back(ub.batch_idx[t], before + r++);
    } while (ctx->next());

    std::sort(rows.begin(), rows.end());
    res.logits.resize(rows.size() * hp.n_vocab);
    for (size_t i = 0; i < rows.size(); ++i) {
        res.output_ids.push_back(rows[i].first);
        std::copy_n(&logits[rows[i].second * hp.n_vocab], hp.n_vocab, &res.logits[i * hp.n_vocab]);
    }
    return res;
}

}  // namespace kvc
