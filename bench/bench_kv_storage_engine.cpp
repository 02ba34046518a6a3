// Engine-owned storage's per-step bookkeeping next to host storage's, measured in the same run (issue 18:
// target engine / host <= 1.2): a decode step of one token for each of 64 or 256 sequences in a cache of
// 32,768 cells (one layer of 8 KV heads x 64 values, f16), with and without transposed V.
//   host (0):         batch validation + init_batch + apply (the engine then calls cpy_k / cpy_v, which
//                     move bytes);
//   engine (1):       the same + k_idxs, and v_idxs when V is not transposed: the rows the engine scatters
//                     the ubatch's K/V at (transposed V: the engine derives each channel's element from the
//                     row, row / kv_size * kv_size * E_vmax + e * kv_size + row % kv_size, on its device);
//   engine + v_idxs (2): with transposed V also the element indices built on the host, one per token and
//                     channel (llama.cpp's v_idxs): n_tokens x E_vmax int64 per step.
// A plain decode step hands the engine no operation; the ops of maintenance (K-shift, compaction) are as
// many as the rows the host storage would move.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <benchmark/benchmark.h>
#include <kvcache/kv_cache.h>
#include <kvcache/kv_storage_engine.h>

namespace {

using namespace kvc;
using clock_type = std::chrono::steady_clock;

// Holds nothing: the benchmark times kvcache's side only.
class null_engine final : public kv_storage_engine {
public:
    void allocate(const kv_storage&, std::span<const uint32_t>) override {}
    void run(const kv_op& op) override { n_rows += op.copies.size() + op.shifts.size(); }
    void read_rows(uint32_t, kv_part, std::span<const uint64_t>, std::byte*) override {}
    void write_rows(uint32_t, kv_part, std::span<const uint64_t>, const std::byte*) override {}
    size_t n_rows = 0;
};

null_engine g_engine;

// The cache of (engine?, n_seq, v_trans), filled with 16,384 tokens over its sequences.
kv_cache& step_cache(bool engine, uint32_t n_seq, bool v_trans) {
    static std::map<std::tuple<bool, uint32_t, bool>, std::unique_ptr<kv_cache>> caches;
    auto& c = caches[{engine, n_seq, v_trans}];
    if (c) return *c;
    kv_cache_params p;
    p.layers = {layer_desc{.n_head_kv = 8, .n_embd_head_k = 64, .n_embd_head_v = 64}};
    p.kv_size = 32768;
    p.n_seq_max = n_seq;
    p.v_trans = v_trans;
    if (engine) p.engine = &g_engine;
    c = std::make_unique<kv_cache>(p);
    const uint32_t per_seq = 16384 / n_seq;
    for (uint32_t pos = 0; pos < per_seq; pos += 8) {
        batch_storage b = batch::init(static_cast<int32_t>(n_seq * 8), 0, 1);
        for (uint32_t s = 0; s < n_seq; ++s)
            for (uint32_t k = pos; k < std::min(per_seq, pos + 8); ++k)
                b.add(1, static_cast<pos_t>(k), std::vector<seq_id_t>{static_cast<seq_id_t>(s)}, false);
        batch_allocr a;
        a.init(b.view(), positions_of(c.get()), {.n_seq_max = n_seq});
        auto ctx = c->init_batch(a, 4096, /*embd_all=*/false);
        do ctx->apply();
        while (ctx->next());
    }
    return *c;
}

// args: storage (0 host, 1 engine, 2 engine with host-built transposed V indices), sequences, transposed V
void bm_step(benchmark::State& state) {
    const bool engine = state.range(0) != 0;
    const bool v_idxs = state.range(0) == 2 || state.range(2) == 0;
    const auto n_seq = static_cast<uint32_t>(state.range(1));
    kv_cache& c = step_cache(engine, n_seq, state.range(2) != 0);
    batch_storage b = batch::init(static_cast<int32_t>(n_seq), 0, 1);
    batch_allocr a;
    for (auto _ : state) {
        const auto t0 = clock_type::now();
        b.clear();
        for (uint32_t s = 0; s < n_seq; ++s) {
            const seq_id_t id[1] = {static_cast<seq_id_t>(s)};
            b.add(1, c.seq_pos_max(id[0]) + 1, id, true);
        }
        a.init(b.view(), positions_of(c), {.n_seq_max = n_seq});
        {
            auto ctx = c.init_batch(a, 512, /*embd_all=*/false);
            do {
                ctx->apply();
                if (engine) {
                    kv_cache_context& kc = *ctx->get_attn(0);
                    benchmark::DoNotOptimize(kc.k_idxs());
                    if (v_idxs) benchmark::DoNotOptimize(kc.v_idxs(0));
                }
            } while (ctx->next());
        }
        state.SetIterationTime(std::chrono::duration<double>(clock_type::now() - t0).count());
        for (uint32_t s = 0; s < n_seq; ++s) {  // back to the same contents, untimed
            const pos_t p = c.seq_pos_max(static_cast<seq_id_t>(s));
            c.seq_rm(static_cast<seq_id_t>(s), p, p + 1);
        }
    }
}

}  // namespace

// The minimum over repetitions too: on a shared machine other processes only ever add time, so the
// fastest repetition of each shape is the closest to its own cost.
BENCHMARK(bm_step)
    ->ArgsProduct({{0, 1, 2}, {64, 256}, {0, 1}})
    ->UseManualTime()
    ->ComputeStatistics("min",
                        [](const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); })
    ->Unit(benchmark::kMicrosecond);

namespace {

// The usual console output, then engine / host per shape: of single runs, or with --benchmark_repetitions
// of the medians and of the minima.
class ratio_reporter : public benchmark::ConsoleReporter {
public:
    void ReportRuns(const std::vector<Run>& runs) override {
        ConsoleReporter::ReportRuns(runs);
        for (const Run& r : runs) {
            if (r.error_occurred) continue;
            const std::string name = r.run_name.str();
            if (r.run_type != Run::RT_Aggregate) {
                if (!us_.count(name)) us_[name] = min_[name] = r.GetAdjustedRealTime();
            } else if (r.aggregate_name == "median") {
                us_[name] = r.GetAdjustedRealTime();
            } else if (r.aggregate_name == "min") {
                min_[name] = r.GetAdjustedRealTime();
            }
        }
    }
    void Finalize() override {
        ConsoleReporter::Finalize();
        print("median", us_);
        print("minimum", min_);
    }

private:
    static void print(const char* what, std::map<std::string, double>& us) {
        std::printf("\nper-step bookkeeping, engine-owned / host storage, %s (target <= 1.2)\n", what);
        for (int n : {64, 256})
            for (int vt : {0, 1}) {
                const auto key = [&](int e) {
                    return "bm_step/" + std::to_string(e) + "/" + std::to_string(n) + "/" +
                           std::to_string(vt) + "/manual_time";
                };
                if (!us.count(key(0)) || !us.count(key(1))) continue;
                std::printf("   %3d seqs, v_trans %d: host %7.1f us  engine %7.1f us  ratio %.2f", n, vt,
                            us[key(0)], us[key(1)], us[key(1)] / us[key(0)]);
                if (vt == 1 && us.count(key(2)))
                    std::printf("   (with host-built v_idxs %7.1f us, ratio %.2f)", us[key(2)],
                                us[key(2)] / us[key(0)]);
                std::printf("\n");
            }
    }

    std::map<std::string, double> us_;   // median (or the single run)
    std::map<std::string, double> min_;  // minimum (or the single run)
};

}  // namespace

int main(int argc, char** argv) {
    benchmark::Initialize(&argc, argv);
    if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
    for (const bool engine : {false, true})  // filled before any timing: both storages start alike
        for (const uint32_t n_seq : {64u, 256u})
            for (const bool v_trans : {false, true}) step_cache(engine, n_seq, v_trans);
    ratio_reporter reporter;
    benchmark::RunSpecifiedBenchmarks(&reporter);
    benchmark::Shutdown();
    return 0;
}
