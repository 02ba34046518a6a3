// kvcache bench: the project's key figures in one run, each next to its yardstick measured in the same
// run (memcpy, a plain fill, the same operation on a smaller cache). Google Benchmark suites (bench/) go
// deeper; this is the quick look. --json for machines.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <kvcache/disk_store.h>
#include <kvcache/kv_cache.h>
#include <kvcache/memory_recurrent.h>
#include <kvcache/recurrent_engine.h>
#include <kvcache/runtime/runtime.h>
#include <kvcache/runtime/tiny_model.h>
#include <kvcache/state.h>
#include <kvcache/version.h>

#include <kvcache/runtime/thread_pool.h>

#include "commands.h"

namespace kvc::cli {
namespace {

namespace fs = std::filesystem;
using clock_type = std::chrono::steady_clock;

struct bench_options {
    bool json = false;
    bool quick = false;  // fewer repetitions and smaller sizes (tests)
    uint32_t threads = 0;
};

// One figure: value in `unit`, its yardstick, and value / yardstick (or its inverse: `ratio` is always
// oriented so that the target reads "ratio >= target" when higher_is_better, else "<=").
struct figure {
    std::string section, name;
    double value = 0;
    std::string unit;
    double yardstick = 0;
    std::string yardstick_name;
    double ratio = 0;
    double target = 0;  // 0: none
    bool higher_is_better = true;
};

// Best time of fn over `reps` runs, in seconds (each run timed as a whole; `setup` untimed before it).
double best_of(int reps, const std::function<void()>& fn, const std::function<void()>& setup = {}) {
    double best = 1e300;
    for (int r = 0; r < reps; ++r) {
        if (setup) setup();
        const auto t0 = clock_type::now();
        fn();
        best = std::min(best, std::chrono::duration<double>(clock_type::now() - t0).count());
    }
    return best;
}

// A store that takes `seconds` longer per read (a remote tier on a slow link).
class delayed_store final : public block_store_i {
public:
    delayed_store(std::shared_ptr<block_store_i> inner, double seconds)
        : in_(std::move(inner)), s_(seconds) {}
    size_t read_many(std::span<const std::string> keys, const block_value_fn& on_value) override {
        std::this_thread::sleep_for(std::chrono::duration<double>(s_));
        return in_->read_many(keys, on_value);
    }
    void put_many(std::span<const block_put> items) override { in_->put_many(items); }
    std::vector<uint8_t> contains_many(std::span<const std::string> keys) override {
        return in_->contains_many(keys);
    }
    block_store_stats stats() const override { return in_->stats(); }
    std::string describe() const override { return "slow " + in_->describe(); }

private:
    std::shared_ptr<block_store_i> in_;
    double s_;
};

// The tiny llama the decode and tier sections run: 2 layers, 512 wide, 8 heads over 4 KV heads.
model decode_model() {
    const fs::path path = fs::temp_directory_path() / fmt::format("kvcache-bench-{}.gguf", ::getpid());
    tiny_model_options t;
    t.n_embd = 512;
    t.n_head = 8;
    t.n_head_kv = 4;
    t.n_layer = 2;
    t.n_ff = 512;
    write_tiny_model(path.string(), t);
    model m = model::load(path.string());
    fs::remove(path);
    return m;
}

double memcpy_gbs(size_t bytes, int reps) {
    std::vector<uint8_t> a(bytes, 1), b(bytes, 2);
    const double s = best_of(reps, [&] {
        std::memcpy(b.data(), a.data(), bytes);
        asm volatile("" : : "r"(b.data()) : "memory");
    });
    return static_cast<double>(bytes) / s / 1e9;
}

// n tokens of s from p0 (token ids from toks when given)
ubatch tokens_of(seq_id_t s, pos_t p0, uint32_t n, const token_t* toks = nullptr) {
    ubatch u;
    if (toks) u.token.assign(toks, toks + n);
    u.n_tokens = n;
    u.n_seq_tokens = n;
    u.n_seqs = 1;
    u.equal_seqs = true;
    for (uint32_t i = 0; i < n; ++i) u.pos.push_back(p0 + static_cast<pos_t>(i));
    for (uint32_t i = 0; i <= n; ++i) u.seq_id_begin.push_back(i);
    u.n_seq_id.assign(n, 1);
    u.seq_id_data.assign(n, s);
    u.seq_id_unq = {s};
    u.n_seqs_unq = 1;
    u.output.assign(n, 0);
    return u;
}

// Places n tokens of each of n_seq sequences (positions from 0), with random K/V rows when rows is set.
void fill(kv_cache& c, uint32_t n_seq, uint32_t n, bool rows, std::mt19937& rng) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (uint32_t s = 0; s < n_seq; ++s)
        for (uint32_t p0 = 0; p0 < n; p0 += 512) {
            const uint32_t m = std::min(512u, n - p0);
            auto ctx = c.init_ubatches({tokens_of(static_cast<seq_id_t>(s), static_cast<pos_t>(p0), m)}, {});
            if (is_fail(ctx->get_status())) throw error(errc::invalid_state, "bench: the cache is full");
            ctx->apply();
            if (!rows) continue;
            for (uint32_t il : c.layer_ids()) {
                const layer_desc& d = c.params().layers[il];
                std::vector<float> k(size_t{m} * d.n_head_kv * d.n_embd_head_k);
                for (float& x : k) x = normal(rng);
                const auto view =
                    const_tensor_view::contiguous(dtype::f32, reinterpret_cast<const std::byte*>(k.data()),
                                                  d.n_head_kv * d.n_embd_head_k, m);
                ctx->get_attn(il)->cpy_k(il, view);
                ctx->get_attn(il)->cpy_v(il, view);
            }
        }
}

kv_cache_params shape(uint32_t kv_size, uint32_t n_seq, uint32_t n_layer, uint32_t n_head_kv, uint32_t hd,
                      dtype t) {
    kv_cache_params p;
    p.layers.assign(n_layer, layer_desc{.n_head_kv = n_head_kv,
                                        .n_embd_head_k = hd,
                                        .n_embd_head_v = hd,
                                        .rope = rope_params{.n_rot = static_cast<int32_t>(hd)}});
    p.kv_size = kv_size;
    p.n_seq_max = n_seq;
    p.type_k = p.type_v = t;
    p.v_trans = false;
    return p;
}

class runner {
public:
    explicit runner(const bench_options& o) : o_(o), reps_(o.quick ? 2 : 5) {}

    std::vector<figure> run() {
        dtypes();
        bookkeeping();
        mask();
        seq_ops();
        k_shift();
        prefix();
        state();
        decode();
        tiers();
        recurrent_decode();
        return std::move(out_);
    }

private:
    void add(figure f) {
        if (!o_.json) {
            std::string line = fmt::format("  {:<44} {:>10.3g} {:<6}", f.name, f.value, f.unit);
            if (f.yardstick > 0)
                line += fmt::format(" {:>10.3g} {:<14} {:>7.2f}x", f.yardstick, f.yardstick_name, f.ratio);
            if (f.target > 0) {
                const bool met = f.higher_is_better ? f.ratio >= f.target : f.ratio <= f.target;
                line += fmt::format("  (target {} {:g}x: {})", f.higher_is_better ? ">=" : "<=", f.target,
                                    met ? "met" : "MISSED");
            }
            fmt::print("{}\n", line);
        }
        out_.push_back(std::move(f));
    }
    void section(const char* title) {
        section_ = title;
        if (!o_.json) fmt::print("\n{}\n", title);
    }

    void dtypes() {
        section("element conversion (GB/s of f32 data vs memcpy of the same bytes)");
        const size_t n = o_.quick ? (1u << 18) : (4u << 20);
        const double mc = memcpy_gbs(n * 4, reps_);
        std::vector<float> x(n);
        std::mt19937 rng(1);
        std::normal_distribution<float> normal;
        for (float& v : x) v = normal(rng);
        for (dtype t : {dtype::f16, dtype::bf16, dtype::q8_0, dtype::q4_0}) {
            std::vector<std::byte> enc(row_size(t, static_cast<int64_t>(n)));
            const double se =
                best_of(reps_, [&] { from_f32(t, x.data(), enc.data(), static_cast<int64_t>(n)); });
            const double sd =
                best_of(reps_, [&] { to_f32(t, enc.data(), x.data(), static_cast<int64_t>(n)); });
            const double ge = static_cast<double>(n) * 4 / se / 1e9,
                         gd = static_cast<double>(n) * 4 / sd / 1e9;
            const double target = is_quantized(t) ? 0.25 : 0.5;
            add({section_, fmt::format("f32 -> {}", to_string(t)), ge, "GB/s", mc, "memcpy GB/s", ge / mc,
                 target});
            add({section_, fmt::format("{} -> f32", to_string(t)), gd, "GB/s", mc, "memcpy GB/s", gd / mc,
                 target});
        }
    }

    // one decode step of one token for each of 64 sequences: batch validation, init_batch, apply
    double step_ns_per_token(uint32_t kv_size) {
        const uint32_t n_seq = 64;
        kv_cache c(shape(kv_size, n_seq, 1, 1, 32, dtype::f16));
        std::mt19937 rng(2);
        fill(c, n_seq, 256, false, rng);
        batch_storage b = batch::init(static_cast<int32_t>(n_seq), 0, 1);
        const int steps = o_.quick ? 20 : 200;
        const double s = best_of(reps_, [&] {
            for (int i = 0; i < steps; ++i) {
                b.clear();
                for (uint32_t q = 0; q < n_seq; ++q) {
                    const seq_id_t id[1] = {static_cast<seq_id_t>(q)};
                    b.add(1, c.seq_pos_max(id[0]) + 1, id, true);
                }
                batch_allocr a;
                a.init(b.view(), positions_of(c), {.n_seq_max = n_seq});
                auto ctx = c.init_batch(a, 512, /*embd_all=*/false);
                do ctx->apply();
                while (ctx->next());
                for (uint32_t q = 0; q < n_seq; ++q) {  // back to the same contents
                    const auto id = static_cast<seq_id_t>(q);
                    c.seq_rm(id, c.seq_pos_max(id), -1);
                }
            }
        });
        return s / steps / n_seq * 1e9;
    }

    void bookkeeping() {
        section(
            "decode-step bookkeeping (64 sequences x 256 tokens; ns per token incl. restoring the contents)");
        const double small = step_ns_per_token(32768), big = step_ns_per_token(o_.quick ? 65536 : 262144);
        add({section_, o_.quick ? "at 65,536 cells" : "at 262,144 cells", big, "ns", small, "at 32,768",
             big / small, 1.3, false});
    }

    void mask() {
        section("KQ mask of a 512-token ubatch of 4 sequences over n_kv = 32,768 (vs a plain fill)");
        kv_cache c(shape(32768, 4, 1, 1, 32, dtype::f16));
        std::mt19937 rng(3);
        fill(c, 4, 8000, false, rng);
        ubatch all = tokens_of(0, 8000, 512);
        for (uint32_t i = 0; i < 512; ++i) {
            all.seq_id_data[i] = static_cast<seq_id_t>(i / 128);
            all.pos[i] = 8000 + static_cast<pos_t>(i % 128);
        }
        all.n_seqs = 4;
        all.n_seq_tokens = 128;
        all.seq_id_unq = {0, 1, 2, 3};
        all.n_seqs_unq = 4;
        auto ctx = c.init_ubatches({all}, {});
        ctx->apply();
        kv_cache_context& kc = *ctx->get_attn(0);
        const uint32_t n_kv = kc.get_n_kv();  // 32,768: 32,000 + 512 cells used
        std::vector<float> m(size_t{n_kv} * 512);
        const double sm = best_of(reps_, [&] {
            kc.set_input_kq_mask(
                tensor_view::contiguous(dtype::f32, reinterpret_cast<std::byte*>(m.data()), n_kv, 512));
        });
        const double sf = best_of(reps_, [&] {
            std::fill(m.begin(), m.end(), -1.0f);
            asm volatile("" : : "r"(m.data()) : "memory");
        });
        add({section_, "f32 mask", sm * 1e3, "ms", sf * 1e3, "fill ms", sm / sf, 2.0, false});
    }

    void seq_ops() {
        section("sequence operations, 64 sequences x 256 tokens (ns per call; big cache vs 32,768 cells)");
        const auto measure = [&](uint32_t kv_size, int op) {
            kv_cache c(shape(kv_size, 64, 1, 1, 32, dtype::f16));
            std::mt19937 rng(4);
            fill(c, 64, 256, false, rng);
            const int calls = o_.quick ? 50 : 1000;
            return best_of(reps_,
                           [&] {
                               for (int i = 0; i < calls; ++i) {
                                   const auto s = static_cast<seq_id_t>(i % 32);
                                   if (op == 0) {  // seq_add of a suffix by +1 and back
                                       c.seq_add(s, 128, -1, 1);
                                       c.seq_add(s, 129, -1, -1);
                                   } else {  // seq_cp of a whole sequence and its removal
                                       c.seq_cp(s, s + 32, -1, -1);
                                       c.seq_rm(s + 32, 0, 256);
                                       c.seq_cp(s + 32, s + 32, -1, -1);
                                   }
                               }
                           }) /
                   calls * 1e9;
        };
        const uint32_t big = o_.quick ? 65536 : 262144;
        for (int op : {0, 1}) {
            const double a = measure(32768, op), b = measure(big, op);
            add({section_, op == 0 ? "seq_add of a suffix, and back" : "seq_cp of a sequence + seq_rm", b,
                 "ns", a, "at 32,768", b / a, 1.3, false});
        }
    }

    void k_shift() {
        section("K-shift on 2 threads (GB/s of K re-rotated vs memcpy of the same bytes)");
        const uint32_t cells = o_.quick ? 4096 : 32768;
        thread_pool pool(2);
        for (dtype t : {dtype::f16, dtype::q8_0}) {
            kv_cache_params p = shape(cells, 1, 4, 8, 128, t);
            p.exec = pool.as_executor(64);
            kv_cache c(p);
            std::mt19937 rng(5);
            fill(c, 1, cells, true, rng);
            const double s = best_of(
                reps_, [&] { c.update(); }, [&] { c.seq_add(0, 0, -1, 1); });
            const double bytes = static_cast<double>(c.size_bytes(kvc::kv_part::k));
            const double g = bytes / s / 1e9, mc = memcpy_gbs(static_cast<size_t>(bytes), reps_);
            add({section_, fmt::format("{} K, {} cells x 4 layers x 1,024 dims", to_string(t), cells), g,
                 "GB/s", mc, "memcpy GB/s", g / mc, t == dtype::f16 ? 0.5 : 0.25});
        }
    }

    void prefix() {
        section("prefix cache (16-token blocks): a 1,024-token request whose first 1,008 tokens are cached");
        struct result {
            double ns_per_token, index_bytes_per_token;
        };
        std::mt19937 rng(11);
        const auto place = [](kv_cache& c, seq_id_t s, pos_t p0, std::span<const token_t> t) {
            for (size_t i = 0; i < t.size(); i += 512) {
                const auto m = static_cast<uint32_t>(std::min<size_t>(512, t.size() - i));
                auto ctx = c.init_ubatches({tokens_of(s, p0 + static_cast<pos_t>(i), m, t.data() + i)}, {});
                if (is_fail(ctx->get_status())) throw error(errc::invalid_state, "bench: the cache is full");
                ctx->apply();
            }
        };
        const auto params = [](uint32_t cells) {
            kv_cache_params p = shape(cells, 2, 1, 1, 32, dtype::q4_0);
            p.prefix.enabled = true;
            return p;
        };
        // ns per prompt token of a request that hits (attach, place the other 16, publish, end) with
        // `cached` tokens of ended conversations in the cache; and the index's bytes per cached token
        const auto hit = [&](uint32_t cached) {
            kv_cache c(params(cached + 65536));
            std::vector<std::vector<token_t>> convs(cached / 1024, std::vector<token_t>(1024));
            for (auto& t : convs) {
                for (auto& x : t) x = static_cast<token_t>(rng() % 32000);
                place(c, 0, 0, t);
                c.prefix_cache()->prefix_publish();
                c.seq_rm(0, -1, -1);
            }
            const prefix_stats st = c.prefix_cache()->get_prefix_stats();
            const double tokens = 16.0 * st.blocks;
            // the requests: a random conversation's first 1,008 tokens and 16 new ones
            const int calls = o_.quick ? 200 : 2000;
            std::vector<std::vector<token_t>> prompts(static_cast<size_t>(calls));
            for (auto& prompt : prompts) {
                const auto& t = convs[rng() % convs.size()];
                prompt.assign(t.begin(), t.begin() + 1008);
                for (size_t k = 1008; k < 1024; ++k) prompt.push_back(static_cast<token_t>(rng() % 32000));
            }
            const double s = best_of(reps_, [&] {
                for (const auto& prompt : prompts) {
                    const uint32_t n = c.prefix_cache()->prefix_attach(1, prompt);
                    place(c, 1, static_cast<pos_t>(n), std::span(prompt).subspan(n));
                    c.prefix_cache()->prefix_publish();
                    c.seq_rm(1, -1, -1);
                }
            });
            return result{s / calls / 1024 * 1e9,
                          (static_cast<double>(st.index_bytes) - 4 * tokens) / tokens};
        };
        const uint32_t small = o_.quick ? 1u << 16 : 1u << 20, big = o_.quick ? 1u << 18 : 10u << 20;
        const result a = hit(small), b = hit(big);
        add({section_, fmt::format("request at {:.1f}M cached tokens", big / 1048576.0), b.ns_per_token,
             "ns/token", a.ns_per_token, fmt::format("at {:.2f}M", small / 1048576.0),
             b.ns_per_token / a.ns_per_token, 1.3, false});
        add({section_, "index memory beyond the token ids", b.index_bytes_per_token, "B/token", 4.0,
             "token ids B/token", b.index_bytes_per_token / 4, 2.0, false});
        // placing 512 tokens when every cell is cached (32 blocks evicted) vs into free cells
        const auto placing = [&](bool full) {
            kv_cache c(params(65536));
            std::vector<token_t> t(512);
            const auto fresh = [&] {
                for (auto& x : t) x = static_cast<token_t>(rng() % 32000);
            };
            for (uint32_t done = 0; full && done < c.get_size(); done += 512) {
                fresh();
                place(c, 0, 0, t);
                c.prefix_cache()->prefix_publish();
                c.seq_rm(0, -1, -1);
            }
            const int calls = o_.quick ? 20 : 100;
            return best_of(reps_,
                           [&] {
                               for (int i = 0; i < calls; ++i) {
                                   fresh();
                                   place(c, 1, 0, t);
                                   c.prefix_cache()->prefix_publish();
                                   c.seq_rm(1, -1, -1);
                               }
                           }) /
                   calls / 512 * 1e9;
        };
        const double free = placing(false), evicting = placing(true);
        add({section_, "placing 512 tokens, evicting 32 blocks", evicting, "ns/token", free,
             "into free cells", evicting / free, 2.0, false});
    }

    void state() {
        section("state of one sequence (~4 MB; GB/s vs memcpy of the same bytes)");
        kv_cache c(shape(1024, 2, 8, 8, 128, dtype::f16));
        std::mt19937 rng(6);
        fill(c, 1, 128, true, rng);
        const auto buf = state_seq_get_data(c, 0);
        std::vector<uint8_t> into(buf.size());
        const double mc = memcpy_gbs(buf.size(), reps_);
        const double ss = best_of(reps_, [&] { state_seq_get_data(c, 0, std::span(into)); });
        const double sl = best_of(reps_, [&] { state_seq_set_data(c, buf, 0); });
        const double n = static_cast<double>(buf.size());
        add({section_, "save into a buffer", n / ss / 1e9, "GB/s", mc, "memcpy GB/s", n / ss / 1e9 / mc,
             0.5});
        add({section_, "load", n / sl / 1e9, "GB/s", mc, "memcpy GB/s", n / sl / 1e9 / mc, 0.5});
    }

    void decode() {
        const uint32_t n_kv = o_.quick ? 4096 : 32768;
        section(fmt::format(
                    "runtime decode, one token over n_kv = {} (f16 K/V; K/V read bandwidth vs memcpy)", n_kv)
                    .c_str());
        const model m = decode_model();
        auto p = m.cache_params(n_kv + 256, 1);
        p.v_trans = false;
        kv_cache c(p);
        std::mt19937 rng(7);
        fill(c, 1, n_kv - 1, true, rng);
        runtime rt(m, c, runtime_params{.n_threads = o_.threads});
        const token_t tok[1] = {1};
        const double s = best_of(
            reps_, [&] { rt.decode(batch::get_one(tok)); },
            [&] { c.seq_rm(0, static_cast<pos_t>(n_kv - 1), -1); });
        const double bytes = static_cast<double>(m.hparams().n_layer) * n_kv *
                             static_cast<double>(row_size(p.type_k, 256) + row_size(p.type_v, 256));
        const double g = bytes / s / 1e9, mc = memcpy_gbs(static_cast<size_t>(bytes), reps_);
        add({section_, "tokens per second", 1.0 / s, "tok/s", 0, "", 0, 0});
        add({section_, "K/V read bandwidth", g, "GB/s", mc, "memcpy GB/s", g / mc, 0.5});
    }

    // Time to first token of a prompt whose blocks are in a tier, against computing the whole prompt
    // (the yardstick, which also gives the prefill cost per token that tiers' cost model takes): from a
    // disk tier (its files in the page cache), and from a tier slower than computing, with the cost
    // model (it asks once, then computes) and without it (what a tier costs when always asked).
    void tiers() {
        const uint32_t n = o_.quick ? 256 : 1024;
        section(fmt::format("tiers: time to first token of a {}-token prompt whose first {} tokens are in a "
                            "tier (vs computing it all)",
                            n, n - 16)
                    .c_str());
        const model m = decode_model();
        std::mt19937 rng(11);
        std::vector<token_t> prompt(n);
        for (token_t& x : prompt) x = static_cast<token_t>(rng() % m.hparams().n_vocab);
        const auto decode = [&](runtime& rt, std::span<const token_t> toks, pos_t p0) {
            batch_storage b = batch::init(static_cast<int32_t>(toks.size()), 0, 1);
            const seq_id_t ids[1] = {0};
            for (size_t i = 0; i < toks.size(); ++i)
                b.add(toks[i], p0 + static_cast<pos_t>(i), ids, i + 1 == toks.size());
            if (is_fail(rt.decode(b.view()).status)) throw error(errc::invalid_state, "bench: decode failed");
        };
        auto p = m.cache_params(2 * n, 1);
        p.v_trans = false;
        p.prefix = {.enabled = true, .block_size = 16};
        kv_cache plain(p);
        runtime plain_rt(m, plain, runtime_params{.n_threads = o_.threads});
        const double recompute = best_of(
            reps_, [&] { decode(plain_rt, prompt, 0); }, [&] { plain.clear(true); });
        const double prefill_ns = recompute * 1e9 / n;
        add({section_, "prefill cost (computing the prompt)", prefill_ns, "ns/tok", 0, "", 0, 0});

        const fs::path dir = fs::temp_directory_path() / fmt::format("kvcache-bench-tier-{}", ::getpid());
        fs::remove_all(dir);
        disk_store_params dp;
        dp.dir = dir.string();
        const auto disk = std::make_shared<disk_block_store>(dp);
        p.prefix.tiers = {.stores = {disk}, .model_id = 1, .write = tier_write::through};
        {  // a first engine computes the prompt: its blocks go to the tier
            kv_cache first(p);
            runtime rt(m, first, runtime_params{.n_threads = o_.threads});
            decode(rt, prompt, 0);
            first.prefix_cache()->prefix_publish();
        }
        // Each run: an empty cache attaches the prompt (fetching its blocks) and computes the rest.
        const auto ttft = [&](const std::shared_ptr<block_store_i>& store, double cost_ns) {
            p.prefix.tiers.stores = {store};
            p.prefix.tiers.prefill_ns_per_token = cost_ns;
            p.prefix.tiers.write = tier_write::never;  // the time to the first token, not of writing
            kv_cache c(p);
            runtime rt(m, c, runtime_params{.n_threads = o_.threads});
            const auto run = [&] {
                const uint32_t hit = c.prefix_cache()->prefix_attach(0, prompt);
                decode(rt, std::span(prompt).subspan(hit), static_cast<pos_t>(hit));
            };
            run();  // the cost model's first measurement
            return best_of(reps_, run, [&] { c.clear(true); });
        };
        const double from_disk = ttft(disk, prefill_ns);
        add({section_, "TTFT, disk tier (page cache)", from_disk * 1e3, "ms", recompute * 1e3, "compute ms",
             recompute / from_disk, 1.0});
        // a tier whose every call takes twice the prompt's computation
        const auto slow = std::make_shared<delayed_store>(disk, recompute * 2);
        const double declined = ttft(slow, prefill_ns);
        add({section_, "TTFT, slow tier, cost model on", declined * 1e3, "ms", recompute * 1e3, "compute ms",
             recompute / declined, 0.9});
        const double asked = ttft(slow, 0);
        add({section_, "TTFT, slow tier, cost model off", asked * 1e3, "ms", recompute * 1e3, "compute ms",
             recompute / asked, 0});
        fs::remove_all(dir);
    }

    // One decode step of 64 sequences, one token each, through a memory_recurrent at Mamba-130m's widths
    // (d_inner 1,536, d_state 16, d_conv 4; 2 layers of random weights): the state rows the step gathers
    // and scatters (recurrent_step: every block's r and s rows in, the new ones out) timed on their own
    // against memcpy of the same bytes, the host bookkeeping (init_batch, apply), and the whole step
    // through the runtime (its matmuls dominate).
    void recurrent_decode() {
        const uint32_t n_seq = 64;
        section(
            "recurrent decode step, 64 sequences x 1 token, Mamba-130m widths (d_inner 1,536, d_state 16)");
        tiny_model_options t = tiny_model_options::mamba();
        t.n_embd = 768;
        t.n_layer = 2;
        t.d_state = 16;
        t.dt_rank = 48;
        const fs::path path =
            fs::temp_directory_path() / fmt::format("kvcache-bench-mamba-{}.gguf", ::getpid());
        write_tiny_model(path.string(), t);
        const model m = model::load(path.string());
        fs::remove(path);
        const int steps = o_.quick ? 5 : 20;
        for (const uint32_t k : {0u, 4u}) {
            recurrent_params rp = m.recr_params(n_seq);
            rp.n_rs_seq = k;
            memory_recurrent mem(rp);
            runtime rt(m, mem, runtime_params{.n_threads = o_.threads});
            std::mt19937 rng(12);
            // one token per sequence at its next position
            const auto step_batch = [&] {
                batch_storage b = batch::init(static_cast<int32_t>(n_seq), 0, 1);
                for (seq_id_t s = 0; s < static_cast<seq_id_t>(n_seq); ++s) {
                    const seq_id_t ids[1] = {s};
                    b.add(static_cast<token_t>(rng() % 256), mem.seq_pos_max(s) + 1, ids, true);
                }
                return b;
            };
            // every sequence starts with a prompt of 8 tokens, so that each step gathers real rows
            batch_storage prompt = batch::init(static_cast<int32_t>(n_seq * 8), 0, 1);
            for (seq_id_t s = 0; s < static_cast<seq_id_t>(n_seq); ++s)
                for (pos_t p = 0; p < 8; ++p) {
                    const seq_id_t ids[1] = {s};
                    prompt.add(static_cast<token_t>(rng() % 256), p, ids, false);
                }
            rt.decode(prompt.view());
            // the engine's side of the state, alone: every tensor's recurrent_step, each block storing its
            // one token; bytes: the rows gathered (sources, history sources) and written (plane 0, history)
            double t_book = 1e300, t_rows = 1e300, bytes = 0;
            for (int rep = 0; rep < reps_; ++rep) {
                double book = 0, rows = 0;
                for (int i = 0; i < steps; ++i) {
                    batch_storage b = step_batch();
                    const auto t0 = clock_type::now();
                    batch_allocr balloc;
                    balloc.init(b.view(), positions_of(mem), {.n_seq_max = n_seq, .n_vocab = 256});
                    auto ctx = mem.init_batch(balloc, 512, false);
                    ctx->apply();
                    const auto t1 = clock_type::now();
                    memory_recurrent_context& rc = *ctx->get_recr();
                    bytes = 0;  // every step moves as many rows
                    for (const uint32_t il : mem.layer_ids())
                        for (const rs_tensor which : {rs_tensor::r, rs_tensor::s}) {
                            recurrent_step st(rc, il, which);
                            for (uint32_t blk = 0; blk < st.n_seqs(); ++blk) st.store(blk, 0);
                            st.finish();
                            bytes += 2.0 * static_cast<double>(rc.get_n_rs() + rc.hist_copies().size()) *
                                     st.width() * sizeof(float);
                        }
                    const auto t2 = clock_type::now();
                    book += std::chrono::duration<double>(t1 - t0).count();
                    rows += std::chrono::duration<double>(t2 - t1).count();
                }
                t_book = std::min(t_book, book / steps);
                t_rows = std::min(t_rows, rows / steps);
            }
            const double g = bytes / t_rows / 1e9, mc = memcpy_gbs(static_cast<size_t>(bytes), reps_);
            add({section_, fmt::format("n_rs_seq {}: state rows in + out ({:.1f} MB)", k, bytes / 1e6), g,
                 "GB/s", mc, "memcpy GB/s", g / mc, 0.5});
            add({section_, fmt::format("n_rs_seq {}: host bookkeeping per step", k), t_book * 1e6, "us",
                 t_rows * 1e6, "rows us", t_book / t_rows, 0, false});
            if (k != 0) continue;
            const double s = best_of(reps_, [&] {
                for (int i = 0; i < steps; ++i) rt.decode(step_batch().view());
            });
            add({section_, "decode step through the runtime", s / steps * 1e3, "ms", 0, "", 0, 0, false});
        }
    }

    bench_options o_;
    int reps_;
    std::string section_;
    std::vector<figure> out_;
};

}  // namespace

void add_bench_command(CLI::App& app) {
    auto opt = std::make_shared<bench_options>();
    CLI::App* cmd =
        app.add_subcommand("bench",
                           "The key figures, each next to a yardstick from the same run. The targets are "
                           "informative: a figure that misses one is printed as MISSED and the exit status "
                           "stays 0 (a shared or small machine misses them; docs/performance.md has the "
                           "measured ones)");
    cmd->add_flag("--json", opt->json, "print JSON");
    cmd->add_flag("--quick", opt->quick, "smaller sizes, fewer repetitions (a smoke run)");
    cmd->add_option("--threads", opt->threads, "runtime threads (0: all cores)")
        ->check(CLI::Range(0u, thread_pool::max_threads));
    cmd->callback([opt] {
        if (!opt->json)
            fmt::print(
                "kvcache {} bench{} ({} hardware threads)\n  {:<44} {:>10} {:<6} {:>10} {:<14} {:>8}\n",
                version_string(), opt->quick ? " --quick" : "", std::thread::hardware_concurrency(), "figure",
                "value", "", "yardstick", "", "ratio");
        runner r(*opt);
        const std::vector<figure> figs = r.run();
        if (!opt->json) return;
        nlohmann::ordered_json j;
        j["version"] = version_string();
        j["hardware_threads"] = std::thread::hardware_concurrency();
        j["quick"] = opt->quick;
        auto& arr = j["figures"] = nlohmann::ordered_json::array();
        for (const figure& f : figs) {
            nlohmann::ordered_json e{{"section", f.section},     {"name", f.name},
                                     {"value", f.value},         {"unit", f.unit},
                                     {"yardstick", f.yardstick}, {"yardstick_name", f.yardstick_name},
                                     {"ratio", f.ratio}};
            if (f.target > 0) {
                e["target"] = f.target;
                e["target_met"] = f.higher_is_better ? f.ratio >= f.target : f.ratio <= f.target;
            }
            arr.push_back(std::move(e));
        }
        fmt::print("{}\n", j.dump(2));
    });
}

}  // namespace kvc::cli
