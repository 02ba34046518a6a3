// kvcache's reference runtime (kvcache::runtime) from an engine's point of view: the tiny llama model
// written to a temporary file and loaded, a prompt and three generated tokens decoded through a kv_cache,
// every logit compared with reference_memory, which recomputes attention without the cache. The exit
// status is 0 only if they agree within the f16 tolerance.
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

// Decodes b through the cache and through the reference; true when their logits agree.
bool decode_both(kvc::runtime& rt, kvc::reference_memory& ref, const kvc::batch& b) {
    const kvc::decode_result a = rt.decode(b);
    const kvc::decode_result r = ref.decode(b);
    if (a.status != kvc::memory_status::success || a.output_ids != r.output_ids) return false;
    float scale = 0.0f;
    for (float x : r.logits) scale = std::max(scale, std::fabs(x));
    return kvc::max_abs_diff(a.logits, r.logits) <= kvc::logits_tolerance(kvc::dtype::f16) * scale;
}

}  // namespace

int main() {
    const std::string name = "kvc-example-runtime-" + std::to_string(::getpid()) + ".gguf";
    const std::string path = (std::filesystem::temp_directory_path() / name).string();
    kvc::write_tiny_model(path);
    const kvc::model m = kvc::model::load(path);  // memory-mapped: the file may go now
    std::filesystem::remove(path);

    kvc::kv_cache cache(m.cache_params(/*kv_size=*/64, /*n_seq_max=*/1));
    kvc::runtime rt(m, cache, {.n_threads = 2});
    kvc::reference_memory ref(m, /*n_seq_max=*/1, /*n_threads=*/2);

    int failures = 0;
    std::vector<kvc::token_t> prompt;
    for (int i = 0; i < 8; ++i) prompt.push_back((i * 37 + 5) % 256);
    bool ok = decode_both(rt, ref, kvc::batch::get_one(prompt));
    std::printf("  [%s] prompt of %zu tokens: cache == recompute\n", ok ? "ok" : "FAILED", prompt.size());
    failures += !ok;
    for (kvc::token_t t : {7, 42, 99}) {
        const kvc::token_t one[] = {t};
        ok = decode_both(rt, ref, kvc::batch::get_one(one));
        std::printf("  [%s] token %d at pos %d: cache == recompute\n", ok ? "ok" : "FAILED", t,
                    cache.seq_pos_max(0));
        failures += !ok;
    }
    std::printf("%s\n", failures == 0 ? "runtime example: all checks passed" : "runtime example: FAILED");
    return failures == 0 ? 0 : 1;
}
