// The recurrent memory's host-side work:
//  1. a decode step of 256 sequences, one token each (batch validation, then init_batch + apply of every
//     ubatch: split, dry run, placement), without and with rollback (n_rs_seq = 4). Timed: init_batch +
//     apply, per step; counters: the batch validation (allocr_ns), and the rows an engine moves per step
//     (rows: s_copy gathers + history copies, per layer and tensor);
//  2. a k-token rollback (seq_rm of the last 4 tokens of a sequence, k = 4) next to a copy of one state
//     row in the same memory (a Mamba-130m s row: 16 x 1,536 f32 = 96 KiB), per sequence; counter
//     rollback_vs_row = rollback / row copy. The rollback is bookkeeping: the engine reads the restored
//     plane at the next step instead of plane 0, at no extra cost.
#include <chrono>
#include <cstring>
#include <memory>
#include <vector>

#include <benchmark/benchmark.h>
#include <kvcache/batch.h>
#include <kvcache/memory_recurrent.h>

namespace {

using namespace kvc;
using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t0) {
    return std::chrono::duration<double>(clock_type::now() - t0).count();
}

// One token for each sequence [0, n_seq) at its next position (all outputs), validated against m.
void next_tokens(batch_storage& b, batch_allocr& a, const memory_recurrent& m, uint32_t n_seq,
                 uint32_t per_seq) {
    b.clear();
    for (uint32_t s = 0; s < n_seq; ++s) {
        const seq_id_t ids[] = {static_cast<seq_id_t>(s)};
        const pos_t p = m.seq_pos_max(ids[0]) + 1;
        for (uint32_t t = 0; t < per_seq; ++t) b.add(1, p + static_cast<pos_t>(t), ids, true);
    }
    a.init(b.view(), positions_of(m), {.n_seq_max = m.params().n_seq_max});
}

// init_batch + apply of every ubatch; returns the rows an engine moves (per layer and tensor).
size_t place(memory_recurrent& m, batch_allocr& a) {
    auto ctx = m.init_batch(a, 512, /*embd_all=*/false);
    memory_recurrent_context& rc = *ctx->get_recr();
    size_t rows = 0;
    do {
        rc.apply();
        rows += rc.get_n_rs() + rc.hist_copies().size();
    } while (rc.next());
    return rows;
}

// -- 1. decode step --

void bm_decode_step(benchmark::State& state) {
    constexpr uint32_t n_seq = 256;
    recurrent_params p;
    p.layers = {recurrent_layer_desc{.n_embd_r = 16, .n_embd_s = 64}};
    p.n_seq_max = n_seq;
    p.n_rs_seq = static_cast<uint32_t>(state.range(0));
    memory_recurrent m(p);
    batch_storage b = batch::init(static_cast<int32_t>(n_seq), 0, 1);
    batch_allocr a;
    for (int warm = 0; warm < 8; ++warm) {  // every sequence has a state and a full history
        next_tokens(b, a, m, n_seq, 1);
        place(m, a);
    }
    double allocr = 0;
    size_t rows = 0;
    for (auto _ : state) {
        const auto t0 = clock_type::now();
        next_tokens(b, a, m, n_seq, 1);
        allocr += seconds_since(t0);
        const auto t1 = clock_type::now();
        rows = place(m, a);
        state.SetIterationTime(seconds_since(t1));
    }
    state.counters["allocr_ns"] = benchmark::Counter(allocr * 1e9 / static_cast<double>(state.iterations()));
    state.counters["rows"] = static_cast<double>(rows);
}

// -- 2. rollback vs row copy --

void bm_rollback(benchmark::State& state) {
    constexpr uint32_t n_seq = 32, k = 4;
    recurrent_params p;
    p.layers = {recurrent_layer_desc{.n_embd_r = 3 * 1536, .n_embd_s = 16 * 1536}};
    p.n_seq_max = n_seq;
    p.n_rs_seq = k;
    memory_recurrent m(p);
    batch_storage b = batch::init(static_cast<int32_t>(n_seq * (k + 1)), 0, 1);
    batch_allocr a;
    next_tokens(b, a, m, n_seq, k + 1);
    place(m, a);
    const tensor_view s = m.get_s(0);
    const size_t row = s.row_bytes();
    double rollback = 0, copy = 0;
    for (auto _ : state) {
        auto t0 = clock_type::now();
        for (uint32_t q = 0; q < n_seq; ++q) {
            const auto id = static_cast<seq_id_t>(q);
            benchmark::DoNotOptimize(m.seq_rm(id, m.seq_pos_max(id) - static_cast<pos_t>(k) + 1, -1));
        }
        const double t_rollback = seconds_since(t0);
        rollback += t_rollback;
        // the yardstick: each sequence's plane-4 row copied over its plane-0 row
        t0 = clock_type::now();
        for (uint32_t q = 0; q < n_seq; ++q) std::memcpy(s.row(q, 0), s.row(q, k), row);
        benchmark::ClobberMemory();
        copy += seconds_since(t0);
        state.SetIterationTime(t_rollback);
        next_tokens(b, a, m, n_seq, k);  // the history back (untimed)
        place(m, a);
    }
    const auto per = static_cast<double>(state.iterations()) * n_seq;
    state.counters["rollback_ns"] = rollback * 1e9 / per;
    state.counters["row_copy_ns"] = copy * 1e9 / per;
    state.counters["rollback_vs_row"] = rollback / copy;
}

}  // namespace

BENCHMARK(bm_decode_step)->Arg(0)->Arg(4)->UseManualTime()->Unit(benchmark::kMicrosecond);
// each iteration also re-decodes 4 tokens of every sequence (untimed): a fixed count keeps the run short
BENCHMARK(bm_rollback)->UseManualTime()->Iterations(2000)->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();
