// The memory factories of `kvcache replay`: one per memory type of the `memory` line.
#include "replay_memory.h"

#include <algorithm>
#include <utility>

#include <fmt/format.h>
#include <kvcache/kv_cache_iswa.h>
#include <kvcache/memory_hybrid.h>

namespace kvc::cli {

uint32_t replay_part::used() const {
    if (recr) return recr->get_used();
    uint32_t n = 0;
    for (uint32_t s = 0; s < kv->get_n_stream(); ++s) n += kv->cells(s).get_used();
    return n;
}

namespace {

// Layers a script may declare: far above any model's, and few enough that their descriptions cost little
// (what the layers' K/V would need is the memory budget's to refuse).
constexpr uint32_t max_layers = 65536;

// budget=BYTES: the most the memory may grow to (0, the default: the machine's physical memory).
uint64_t memory_budget(const keys& k) {
    const int64_t v = k.get_int("budget", 0);
    if (v < 0) fail(fmt::format("memory: budget={} must be at least 0", v));
    return static_cast<uint64_t>(v);
}

// The attention caches of a memory, found through its layers (memory_i::layer_cache): the one that keeps
// the full-attention layers, and the sliding-window one of an iSWA pair (null without).
std::pair<const kv_cache*, const kv_cache*> attn_caches(const memory_i& mem) {
    const kv_cache *base = nullptr, *swa = nullptr;
    for (uint32_t il = 0; il < mem.n_layer(); ++il) {
        const kv_cache* c = mem.layer_cache(il);
        if (c == nullptr || c == base || c == swa) continue;
        (base == nullptr ? base : swa) = c;
        if (swa != nullptr && !swa->params().layers[il].is_swa) std::swap(base, swa);
    }
    return {base, swa};
}

// A constructor's refusal of the configuration is a script error.
template <class T, class... Args>
std::unique_ptr<T> build(Args&&... args) {
    try {
        return std::make_unique<T>(std::forward<Args>(args)...);
    } catch (const error& e) {
        fail(fmt::format("memory: {}", e.what()));
    }
}

// A pattern key: every N-th layer (the last of each group of N) is of the other kind, as llama.cpp's
// n_pattern; 0: none is.
uint32_t pattern(const keys& k, const char* name, int64_t def) {
    const int64_t v = k.get_int(name, def);
    if (v < 0 || v > (int64_t{1} << 24)) fail(fmt::format("memory: {}={} out of range", name, v));
    return static_cast<uint32_t>(v);
}

// prefix=BLOCK: a prefix cache of BLOCK-token blocks (evict=lru|slru|adaptive)
void parse_prefix(const keys& k, kv_cache_params& p) {
    const int64_t block = k.get_int("prefix", 0);
    if (block < 0 || block > (int64_t{1} << 24)) fail(fmt::format("memory: prefix={} out of range", block));
    p.prefix.enabled = block > 0;
    p.prefix.block_size = static_cast<uint32_t>(block);
    if (const auto evict = k.get("evict")) {
        if (*evict == "lru")
            p.prefix.policy = evict_policy::lru;
        else if (*evict == "slru")
            p.prefix.policy = evict_policy::slru;
        else if (*evict == "adaptive")
            p.prefix.policy = evict_policy::adaptive;
        else
            fail(fmt::format("memory: evict={} is not lru, slru or adaptive", *evict));
    }
}

// model= of a mamba or jamba model: the memory it needs (recurrent, or hybrid with the KV cache p), n_rs_seq
// rollback planes, and a runtime over it. `size` is the context's cells, as llama_n_ctx() reports them.
void make_model_state(replay_memory& r, const keys& k, kv_cache_params p) {
    recurrent_params rp = r.mdl->recr_params(p.n_seq_max);
    prefix_cache_params prefix = p.prefix;  // for both parts of a hybrid memory
    p.prefix = {};
    const auto count = [&](const char* name, int64_t def) {
        const int64_t v = k.get_int(name, def);
        if (v < 0 || v > (int64_t{1} << 24)) fail(fmt::format("memory: {}={} out of range", name, v));
        return static_cast<uint32_t>(v);
    };
    prefix.snapshot_interval = count("interval", prefix.snapshot_interval);
    prefix.max_snapshots = count("snapshots", 0);
    const int64_t rs = k.get_int("n_rs_seq", 0);
    if (rs < 0 || rs > (1 << 24)) fail("memory: n_rs_seq out of range");
    rp.n_rs_seq = static_cast<uint32_t>(rs);
    rp.memory_budget = p.memory_budget;
    const runtime_params rtp{.n_ubatch = r.n_ubatch};
    if (r.mdl->memory_kind() == model_memory::recurrent) {
        rp.prefix = prefix;
        auto rec = build<memory_recurrent>(std::move(rp));
        r.rt = std::make_unique<runtime>(*r.mdl, *rec, rtp);
        r.parts = {{.name = "rs", .used_label = "used", .recr = rec.get()}};
        r.mem = std::move(rec);
        fmt::print("memory ok size={} streams=1\n", p.kv_size);
        return;
    }
    memory_hybrid_params h;
    h.memory_budget = p.memory_budget;
    if (k.get("swa_pattern")) {  // an iSWA attention part: its layers split by the pattern
        const uint32_t n = pattern(k, "swa_pattern", 2);
        for (uint32_t il = 0; il < p.layers.size(); ++il)
            p.layers[il].is_swa = p.layers[il].has_kv && (n == 0 || il % n < n - 1);
        h.iswa = iswa_sizing{.swa_full = k.get_bool("swa_full", true), .n_ubatch = r.n_ubatch};
    }
    h.attn = std::move(p);
    h.recr = std::move(rp);
    h.prefix = prefix;
    auto hyb = build<memory_hybrid>(std::move(h));
    r.rt = std::make_unique<runtime>(*r.mdl, *hyb, rtp);
    // `show` counts the attention cells, as llama.cpp; `cells part=rs` lists the states
    if (const auto [base, swa] = attn_caches(*hyb); swa != nullptr) {
        r.parts = {{.name = "base", .used_label = "used", .kv = base},
                   {.name = "swa", .used_label = "used_swa", .kv = swa},
                   {.name = "rs", .used_label = "", .recr = &hyb->get_recr()}};
        r.mem = std::move(hyb);
        fmt::print("memory ok size={} streams={} swa_size={}\n", base->get_size() * base->get_n_stream(),
                   base->get_n_stream(), swa->get_size() * swa->get_n_stream());
        return;
    }
    const kv_cache& attn = *attn_caches(*hyb).first;
    r.parts = {{.name = "kv", .used_label = "used", .kv = &attn},
               {.name = "rs", .used_label = "", .recr = &hyb->get_recr()}};
    r.mem = std::move(hyb);
    fmt::print("memory ok size={} streams={}\n", attn.get_size() * attn.get_n_stream(), attn.get_n_stream());
}

// memory type=kv: one KV cache; with model=, the model's layers, and a runtime that decodes through it
// (a mamba or jamba model without type=: the memory it needs); with prefix=BLOCK, a prefix cache of
// BLOCK-token blocks (evict=lru|slru).
void make_kv(replay_memory& r, const keys& k, kv_cache_params p, bool typed) {
    parse_prefix(k, p);
    try {
        if (const auto path = k.get("model")) {
            r.mdl = std::make_unique<model>(model::load(*path));
            p.layers = r.mdl->layers();
            r.n_layer = static_cast<uint32_t>(p.layers.size());
            p.prefix.n_vocab = static_cast<int32_t>(r.mdl->hparams().n_vocab);
            if (r.mdl->memory_kind() != model_memory::kv) {
                const bool mamba = r.mdl->memory_kind() == model_memory::recurrent;
                if (typed)
                    fail(fmt::format("memory: {} is a {} model: leave out type= (its memory is {})", *path,
                                     mamba ? "mamba" : "jamba", mamba ? "recurrent" : "hybrid"));
                if (mamba && (k.get("swa_pattern") || k.get("swa_full")))
                    fail(
                        fmt::format("memory: {} is a mamba model: swa_pattern= and swa_full= are for the "
                                    "attention layers of a jamba model",
                                    *path));
                make_model_state(r, k, std::move(p));
                return;
            }
        }
        for (const char* key : {"swa_pattern", "swa_full"})
            if (k.get(key))
                fail(fmt::format("memory: {}= is for type=iswa or the attention layers of a jamba model",
                                 key));
        for (const char* key : {"interval", "snapshots"})
            if (k.get(key))
                fail(fmt::format("memory: {}= is for the snapshots of a mamba or jamba model", key));
        if (k.get("n_rs_seq"))
            fail(
                "memory: n_rs_seq is for recurrent state (type=recurrent, hybrid, or a "
                "mamba or jamba model)");
        auto cache = std::make_unique<kv_cache>(p);
        if (r.mdl) r.rt = std::make_unique<runtime>(*r.mdl, *cache, runtime_params{.n_ubatch = r.n_ubatch});
        r.parts = {{.name = "kv", .used_label = "used", .kv = cache.get()}};
        r.mem = std::move(cache);
    } catch (const error& e) {
        fail(fmt::format("memory: {}", e.what()));
    }
    const kv_cache& c = *r.parts[0].kv;
    // size: every cell of every stream, as llama_n_ctx() reports it
    fmt::print("memory ok size={} streams={}\n", c.get_size() * c.get_n_stream(), c.get_n_stream());
}

// memory type=iswa: layer il is a sliding-window layer unless il % swa_pattern == swa_pattern - 1
void make_iswa(replay_memory& r, const keys& k, kv_cache_params p) {
    const uint32_t n = pattern(k, "swa_pattern", 2);
    for (uint32_t il = 0; il < p.layers.size(); ++il) p.layers[il].is_swa = n == 0 || il % n < n - 1;
    parse_prefix(k, p);
    auto iswa = build<kv_cache_iswa>(kv_cache_iswa_params{
        .kv = std::move(p), .sizing = {.swa_full = k.get_bool("swa_full", true), .n_ubatch = r.n_ubatch}});
    const kv_cache &base = iswa->get_base(), &swa = iswa->get_swa();
    r.parts = {{.name = "base", .used_label = "used", .kv = &base},
               {.name = "swa", .used_label = "used_swa", .kv = &swa}};
    r.mem = std::move(iswa);
    fmt::print("memory ok size={} streams={} swa_size={}\n", base.get_size() * base.get_n_stream(),
               base.get_n_stream(), swa.get_size() * swa.get_n_stream());
}

// memory type=hybrid: layer il is an attention layer if il % attn_pattern == attn_pattern - 1, else a
// recurrent one with rows of n_embd_r and n_embd_s f32 values
void make_hybrid(replay_memory& r, const keys& k, kv_cache_params p) {
    const uint32_t n = pattern(k, "attn_pattern", 2);
    memory_hybrid_params h;
    h.recr.n_seq_max = p.n_seq_max;
    const int64_t re = k.get_int("n_embd_r", 8), se = k.get_int("n_embd_s", 16),
                  rs = k.get_int("n_rs_seq", 0);
    if (re < 0 || se < 0 || rs < 0 || re > (1 << 24) || se > (1 << 24) || rs > (1 << 24))
        fail("memory: n_embd_r, n_embd_s and n_rs_seq must be in [0, 2^24]");
    h.recr.n_rs_seq = static_cast<uint32_t>(rs);
    for (uint32_t il = 0; il < p.layers.size(); ++il) {
        const bool attn = n != 0 && il % n == n - 1;
        p.layers[il].has_kv = attn;
        h.recr.layers.push_back(attn ? recurrent_layer_desc{}
                                     : recurrent_layer_desc{.n_embd_r = static_cast<uint32_t>(re),
                                                            .n_embd_s = static_cast<uint32_t>(se)});
    }
    h.memory_budget = p.memory_budget;
    h.attn = std::move(p);
    auto hyb = build<memory_hybrid>(std::move(h));
    // replay's hybrid has a plain KV cache as its attention part (no iswa key)
    const kv_cache& attn = *attn_caches(*hyb).first;
    const memory_recurrent& recr = hyb->get_recr();
    r.parts = {{.name = "kv", .used_label = "used", .kv = &attn},
               {.name = "rs", .used_label = "used_rs", .recr = &recr}};
    r.mem = std::move(hyb);
    fmt::print("memory ok size={} streams={} rs_size={}\n", attn.get_size() * attn.get_n_stream(),
               attn.get_n_stream(), recr.get_size());
}

// memory type=recurrent: n_layer layers, each with an r row of n_embd_r and an s row of n_embd_s f32
// values; one cell per sequence; n_rs_seq rollback planes.
void make_recurrent(replay_memory& r, const words& w) {
    const keys k(w, 1,
                 {"type", "n_seq_max", "n_ubatch", "n_layer", "n_embd_r", "n_embd_s", "n_rs_seq", "budget"},
                 "memory");
    const auto count = [&](const char* name, int64_t def, int64_t lo) {
        const int64_t v = k.get_int(name, def);
        if (v < lo || v > (int64_t{1} << 24)) fail(fmt::format("memory: {}={} out of range", name, v));
        return static_cast<uint32_t>(v);
    };
    recurrent_params p;
    p.n_seq_max = count("n_seq_max", 1, 1);
    p.n_rs_seq = count("n_rs_seq", 0, 0);
    const uint32_t n_layer = count("n_layer", 2, 1);
    if (n_layer > max_layers)
        fail(fmt::format("memory: n_layer={} is over the limit of {}", n_layer, max_layers));
    const recurrent_layer_desc d{.n_embd_r = count("n_embd_r", 8, 0), .n_embd_s = count("n_embd_s", 16, 0)};
    p.layers.assign(n_layer, d);
    p.memory_budget = memory_budget(k);
    r.n_layer = n_layer;
    r.n_ubatch = count("n_ubatch", 512, 1);
    auto rec = build<memory_recurrent>(p);
    r.n_seq_max = p.n_seq_max;
    r.parts = {{.name = "rs", .used_label = "used", .recr = rec.get()}};
    fmt::print("memory ok size={} streams=1\n", rec->get_size());
    r.mem = std::move(rec);
}

swa_type parse_swa_type(const std::string& name) {
    if (name == "none") return swa_type::none;
    if (name == "standard") return swa_type::standard;
    if (name == "chunked") return swa_type::chunked;
    if (name == "symmetric") return swa_type::symmetric;
    fail(fmt::format("memory: unknown swa_type '{}'", name));
}

}  // namespace

replay_memory make_replay_memory(const words& w) {
    replay_memory r;
    for (size_t i = 1; i < w.size(); ++i)
        if (w[i] == "type=recurrent") {
            make_recurrent(r, w);
            return r;
        }
    // the attention memories share the KV cache keys
    std::string type = "kv";
    bool typed = false;
    for (size_t i = 1; i < w.size(); ++i)
        if (w[i].substr(0, 5) == "type=") {
            type = std::string(w[i].substr(5));
            typed = true;
        }
    if (type != "kv" && type != "iswa" && type != "hybrid")
        fail(fmt::format("memory: unknown type '{}'", type));
    std::vector<const char*> allowed = {"type",    "n_ctx",    "n_seq_max", "unified",   "n_ubatch",
                                        "type_k",  "type_v",   "v_trans",   "swa_type",  "n_swa",
                                        "n_layer", "n_embd_k", "n_embd_v",  "n_head_kv", "budget"};
    if (type == "kv")
        allowed.insert(allowed.end(), {"model", "n_rs_seq", "prefix", "evict", "interval", "snapshots",
                                       "swa_pattern", "swa_full"});
    if (type == "iswa") allowed.insert(allowed.end(), {"swa_pattern", "swa_full", "prefix", "evict"});
    if (type == "hybrid") allowed.insert(allowed.end(), {"attn_pattern", "n_embd_r", "n_embd_s", "n_rs_seq"});
    const keys k(w, 1, allowed, "memory");
    const auto positive = [&](const char* name, int64_t def) {
        const int64_t v = k.get_int(name, def);
        if (v < 1 || v > (int64_t{1} << 24)) fail(fmt::format("memory: {}={} out of range", name, v));
        return static_cast<uint32_t>(v);
    };
    const uint32_t n_ctx = positive("n_ctx", 256), n_seq_max = positive("n_seq_max", 1);
    const uint32_t n_layer = positive("n_layer", 2), n_head_kv = positive("n_head_kv", 2);
    if (n_layer > max_layers)
        fail(fmt::format("memory: n_layer={} is over the limit of {}", n_layer, max_layers));
    const uint32_t n_embd_k = positive("n_embd_k", 32), n_embd_v = positive("n_embd_v", 32);
    r.n_ubatch = positive("n_ubatch", 512);
    if (n_embd_k % n_head_kv || n_embd_v % n_head_kv)
        fail(fmt::format("memory: n_embd_k {} and n_embd_v {} must be multiples of n_head_kv {}", n_embd_k,
                         n_embd_v, n_head_kv));
    kv_cache_params p;
    const auto parse_type = [&](const char* name) {
        const auto t = dtype_from_name(k.get(name).value_or("f16"));
        if (!t) fail(fmt::format("memory: {} must be f32, f16, bf16, q8_0 or q4_0", name));
        return *t;
    };
    p.type_k = parse_type("type_k");
    p.type_v = parse_type("type_v");
    p.v_trans = k.get_bool("v_trans", false);
    p.unified = k.get_bool("unified", true);
    p.n_seq_max = n_seq_max;
    // as llama.cpp: n_ctx rounded up to 256 cells, split per stream when not unified
    const uint32_t per = p.unified ? n_ctx : std::max(1u, n_ctx / n_seq_max);
    p.kv_size = (per + 255) / 256 * 256;
    p.swa = parse_swa_type(k.get("swa_type").value_or("none"));
    const int64_t n_swa = k.get_int("n_swa", 0);
    if (n_swa < 0 || n_swa > INT32_MAX) fail("memory: n_swa out of range");
    p.n_swa = static_cast<uint32_t>(n_swa);
    const uint32_t head_k = n_embd_k / n_head_kv;
    const rope_params rope{.type = rope_type::normal, .n_rot = static_cast<int32_t>(head_k)};
    p.layers.assign(n_layer, layer_desc{.n_head_kv = n_head_kv,
                                        .n_embd_head_k = head_k,
                                        .n_embd_head_v = n_embd_v / n_head_kv,
                                        .rope = rope});
    p.memory_budget = memory_budget(k);
    r.n_seq_max = n_seq_max;
    r.n_layer = static_cast<uint32_t>(p.layers.size());
    if (type == "iswa")
        make_iswa(r, k, std::move(p));
    else if (type == "hybrid")
        make_hybrid(r, k, std::move(p));
    else
        make_kv(r, k, std::move(p), typed);
    return r;
}

}  // namespace kvc::cli
