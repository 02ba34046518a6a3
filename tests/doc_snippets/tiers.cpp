// The harness of docs/tiers.md's C++ fragments (scripts/doc_snippets.py, ctest docs.snippets): each SNIPPET
// line below is replaced by the doc's next block that names this file, in the doc's order, and the program
// must exit 0. The Redis store of the first fragment connects lazily, at its first call, which never comes.
#include <memory>
#include <numeric>
#include <vector>

#include <kvcache/disk_store.h>
#include <kvcache/prefix_tiers.h>
#include <kvcache/redis/redis_store.h>

#include "doc_engine.h"

using namespace kvc;
using doc::check;
using doc::decode;
using doc::model_cache_params;

namespace {

const uint64_t model_hash = 0x7e57;  // a stand-in for the model file's fingerprint
const uint64_t key = 0;
const seq_id_t seq = 1;

std::vector<token_t> prompt_of(size_t n) {
    std::vector<token_t> t(n);
    std::iota(t.begin(), t.end(), 1);
    return t;
}

// "A cache with tiers". A prompt shorter than a block: the attach asks no store (the test sends nothing to
// the address the doc names).
void with_tiers() {
    const std::vector<token_t> prompt = prompt_of(8);
    // SNIPPET
    check(n == 0 && cache.prefix_cache()->get_tier_stats().size() == 2,
          "a cache with tiers: two tiers, nothing cached yet");
}

// "Writing and fetching by hand"
void by_hand() {
    const std::vector<token_t> prompt = prompt_of(40);
    kv_cache_params p = model_cache_params();
    p.prefix.enabled = true;
    kv_cache cache(p);
    decode(cache, 0, prompt, 0);  // sequence 0 decoded the prompt
    cache.prefix_cache()->prefix_publish();
    // SNIPPET
    check(disk.entries() == 2 && n == 32, "by hand: two blocks in the store, 32 tokens attached");
}

}  // namespace

int main() {
    with_tiers();
    by_hand();
    return doc::failures == 0 ? 0 : 1;
}
