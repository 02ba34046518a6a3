// docs/examples/shared_prompt.cpp: a system prompt decoded once and shared by three sequences with
// seq_cp, one question per sequence in one batch, then a context shift (seq_rm + seq_add) whose K-shift
// runs on the next decode. The reference runtime decodes through the cache; reference_memory recomputes
// every logit without it, and the two must agree within the f16 tolerance. Exit status 0 when they do.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <kvcache/runtime/runtime.h>
#include <kvcache/runtime/tiny_model.h>

namespace {

int failures = 0;
void check(bool ok, const char* what) {
    std::printf("  [%s] %s\n", ok ? "ok" : "FAILED", what);
    if (!ok) ++failures;
}

// Decodes b through the cache and through the reference; true when their logits agree.
bool decode_both(kvc::runtime& rt, kvc::reference_memory& ref, const kvc::batch& b) {
    const kvc::decode_result a = rt.decode(b);
    const kvc::decode_result r = ref.decode(b);
    if (a.status != kvc::memory_status::success || a.output_ids != r.output_ids) return false;
    float scale = 0.0f;
    for (float x : r.logits) scale = std::max(scale, std::fabs(x));
    return kvc::max_abs_diff(a.logits, r.logits) <= kvc::logits_tolerance(kvc::dtype::f16) * scale;
}

std::vector<kvc::token_t> tokens(int n, int seed) {
    std::vector<kvc::token_t> t;
    for (int i = 0; i < n; ++i) t.push_back((seed * 31 + i * 17) % 256);
    return t;
}

}  // namespace

int main() {
    // the tiny llama model: 2 layers, 4 heads / 2 KV heads of 16 values, vocabulary 256
    const std::string name = "kvc-doc-shared-" + std::to_string(::getpid()) + ".gguf";
    const std::string path = (std::filesystem::temp_directory_path() / name).string();
    kvc::write_tiny_model(path);
    const kvc::model m = kvc::model::load(path);  // memory-mapped: the file may go now
    std::filesystem::remove(path);

    kvc::kv_cache_params p = m.cache_params(/*kv_size=*/256, /*n_seq_max=*/3);  // f16 K/V, one stream
    kvc::kv_cache cache(p);
    kvc::runtime rt(m, cache, {.n_threads = 2});
    kvc::reference_memory ref(m, /*n_seq_max=*/3, /*n_threads=*/2);

    // 1. the system prompt, once, in sequence 0 (positions 0-15), then shared
    const auto system = tokens(16, 1);
    check(decode_both(rt, ref, kvc::batch::get_one(system)), "system prompt: cache == recompute");
    for (kvc::seq_id_t s : {1, 2}) {
        cache.seq_cp(0, s, -1, -1);  // s joins sequence 0's cells: no copy of K/V
        ref.seq_cp(0, s, -1, -1);
    }
    check(cache.cells(0).get_used() == 16, "three sequences, 16 cells");

    // 2. one question of 12 tokens per sequence, in one batch (positions 16-27), every token an output
    kvc::batch_storage b = kvc::batch::init(36, 0, 3);
    for (kvc::seq_id_t s = 0; s < 3; ++s) {
        const auto q = tokens(12, 10 + s);
        const kvc::seq_id_t ids[] = {s};
        for (int i = 0; i < 12; ++i) b.add(q[i], 16 + i, ids, /*output=*/true);
    }
    check(decode_both(rt, ref, b.view()), "questions: cache == recompute");
    check(cache.cells(0).get_used() == 16 + 36, "52 cells");

    // 3. context shift of sequence 1: keep the shared prompt, drop positions [16, 24), move 24.. down by 8.
    //    Only cells of sequence 1 alone move; a shift of shared cells would move them for every sequence.
    cache.seq_rm(1, 16, 24);
    ref.seq_rm(1, 16, 24);
    cache.seq_add(1, 24, -1, -8);
    ref.seq_add(1, 24, -1, -8);
    check(cache.seq_pos_max(1) == 19, "sequence 1 now ends at position 19");
    check(cache.get_has_shift(), "a K-shift is pending");

    // 4. one more token for every sequence; the runtime's decode applies the K-shift first
    b.clear();
    for (kvc::seq_id_t s = 0; s < 3; ++s) {
        const kvc::seq_id_t ids[] = {s};
        b.add(7 + s, cache.seq_pos_max(s) + 1, ids, true);
    }
    check(decode_both(rt, ref, b.view()), "after the shift: cache == recompute");
    check(!cache.get_has_shift(), "the K-shift was applied");

    std::printf("%s\n", failures == 0 ? "every check passed" : "FAILED");
    return failures == 0 ? 0 : 1;
}
