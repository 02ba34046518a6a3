// The block stores against what their medium can do, measured in the same run (issue 19's targets):
//
//   redis_read_many / redis_put_many  one call moves 16 block records (one lookup's chain) through a
//                                     redis-server this program starts on a free port of 127.0.0.1
//   redis-benchmark GET / SET         the same server, the same value size, one client pipelining 16
//                                     requests (-c 1 -P 16: the shape of one get_many), run after the
//                                     benchmarks; bytes/s = requests/s x value size
//   disk_read_many                    16 records of a disk_block_store per call
//   disk_sequential_read              the same bytes in one file, read front to back in 1 MiB pieces
//
// Both disk benchmarks drop their files from the page cache before every iteration
// (posix_fadvise DONTNEED; the files are synced) when the second argument is 1 ("cold": the disk), and
// read the page cache when it is 0 ("warm"). The table at the end gives each store's bytes/s over its
// baseline's: the targets are >= 0.5. Without redis-server / redis-benchmark the Redis rows are skipped.
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <kvcache/block_record.h>
#include <kvcache/disk_store.h>
#include <kvcache/redis/redis_store.h>

#include "redis_test_util.h"

namespace {

using namespace kvc;
namespace fs = std::filesystem;

constexpr int n_blocks = 16;

// Records of about `size` bytes: block_size 16, one layer of f16 K and V rows.
struct record_set {
    block_layout layout;
    std::vector<std::string> keys;
    std::vector<std::vector<uint8_t>> values;

    explicit record_set(int64_t size) {
        layout.model_id = 7;
        layout.block_size = 16;
        const auto width = static_cast<uint32_t>(std::max<int64_t>(1, size / (2 * 16 * 2)));
        layout.layers = {{.il = 0, .n_k = width, .n_v = width}};
        std::vector<uint8_t> rows(layout.row_bytes());
        for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<uint8_t>(i * 131);
        for (int b = 0; b < n_blocks; ++b) {
            std::vector<token_t> t(16, b);
            const block_id id{.key = 1, .hash = block_chain_hash(1, t), .parent_hash = 1, .depth = 0};
            values.push_back(encode_block(layout, id, t, rows));
            keys.push_back(block_key(layout.fingerprint(), 1, id.hash));
        }
    }
    std::vector<block_put> puts() const {
        std::vector<block_put> out;
        for (int b = 0; b < n_blocks; ++b) out.push_back({keys[b], values[b]});
        return out;
    }
    uint64_t bytes() const { return uint64_t{values[0].size()} * n_blocks; }
};

std::unique_ptr<test::redis_server> g_server;

fs::path bench_dir() {
    return fs::temp_directory_path() / fmt::format("kvc-bench-store-{}", ::getpid());
}

void drop_cache(const fs::path& p) {
    const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
}

void redis_read_many(benchmark::State& state) {
    if (!g_server || !g_server->ok()) {
        state.SkipWithError("no redis-server");
        return;
    }
    const record_set r(state.range(0));
    redis_store_params p;
    p.port = g_server->port();
    p.key_prefix = "bench:";
    p.check = block_value_check(r.layout);  // every value decoded and verified, as a lookup would
    redis_block_store s(p);
    s.put_many(r.puts());
    uint64_t sum = 0;
    for (auto _ : state) {  // the values as a lookup sees them: verified, in the reply's buffer
        if (s.read_many(r.keys, [&](size_t, std::span<const uint8_t> v) { sum += v[v.size() / 2]; }) !=
            n_blocks)
            state.SkipWithError("miss");
    }
    benchmark::DoNotOptimize(sum);
    state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * r.bytes()));
    state.counters["value_bytes"] = static_cast<double>(r.values[0].size());
}

void redis_put_many(benchmark::State& state) {
    if (!g_server || !g_server->ok()) {
        state.SkipWithError("no redis-server");
        return;
    }
    const record_set r(state.range(0));
    redis_store_params p;
    p.port = g_server->port();
    p.key_prefix = "bench:";
    p.ttl_seconds = 600;
    redis_block_store s(p);
    const auto puts = r.puts();
    for (auto _ : state) s.put_many(puts);
    if (s.stats().errors) state.SkipWithError("errors");
    state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * r.bytes()));
}

void disk_read_many(benchmark::State& state) {
    const record_set r(state.range(0));
    const bool cold = state.range(1) != 0;
    const fs::path dir = bench_dir() / "store";
    fs::remove_all(dir);
    disk_block_store s({.dir = dir.string(), .check = block_value_check(r.layout)});
    s.put_many(r.puts());
    uint64_t sum = 0;
    for (auto _ : state) {
        if (cold) {
            state.PauseTiming();
            for (const std::string& k : r.keys) drop_cache(dir / k);
            state.ResumeTiming();
        }
        if (s.read_many(r.keys, [&](size_t, std::span<const uint8_t> v) { sum += v[v.size() / 2]; }) !=
            n_blocks)
            state.SkipWithError("miss");
    }
    benchmark::DoNotOptimize(sum);
    state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * r.bytes()));
    fs::remove_all(dir);
}

void disk_sequential_read(benchmark::State& state) {
    const record_set r(state.range(0));
    const bool cold = state.range(1) != 0;
    fs::create_directories(bench_dir());
    const fs::path file = bench_dir() / "sequential";
    {
        const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        for (const auto& v : r.values)
            if (::write(fd, v.data(), v.size()) != static_cast<ssize_t>(v.size()))
                state.SkipWithError("write");
        ::fsync(fd);
        ::close(fd);
    }
    std::vector<uint8_t> buf(r.bytes());
    for (auto _ : state) {
        if (cold) {
            state.PauseTiming();
            drop_cache(file);
            state.ResumeTiming();
        }
        const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
        size_t got = 0;
        while (got < buf.size()) {
            const ssize_t n =
                ::read(fd, buf.data() + got, std::min<size_t>(size_t{1} << 20, buf.size() - got));
            if (n <= 0) break;
            got += static_cast<size_t>(n);
        }
        ::close(fd);
        benchmark::DoNotOptimize(buf.data());
    }
    state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * r.bytes()));
    fs::remove(file);
}

BENCHMARK(redis_read_many)->Arg(64 << 10)->Arg(1 << 20)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(redis_put_many)->Arg(64 << 10)->Arg(1 << 20)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(disk_read_many)
    ->ArgsProduct({{64 << 10, 1 << 20}, {0, 1}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(disk_sequential_read)
    ->ArgsProduct({{64 << 10, 1 << 20}, {0, 1}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

// Keeps every run's bytes/s for the table of ratios.
class capture final : public benchmark::ConsoleReporter {
public:
    std::map<std::string, double> bps;
    void ReportRuns(const std::vector<Run>& runs) override {
        for (const Run& r : runs) {
            const auto it = r.counters.find("bytes_per_second");
            std::string name = r.benchmark_name();
            if (const size_t at = name.find("/real_time"); at != std::string::npos) name.erase(at);
            if (!r.error_occurred && it != r.counters.end()) bps[name] = it->second.value;
        }
        ConsoleReporter::ReportRuns(runs);
    }
};

// redis-benchmark's requests/s for GET and SET of `size`-byte values on the bench's server.
std::map<std::string, double> redis_benchmark(int port, int64_t size) {
    const int64_t n = std::clamp<int64_t>((int64_t{512} << 20) / size, 1000, 100000);
    const std::string cmd =
        fmt::format("redis-benchmark -h 127.0.0.1 -p {} -t set,get -d {} -n {} -c 1 -P {} --csv 2>/dev/null",
                    port, size, n, n_blocks);
    std::map<std::string, double> out;
    FILE* f = ::popen(cmd.c_str(), "r");
    if (!f) return out;
    char line[512];
    while (std::fgets(line, sizeof line, f)) {
        char test[32] = {};
        double rps = 0;
        if (std::sscanf(line, "\"%31[A-Z]\",\"%lf\"", test, &rps) == 2) out[test] = rps;
    }
    ::pclose(f);
    return out;
}

}  // namespace

int main(int argc, char** argv) {
    benchmark::Initialize(&argc, argv);
    if (test::have_redis_server()) g_server = std::make_unique<test::redis_server>();
    capture reporter;
    benchmark::RunSpecifiedBenchmarks(&reporter);
    std::printf("\n%-34s %14s %14s %7s\n", "store / baseline (same run)", "store MB/s", "baseline MB/s",
                "ratio");
    const auto row = [&](const std::string& what, const std::string& ours, double base) {
        const auto it = reporter.bps.find(ours);
        if (it == reporter.bps.end() || base <= 0) return;
        std::printf("%-34s %14.0f %14.0f %7.2f\n", what.c_str(), it->second / 1e6, base / 1e6,
                    it->second / base);
    };
    for (const int64_t size : {int64_t{64} << 10, int64_t{1} << 20}) {
        const record_set r(size);
        if (g_server && g_server->ok()) {
            const auto rb = redis_benchmark(g_server->port(), static_cast<int64_t>(r.values[0].size()));
            const auto get = rb.find("GET"), set = rb.find("SET");
            if (get != rb.end())
                row(fmt::format("redis read_many {} KiB / GET", size >> 10),
                    fmt::format("redis_read_many/{}", size),
                    get->second * static_cast<double>(r.values[0].size()));
            if (set != rb.end())
                row(fmt::format("redis put_many {} KiB / SET", size >> 10),
                    fmt::format("redis_put_many/{}", size),
                    set->second * static_cast<double>(r.values[0].size()));
        }
        for (const int cold : {0, 1}) {
            const auto base = reporter.bps.find(fmt::format("disk_sequential_read/{}/{}", size, cold));
            if (base != reporter.bps.end())
                row(fmt::format("disk read_many {} KiB {} / seq. read", size >> 10, cold ? "cold" : "warm"),
                    fmt::format("disk_read_many/{}/{}", size, cold), base->second);
        }
    }
    g_server.reset();
    fs::remove_all(bench_dir());
    benchmark::Shutdown();
    return 0;
}
