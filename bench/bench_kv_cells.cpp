// Sequence operations on one stream of cells, at two stream sizes with the same occupancy (64 sequences
// x 256 positions, placed as a cache fills a stream: front first, sequences interleaved). Their cost must
// follow the cells touched, not the stream size: the table at the end prints the ratio big/small per
// operation (target <= 1.2).
//
// Mutating operations are timed together with their inverse so that every iteration starts from the
// same state: seq_rm of 32 positions + refilling them, seq_cp of a whole sequence + removing the copy,
// seq_add of a 128-position suffix by +5 and back by -5.
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>
#include <kvcache/kv_cells.h>

namespace {

constexpr uint32_t n_seqs = 64;
constexpr kvc::pos_t n_pos = 256;
constexpr uint32_t small_size = 32768;
constexpr uint32_t big_size = 262144;

kvc::kv_cells& filled(uint32_t size) {
    static std::map<uint32_t, kvc::kv_cells> cache;
    auto it = cache.find(size);
    if (it != cache.end()) return it->second;
    kvc::kv_cells c(size, n_seqs + 1);  // one spare id as the seq_cp destination
    const uint32_t n = n_seqs * static_cast<uint32_t>(n_pos);
    for (uint32_t k = 0; k < n; ++k) {  // token k: sequence k % 64, interleaved like parallel decoding
        const uint32_t cell = k;
        c.pos_set(cell, static_cast<kvc::pos_t>(k / n_seqs));
        c.seq_add(cell, static_cast<kvc::seq_id_t>(k % n_seqs));
    }
    return cache.emplace(size, std::move(c)).first->second;
}

void bm_seq_pos_max(benchmark::State& state) {
    const kvc::kv_cells& c = filled(static_cast<uint32_t>(state.range(0)));
    kvc::seq_id_t s = 0;
    for (auto _ : state) {
        benchmark::DoNotOptimize(c.seq_pos_max(s));
        s = (s + 1) % n_seqs;
    }
}

void bm_seq_rm_partial(benchmark::State& state) {
    kvc::kv_cells& c = filled(static_cast<uint32_t>(state.range(0)));
    std::vector<uint32_t> cells;
    kvc::seq_id_t s = 0;
    for (auto _ : state) {
        cells.clear();
        c.seq_cells(s, 200, 232, cells);
        c.seq_rm_range(s, 200, 232);
        for (size_t j = 0; j < cells.size(); ++j) {  // refill the same cells
            c.pos_set(cells[j], 200 + static_cast<kvc::pos_t>(j));
            c.seq_add(cells[j], s);
        }
        s = (s + 1) % n_seqs;
    }
}

void bm_seq_cp_whole(benchmark::State& state) {
    kvc::kv_cells& c = filled(static_cast<uint32_t>(state.range(0)));
    kvc::seq_id_t s = 0;
    for (auto _ : state) {
        c.seq_cp_range(s, n_seqs, -1, -1);
        c.seq_rm_range(n_seqs, -1, -1);
        s = (s + 1) % n_seqs;
    }
}

void bm_seq_add_suffix(benchmark::State& state) {
    kvc::kv_cells& c = filled(static_cast<uint32_t>(state.range(0)));
    kvc::seq_id_t s = 0;
    for (auto _ : state) {
        c.seq_add_range(s, 128, -1, 5);
        c.seq_add_range(s, 133, -1, -5);
        s = (s + 1) % n_seqs;
    }
}

// Prints the usual console output, then ns/op per size and the ratio big/small.
class ratio_reporter : public benchmark::ConsoleReporter {
public:
    void ReportRuns(const std::vector<Run>& runs) override {
        ConsoleReporter::ReportRuns(runs);
        for (const Run& r : runs) {
            const std::string name = r.benchmark_name();
            const auto slash = name.find('/');
            ns_[name.substr(0, slash)][std::stoul(name.substr(slash + 1))] = r.GetAdjustedRealTime();
        }
    }
    void Finalize() override {
        ConsoleReporter::Finalize();
        std::printf("\n%-18s %12s %12s %8s\n", "operation", "ns @32768", "ns @262144", "ratio");
        for (const auto& [op, by_size] : ns_) {
            if (!by_size.count(small_size) || !by_size.count(big_size)) continue;
            const double a = by_size.at(small_size), b = by_size.at(big_size);
            std::printf("%-18s %12.1f %12.1f %8.2f%s\n", op.c_str(), a, b, b / a,
                        b / a <= 1.2 ? "" : "  (> 1.2)");
        }
    }

private:
    std::map<std::string, std::map<unsigned long, double>> ns_;
};

}  // namespace

BENCHMARK(bm_seq_pos_max)->Arg(small_size)->Arg(big_size)->Unit(benchmark::kNanosecond);
BENCHMARK(bm_seq_rm_partial)->Arg(small_size)->Arg(big_size)->Unit(benchmark::kNanosecond);
BENCHMARK(bm_seq_cp_whole)->Arg(small_size)->Arg(big_size)->Unit(benchmark::kNanosecond);
BENCHMARK(bm_seq_add_suffix)->Arg(small_size)->Arg(big_size)->Unit(benchmark::kNanosecond);

int main(int argc, char** argv) {
    benchmark::Initialize(&argc, argv);
    if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
    ratio_reporter reporter;
    benchmark::RunSpecifiedBenchmarks(&reporter);
    benchmark::Shutdown();
    return 0;
}
