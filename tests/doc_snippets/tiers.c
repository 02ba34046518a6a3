/* The harness of docs/tiers.md's C fragment (scripts/doc_snippets.py, ctest docs.snippets): the SNIPPET
 * line below is replaced by the doc's block that names this file, and the program must exit 0. The Redis
 * store connects lazily, at its first call, which never comes here. */
#include <stdio.h>

#include <kvcache/kvcache.h>
#include <kvcache/redis/kvcache_redis.h>

static kvc_layer_desc layers[2];

/* the engine's parameters for its model: two layers of 2 heads of 64 */
static kvc_kv_cache_params model_cache_params(void) {
    for (int il = 0; il < 2; ++il) {
        layers[il] = kvc_layer_desc_default();
        layers[il].n_head_kv = 2;
        layers[il].n_embd_head_k = 64;
        layers[il].n_embd_head_v = 64;
    }
    kvc_kv_cache_params p = kvc_kv_cache_default_params();
    p.layers = layers;
    p.n_layers = 2;
    p.kv_size = 256;
    return p;
}

int main(void) {
    const uint64_t model_id = 0x7e57; /* a stand-in for the model file's fingerprint */
    kvc_memory* mem = NULL;
    /* SNIPPET */
    uint32_t n_tiers = 0;
    const int ok = mem != NULL && kvc_memory_get_tier_count(mem, &n_tiers) == KVC_OK && n_tiers == 2;
    if (!ok) fprintf(stderr, "FAILED: %s\n", mem == NULL ? kvc_last_error() : "two tiers");
    kvc_memory_free(mem);
    return ok ? 0 : 1;
}
