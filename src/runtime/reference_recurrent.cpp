// The oracle of recurrent and hybrid models: token lists, recomputed from the first token.
#include <kvcache/runtime/reference_recurrent.h>

#include <algorithm>
#include <limits>

#include <fmt/format.h>

#include "model_impl.h"

namespace kvc {

namespace {

// What running a sequence's list gave: Mamba states and the attention layers' keys and values.
struct seq_data {
    std::vector<std::pair<token_t, pos_t>> toks;
    bool valid = false;                    // the arrays below are the state after toks
    std::vector<std::vector<float>> r, s;  // [layer] Mamba states
    std::vector<std::vector<float>> k, v;  // [layer] [entry][n_head_kv * head_dim]
    std::vector<pos_t> kv_pos;             // [entry]
};

// One token, one block: the sequence's own arrays.
class seq_states final : public rt::ssm_states {
public:
    explicit seq_states(seq_data& sd) : sd_(sd) {}
    uint32_t n_blocks() const override { return 1; }
    uint32_t n_block_tokens() const override { return 1; }
    void begin(uint32_t il, rs_tensor which) override {
        cur_ = which == rs_tensor::r ? sd_.r[il] : sd_.s[il];
    }
    std::span<float> state(uint32_t) override { return cur_; }
    void store(uint32_t, uint32_t) override {}
    void finish() override {}

private:
    seq_data& sd_;
    std::span<float> cur_;
};

}  // namespace

struct reference_recurrent::impl {
    const model::impl* m;
    uint32_t n_seq_max;
    thread_pool pool;
    std::vector<seq_data> seqs;
    uint64_t n_forwards = 0;
    uint32_t n_swa = 0;  // a window (set_swa), in the layers of swa_layers (empty: every layer)
    swa_type swa = swa_type::none;
    std::vector<bool> swa_layers;

    impl(const model& md, uint32_t n, uint32_t n_threads)
        : m(&md.get()), n_seq_max(n), pool(n_threads), seqs(n) {}

    seq_data& seq(seq_id_t s, const char* what) {
        if (s < 0 || static_cast<uint32_t>(s) >= n_seq_max)
            throw error(errc::out_of_range,
                        fmt::format("reference_recurrent {}: seq_id {} not in [0, {})", what, s, n_seq_max));
        return seqs[static_cast<size_t>(s)];
    }

    void reset(seq_data& sd) const {
        const model_hparams& hp = m->hp;
        sd.r.assign(hp.n_layer, {});
        sd.s.assign(hp.n_layer, {});
        for (uint32_t il = 0; il < hp.n_layer; ++il)
            if (hp.is_recurrent(il)) {
                sd.r[il].assign(hp.n_embd_r(), 0.0f);
                sd.s[il].assign(hp.n_embd_s(), 0.0f);
            }
        sd.k.assign(hp.n_layer, {});
        sd.v.assign(hp.n_layer, {});
        sd.kv_pos.clear();
    }

    // Runs one token on sd's state and appends its keys and values; logits appended when out.
    void step(seq_data& sd, token_t tok, pos_t p, bool out, std::vector<float>& logits) {
        const model_hparams& hp = m->hp;
        const size_t hd = hp.n_embd_head, e_kv = size_t{hp.n_head_kv} * hd;
        const uint32_t group = hp.n_head_kv ? hp.n_head / hp.n_head_kv : 1;
        std::vector<float> keys, values, scratch;
        const rt::attend_fn attend = [&](uint32_t il, const float* q, const float* k, const float*,
                                         const float* v, float* o) {
            // visible: the sequence's entries at or before p (and in the window, if the layer has one),
            // then the token itself (no RoPE to redo: the keys kept are the ones attended)
            const bool windowed =
                swa != swa_type::none && (swa_layers.empty() || (il < swa_layers.size() && swa_layers[il]));
            keys.clear();
            values.clear();
            for (size_t e = 0; e < sd.kv_pos.size(); ++e) {
                if (sd.kv_pos[e] > p || (windowed && is_masked_swa(n_swa, swa, sd.kv_pos[e], p))) continue;
                keys.insert(keys.end(), &sd.k[il][e * e_kv], &sd.k[il][(e + 1) * e_kv]);
                values.insert(values.end(), &sd.v[il][e * e_kv], &sd.v[il][(e + 1) * e_kv]);
            }
            keys.insert(keys.end(), k, k + e_kv);
            values.insert(values.end(), v, v + e_kv);
            sd.k[il].insert(sd.k[il].end(), k, k + e_kv);
            sd.v[il].insert(sd.v[il].end(), v, v + e_kv);
            const size_t n_keys = keys.size() / e_kv;
            for (uint32_t h = 0; h < hp.n_head; ++h)
                rt::attend_head(q + h * hd, static_cast<uint32_t>(hd), n_keys, &keys[(h / group) * hd], e_kv,
                                &values[(h / group) * hd], e_kv, false, nullptr, o + h * hd, scratch);
        };
        if (hp.rope.type != rope_type::none)
            throw error(errc::unsupported, "reference_recurrent: attention with RoPE (use reference_memory)");
        seq_states st(sd);
        const int8_t is_out = out ? 1 : 0;
        m->forward(pool, std::span(&tok, 1), std::span(&p, 1), std::span(&is_out, 1), attend, &st, logits);
        sd.kv_pos.push_back(p);
        ++n_forwards;
    }

    // The state after sd's whole list, from zero.
    void recompute(seq_data& sd) {
        reset(sd);
        std::vector<float> none;
        for (const auto& [tok, p] : sd.toks) step(sd, tok, p, false, none);
        sd.valid = true;
    }
};

reference_recurrent::reference_recurrent(const model& m, uint32_t n_seq_max, uint32_t n_threads)
    : p_(std::make_unique<impl>(m, n_seq_max, n_threads)) {}
reference_recurrent::~reference_recurrent() = default;

decode_result reference_recurrent::decode(const batch& b) {
    const model_hparams& hp = p_->m->hp;
    std::vector<pos_t> pos;
    batch with_pos = b;
    if (!b.pos && b.n_tokens > 0 && b.token) {
        std::vector<pos_t> next(p_->n_seq_max);
        for (uint32_t s = 0; s < p_->n_seq_max; ++s) next[s] = seq_pos_max(static_cast<seq_id_t>(s)) + 1;
        for (int32_t i = 0; i < b.n_tokens; ++i) {
            const seq_id_t s = b.seq_id ? b.seq_id[i][0] : 0;
            p_->seq(s, "decode");
            pos.push_back(next[static_cast<size_t>(s)]++);
        }
        with_pos.pos = pos.data();
    }
    batch_allocr balloc;
    balloc.init(with_pos, {}, {.n_seq_max = p_->n_seq_max, .n_vocab = static_cast<int32_t>(hp.n_vocab)});
    decode_result res;
    res.n_ubatches = 1;
    for (uint32_t i = 0; i < balloc.get_n_tokens(); ++i) {
        const auto ids = balloc.seq_ids(i);
        seq_data& sd = p_->seqs[static_cast<size_t>(ids[0])];
        if (!sd.valid) p_->recompute(sd);
        const size_t before = res.logits.size();
        p_->step(sd, with_pos.token[i], balloc.pos(i), balloc.is_output(i), res.logits);
        if (res.logits.size() > before) res.output_ids.push_back(static_cast<int32_t>(i));
        sd.toks.emplace_back(with_pos.token[i], balloc.pos(i));
        for (size_t j = 1; j < ids.size(); ++j) {
            seq_data& other = p_->seqs[static_cast<size_t>(ids[j])];
            other.toks.emplace_back(with_pos.token[i], balloc.pos(i));
            other.valid = false;
        }
    }
    return res;
}

void reference_recurrent::set_swa(uint32_t n_swa, swa_type type, std::vector<bool> swa_layers) {
    p_->n_swa = n_swa;
    p_->swa = type;
    p_->swa_layers = std::move(swa_layers);
}

void reference_recurrent::clear() {
    for (seq_data& sd : p_->seqs) sd = seq_data{};
}

void reference_recurrent::seq_rm(seq_id_t s, pos_t p0, pos_t p1) {
    if (s >= 0) p_->seq(s, "seq_rm");  // validates
    const int64_t lo = p0 < 0 ? 0 : p0, hi = p1 < 0 ? std::numeric_limits<int64_t>::max() : p1;
    for (uint32_t q = 0; q < p_->n_seq_max; ++q) {
        if (s >= 0 && static_cast<seq_id_t>(q) != s) continue;
        seq_data& sd = p_->seqs[q];
        const size_t n = sd.toks.size();
        std::erase_if(sd.toks, [&](const auto& t) { return t.second >= lo && t.second < hi; });
        if (sd.toks.size() != n) sd.valid = false;
    }
}

void reference_recurrent::seq_cp(seq_id_t src, seq_id_t dst, pos_t, pos_t) {
    const seq_data from = p_->seq(src, "seq_cp");
    p_->seq(dst, "seq_cp") = from;
}

void reference_recurrent::seq_keep(seq_id_t s) {
    p_->seq(s, "seq_keep");
    for (uint32_t q = 0; q < p_->n_seq_max; ++q)
        if (static_cast<seq_id_t>(q) != s) p_->seqs[q] = seq_data{};
}

void reference_recurrent::seq_add(seq_id_t s, pos_t p0, pos_t p1, pos_t shift) {
    seq_data& sd = p_->seq(s, "seq_add");
    const int64_t lo = p0 < 0 ? 0 : p0, hi = p1 < 0 ? std::numeric_limits<int64_t>::max() : p1;
    for (auto& t : sd.toks)
        if (t.second >= lo && t.second < hi) t.second += shift;
    sd.valid = false;
}

pos_t reference_recurrent::seq_pos_max(seq_id_t s) const {
    const seq_data& sd = p_->seq(s, "seq_pos_max");
    return sd.toks.empty() ? -1 : sd.toks.back().second;
}

size_t reference_recurrent::seq_size(seq_id_t s) const {
    return p_->seq(s, "seq_size").toks.size();
}

uint64_t reference_recurrent::n_forwards() const {
    return p_->n_forwards;
}

}  // namespace kvc
