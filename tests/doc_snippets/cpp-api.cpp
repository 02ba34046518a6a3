// The harness of docs/cpp-api.md's C++ fragments (scripts/doc_snippets.py, ctest docs.snippets): each
// SNIPPET line below is replaced by the doc's next block that names this file, in the doc's order, and
// the program must exit 0. It runs in a temporary directory.
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <span>
#include <vector>

#include <kvcache/kv_cache.h>
#include <kvcache/limits.h>
#include <kvcache/runtime/runtime.h>
#include <kvcache/runtime/tiny_model.h>

namespace {

int failures = 0;
void check(bool ok, const char* what) {
    std::printf("  [%s] %s\n", ok ? "ok" : "FAILED", what);
    if (!ok) ++failures;
}

// "Limits"
void limits() {
    const kvc::limits before = kvc::get_limits();
    // SNIPPET
    check(kvc::get_limits().file_bytes == 8ull << 30, "limits: file_bytes set");
    kvc::set_limits(before);
}

}  // namespace

// "What a memory can do: capabilities"
// SNIPPET

int main() {
    limits();

    kvc::write_tiny_model("tiny.gguf");
    const kvc::model m = kvc::model::load("tiny.gguf");
    kvc::kv_cache_params p = m.cache_params(/*kv_size=*/256, /*n_seq_max=*/2);
    p.prefix.enabled = true;  // blocks of 16 tokens
    kvc::kv_cache cache(p);
    kvc::runtime rt(m, cache);
    std::vector<kvc::token_t> prompt(40);
    std::iota(prompt.begin(), prompt.end(), 1);
    rt.decode(kvc::batch::get_one(prompt));  // sequence 0
    cache.prefix_cache()->prefix_publish();
    check(attach(cache, 1, prompt) == 32, "capabilities: attach gives sequence 1 two cached blocks");
    kvc::kv_cache plain(m.cache_params(256, 2));
    check(attach(plain, 0, prompt) == 0, "capabilities: a memory without a prefix cache gives nothing");

    std::printf("%s\n", failures == 0 ? "every fragment ran" : "FAILED");
    return failures == 0 ? 0 : 1;
}
