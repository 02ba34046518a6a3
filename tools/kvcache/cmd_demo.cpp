// kvcache demo: the main job. A llama model (the built-in tiny one, or --model FILE) serves several
// sequences through the cache the way an inference server does — a shared system prompt, parallel
// decoding, a context shift, a sequence saved to a session file and restored into another, compaction,
// then chat sessions through the prefix cache (turns that reuse what earlier turns and sessions
// computed, sessions that end, evictions; then a fresh cache, as after a restart or in another process,
// that brings the conversations back from a disk tier) — and after every phase the logits are compared with a
// reference that recomputes attention from plain f32 keys and values without the cache. Exit status 1
// if a difference exceeds the K/V types' tolerance. A mamba or jamba model runs the recurrent demo
// instead (cmd_demo_recurrent.cpp).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <xxhash.h>
#include <kvcache/disk_store.h>
#include <kvcache/runtime/runtime.h>
#include <kvcache/runtime/tiny_model.h>
#include <kvcache/session.h>
#include <kvcache/version.h>

#include <kvcache/runtime/thread_pool.h>

#include "commands.h"
#include "demo_recurrent.h"
#include "files.h"
#include "rss.h"
#include "svg.h"

namespace kvc::cli {
namespace {

namespace fs = std::filesystem;

struct demo_options {
    std::string model;
    std::string type_k = "f16", type_v = "f16";
    uint32_t seqs = 4;
    uint32_t ctx = 1024;
    uint32_t threads = 0;
    bool v_trans = false;  // llama.cpp's default with flash attention; commits memory in small granules
    bool unified = true;
    uint32_t swa = 0;  // > 0: every other layer slides a window of this many positions (iSWA memory)
    std::string plot;
    std::string tier_dir;   // the disk tier's directory (empty: a temporary one)
    std::string session;    // where phase 4's session file is kept (empty: kvcache-demo.kvc in the temp dir)
    uint64_t model_id = 0;  // XXH3-64 of the model file: names the blocks of this model in the tier
};

// Colours of sequences in the cell pictures.
const char* colour(seq_id_t s) {
    static const char* c[] = {"#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f",
                              "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"};
    return c[static_cast<size_t>(s) % 10];
}

class demo {
public:
    demo(const demo_options& o, const model& m)
        : o_(o), m_(m), ref_(m, o.seqs, o.threads), rng_state_(0x5EED) {
        auto p = m.cache_params(o.ctx, o.seqs);
        p.type_k = parse_dtype(o.type_k);
        p.type_v = parse_dtype(o.type_v);
        p.v_trans = o.v_trans;
        p.unified = o.unified;
        const runtime_params rp{.n_threads = o.threads, .n_ubatch = 512};
        if (o.swa > 0) {  // even layers slide a window (Gemma-style), odd ones see everything
            std::vector<bool> windowed;
            for (uint32_t il = 0; il < p.layers.size(); ++il) {
                p.layers[il].is_swa = il % 2 == 0;
                windowed.push_back(p.layers[il].is_swa);
            }
            p.n_swa = o.swa;
            p.swa = swa_type::standard;
            iswa_ = std::make_unique<kv_cache_iswa>(
                kv_cache_iswa_params{.kv = p, .sizing = {.swa_full = false, .n_ubatch = rp.n_ubatch}});
            rt_ = std::make_unique<runtime>(m, *iswa_, rp);
            ref_.set_swa(o.swa, swa_type::standard, windowed);
            mem_ = iswa_.get();
        } else {
            p.prefix.enabled = true;  // the chat phases reuse prompt prefixes
            // below it a disk tier that every published block is written to, for the restart phase
            disk_store_params dp;
            dp.dir = o.tier_dir;
            tier_ = std::make_shared<disk_block_store>(dp);
            p.prefix.tiers = {.stores = {tier_}, .model_id = o.model_id, .write = tier_write::through};
            params_ = p;
            cache_ = std::make_unique<kv_cache>(p);
            rt_ = std::make_unique<runtime>(m, *cache_, rp);
            mem_ = cache_.get();
        }
        limit_ = std::max(logits_tolerance(p.type_k), logits_tolerance(p.type_v));
    }

    int run() {
        const model_hparams& hp = m_.hparams();
        fmt::print("kvcache {} demo: decoding through the cache vs recomputing without it\n",
                   version_string());
        fmt::print("model   {}: {} layers, {} dims, {} heads / {} KV heads of {}, vocab {}, weights {}\n",
                   hp.name.empty() ? "(unnamed)" : hp.name, hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv,
                   hp.n_embd_head, hp.n_vocab, to_string(hp.weight_type));
        const kv_cache& c = base();
        const size_t kv_bytes = iswa_ ? iswa_->size_bytes() : c.size_bytes();
        fmt::print("cache   {} cells{}, K {}, V {}{}, {} sequences, {:.1f} KiB of K/V; {} threads\n",
                   c.get_size(), o_.unified ? "" : fmt::format(" x {} streams", c.get_n_stream()), o_.type_k,
                   o_.type_v, o_.v_trans ? " (transposed)" : "", o_.seqs,
                   static_cast<double>(kv_bytes) / 1024, rt_->pool().size());
        fmt::print(
            "memory  {:.1f} KiB reserved, committed as cells are used in granules of {} cells per stream\n",
            static_cast<double>(mem_->get_memory_breakdown().reserved) / 1024, granule_cells());
        if (iswa_)
            fmt::print(
                "iSWA    layers 0, 2, ... see a window of {} positions through a cache of {} cells per "
                "stream "
                "(a full-size one would hold {:.1f} KiB more)\n",
                o_.swa, iswa_->get_swa().get_size(),
                static_cast<double>(iswa_->get_swa().size_bytes()) *
                    (static_cast<double>(c.get_size()) / iswa_->get_swa().get_size() - 1) / 1024);
        if (tier_)
            fmt::print("tier    {}: every published block is written there (write-through)\n",
                       tier_->describe());
        fmt::print(
            "cells   one character per {} cells: the sequence holding them, + several, : cached (prefix "
            "cache), . empty\n\n",
            cells_per_char());

        const uint32_t n = o_.seqs;
        // 1. a system prompt in sequence 0, shared by every sequence through seq_cp
        phase("shared system prompt", [&] {
            step({{0, tokens(48)}});
            for (seq_id_t s = 1; s < static_cast<seq_id_t>(n); ++s) both_cp(0, s);
            return fmt::format("48 tokens in seq 0, seq_cp to {} more", n - 1);
        });
        // 2. each sequence gets its own question, then answers token by token, all in one batch per step
        phase("parallel decoding", [&] {
            std::vector<std::pair<seq_id_t, std::vector<token_t>>> prompts;
            prompts.reserve(n);
            for (seq_id_t s = 0; s < static_cast<seq_id_t>(n); ++s)
                prompts.emplace_back(s, tokens(5 + 3 * s));
            step(prompts);
            generate(24, "decode");
            return fmt::format("{} prompts in one batch, then 24 steps of {} tokens", n, n);
        });
        // 3. sequence 0 runs out of room: keep the system prompt, drop the oldest 12 positions after it,
        //    shift the rest down (the cells of the shared prompt are not moved: a shift moves a cell for
        //    every sequence that holds it)
        phase("context shift", [&] {
            const pos_t keep = 48, drop = 12;
            mem_->seq_rm(0, keep, keep + drop);
            ref_.seq_rm(0, keep, keep + drop);
            if (!mem_->get_can_shift()) {  // iSWA without swa_full: the positions stay where they are
                generate(8, "decode");
                return fmt::format(
                    "seq 0: rm [{}, {}); no shift (an iSWA memory whose SWA cache is smaller "
                    "cannot shift positions)",
                    keep, keep + drop);
            }
            mem_->seq_add(0, keep + drop, -1, -drop);
            ref_.seq_add(0, keep + drop, -1, -drop);
            const bool pending = base().get_has_shift();
            generate(8, "decode");
            return fmt::format("seq 0: rm [{}, {}), add {} to the rest ({}K-shift on the next decode)", keep,
                               keep + drop, -drop, pending ? "" : "no ");
        });
        // 4. sequence 1 saved to a session file and restored into the last sequence
        phase("save and restore", [&] {
            // under a name of its own while in use (demos may run side by side), then kept for the reader
            const std::string file = fmt::format("{}.{}", o_.session, ::getpid());
            session_save_options so;
            so.compress = true;
            const uint64_t bytes = save_file(*mem_, file, 1, so);
            const seq_id_t last = static_cast<seq_id_t>(n) - 1;
            load_file(*mem_, file, last);
            fs::rename(file, o_.session);
            ref_.seq_rm(last, -1, -1);
            ref_.seq_cp(1, last, -1, -1);
            generate(8, "decode");
            return fmt::format("seq 1 -> {} bytes (zstd) -> seq {}", bytes, last);
        });
        // 5. a finished request frees its cells; compaction closes the holes
        phase("compaction", [&] {
            const seq_id_t done = n > 2 ? 2 : 0;
            mem_->seq_rm(done, -1, -1);
            ref_.seq_rm(done, -1, -1);
            const float before = base().fragmentation();
            if (auto up = mem_->init_update(/*optimize=*/true); up->get_status() == memory_status::success)
                up->apply();
            const float after = base().fragmentation();
            generate(8, "decode");
            return fmt::format("seq {} done; compacted (fragmentation {:.0f}% -> {:.0f}%)", done,
                               100 * before, 100 * after);
        });

        if (cache_ && cache_->params().prefix.enabled) chat();

        fmt::print(
            "\n{} tokens decoded through the cache in {:.2f} s; worst difference {:.2e} (limit {:.0e}): {}\n",
            n_decoded_, seconds_, worst_, limit_, worst_ <= limit_ ? "cache == recompute" : "MISMATCH");
        if (!o_.plot.empty()) fmt::print("cell pictures in {}\n", o_.plot);
        fmt::print("session file of phase 4 kept in {} (kvcache inspect {} shows what it holds)\n",
                   o_.session, o_.session);
        const rss r = read_rss();
        fmt::print("process memory: {:.1f} MiB resident, {:.1f} MiB at the peak (model, reference, cache)\n",
                   static_cast<double>(r.now) / (1 << 20), static_cast<double>(r.peak) / (1 << 20));
        return worst_ <= limit_ && committed_ok_ ? 0 : 1;
    }

private:
    // Chat sessions through the prefix cache: every turn is a request whose prompt is the system prompt,
    // the conversation so far and a new message; the engine attaches what is cached, decodes the rest,
    // answers, and ends the request. The reference recomputes every prompt in full.
    void chat() {
        mem_->clear(/*data=*/true);
        ref_.clear();
        const std::vector<token_t> system = tokens(64);
        std::vector<std::vector<token_t>> history;  // per session: its prompts and answers so far
        const auto turn = [&](std::vector<size_t> sessions) {
            // one request per session, at most o_.seqs at a time; each gets a sequence of its own
            for (size_t k = 0; k < sessions.size(); k += o_.seqs) {
                std::vector<std::pair<seq_id_t, std::vector<token_t>>> rest;
                for (size_t j = k; j < std::min(sessions.size(), k + o_.seqs); ++j) {
                    auto& h = history[sessions[j]];
                    if (h.empty()) h = system;
                    const auto msg = tokens(20);
                    h.insert(h.end(), msg.begin(), msg.end());
                    const auto s = static_cast<seq_id_t>(j - k);
                    rest.emplace_back(s, attach(s, h));
                }
                std::vector<token_t> next_tok = step(rest);
                for (int i = 0; i < 12; ++i) {  // the answers, every token appended to its conversation
                    std::vector<std::pair<seq_id_t, std::vector<token_t>>> groups;
                    for (size_t g = 0; g < rest.size(); ++g) {
                        history[sessions[k + g]].push_back(next_tok[g]);
                        groups.emplace_back(rest[g].first, std::vector<token_t>{next_tok[g]});
                    }
                    next_tok = step(groups);
                }
                // the requests end; what they computed stays cached (published first: the last step
                // completed blocks that no later step would publish)
                cache_->prefix_cache()->prefix_publish();
                for (const auto& [s, toks] : rest) {
                    mem_->seq_rm(s, -1, -1);
                    ref_.seq_rm(s, -1, -1);
                }
            }
        };
        const auto sessions = [](size_t a, size_t b) {
            std::vector<size_t> v;
            for (size_t i = a; i < b; ++i) v.push_back(i);
            return v;
        };
        const size_t n = o_.seqs;
        // enough sessions that their conversations outgrow the cache: the oldest cached blocks go
        const size_t more = std::max<size_t>(n, (base().get_size() / 16 + 1) / 2);
        history.resize(n + more);
        chat_phase("chat: first turns", [&] {  // the first session computes the system prompt for all
            turn(sessions(0, 1));
            turn(sessions(1, n));
        });
        chat_phase("chat: second turns", [&] { turn(sessions(0, n)); });
        chat_phase("chat: new sessions", [&] { turn(sessions(n, n + more)); });
        chat_phase("chat: third turns", [&] { turn(sessions(0, n)); });
        // A fresh cache on the same directory, as after a restart or in a second process: its memory is
        // empty, and the sessions' fourth turns bring their conversations back from the disk tier.
        rt_.reset();
        cache_.reset();
        disk_store_params dp;
        dp.dir = o_.tier_dir;
        tier_ = std::make_shared<disk_block_store>(dp);  // reopened: it knows the files from the directory
        params_.prefix.tiers.stores = {tier_};
        cache_ = std::make_unique<kv_cache>(params_);
        rt_ =
            std::make_unique<runtime>(m_, *cache_, runtime_params{.n_threads = o_.threads, .n_ubatch = 512});
        mem_ = cache_.get();
        chat_phase("restart: fourth turns", [&] { turn(sessions(0, n)); });
    }

    // The cache attaches the cached prefix of prompt to s (the reference decodes it, unchecked); returns
    // the rest of the prompt.
    std::vector<token_t> attach(seq_id_t s, const std::vector<token_t>& prompt) {
        const uint32_t n = cache_->prefix_cache()->prefix_attach(s, prompt);
        if (n > 0) {
            batch_storage b = batch::init(static_cast<int32_t>(n), 0, 1);
            const seq_id_t ids[1] = {s};
            for (uint32_t i = 0; i < n; ++i) b.add(prompt[i], static_cast<pos_t>(i), ids, false);
            ref_.decode(b.view());
        }
        return {prompt.begin() + n, prompt.end()};
    }

    template <class F>
    void chat_phase(const char* name, F&& body) {
        const prefix_stats a = cache_->prefix_cache()->get_prefix_stats();
        phase(name, [&] {
            body();
            const prefix_stats b = cache_->prefix_cache()->get_prefix_stats();
            const uint64_t looked = b.tokens_looked_up - a.tokens_looked_up,
                           hit = b.hit_tokens - a.hit_tokens;
            return fmt::format(
                "{} requests, {} of {} prompt tokens reused ({:.0f}%), {} blocks published, {} evicted, {} "
                "from disk",
                b.lookups - a.lookups, hit, looked, looked ? 100.0 * hit / looked : 0.0,
                b.published_blocks - a.published_blocks, b.evicted_blocks - a.evicted_blocks,
                b.tier_fetched_blocks - a.tier_fetched_blocks);
        });
    }

    std::vector<token_t> tokens(size_t count) {
        std::vector<token_t> t(count);
        for (auto& x : t) x = static_cast<token_t>(next() % m_.hparams().n_vocab);
        return t;
    }
    uint64_t next() {
        rng_state_ += 0x9E3779B97F4A7C15ull;
        uint64_t z = rng_state_;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }

    void both_cp(seq_id_t src, seq_id_t dst) {
        mem_->seq_cp(src, dst, -1, -1);
        ref_.seq_cp(src, dst, -1, -1);
    }

    // One batch: every group continues its sequence, every token an output; compares the logits.
    std::vector<token_t> step(const std::vector<std::pair<seq_id_t, std::vector<token_t>>>& groups) {
        size_t count = 0;
        for (const auto& g : groups) count += g.second.size();
        batch_storage b = batch::init(static_cast<int32_t>(count), 0, 1);
        std::vector<size_t> last;  // output row of each group's last token
        for (const auto& [s, toks] : groups) {
            pos_t p = mem_->seq_pos_max(s) + 1;
            const seq_id_t ids[1] = {s};
            for (token_t t : toks) b.add(t, p++, ids, true);
            last.push_back(static_cast<size_t>(b.view().n_tokens) - 1);
        }
        const auto t0 = std::chrono::steady_clock::now();
        const decode_result a = rt_->decode(b.view());
        seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (is_fail(a.status)) throw error(errc::invalid_state, "demo: the cache has no room for the batch");
        const decode_result r = ref_.decode(b.view());
        n_decoded_ += count;
        phase_worst_ = std::max(phase_worst_, relative_diff(a.logits, r.logits));
        // greedy next tokens from the cache's logits
        const uint32_t nv = m_.hparams().n_vocab;
        std::vector<token_t> out;
        for (size_t row : last) {
            const auto l = a.row(row, nv);
            out.push_back(static_cast<token_t>(std::max_element(l.begin(), l.end()) - l.begin()));
        }
        return out;
    }

    // steps of one token for every live sequence, greedy, with a progress bar
    void generate(int steps, const char* what) {
        std::vector<seq_id_t> live;
        for (seq_id_t s = 0; s < static_cast<seq_id_t>(o_.seqs); ++s)
            if (mem_->seq_pos_max(s) >= 0) live.push_back(s);
        std::vector<token_t> next_tok(live.size(), 1);
        for (int i = 0; i < steps; ++i) {
            std::vector<std::pair<seq_id_t, std::vector<token_t>>> groups;
            for (size_t j = 0; j < live.size(); ++j)
                groups.emplace_back(live[j], std::vector<token_t>{next_tok[j]});
            next_tok = step(groups);
            progress(what, i + 1, steps);
        }
    }

    void progress(const char* what, int done, int total) {
        if (!isatty(fileno(stdout))) return;
        const int width = 30, filled = done * width / total;
        fmt::print("\r  {} [{}{}] {}/{}", what, std::string(static_cast<size_t>(filled), '#'),
                   std::string(static_cast<size_t>(width - filled), '.'), done, total);
        if (done == total) fmt::print("\r{}\r", std::string(60, ' '));
        std::fflush(stdout);
    }

    template <class F>
    void phase(const char* name, F&& body) {
        ++n_phase_;
        phase_worst_ = 0;
        const std::string what = body();
        worst_ = std::max(worst_, phase_worst_);
        const bool ok = phase_worst_ <= limit_;
        const auto used = [](const kv_cache& c) {
            uint32_t n = 0;
            for (uint32_t s = 0; s < c.get_n_stream(); ++s) n += c.cells(s).get_used();
            return n;
        };
        fmt::print("{}. {:<22} {}\n", n_phase_, name, what);
        fmt::print("   cells {:>5}/{:<5} {}  max|diff| {:.2e} {} {:.0e}  {}\n", used(base()),
                   base().get_size() * base().get_n_stream(), occupancy(base()), phase_worst_,
                   ok ? "<=" : ">", limit_, ok ? "ok" : "MISMATCH");
        if (iswa_)
            fmt::print("   swa   {:>5}/{:<5} {}\n", used(iswa_->get_swa()),
                       iswa_->get_swa().get_size() * iswa_->get_swa().get_n_stream(),
                       occupancy(iswa_->get_swa()));
        // memory follows what the cells hold: at most one commit granule per stream above it
        const memory_breakdown b = mem_->get_memory_breakdown();
        const bool within = b.committed <= b.used + b.cached + granule_bytes();
        committed_ok_ = committed_ok_ && within;
        const auto kib = [](uint64_t n) { return static_cast<double>(n) / 1024; };
        fmt::print("   bytes {:.1f} KiB committed: {:.1f} used, {:.1f} cached, {:.1f} free  {}\n",
                   kib(b.committed), kib(b.used), kib(b.cached), kib(b.free),
                   within ? "<= held + a granule per stream" : "OVER");
        if (!o_.plot.empty()) plot(name);
    }

    // The KV caches of the memory (base and SWA of an iSWA memory).
    std::vector<const kv_cache*> caches() const {
        if (iswa_) return {&iswa_->get_base(), &iswa_->get_swa()};
        return {cache_.get()};
    }

    uint32_t granule_cells() const { return base().storage().commit_granule(); }

    // Bytes of one commit granule in every stream of every cache.
    uint64_t granule_bytes() const {
        uint64_t n = 0;
        for (const kv_cache* c : caches()) {
            const uint64_t cell = c->size_bytes() / (uint64_t{c->get_size()} * c->get_n_stream());
            n += uint64_t{c->storage().commit_granule()} * cell * c->get_n_stream();
        }
        return n;
    }

    // The memory's KV cache (the base cache of an iSWA memory).
    const kv_cache& base() const { return iswa_ ? iswa_->get_base() : *cache_; }

    uint32_t cells_per_char() const {
        const uint32_t width = 64 / base().get_n_stream();
        return std::max(1u, (base().get_size() + width - 1) / width);
    }

    // One character per group of cells: '.' empty, the digit of the only sequence holding them, '+' several.
    std::string occupancy(const kv_cache& cache) const {
        const uint32_t per = cells_per_char();
        std::string out;
        for (uint32_t st = 0; st < cache.get_n_stream(); ++st) {
            const kv_cells& c = cache.cells(st);
            if (st) out += '|';
            for (uint32_t i = 0; i < c.size(); i += per) {
                char ch = '.';
                for (uint32_t j = i; j < std::min(c.size(), i + per); ++j) {
                    if (c.is_empty(j)) continue;
                    const uint32_t k = c.seq_count(j);
                    const char d = k == 0 ? ':' : k > 1 ? '+' : static_cast<char>('0' + c.seq_get(j) % 10);
                    ch = ch == '.' ? d : (ch == d ? ch : '+');
                }
                out += ch;
            }
        }
        return fmt::format("[{}]", out);
    }

    // An SVG of every stream's cells: a square per cell, coloured by sequence (grey stripes: shared).
    void plot(const char* name) const {
        const uint32_t cols = 64, px = 10;
        // the legend: a swatch per kind of cell, then one per sequence
        std::string body;
        uint32_t lx = 4;
        const auto swatch = [&](const char* fill, const std::string& label) {
            body += svg_rect(lx, 26, 10, 10, fill);
            body += svg_text(lx + 13, 35, 11, label);
            lx += 26 + 6 * static_cast<uint32_t>(label.size());
        };
        swatch("#eeeeee", "empty");
        swatch("#9ecae1", "cached (no sequence)");
        swatch("#555555", "shared");
        for (seq_id_t s = 0; s < static_cast<seq_id_t>(std::min<uint32_t>(o_.seqs, 6)); ++s)
            swatch(colour(s), fmt::format("seq {}", s));
        uint32_t y = 44;
        for (const kv_cache* cache : caches()) {
            const char* part = !iswa_ ? "" : cache == &iswa_->get_swa() ? "SWA cache, " : "base cache, ";
            for (uint32_t st = 0; st < cache->get_n_stream(); ++st) {
                const kv_cells& c = cache->cells(st);
                body += svg_text(4, y + 10, 11, fmt::format("{}stream {}", part, st));
                y += 16;
                for (uint32_t i = 0; i < c.size(); ++i) {
                    const uint32_t x0 = 4 + (i % cols) * px, y0 = y + (i / cols) * px;
                    const char* fill = "#eeeeee";
                    if (!c.is_empty(i))
                        fill = c.seq_count(i) == 0  ? "#9ecae1"
                               : c.seq_count(i) > 1 ? "#555555"
                                                    : colour(c.seq_get(i));
                    body += svg_rect(x0, y0, px, px, fill, "stroke='white'");
                }
                y += (c.size() + cols - 1) / cols * px + 10;
            }
        }
        const memory_breakdown b = mem_->get_memory_breakdown();
        body += svg_text(
            4, y + 10, 11,
            fmt::format("memory: {:.1f} KiB committed of {:.1f} KiB reserved ({:.1f} KiB held)",
                        static_cast<double>(b.committed) / 1024, static_cast<double>(b.reserved) / 1024,
                        static_cast<double>(b.used + b.cached) / 1024));
        y += 16;
        body = svg_text(4, 18, 13, fmt::format("phase {}: {}", n_phase_, name)) + body;
        const std::string svg = svg_document(std::max(8 + cols * px, lx), y + 4, body);
        std::string file = fmt::format("{}/phase-{}.svg", o_.plot, n_phase_);
        write_file(file, "picture", svg);
    }

    demo_options o_;
    const model& m_;
    std::shared_ptr<disk_block_store> tier_;  // the KV cache's disk tier
    kv_cache_params params_;                  // the KV cache's parameters (the restart makes another)
    std::unique_ptr<kv_cache> cache_;         // the memory: a KV cache,
    std::unique_ptr<kv_cache_iswa> iswa_;     // or an iSWA memory (--swa)
    memory_i* mem_ = nullptr;                 // the one in use
    std::unique_ptr<runtime> rt_;
    reference_memory ref_;
    uint64_t rng_state_;
    double limit_ = 0, worst_ = 0, phase_worst_ = 0, seconds_ = 0;
    bool committed_ok_ = true;  // every phase ended with memory committed <= held + a granule per stream
    size_t n_decoded_ = 0;
    int n_phase_ = 0;
};

// XXH3-64 of a file's bytes: the model's name in a tier (two models of the same shapes differ there).
uint64_t file_hash(const std::string& path) {
    std::ifstream f = open_read(path, "model", /*binary=*/true);
    XXH3_state_t* st = XXH3_createState();
    XXH3_64bits_reset(st);
    std::vector<char> buf(1 << 20);
    while (f) {
        f.read(buf.data(), static_cast<std::streamsize>(buf.size()));
        XXH3_64bits_update(st, buf.data(), static_cast<size_t>(f.gcount()));
    }
    const uint64_t h = XXH3_64bits_digest(st);
    XXH3_freeState(st);
    return h;
}

int run_demo(const demo_options& o) {
    if (o.seqs < 2 || o.seqs > 64)
        throw error(errc::invalid_argument, fmt::format("--seqs {} not in [2, 64]", o.seqs));
    if (o.ctx < 256 || o.ctx > (1u << 20))
        throw error(errc::invalid_argument, fmt::format("--ctx {} not in [256, 1048576]", o.ctx));
    fs::path tmp;
    std::string path = o.model;
    if (path.empty()) {  // the built-in tiny model: head size 32, so every K/V type works
        tmp = fs::temp_directory_path() / fmt::format("kvcache-demo-{}.gguf", ::getpid());
        tiny_model_options t;
        t.n_embd = 128;
        t.n_ff = 256;
        t.n_layer = 4;
        write_tiny_model(tmp.string(), t);
        path = tmp.string();
    }
    struct remove_tmp {
        fs::path p;
        ~remove_tmp() {
            std::error_code ec;
            if (!p.empty()) fs::remove(p, ec);
        }
    } cleanup{tmp};
    demo_options opts = o;
    if (opts.session.empty()) opts.session = (fs::temp_directory_path() / "kvcache-demo.kvc").string();
    fs::path tier_tmp;
    if (opts.tier_dir.empty()) {
        tier_tmp = fs::temp_directory_path() / fmt::format("kvcache-demo-tier-{}", ::getpid());
        opts.tier_dir = tier_tmp.string();
    }
    struct remove_dir {
        fs::path p;
        ~remove_dir() {
            std::error_code ec;
            if (!p.empty()) fs::remove_all(p, ec);
        }
    } cleanup_tier{tier_tmp};
    opts.model_id = file_hash(path);
    const model m = model::load(path);
    if (m.memory_kind() != model_memory::kv) {
        if (o.swa > 0) throw error(errc::invalid_argument, "--swa is for llama models");
        return run_recurrent_demo(m, {.seqs = o.seqs,
                                      .ctx = o.ctx,
                                      .threads = o.threads,
                                      .type_k = parse_dtype(o.type_k),
                                      .type_v = parse_dtype(o.type_v),
                                      .v_trans = o.v_trans,
                                      .unified = o.unified,
                                      .session = opts.session});
    }
    if (!o.plot.empty()) {  // before any work: a bad directory is an error now, not after phase 1
        std::error_code ec;
        if (fs::exists(o.plot, ec) && !fs::is_directory(o.plot, ec))
            throw error(errc::invalid_argument,
                        fmt::format("--plot {}: exists and is not a directory", o.plot));
        fs::create_directories(o.plot, ec);
        if (ec)
            throw error(errc::io,
                        fmt::format("--plot {}: cannot create the directory: {}", o.plot, ec.message()));
    }
    demo d(opts, m);
    return d.run();
}

}  // namespace

void add_demo_command(CLI::App& app, int& exit_code) {
    auto opt = std::make_shared<demo_options>();
    CLI::App* cmd = app.add_subcommand(
        "demo", "Serve several sequences through the cache and check every phase against a recomputation");
    cmd->add_option("--model", opt->model,
                    "a llama, mamba or jamba GGUF model (default: the built-in tiny llama model)");
    cmd->add_option("--type-k", opt->type_k, "K element type: f32, f16, bf16, q8_0, q4_0")
        ->capture_default_str();
    cmd->add_option("--type-v", opt->type_v, "V element type")->capture_default_str();
    cmd->add_option("--seqs", opt->seqs, "parallel sequences (2..64)")->capture_default_str();
    cmd->add_option("--ctx", opt->ctx, "cells per stream")->capture_default_str();
    cmd->add_option("--threads", opt->threads, "threads (0: all cores)")
        ->check(CLI::Range(0u, thread_pool::max_threads))
        ->capture_default_str();
    cmd->add_option("--v-trans", opt->v_trans, "store V transposed (1) or as rows (0)")
        ->check(CLI::Range(0, 1))  // 2 is not a yes
        ->capture_default_str();
    cmd->add_option("--unified", opt->unified, "one stream for all sequences (1) or one per sequence (0)")
        ->check(CLI::Range(0, 1))  // 2 is not a yes
        ->capture_default_str();
    cmd->add_option(
           "--swa", opt->swa,
           "> 0: even layers slide a window of this many positions, through an iSWA memory whose SWA "
           "cache is sized for the window")
        ->capture_default_str();
    cmd->add_option("--plot", opt->plot, "write an SVG picture of the cells after each phase to DIR");
    cmd->add_option("--tier-dir", opt->tier_dir,
                    "the disk tier's directory, kept after the run: a second run hits what the first wrote "
                    "(default: a temporary one)");
    cmd->add_option("--session", opt->session,
                    "where the session file the demo saves is kept, for `kvcache inspect` (default: "
                    "kvcache-demo.kvc in the temporary directory)");
    cmd->callback([opt, &exit_code] { exit_code = run_demo(*opt); });
}

}  // namespace kvc::cli
