// kvcache replay SCRIPT: runs an op script (docs/op-scripts.md, format v1) against a fresh memory and
// prints one canonical result line per operation. Script errors: `error line N: ...` on stderr, exit 2.
#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <kvcache/batch.h>
#include <kvcache/kv_cache.h>
#include <kvcache/kv_cache_iswa.h>
#include <kvcache/memory_hybrid.h>
#include <kvcache/memory_recurrent.h>
#include <kvcache/runtime/runtime.h>
#include <kvcache/session.h>
#include <kvcache/state.h>

#include "commands.h"

namespace kvc::cli {
namespace {

// A script error: stops the run with exit status 2.
struct script_error {
    std::string what;
};

[[noreturn]] void fail(const std::string& what) {
    throw script_error{what};
}

int64_t parse_int(std::string_view s, const std::string& what) {
    int64_t v = 0;
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec != std::errc() || end != s.data() + s.size() || s.empty())
        fail(fmt::format("{}: '{}' is not an integer", what, s));
    return v;
}

int32_t parse_i32(std::string_view s, const std::string& what) {
    const int64_t v = parse_int(s, what);
    if (v < INT32_MIN || v > INT32_MAX) fail(fmt::format("{}: {} does not fit int32", what, v));
    return static_cast<int32_t>(v);
}

std::vector<std::string_view> split(std::string_view s, char sep) {
    std::vector<std::string_view> out;
    size_t start = 0;
    while (true) {
        const size_t at = s.find(sep, start);
        out.push_back(s.substr(start, at == std::string_view::npos ? std::string_view::npos : at - start));
        if (at == std::string_view::npos) return out;
        start = at + 1;
    }
}

// Keys of one line: name=value pairs, each allowed key used at most once.
struct keys {
    std::map<std::string, std::string, std::less<>> values;

    keys(const std::vector<std::string_view>& words, size_t first, std::span<const char* const> allowed,
         const char* op) {
        for (size_t i = first; i < words.size(); ++i) {
            const size_t eq = words[i].find('=');
            if (eq == std::string_view::npos)
                fail(fmt::format("{}: expected key=value, got '{}'", op, words[i]));
            const std::string name(words[i].substr(0, eq));
            bool known = false;
            for (const char* a : allowed) known |= name == a;
            if (!known) fail(fmt::format("{}: unknown key '{}'", op, name));
            if (!values.emplace(name, std::string(words[i].substr(eq + 1))).second)
                fail(fmt::format("{}: key '{}' given twice", op, name));
        }
    }
    keys(const std::vector<std::string_view>& words, size_t first, std::initializer_list<const char*> allowed,
         const char* op)
        : keys(words, first, std::span<const char* const>(allowed.begin(), allowed.size()), op) {}
    std::optional<std::string> get(std::string_view name) const {
        const auto it = values.find(name);
        if (it == values.end()) return std::nullopt;
        return it->second;
    }
    int64_t get_int(std::string_view name, int64_t def) const {
        const auto v = get(name);
        return v ? parse_int(*v, std::string(name)) : def;
    }
    bool get_bool(std::string_view name, bool def) const {
        const int64_t v = get_int(name, def ? 1 : 0);
        if (v != 0 && v != 1) fail(fmt::format("{} must be 0 or 1", name));
        return v == 1;
    }
};

uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// Deterministic K/V value of (layer, sequence set, position, dim, K or V) in [-1, 1).
float synth_value(uint32_t layer, uint64_t seq_key, pos_t pos, uint32_t dim, bool is_v) {
    uint64_t h = splitmix64(layer * 0x100000001b3ull ^ splitmix64(seq_key));
    h = splitmix64(h ^ (static_cast<uint64_t>(static_cast<uint32_t>(pos)) << 20) ^ (uint64_t{dim} << 1) ^
                   (is_v ? 1 : 0));
    return static_cast<float>(h >> 40) / static_cast<float>(1 << 23) - 1.0f;
}

// The engine side of a recurrent memory without a model (the contract in memory_recurrent.h): each token
// folds a deterministic value of (layer, sequence set, position, dim) into the state, new = old / 2 + v,
// so that state bytes depend on the whole history and are reproducible.
void recurrent_ubatch(memory_recurrent_context& ctx, const std::vector<uint64_t>& seq_key) {
    const memory_recurrent& mem = ctx.memory();
    const ubatch& ub = ctx.get_ubatch();
    const uint32_t head = ctx.get_head(), n = ctx.get_n_rs(), B = ub.n_seqs, T = ub.n_seq_tokens;
    const uint32_t k = mem.get_n_rs_seq(), size = mem.get_size();
    for (uint32_t il : mem.layer_ids())
        for (const bool is_s : {false, true}) {
            if (!(is_s ? mem.has_s(il) : mem.has_r(il))) continue;
            const tensor_view v = is_s ? ctx.get_s(il) : ctx.get_r(il);
            const auto width = static_cast<size_t>(v.ne[0]);
            const auto row = [&](int64_t i) {
                return reinterpret_cast<float*>(v.data + static_cast<size_t>(i) * v.nb[1]);
            };
            if (ctx.get_rs_z() >= 0) std::fill_n(row(ctx.get_rs_z()), width, 0.0f);
            std::vector<std::vector<float>> src(n), hist(ctx.hist_copies().size());
            for (uint32_t i = 0; i < n; ++i) src[i].assign(row(ctx.s_copy(i)), row(ctx.s_copy(i)) + width);
            for (size_t j = 0; j < hist.size(); ++j)
                hist[j].assign(row(ctx.hist_copies()[j].src), row(ctx.hist_copies()[j].src) + width);
            for (uint32_t i = B; i < n; ++i) std::copy(src[i].begin(), src[i].end(), row(head + i));
            for (uint32_t b = 0; b < B; ++b) {
                std::vector<float>& x = src[b];
                for (uint32_t t = 0; t < T; ++t) {
                    const uint32_t tok = b * T + t;
                    const uint64_t key = seq_key[static_cast<size_t>(ub.batch_idx[tok])];
                    for (size_t d = 0; d < width; ++d)
                        x[d] =
                            0.5f * x[d] + synth_value(il, key, ub.pos[tok], static_cast<uint32_t>(d), is_s);
                    const uint32_t back = T - 1 - t;  // plane of this token's state
                    if (back <= k) std::copy(x.begin(), x.end(), row(int64_t{back} * size + head + b));
                }
            }
            for (size_t j = 0; j < hist.size(); ++j)
                std::copy(hist[j].begin(), hist[j].end(), row(ctx.hist_copies()[j].dst));
        }
}

// FNV-1a of bytes: a short fingerprint for `digest`.
uint64_t fnv1a(std::span<const uint8_t> bytes) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (uint8_t b : bytes) h = (h ^ b) * 0x100000001b3ull;
    return h;
}

class replayer {
public:
    void line(std::string_view text) {
        const size_t hash = text.find('#');
        if (hash != std::string_view::npos) text = text.substr(0, hash);
        std::vector<std::string_view> words;
        for (std::string_view w : split(text, ' '))
            for (std::string_view t : split(w, '\t'))
                if (!t.empty()) words.push_back(t);
        if (words.empty()) return;
        const std::string_view op = words[0];
        if (op == "memory") return memory(words);
        if (!mem_) fail(fmt::format("'{}' before 'memory'", op));
        if (op == "decode") return decode(words);
        if (op == "rm") return rm(words);
        if (op == "cp") return cp(words);
        if (op == "keep") return keep(words);
        if (op == "add") return add(words);
        if (op == "div") return div(words);
        if (op == "clear") return clear(words);
        if (op == "update") return update(words);
        if (op == "show") return show(words);
        if (op == "cells") return cells(words);
        if (op == "size") return size(words);
        if (op == "save") return save(words);
        if (op == "load") return load(words);
        if (op == "digest") return digest(words);
        fail(fmt::format("unknown operation '{}'", op));
    }

private:
    struct group {  // SEQS@POS:TOKENS of a decode line
        std::vector<seq_id_t> seqs;
        std::optional<pos_t> pos;
        std::vector<token_t> tokens;
    };

    static void arity(const std::vector<std::string_view>& w, size_t n, const char* usage) {
        if (w.size() != n) fail(fmt::format("usage: {}", usage));
    }

    void memory(const std::vector<std::string_view>& w) {
        if (mem_) fail("'memory' given twice");
        for (size_t i = 1; i < w.size(); ++i)
            if (w[i] == "type=recurrent") return memory_recurrent_line(w);
        std::string type = "kv";
        for (size_t i = 1; i < w.size(); ++i)
            if (w[i].substr(0, 5) == "type=") type = std::string(w[i].substr(5));
        if (type != "kv" && type != "iswa" && type != "hybrid")
            fail(fmt::format("memory: unknown type '{}'", type));
        std::vector<const char*> allowed = {"type",    "n_ctx",    "n_seq_max", "unified",  "n_ubatch",
                                            "type_k",  "type_v",   "v_trans",   "swa_type", "n_swa",
                                            "n_layer", "n_embd_k", "n_embd_v",  "n_head_kv"};
        if (type == "kv") allowed.push_back("model");
        if (type == "iswa") allowed.insert(allowed.end(), {"swa_pattern", "swa_full"});
        if (type == "hybrid")
            allowed.insert(allowed.end(), {"attn_pattern", "n_embd_r", "n_embd_s", "n_rs_seq"});
        const keys k(w, 1, allowed, "memory");
        const auto positive = [&](const char* name, int64_t def) {
            const int64_t v = k.get_int(name, def);
            if (v < 1 || v > (int64_t{1} << 24)) fail(fmt::format("memory: {}={} out of range", name, v));
            return static_cast<uint32_t>(v);
        };
        const uint32_t n_ctx = positive("n_ctx", 256), n_seq_max = positive("n_seq_max", 1);
        const uint32_t n_layer = positive("n_layer", 2), n_head_kv = positive("n_head_kv", 2);
        const uint32_t n_embd_k = positive("n_embd_k", 32), n_embd_v = positive("n_embd_v", 32);
        n_ubatch_ = positive("n_ubatch", 512);
        if (n_embd_k % n_head_kv || n_embd_v % n_head_kv)
            fail(fmt::format("memory: n_embd_k {} and n_embd_v {} must be multiples of n_head_kv {}",
                             n_embd_k, n_embd_v, n_head_kv));
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
        const std::string swa = k.get("swa_type").value_or("none");
        if (swa == "none")
            p.swa = swa_type::none;
        else if (swa == "standard")
            p.swa = swa_type::standard;
        else if (swa == "chunked")
            p.swa = swa_type::chunked;
        else if (swa == "symmetric")
            p.swa = swa_type::symmetric;
        else
            fail(fmt::format("memory: unknown swa_type '{}'", swa));
        const int64_t n_swa = k.get_int("n_swa", 0);
        if (n_swa < 0 || n_swa > INT32_MAX) fail("memory: n_swa out of range");
        p.n_swa = static_cast<uint32_t>(n_swa);
        const uint32_t head_k = n_embd_k / n_head_kv;
        const rope_params rope{.type = rope_type::normal, .n_rot = static_cast<int32_t>(head_k)};
        p.layers.assign(n_layer, layer_desc{.n_head_kv = n_head_kv,
                                            .n_embd_head_k = head_k,
                                            .n_embd_head_v = n_embd_v / n_head_kv,
                                            .rope = rope});
        n_seq_max_ = n_seq_max;
        n_layer_ = static_cast<uint32_t>(p.layers.size());
        if (type == "iswa") return memory_iswa_line(k, std::move(p));
        if (type == "hybrid") return memory_hybrid_line(k, std::move(p));
        try {
            if (const auto path = k.get("model")) {  // the layers are the model's; decode runs it
                model_ = std::make_unique<model>(model::load(*path));
                p.layers = model_->layers();
                n_layer_ = static_cast<uint32_t>(p.layers.size());
            }
            cache_ = std::make_unique<kv_cache>(p);
            if (model_)
                rt_ = std::make_unique<runtime>(*model_, *cache_, runtime_params{.n_ubatch = n_ubatch_});
        } catch (const error& e) {
            fail(fmt::format("memory: {}", e.what()));
        }
        mem_ = cache_.get();
        // size: every cell of every stream, as llama_n_ctx() reports it
        fmt::print("memory ok size={} streams={}\n", cache_->get_size() * cache_->get_n_stream(),
                   cache_->get_n_stream());
    }

    // A pattern key: every N-th layer (the last of each group of N) is of the other kind, as llama.cpp's
    // n_pattern; 0: none is.
    static uint32_t pattern(const keys& k, const char* name, int64_t def) {
        const int64_t v = k.get_int(name, def);
        if (v < 0 || v > (int64_t{1} << 24)) fail(fmt::format("memory: {}={} out of range", name, v));
        return static_cast<uint32_t>(v);
    }

    // memory type=iswa: layer il is a sliding-window layer unless il % swa_pattern == swa_pattern - 1
    void memory_iswa_line(const keys& k, kv_cache_params p) {
        const uint32_t n = pattern(k, "swa_pattern", 2);
        for (uint32_t il = 0; il < p.layers.size(); ++il) p.layers[il].is_swa = n == 0 || il % n < n - 1;
        try {
            iswa_ = std::make_unique<kv_cache_iswa>(kv_cache_iswa_params{
                .kv = std::move(p), .swa_full = k.get_bool("swa_full", true), .n_ubatch = n_ubatch_});
        } catch (const error& e) {
            fail(fmt::format("memory: {}", e.what()));
        }
        mem_ = iswa_.get();
        const kv_cache& base = iswa_->get_base();
        fmt::print("memory ok size={} streams={} swa_size={}\n", base.get_size() * base.get_n_stream(),
                   base.get_n_stream(), iswa_->get_swa().get_size() * iswa_->get_swa().get_n_stream());
    }

    // memory type=hybrid: layer il is an attention layer if il % attn_pattern == attn_pattern - 1, else a
    // recurrent one with rows of n_embd_r and n_embd_s f32 values
    void memory_hybrid_line(const keys& k, kv_cache_params p) {
        const uint32_t n = pattern(k, "attn_pattern", 2);
        memory_hybrid_params h;
        h.recr.n_seq_max = p.n_seq_max;
        const int64_t r = k.get_int("n_embd_r", 8), sz = k.get_int("n_embd_s", 16),
                      rs = k.get_int("n_rs_seq", 0);
        if (r < 0 || sz < 0 || rs < 0 || r > (1 << 24) || sz > (1 << 24) || rs > (1 << 24))
            fail("memory: n_embd_r, n_embd_s and n_rs_seq must be in [0, 2^24]");
        h.recr.n_rs_seq = static_cast<uint32_t>(rs);
        for (uint32_t il = 0; il < p.layers.size(); ++il) {
            const bool attn = n != 0 && il % n == n - 1;
            p.layers[il].has_kv = attn;
            h.recr.layers.push_back(attn ? recurrent_layer_desc{}
                                         : recurrent_layer_desc{.n_embd_r = static_cast<uint32_t>(r),
                                                                .n_embd_s = static_cast<uint32_t>(sz)});
        }
        h.attn = std::move(p);
        try {
            hyb_ = std::make_unique<memory_hybrid>(std::move(h));
        } catch (const error& e) {
            fail(fmt::format("memory: {}", e.what()));
        }
        mem_ = hyb_.get();
        const auto& attn = dynamic_cast<const kv_cache&>(hyb_->get_attn());
        fmt::print("memory ok size={} streams={} rs_size={}\n", attn.get_size() * attn.get_n_stream(),
                   attn.get_n_stream(), hyb_->get_recr().get_size());
    }

    // memory type=recurrent: n_layer layers, each with an r row of n_embd_r and an s row of n_embd_s f32
    // values; one cell per sequence; n_rs_seq rollback planes.
    void memory_recurrent_line(const std::vector<std::string_view>& w) {
        const keys k(w, 1, {"type", "n_seq_max", "n_ubatch", "n_layer", "n_embd_r", "n_embd_s", "n_rs_seq"},
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
        const recurrent_layer_desc d{.n_embd_r = count("n_embd_r", 8, 0),
                                     .n_embd_s = count("n_embd_s", 16, 0)};
        p.layers.assign(n_layer, d);
        n_layer_ = n_layer;
        n_ubatch_ = count("n_ubatch", 512, 1);
        try {
            rec_ = std::make_unique<memory_recurrent>(p);
        } catch (const error& e) {
            fail(fmt::format("memory: {}", e.what()));
        }
        n_seq_max_ = p.n_seq_max;
        mem_ = rec_.get();
        fmt::print("memory ok size={} streams=1\n", rec_->get_size());
    }

    void decode(const std::vector<std::string_view>& w) {
        if (w.size() < 2) fail("usage: decode SEQS@POS:TOKENS [...] [out=last|all|none]");
        std::string out = "last";
        std::vector<group> groups;
        for (size_t i = 1; i < w.size(); ++i) {
            if (w[i].substr(0, 4) == "out=") {
                out = std::string(w[i].substr(4));
                if (out != "last" && out != "all" && out != "none")
                    fail(fmt::format("decode: out={} unknown", out));
                if (i + 1 != w.size()) fail("decode: out= must come last");
                continue;
            }
            const size_t at = w[i].find('@'), colon = w[i].find(':');
            if (at == std::string_view::npos || colon == std::string_view::npos || colon < at)
                fail(fmt::format("decode: group '{}' is not SEQS@POS:TOKENS", w[i]));
            group g;
            for (std::string_view s : split(w[i].substr(0, at), '+'))
                g.seqs.push_back(parse_i32(s, "decode seq"));
            const std::string_view pos = w[i].substr(at + 1, colon - at - 1);
            if (pos != "auto") g.pos = parse_i32(pos, "decode pos");
            for (std::string_view t : split(w[i].substr(colon + 1), ','))
                g.tokens.push_back(parse_i32(t, "decode token"));
            groups.push_back(std::move(g));
        }
        if (groups.empty()) fail("decode: no group");

        // the memory's pending work first, as an engine's decode does
        if (auto up = mem_->init_update(false); up->get_status() == memory_status::success) up->apply();

        size_t n = 0, max_seqs = n_seq_max_;
        for (const group& g : groups) {
            n += g.tokens.size();
            max_seqs = std::max(max_seqs, g.seqs.size());
        }
        batch_storage b = batch::init(static_cast<int32_t>(n), 0, static_cast<int32_t>(max_seqs));
        std::vector<uint64_t> seq_key;  // per token: its sequence set, for the synthetic rows
        try {
            for (const group& g : groups) {
                pos_t p = g.pos ? *g.pos
                                : (g.seqs[0] >= 0 && static_cast<uint32_t>(g.seqs[0]) < n_seq_max_
                                       ? mem_->seq_pos_max(g.seqs[0]) + 1
                                       : 0);
                uint64_t key = 0;
                for (seq_id_t s : g.seqs)
                    key = splitmix64(key ^ static_cast<uint64_t>(static_cast<uint32_t>(s)));
                for (token_t t : g.tokens) {
                    b.add(t, p++, g.seqs, out == "all");
                    seq_key.push_back(key);
                }
            }
        } catch (const error& e) {
            fmt::print("decode failed invalid-batch: {}\n", e.what());
            return;
        }
        if (out == "last") b.set_output(static_cast<int32_t>(n) - 1, true);
        if (rt_) {
            decode_model(b.view());
            return;
        }
        batch_allocr a;
        try {
            a.init(b.view(), positions_of(mem_), {.n_seq_max = n_seq_max_});
        } catch (const error& e) {
            fmt::print("decode failed invalid-batch: {}\n", e.what());
            return;
        }
        auto ctx = mem_->init_batch(a, n_ubatch_, false);
        if (is_fail(ctx->get_status())) {
            fmt::print("decode failed no-slot\n");
            return;
        }
        size_t n_ub = 0;
        do {
            ctx->apply();
            ++n_ub;
            // the engine side, layer by layer, whatever the memory kind
            if (memory_recurrent_context* rc = ctx->get_recr()) recurrent_ubatch(*rc, seq_key);
            for (uint32_t il = 0; il < n_layer_; ++il)
                if (kv_cache_context* kc = ctx->get_attn(il)) write_kv(*kc, il, seq_key);
        } while (ctx->next());
        fmt::print("decode ok ubatches={}\n", n_ub);
    }

    // the engine side of an attention layer without a model: synthetic K/V rows of the current ubatch
    static void write_kv(kv_cache_context& kc, uint32_t il, const std::vector<uint64_t>& seq_key) {
        const ubatch& ub = kc.get_ubatch();
        const layer_desc& d = kc.cache().params().layers[il];
        const uint32_t e_k = d.n_head_kv * d.n_embd_head_k, e_v = d.n_head_kv * d.n_embd_head_v;
        std::vector<float> k(size_t{ub.n_tokens} * e_k), v(size_t{ub.n_tokens} * e_v);
        for (uint32_t t = 0; t < ub.n_tokens; ++t) {
            const uint64_t key = seq_key[static_cast<size_t>(ub.batch_idx[t])];
            for (uint32_t i = 0; i < e_k; ++i) k[t * e_k + i] = synth_value(il, key, ub.pos[t], i, false);
            for (uint32_t i = 0; i < e_v; ++i) v[t * e_v + i] = synth_value(il, key, ub.pos[t], i, true);
        }
        kc.cpy_k(il, const_tensor_view::contiguous(dtype::f32, reinterpret_cast<const std::byte*>(k.data()),
                                                   e_k, ub.n_tokens));
        kc.cpy_v(il, const_tensor_view::contiguous(dtype::f32, reinterpret_cast<const std::byte*>(v.data()),
                                                   e_v, ub.n_tokens));
    }

    // decode with a model: the real forward pass, then one `out` line per output row in batch order
    void decode_model(const batch& b) {
        decode_result res;
        try {
            res = rt_->decode(b);
        } catch (const error& e) {
            fmt::print("decode failed invalid-batch: {}\n", e.what());
            return;
        }
        if (is_fail(res.status)) {
            fmt::print("decode failed no-slot\n");
            return;
        }
        fmt::print("decode ok ubatches={}\n", res.n_ubatches);
        const uint32_t n_vocab = model_->hparams().n_vocab;
        for (size_t i = 0; i < res.output_ids.size(); ++i) {
            const auto idx = static_cast<size_t>(res.output_ids[i]);
            const auto l = res.row(i, n_vocab);
            double sum = 0;
            for (float x : l) sum += x;
            fmt::print("out seq={} pos={} sum={:.6f} argmax={} first4=[{:.6f} {:.6f} {:.6f} {:.6f}]\n",
                       b.seq_id[idx][0], b.pos[idx], sum, std::max_element(l.begin(), l.end()) - l.begin(),
                       l[0], l[1], l[2], l[3]);
        }
    }

    // Runs a memory call; a rejection prints `<op> failed: <why>` and the script goes on.
    template <class F>
    void guarded(const char* op, F&& f) {
        try {
            f();
        } catch (const error& e) {
            fmt::print("{} failed: {}\n", op, e.what());
        }
    }

    void rm(const std::vector<std::string_view>& w) {
        arity(w, 4, "rm SEQ P0 P1");
        const seq_id_t s = parse_i32(w[1], "rm seq");
        const pos_t p0 = parse_i32(w[2], "rm p0"), p1 = parse_i32(w[3], "rm p1");
        guarded("rm", [&] { fmt::print("rm -> {}\n", mem_->seq_rm(s, p0, p1) ? "true" : "false"); });
    }
    void cp(const std::vector<std::string_view>& w) {
        arity(w, 5, "cp SRC DST P0 P1");
        const seq_id_t a = parse_i32(w[1], "cp src"), b = parse_i32(w[2], "cp dst");
        const pos_t p0 = parse_i32(w[3], "cp p0"), p1 = parse_i32(w[4], "cp p1");
        guarded("cp", [&] {
            mem_->seq_cp(a, b, p0, p1);
            fmt::print("cp ok\n");
        });
    }
    void keep(const std::vector<std::string_view>& w) {
        arity(w, 2, "keep SEQ");
        const seq_id_t s = parse_i32(w[1], "keep seq");
        guarded("keep", [&] {
            mem_->seq_keep(s);
            fmt::print("keep ok\n");
        });
    }
    void add(const std::vector<std::string_view>& w) {
        arity(w, 5, "add SEQ P0 P1 DELTA");
        const seq_id_t s = parse_i32(w[1], "add seq");
        const pos_t p0 = parse_i32(w[2], "add p0"), p1 = parse_i32(w[3], "add p1"),
                    d = parse_i32(w[4], "add delta");
        guarded("add", [&] {
            mem_->seq_add(s, p0, p1, d);
            fmt::print("add ok\n");
        });
    }
    void div(const std::vector<std::string_view>& w) {
        arity(w, 5, "div SEQ P0 P1 D");
        const seq_id_t s = parse_i32(w[1], "div seq");
        const pos_t p0 = parse_i32(w[2], "div p0"), p1 = parse_i32(w[3], "div p1");
        const int d = parse_i32(w[4], "div d");
        guarded("div", [&] {
            mem_->seq_div(s, p0, p1, d);
            fmt::print("div ok\n");
        });
    }
    void clear(const std::vector<std::string_view>& w) {
        const keys k(w, 1, {"data"}, "clear");
        mem_->clear(k.get_bool("data", false));
        fmt::print("clear ok\n");
    }
    void update(const std::vector<std::string_view>& w) {
        arity(w, 1, "update");
        auto up = mem_->init_update(false);
        if (up->get_status() != memory_status::success) {
            fmt::print("update none\n");
            return;
        }
        guarded("update", [&] {
            up->apply();
            fmt::print("update ok\n");
        });
    }
    void show(const std::vector<std::string_view>& w) {
        arity(w, 1, "show");
        std::string line = "pos";
        for (seq_id_t s = 0; s < static_cast<seq_id_t>(n_seq_max_); ++s)
            line += fmt::format(" {}:[{},{}]", s, mem_->seq_pos_min(s), mem_->seq_pos_max(s));
        const auto kv_used = [](const kv_cache& c) {
            uint32_t n = 0;
            for (uint32_t s = 0; s < c.get_n_stream(); ++s) n += c.cells(s).get_used();
            return n;
        };
        if (rec_) line += fmt::format(" used={}", rec_->get_used());
        if (cache_) line += fmt::format(" used={}", kv_used(*cache_));
        if (iswa_)
            line +=
                fmt::format(" used={} used_swa={}", kv_used(iswa_->get_base()), kv_used(iswa_->get_swa()));
        if (hyb_)
            line +=
                fmt::format(" used={} used_rs={}", kv_used(dynamic_cast<const kv_cache&>(hyb_->get_attn())),
                            hyb_->get_recr().get_used());
        fmt::print("{}\n", line);
    }
    // cells [STREAM] [part=base|swa|rs]: part chooses the cache of an iswa or hybrid memory
    void cells(const std::vector<std::string_view>& w) {
        std::vector<std::string_view> args(w.begin(), w.end());
        std::string part = iswa_ ? "base" : rec_ ? "rs" : "kv";
        if (args.size() > 1 && args.back().substr(0, 5) == "part=") {
            part = std::string(args.back().substr(5));
            args.pop_back();
            const bool ok =
                (iswa_ && (part == "base" || part == "swa")) || (hyb_ && (part == "kv" || part == "rs"));
            if (!ok) fail(fmt::format("cells: part={} is not a part of this memory", part));
        }
        if (args.size() > 2) fail("usage: cells [STREAM] [part=base|swa|kv|rs]");
        if (part == "rs") return recurrent_cells(args, rec_ ? *rec_ : hyb_->get_recr());
        const kv_cache& cache = iswa_  ? (part == "swa" ? iswa_->get_swa() : iswa_->get_base())
                                : hyb_ ? dynamic_cast<const kv_cache&>(hyb_->get_attn())
                                       : *cache_;
        const int64_t stream = args.size() == 2 ? parse_int(args[1], "cells stream") : 0;
        if (stream < 0 || stream >= cache.get_n_stream())
            fail(fmt::format("cells: stream {} not in [0, {})", stream, cache.get_n_stream()));
        const kv_cells& c = cache.cells(static_cast<uint32_t>(stream));
        fmt::print("cells n={}\n", c.get_used());
        std::vector<uint32_t> used;
        c.used_cells(used);
        for (uint32_t i : used) {
            std::string seqs;
            for (seq_id_t s : c.seqs(i)) {
                if (!seqs.empty()) seqs += '+';
                seqs += std::to_string(s);
            }
            fmt::print("{} pos={} seqs={} shift={}\n", i, c.pos_get(i), seqs, c.get_shift(i));
        }
    }

    // cells of a recurrent memory: `<idx> pos=<p> seqs=<a+b> hist=<states kept> rollback=<pending plane>`
    static void recurrent_cells(const std::vector<std::string_view>& w, const memory_recurrent& rec) {
        if (w.size() != 1) fail("cells: a recurrent memory has one stream");
        fmt::print("cells n={}\n", rec.get_used());
        for (uint32_t i = 0; i < rec.get_size(); ++i) {
            const auto c = rec.cell(i);
            if (c.seqs.empty()) continue;
            std::string seqs;
            for (seq_id_t s : c.seqs) seqs += (seqs.empty() ? "" : "+") + std::to_string(s);
            fmt::print("{} pos={} seqs={} hist={} rollback={}\n", i, c.pos, seqs, c.depth, c.rs_idx);
        }
    }

    seq_id_t state_seq(std::string_view w, const char* op) const {
        return parse_i32(w, fmt::format("{} seq", op));
    }
    // partial=1: state_seq_flag_partial_only (the SWA part of an iswa memory, the recurrent part of a
    // hybrid one)
    static state_seq_flags flags_of(const keys& k) {
        return k.get_bool("partial", false) ? state_seq_flag_partial_only : 0;
    }
    void size(const std::vector<std::string_view>& w) {
        if (w.size() != 2 && w.size() != 3) fail("usage: size SEQ [partial=0|1]");
        const seq_id_t s = state_seq(w[1], "size");
        const state_seq_flags flags = flags_of(keys(w, 2, {"partial"}, "size"));
        guarded("size", [&] { fmt::print("size {}\n", state_seq_get_size(*mem_, s, flags)); });
    }
    // save SEQ FILE [format=buffer|session|zstd|ggsq]: llama.cpp's per-sequence buffer by default, else a
    // session file (zstd: compressed) or llama.cpp's 'ggsq' file (no tokens).
    void save(const std::vector<std::string_view>& w) {
        if (w.size() < 3 || w.size() > 5)
            fail("usage: save SEQ FILE [format=buffer|session|zstd|ggsq] [partial=0|1]");
        const seq_id_t s = state_seq(w[1], "save");
        const std::string path(w[2]);
        const keys k(w, 3, {"format", "partial"}, "save");
        const state_seq_flags flags = flags_of(k);
        const std::string format = k.get("format").value_or("buffer");
        if (format != "buffer" && format != "session" && format != "zstd" && format != "ggsq")
            fail(fmt::format("save: format '{}' is not buffer, session, zstd or ggsq", format));
        guarded("save", [&] {
            if (format == "buffer") {
                const std::vector<uint8_t> bytes = state_seq_get_data(*mem_, s, flags);
                io_file_writer out(path);
                out.write(bytes.data(), bytes.size());
                out.close();
                fmt::print("save {}\n", bytes.size());
            } else if (format == "ggsq") {
                if (flags) throw error(errc::unsupported, "save: 'ggsq' files hold states without flags");
                fmt::print("save {}\n", save_llama_seq_file(*mem_, path, s, {}));
            } else {
                session_save_options o;
                o.flags = flags;
                o.compress = format == "zstd";
                fmt::print("save {}\n", save_file(*mem_, path, s, o));
            }
        });
    }
    // load SEQ FILE [partial=0|1]: any file save writes, told apart by its magic (session files carry
    // their flags; partial= applies to buffers).
    void load(const std::vector<std::string_view>& w) {
        if (w.size() != 3 && w.size() != 4) fail("usage: load SEQ FILE [partial=0|1]");
        const seq_id_t s = state_seq(w[1], "load");
        const std::string path(w[2]);
        const state_seq_flags flags = flags_of(keys(w, 3, {"partial"}, "load"));
        try {
            const std::vector<uint8_t> bytes = read_file_bytes(path);
            uint32_t magic = 0;
            if (bytes.size() >= 4) std::memcpy(&magic, bytes.data(), 4);
            if (magic == session_magic)
                load_file(*mem_, path, s);
            else if (magic == llama_seq_file_magic)
                load_llama_seq_file(*mem_, path, s);
            else
                state_seq_set_data(*mem_, bytes, s, flags);
            fmt::print("load {}\n", bytes.size());
        } catch (const error& e) {
            fmt::print("load failed: {}\n", e.what());
        }
    }

    // digest SEQ: a fingerprint of the state `save SEQ` would write (its payload, without the header with
    // the source id, so the same state held by two sequences has one digest)
    void digest(const std::vector<std::string_view>& w) {
        arity(w, 2, "digest SEQ");
        const seq_id_t s = state_seq(w[1], "digest");
        guarded("digest", [&] {
            const std::vector<uint8_t> bytes = state_seq_get_data(*mem_, s);
            fmt::print("digest {:016x}\n", fnv1a(std::span(bytes).subspan(8)));
        });
    }

    std::unique_ptr<model> model_;
    std::unique_ptr<kv_cache> cache_;        // type=kv
    std::unique_ptr<memory_recurrent> rec_;  // type=recurrent
    std::unique_ptr<kv_cache_iswa> iswa_;    // type=iswa
    std::unique_ptr<memory_hybrid> hyb_;     // type=hybrid
    memory_i* mem_ = nullptr;                // the one of them in use
    std::unique_ptr<runtime> rt_;            // with a model
    uint32_t n_layer_ = 0;                   // model layers of the memory
    uint32_t n_seq_max_ = 1;
    uint32_t n_ubatch_ = 512;
};

int run_replay(const std::string& path) {
    std::ifstream file;
    std::istream* in = &std::cin;
    if (path != "-") {
        file.open(path);
        if (!file) throw error(errc::io, fmt::format("replay: cannot open '{}'", path));
        in = &file;
    }
    replayer r;
    std::string text;
    for (size_t line_no = 1; std::getline(*in, text); ++line_no) {
        try {
            r.line(text);
        } catch (const script_error& e) {
            std::fflush(stdout);
            std::fprintf(stderr, "error line %zu: %s\n", line_no, e.what.c_str());
            return 2;
        }
    }
    return 0;
}

}  // namespace

void add_replay_command(CLI::App& app, int& exit_code) {
    auto path = std::make_shared<std::string>();
    CLI::App* cmd =
        app.add_subcommand("replay", "Run an op script (docs/op-scripts.md) against a fresh memory");
    cmd->add_option("script", *path, "op script file, or - for standard input")->required();
    cmd->callback([path, &exit_code] { exit_code = run_replay(*path); });
}

}  // namespace kvc::cli
