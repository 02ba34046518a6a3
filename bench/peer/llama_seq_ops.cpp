// llama.cpp's side of bench_kv_cache's sequence operations (section 3), in the same shapes and with the
// same batching: a unified cache of 32,768 cells holding 64 sequences x 256 tokens, placed in the same
// order (8 positions of every sequence per batch), and n_seq_max 65 (sequence 64 is the seq_cp target).
//
//   seq_rm   seq_rm(s, 100, 116) for s = 0..63 in one timed region; the whole context is restored
//            (llama_state_set_data) untimed before each round.
//   seq_cp   seq_cp(s, 64, -1, -1) + seq_rm(64, -1, -1) for s = 0..63 in one timed region (the pair puts
//            the cache back); the two calls are also timed apart, one clock read between them.
//   seq_add  seq_add(s, 128, -1, +1) + seq_add(s, 129, -1, -1) for s = 0..63, per call (128 calls).
//
// Each figure is the median over --rounds rounds of (time of the round / calls in it). One steady_clock
// read costs ~20 ns here, against ~20-100 us per llama.cpp call.
//
// Not part of the CMake build: it links the prebuilt llama.cpp of the workplace's peer
// (shared/tools/llama-peer, see its README; copy it somewhere writable and run its setup.sh first):
//
//   P=/tmp/llama-peer-bench   # a copy of shared/tools/llama-peer after ./setup.sh
//   L=$P/npm/node_modules/@node-llama-cpp/linux-x64/bins/linux-x64
//   g++ -std=c++17 -O2 -I$P -DPEER_LIBDIR="\"$L\"" -DPEER_MODEL="\"$P/tiny_llama.gguf\""
//       bench/peer/llama_seq_ops.cpp -o /tmp/llama_seq_ops -L$L -l:libllama.v0.5.0.so
//       -l:libggml.v0.5.0.so -l:libggml-base.so -Wl,-rpath,$L -Wl,--disable-new-dtags
//   /tmp/llama_seq_ops [--rounds 50]
// (the g++ command is one line)
#include "llama_min.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#ifndef PEER_LIBDIR
#define PEER_LIBDIR "."
#endif
#ifndef PEER_MODEL
#define PEER_MODEL "tiny_llama.gguf"
#endif

namespace {

double now_s() {
    using namespace std::chrono;
    return duration<double>(steady_clock::now().time_since_epoch()).count();
}

void quiet(int level, const char* text, void*) {  // llama.cpp's errors only (4: GGML_LOG_LEVEL_ERROR)
    if (level == 4) fputs(text, stderr);
}

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

void report(const char* name, const std::vector<double>& ns) {
    printf("%-34s median %10.1f ns  min %10.1f ns  max %10.1f ns  (%zu rounds)\n", name, median(ns),
           *std::min_element(ns.begin(), ns.end()), *std::max_element(ns.begin(), ns.end()), ns.size());
}

[[noreturn]] void fail(const char* what) {
    fprintf(stderr, "llama_seq_ops: %s\n", what);
    exit(1);
}

}  // namespace

int main(int argc, char** argv) {
    int rounds = 50;
    for (int i = 1; i + 1 < argc; i += 2)
        if (std::string(argv[i]) == "--rounds") rounds = std::max(1, atoi(argv[i + 1]));
    const int NSEQ = 64, NTOK = 256, SCRATCH = 64;

    llama_log_set(quiet, nullptr);
    ggml_backend_load_all_from_path(PEER_LIBDIR);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model* model = llama_model_load_from_file(PEER_MODEL, mp);
    if (!model) fail("cannot load the model");
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 32768;
    cp.n_batch = cp.n_ubatch = 512;
    cp.n_seq_max = NSEQ + 1;
    cp.n_threads = cp.n_threads_batch = 2;
    cp.type_k = cp.type_v = PEER_GGML_TYPE_F16;
    cp.kv_unified = true;
    cp.no_perf = true;
    llama_context* ctx = llama_init_from_model(model, cp);
    if (!ctx) fail("cannot make the context");
    llama_memory_t mem = llama_get_memory(ctx);

    // 8 positions of each sequence per batch of 512 tokens, as bench_kv_cache's fill()
    llama_batch b = llama_batch_init(NSEQ * 8, 0, 1);
    for (int p = 0; p < NTOK; p += 8) {
        b.n_tokens = 0;
        for (int s = 0; s < NSEQ; ++s)
            for (int k = p; k < p + 8; ++k) {
                const int i = b.n_tokens++;
                b.token[i] = static_cast<llama_token>(3 + (s * 31 + k * 7) % 253);
                b.pos[i] = k;
                b.n_seq_id[i] = 1;
                b.seq_id[i][0] = s;
                b.logits[i] = i == NSEQ * 8 - 1;
            }
        if (llama_decode(ctx, b) != 0) fail("fill: llama_decode failed");
    }
    llama_batch_free(b);
    for (int s = 0; s < NSEQ; ++s)
        if (llama_memory_seq_pos_min(mem, s) != 0 || llama_memory_seq_pos_max(mem, s) != NTOK - 1)
            fail("fill: a sequence is not [0, 255]");
    printf("llama.cpp: n_ctx %u, unified, n_seq_max %d, %d sequences x %d tokens\n", llama_n_ctx(ctx),
           NSEQ + 1, NSEQ, NTOK);

    std::vector<uint8_t> full(llama_state_get_size(ctx));
    full.resize(llama_state_get_data(ctx, full.data(), full.size()));
    const size_t seq0_size = llama_state_seq_get_size(ctx, 0);
    const auto restore = [&] {
        if (llama_state_set_data(ctx, full.data(), full.size()) == 0) fail("restore failed");
    };

    std::vector<double> rm, cp_rm, cp_only, rm_only, add;
    for (int r = 0; r < rounds; ++r) {
        restore();
        int n_true = 0;
        const double t0 = now_s();
        for (int s = 0; s < NSEQ; ++s) n_true += llama_memory_seq_rm(mem, s, 100, 116);
        rm.push_back((now_s() - t0) * 1e9 / NSEQ);
        if (n_true != NSEQ || llama_state_seq_get_size(ctx, 0) >= seq0_size) fail("seq_rm did not remove");
    }
    restore();
    for (int r = 0; r < rounds; ++r) {
        double t_cp = 0, t_rm = 0;
        const double t0 = now_s();
        for (int s = 0; s < NSEQ; ++s) {
            const double a = now_s();
            llama_memory_seq_cp(mem, s, SCRATCH, -1, -1);
            const double m = now_s();
            llama_memory_seq_rm(mem, SCRATCH, -1, -1);
            t_rm += now_s() - m;
            t_cp += m - a;
        }
        cp_rm.push_back((now_s() - t0) * 1e9 / NSEQ);
        cp_only.push_back(t_cp * 1e9 / NSEQ);
        rm_only.push_back(t_rm * 1e9 / NSEQ);
        if (r == 0) {  // the copy really happened and the removal really emptied the scratch sequence
            llama_memory_seq_cp(mem, 5, SCRATCH, -1, -1);
            if (llama_memory_seq_pos_max(mem, SCRATCH) != NTOK - 1) fail("seq_cp did not copy");
            llama_memory_seq_rm(mem, SCRATCH, -1, -1);
            if (llama_memory_seq_pos_max(mem, SCRATCH) != -1) fail("seq_rm did not empty the scratch");
        }
    }
    restore();
    for (int r = 0; r < rounds; ++r) {
        const double t0 = now_s();
        for (int s = 0; s < NSEQ; ++s) {
            llama_memory_seq_add(mem, s, 128, -1, 1);
            llama_memory_seq_add(mem, s, 129, -1, -1);
        }
        add.push_back((now_s() - t0) * 1e9 / (2 * NSEQ));
    }
    for (int s = 0; s < NSEQ; ++s)
        if (llama_memory_seq_pos_max(mem, s) != NTOK - 1) fail("seq_add did not come back");

    report("seq_rm(s, 100, 116)", rm);
    report("seq_cp(s, 64, -1, -1) + seq_rm(64)", cp_rm);
    report("  of which seq_cp", cp_only);
    report("  of which seq_rm(64, -1, -1)", rm_only);
    report("seq_add(s, 128|129, -1, +-1), per call", add);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
