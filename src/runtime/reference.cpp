// The oracle of cache == recompute: sequences as plain lists of f32 keys (before RoPE) and values.
#include <algorithm>
#include <limits>

#include <fmt/format.h>

#include "model_impl.h"

namespace kvc {

namespace {

struct entry {
    pos_t pos = 0;
    std::vector<std::vector<float>> k_raw, v;  // [layer][n_head_kv * head_dim]
};

}  // namespace

struct reference_memory::impl {
    const model::impl* m;
    uint32_t n_seq_max;
    uint32_t n_swa = 0;
    swa_type swa = swa_type::none;
    std::vector<bool> swa_layers;  // empty: every layer
    thread_pool pool;
    std::vector<std::vector<entry>> seqs;

    impl(const model& md, uint32_t n, uint32_t n_threads)
        : m(&md.get()), n_seq_max(n), pool(n_threads), seqs(n) {}

    std::vector<entry>& seq(seq_id_t s, const char* what) {
        if (s < 0 || static_cast<uint32_t>(s) >= n_seq_max)
            throw error(errc::out_of_range,
                        fmt::format("reference {}: seq_id {} not in [0, {})", what, s, n_seq_max));
        return seqs[static_cast<size_t>(s)];
    }
    // Each sequence (or, with s = -1, every one) with the entries in [p0, p1) (p1 < 0: to the end).
    template <class F>
    void each(seq_id_t s, pos_t p0, pos_t p1, const char* what, F&& f) {
        if (s >= 0) seq(s, what);  // validates
        const int64_t lo = std::max<pos_t>(p0, 0), hi = p1 < 0 ? std::numeric_limits<int64_t>::max() : p1;
        for (uint32_t q = 0; q < n_seq_max; ++q)
            if (s < 0 || static_cast<uint32_t>(s) == q) f(seqs[q], lo, hi);
    }
};

reference_memory::reference_memory(const model& m, uint32_t n_seq_max, uint32_t n_threads)
    : p_(std::make_unique<impl>(m, n_seq_max, n_threads)) {}
reference_memory::~reference_memory() = default;

decode_result reference_memory::decode(const batch& b) {
    const model::impl& m = *p_->m;
    const model_hparams& hp = m.hp;
    // positions the caller left out continue each token's first sequence, as in a cache
    std::vector<pos_t> pos;
    batch with_pos = b;
    if (!b.pos && b.n_tokens > 0 && b.token) {
        std::vector<pos_t> next(p_->n_seq_max);
        for (uint32_t s = 0; s < p_->n_seq_max; ++s) next[s] = seq_pos_max(static_cast<seq_id_t>(s)) + 1;
        for (int32_t i = 0; i < b.n_tokens; ++i) {
            const seq_id_t s = b.seq_id ? b.seq_id[i][0] : 0;
            if (s < 0 || static_cast<uint32_t>(s) >= p_->n_seq_max)
                throw error(errc::out_of_range,
                            fmt::format("reference decode: seq_id {} not in [0, {})", s, p_->n_seq_max));
            pos.push_back(next[static_cast<size_t>(s)]++);
        }
        with_pos.pos = pos.data();
    }
    batch_allocr balloc;
    balloc.init(with_pos, {}, {.n_seq_max = p_->n_seq_max, .n_vocab = static_cast<int32_t>(hp.n_vocab)});
    const size_t hd = hp.n_embd_head, e_kv = size_t{hp.n_head_kv} * hd;
    const uint32_t group = hp.n_head / hp.n_head_kv;
    decode_result res;
    res.n_ubatches = 1;
    for (uint32_t i = 0; i < balloc.get_n_tokens(); ++i) {
        const pos_t p = balloc.pos(i);
        const std::vector<entry>& own = p_->seqs[static_cast<size_t>(balloc.seq_ids(i)[0])];
        entry self;
        self.pos = p;
        std::vector<float> keys, values;
        const rt::attend_fn attend = [&](uint32_t il, const float* q, const float* k, const float* k_raw,
                                         const float* v, float* out) {
            self.k_raw.emplace_back(k_raw, k_raw + e_kv);
            self.v.emplace_back(v, v + e_kv);
            const bool windowed =
                p_->swa_layers.empty() || (il < p_->swa_layers.size() && p_->swa_layers[il]);
            // visible: the sequence's entries at or before p, rotated to where they are now, then itself
            keys.clear();
            values.clear();
            for (const entry& e : own) {
                if (e.pos > p || (windowed && is_masked_swa(p_->n_swa, p_->swa, e.pos, p))) continue;
                const size_t at = keys.size();
                keys.insert(keys.end(), e.k_raw[il].begin(), e.k_raw[il].end());
                ops::rope(std::span(&keys[at], e_kv), hp.n_head_kv, static_cast<uint32_t>(hd), e.pos,
                          hp.rope);
                values.insert(values.end(), e.v[il].begin(), e.v[il].end());
            }
            keys.insert(keys.end(), k, k + e_kv);
            values.insert(values.end(), v, v + e_kv);
            const size_t n_keys = keys.size() / e_kv;
            std::vector<float> scratch;
            for (uint32_t h = 0; h < hp.n_head; ++h)
                rt::attend_head(q + h * hd, static_cast<uint32_t>(hd), n_keys, &keys[(h / group) * hd], e_kv,
                                &values[(h / group) * hd], e_kv, false, nullptr, out + h * hd, scratch);
        };
        const token_t tok = with_pos.token[i];
        const int8_t is_out = balloc.is_output(i) ? 1 : 0;
        const size_t before = res.logits.size();
        m.forward(p_->pool, std::span(&tok, 1), std::span(&p, 1), std::span(&is_out, 1), attend, nullptr,
                  res.logits);
        if (res.logits.size() > before) res.output_ids.push_back(static_cast<int32_t>(i));
        for (seq_id_t s : balloc.seq_ids(i)) p_->seqs[static_cast<size_t>(s)].push_back(self);
    }
    return res;
}

void reference_memory::set_swa(uint32_t n_swa, swa_type type, std::vector<bool> swa_layers) {
    p_->n_swa = n_swa;
    p_->swa = type;
    p_->swa_layers = std::move(swa_layers);
}

void reference_memory::clear() {
    for (auto& s : p_->seqs) s.clear();
}

bool reference_memory::seq_rm(seq_id_t s, pos_t p0, pos_t p1) {
    p_->each(s, p0, p1, "seq_rm", [](std::vector<entry>& es, int64_t a, int64_t b) {
        std::erase_if(es, [&](const entry& e) { return e.pos >= a && e.pos < b; });
    });
    return true;
}

void reference_memory::seq_cp(seq_id_t src, seq_id_t dst, pos_t p0, pos_t p1) {
    const std::vector<entry> from = p_->seq(src, "seq_cp");
    std::vector<entry>& to = p_->seq(dst, "seq_cp");
    if (src == dst) return;
    const int64_t lo = std::max<pos_t>(p0, 0), hi = p1 < 0 ? std::numeric_limits<int64_t>::max() : p1;
    for (const entry& e : from)
        if (e.pos >= lo && e.pos < hi) to.push_back(e);
}

void reference_memory::seq_keep(seq_id_t s) {
    p_->seq(s, "seq_keep");
    for (uint32_t q = 0; q < p_->n_seq_max; ++q)
        if (static_cast<seq_id_t>(q) != s) p_->seqs[q].clear();
}

void reference_memory::seq_add(seq_id_t s, pos_t p0, pos_t p1, pos_t shift) {
    p_->each(s, p0, p1, "seq_add", [&](std::vector<entry>& es, int64_t a, int64_t b) {
        for (entry& e : es)
            if (e.pos >= a && e.pos < b) e.pos += shift;
        std::erase_if(es, [](const entry& e) { return e.pos < 0; });  // shifted out, as cells are freed
    });
}

void reference_memory::seq_div(seq_id_t s, pos_t p0, pos_t p1, int d) {
    if (d < 1) throw error(errc::invalid_argument, fmt::format("reference seq_div: divisor {}", d));
    p_->each(s, p0, p1, "seq_div", [&](std::vector<entry>& es, int64_t a, int64_t b) {
        for (entry& e : es)
            if (e.pos >= a && e.pos < b) e.pos /= d;
    });
}

pos_t reference_memory::seq_pos_min(seq_id_t s) const {
    const auto& es = p_->seq(s, "seq_pos_min");
    pos_t r = -1;
    for (const entry& e : es) r = r < 0 ? e.pos : std::min(r, e.pos);
    return r;
}

pos_t reference_memory::seq_pos_max(seq_id_t s) const {
    const auto& es = p_->seq(s, "seq_pos_max");
    pos_t r = -1;
    for (const entry& e : es) r = std::max(r, e.pos);
    return r;
}

size_t reference_memory::seq_size(seq_id_t s) const {
    return p_->seq(s, "seq_size").size();
}

}  // namespace kvc
