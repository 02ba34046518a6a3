// Elastic host storage (issue 18): what memory on demand costs, next to touching the same bytes.
//   kv_write/fresh:     a prompt of 512 tokens written into cells whose memory went back to the system
//                       (the cache was emptied): placement + the rows of 8 layers (K and V, 2 KiB rows);
//   kv_write/committed: the same into cells whose memory stayed committed (a token of another sequence at
//                       the top keeps the commit mark up);
//   touch/fresh, touch/resident: memset of the same bytes into pages just given back, and into resident
//                       pages: the cost of touching memory once.
// Committing is (fresh - committed) for kvcache and (touch/fresh - touch/resident) for memset: the
// target is that the first is no more than the second.
//   refuse: creating a cache of 65,536 layers x 65,536 cells (512 GiB) over the budget: the error comes
//   before anything is allocated (target: < 10 ms).
#include <sys/mman.h>

#include <cstring>
#include <vector>

#include <benchmark/benchmark.h>
#include <kvcache/kv_cache.h>

namespace {

using namespace kvc;

constexpr uint32_t n_layer = 8, n_tokens = 512, e = 1024;  // E values per row, f16: 2 KiB

kv_cache_params params() {
    kv_cache_params p;
    p.layers.assign(n_layer, layer_desc{.n_head_kv = 8, .n_embd_head_k = 128, .n_embd_head_v = 128});
    p.kv_size = 4096;
    p.n_seq_max = 2;
    p.v_trans = false;
    return p;
}

ubatch prompt(seq_id_t s, pos_t p0, uint32_t n) {
    ubatch u;
    u.n_tokens = n;
    u.n_seq_tokens = 1;
    u.n_seqs = n;
    u.n_seqs_unq = 1;
    u.seq_id_unq = {s};
    u.seq_id_begin.push_back(0);
    for (uint32_t i = 0; i < n; ++i) {
        u.pos.push_back(p0 + static_cast<pos_t>(i));
        u.n_seq_id.push_back(1);
        u.seq_id_data.push_back(s);
        u.seq_id_begin.push_back(i + 1);
        u.output.push_back(0);
    }
    return u;
}

void write_prompt(kv_cache& c, const std::vector<float>& rows) {
    auto ctx = c.init_ubatches({prompt(0, 0, n_tokens)}, {});
    ctx->apply();
    kv_cache_context& kc = *ctx->get_attn(0);
    const auto src = const_tensor_view::contiguous(
        dtype::f32, reinterpret_cast<const std::byte*>(rows.data()), e, n_tokens);
    for (uint32_t il = 0; il < n_layer; ++il) {
        kc.cpy_k(il, src);
        kc.cpy_v(il, src);
    }
}

void kv_write(benchmark::State& state) {
    const bool fresh = state.range(0) == 0;
    kv_cache c(params());
    const std::vector<float> rows(size_t{n_tokens} * e, 0.25f);
    if (!fresh) {  // seq 1 at the top cell: the commit mark stays at the whole stream
        auto ctx = c.init_ubatches({prompt(1, 0, 1)}, {});
        ctx->apply();
        c.compact();
        ubatch top = prompt(1, 1, 4096 - 1);
        auto fill = c.init_ubatches({top}, {});
        fill->apply();
        c.seq_rm(1, 0, 4095);  // only the last cell stays
    }
    for (auto _ : state) {
        state.PauseTiming();
        c.seq_rm(0, -1, -1);  // fresh: the memory goes back
        state.ResumeTiming();
        write_prompt(c, rows);
    }
    state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * n_tokens * n_layer * 2 * e * 2);
}
BENCHMARK(kv_write)->Arg(0)->Arg(1)->ArgName("committed")->Unit(benchmark::kMicrosecond);

void touch(benchmark::State& state) {
    const bool fresh = state.range(0) == 0;
    const size_t bytes = size_t{n_tokens} * n_layer * 2 * e * 2;
    void* p =
        ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    std::memset(p, 1, bytes);
    for (auto _ : state) {
        if (fresh) {
            state.PauseTiming();
            ::madvise(p, bytes, MADV_DONTNEED);
            state.ResumeTiming();
        }
        std::memset(p, 2, bytes);
        benchmark::DoNotOptimize(p);
    }
    ::munmap(p, bytes);
    state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
}
BENCHMARK(touch)->Arg(0)->Arg(1)->ArgName("resident")->Unit(benchmark::kMicrosecond);

void refuse(benchmark::State& state) {
    kv_cache_params p;
    p.layers.assign(65536, layer_desc{.n_head_kv = 2, .n_embd_head_k = 16, .n_embd_head_v = 16});
    p.kv_size = 65536;
    for (auto _ : state) {
        try {
            kv_cache c(p);
            state.SkipWithError("created over the budget");
        } catch (const error&) {}
    }
}
BENCHMARK(refuse)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
