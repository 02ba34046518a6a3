/* The C API of the prefix cache's tiers (kvcache_tiers.h), compiled as C11: a disk store whose blocks a
 * fresh memory attaches after a restart, a store of C callbacks, the counters, and the errors. The runner
 * and fixtures are in capi_test.h. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <kvcache/kvcache.h>

#include "capi_test.h"

/* Positions [p0, p1) of one sequence with tokens base + p, the last one an output. */
static kvc_batch* tok_batch(int32_t seq, int32_t p0, int32_t p1, int32_t base) {
    kvc_batch* b = kvc_batch_init(p1 - p0, 0, 1);
    CHECK(b != NULL);
    for (int32_t p = p0; p < p1; ++p) CHECK_OK(kvc_batch_add(b, base + p, p, &seq, 1, p == p1 - 1));
    return b;
}

/* A KV cache of 16 cells, blocks of 4, over the stores. */
static kvc_memory* tiered_cache(kvc_block_store* const* stores, size_t n, uint64_t model_id,
                                kvc_tier_write w) {
    kvc_kv_cache_params p = small_params(16, 1);
    p.prefix.enabled = true;
    p.prefix.block_size = 4;
    p.prefix.tiers.stores = stores;
    p.prefix.tiers.n_stores = n;
    p.prefix.tiers.model_id = model_id;
    p.prefix.tiers.write = w;
    kvc_memory* mem = NULL;
    CHECK_OK(kvc_kv_cache_create(&p, &mem));
    return mem;
}

/* Whether one sequence's state bytes are these. */
static int same_state_seq(const kvc_memory* mem, int32_t seq, const uint8_t* before, size_t n_before) {
    size_t n = 0;
    uint8_t* now = state_of(mem, seq, &n);
    const int same = n == n_before && memcmp(now, before, n) == 0;
    free(now);
    return same;
}

static void remove_dir(const char* dir) {
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0);
}

/* Blocks evicted to a directory come back into a fresh memory over the same directory (a restart): the
 * same state as the memory that computed them. */
static void test_disk_tier(void) {
    char dir[] = "/tmp/kvc-capi-tiers-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    kvc_disk_store_params dp = kvc_disk_store_default_params();
    CHECK(dp.dir == NULL && dp.max_bytes == 0 && dp.max_value_bytes > 0);
    dp.dir = dir;
    kvc_block_store* store = NULL;
    CHECK_OK(kvc_disk_store_new(&dp, &store));
    kvc_memory* mem = tiered_cache(&store, 1, 42, KVC_TIER_WRITE_ON_EVICT);
    kvc_block_store_free(store); /* the memory holds its own reference */

    /* a prompt of 13 tokens (3 whole blocks), then other tokens in every cell: the blocks are evicted */
    kvc_batch* b = tok_batch(0, 0, 13, 100);
    decode(mem, b, 16);
    kvc_batch_free(b);
    CHECK_OK(kvc_memory_prefix_publish(mem));
    size_t n_state = 0;
    uint8_t* state = state_of(mem, 0, &n_state);
    CHECK_OK(kvc_memory_seq_rm(mem, 0, -1, -1, NULL));
    uint32_t n = 0;
    CHECK_OK(kvc_memory_get_tier_count(mem, &n));
    CHECK(n == 1);
    kvc_tier_stats ts;
    CHECK_OK(kvc_memory_get_tier_stats(mem, 0, &ts));
    CHECK(ts.written_blocks == 0); /* on_evict: nothing written while memory holds them */
    b = tok_batch(0, 0, 16, 500);
    decode(mem, b, 16);
    kvc_batch_free(b);
    kvc_prefix_stats ps;
    CHECK_OK(kvc_memory_get_prefix_stats(mem, &ps));
    CHECK(ps.evicted_blocks == 3 && ps.tier_written_blocks == 3 && ps.tier_fetched_blocks == 0);
    CHECK_OK(kvc_memory_get_tier_stats(mem, 0, &ts));
    CHECK(strncmp(ts.where, "disk:", 5) == 0 && strstr(ts.where, dir) != NULL);
    CHECK(ts.written_blocks == 3 && ts.errors == 0 && ts.store.puts == 3 && ts.store.bytes_out > 0);
    kvc_memory_free(mem);

    /* a fresh store and memory over the directory: the prompt is attached from it */
    CHECK_OK(kvc_disk_store_new(&dp, &store));
    mem = tiered_cache(&store, 1, 42, KVC_TIER_WRITE_ON_EVICT);
    int32_t prompt[13];
    for (int i = 0; i < 13; ++i) prompt[i] = 100 + i;
    CHECK_OK(kvc_memory_prefix_attach(mem, 0, prompt, 13, 0, 50, &n));
    CHECK(n == 12);
    b = tok_batch(0, 12, 13, 100);
    decode(mem, b, 16);
    kvc_batch_free(b);
    CHECK(same_state_seq(mem, 0, state, n_state));
    CHECK_OK(kvc_memory_get_prefix_stats(mem, &ps));
    CHECK(ps.tier_fetched_blocks == 3 && ps.hit_tokens == 12);
    CHECK_OK(kvc_memory_get_tier_stats(mem, 0, &ts));
    CHECK(ts.fetches == 1 && ts.fetched_blocks == 3 && ts.refused_blocks == 0 && ts.store.hits == 3);
    kvc_block_store_stats ss;
    CHECK_OK(kvc_block_store_get_stats(store, &ss));
    CHECK(ss.hits == 3 && ss.lookups >= 3 && ss.bytes_in > 0);
    kvc_memory_free(mem);

    /* another model_id reads nothing of it */
    mem = tiered_cache(&store, 1, 43, KVC_TIER_WRITE_ON_EVICT);
    CHECK_OK(kvc_memory_prefix_attach(mem, 0, prompt, 13, 0, 50, &n));
    CHECK(n == 0);
    kvc_memory_free(mem);
    kvc_block_store_free(store);
    free(state);
    remove_dir(dir);
}

/* -- a store of C callbacks: values in memory -- */

enum { MAX_VALUES = 32 };

typedef struct mem_store {
    char* keys[MAX_VALUES];
    uint8_t* values[MAX_VALUES];
    size_t sizes[MAX_VALUES];
    int n;
    int reads, puts, contains;
    int fail_reads; /* read_many returns false, delivering nothing */
    int bad_values; /* read_many delivers an index out of range and an empty value instead */
    int* destroyed; /* set when destroy runs (the struct is gone then) */
} mem_store;

static int find(const mem_store* s, const char* key) {
    for (int i = 0; i < s->n; ++i)
        if (strcmp(s->keys[i], key) == 0) return i;
    return -1;
}

static bool ms_read(void* user, const char* const* keys, size_t n, kvc_block_value_fn on_value, void* ctx) {
    mem_store* s = (mem_store*)user;
    ++s->reads;
    if (s->fail_reads) return false;
    if (s->bad_values) {
        static const uint8_t byte = 1;
        on_value(n, &byte, 1, ctx);
        on_value(0, &byte, 0, ctx);
        return true;
    }
    for (size_t i = 0; i < n; ++i) {
        const int j = find(s, keys[i]);
        if (j >= 0) on_value(i, s->values[j], s->sizes[j], ctx);
    }
    return true;
}

static bool ms_put(void* user, const kvc_block_put* items, size_t n) {
    mem_store* s = (mem_store*)user;
    ++s->puts;
    for (size_t i = 0; i < n; ++i) {
        if (find(s, items[i].key) >= 0) continue;
        if (s->n == MAX_VALUES) return false;
        s->keys[s->n] = malloc(strlen(items[i].key) + 1);
        strcpy(s->keys[s->n], items[i].key);
        s->values[s->n] = malloc(items[i].size);
        memcpy(s->values[s->n], items[i].value, items[i].size);
        s->sizes[s->n++] = items[i].size;
    }
    return true;
}

static bool ms_contains(void* user, const char* const* keys, size_t n, uint8_t* out) {
    mem_store* s = (mem_store*)user;
    ++s->contains;
    for (size_t i = 0; i < n; ++i) out[i] = find(s, keys[i]) >= 0;
    return true;
}

static const char* ms_describe(void* user) {
    (void)user;
    return "mem:test";
}

static void ms_destroy(void* user) {
    mem_store* s = (mem_store*)user;
    for (int i = 0; i < s->n; ++i) {
        free(s->keys[i]);
        free(s->values[i]);
    }
    ++*s->destroyed;
    free(s);
}

static kvc_block_store* new_mem_store(int* destroyed, mem_store** out) {
    mem_store* s = calloc(1, sizeof *s);
    s->destroyed = destroyed;
    kvc_block_store_callbacks cb;
    memset(&cb, 0, sizeof cb);
    cb.read_many = ms_read;
    cb.put_many = ms_put;
    cb.contains_many = ms_contains;
    cb.describe = ms_describe;
    cb.destroy = ms_destroy;
    cb.user_data = s;
    kvc_block_store* store = NULL;
    CHECK_OK(kvc_block_store_from_callbacks(&cb, &store));
    *out = s;
    return store;
}

/* Write-through into a C store: a second memory attaches what the first published; destroy runs once,
 * after the last memory and handle. */
static void test_callbacks_store(void) {
    int destroyed = 0;
    mem_store* s = NULL;
    kvc_block_store* store = new_mem_store(&destroyed, &s);
    kvc_memory* a = tiered_cache(&store, 1, 7, KVC_TIER_WRITE_THROUGH);
    kvc_batch* b = tok_batch(0, 0, 9, 100);
    decode(a, b, 16);
    kvc_batch_free(b);
    CHECK_OK(kvc_memory_prefix_publish(a));
    CHECK(s->n == 2 && s->puts >= 1); /* two whole blocks, written as published */
    kvc_tier_stats ts;
    CHECK_OK(kvc_memory_get_tier_stats(a, 0, &ts));
    CHECK(strcmp(ts.where, "mem:test") == 0 && ts.written_blocks == 2);

    kvc_memory* m2 = tiered_cache(&store, 1, 7, KVC_TIER_WRITE_THROUGH);
    kvc_block_store_free(store);
    CHECK(destroyed == 0);
    int32_t prompt[9];
    for (int i = 0; i < 9; ++i) prompt[i] = 100 + i;
    uint32_t n = 0;
    CHECK_OK(kvc_memory_prefix_attach(m2, 0, prompt, 9, 0, 50, &n));
    CHECK(n == 8);
    CHECK_OK(kvc_memory_get_tier_stats(m2, 0, &ts));
    /* no get_stats callback: kvcache counted what it saw */
    CHECK(ts.fetched_blocks == 2 && ts.store.hits == 2 && ts.store.lookups >= 2 && ts.store.calls >= 2);
    CHECK(ts.store.puts == 2 && ts.store.bytes_in == ts.store.bytes_out);

    kvc_memory_free(a);
    CHECK(destroyed == 0);
    kvc_memory_free(m2);
    CHECK(destroyed == 1);
}

/* async_writes: the memory's own thread writes; kvc_memory_prefix_tier_drain() waits for it. */
static void test_async_writes(void) {
    int destroyed = 0;
    mem_store* s = NULL;
    kvc_block_store* store = new_mem_store(&destroyed, &s);
    kvc_kv_cache_params p = small_params(16, 1);
    p.prefix.enabled = true;
    p.prefix.block_size = 4;
    p.prefix.tiers.stores = &store;
    p.prefix.tiers.n_stores = 1;
    p.prefix.tiers.model_id = 7;
    p.prefix.tiers.write = KVC_TIER_WRITE_THROUGH;
    p.prefix.tiers.async_writes = true;
    kvc_memory* a = NULL;
    p.prefix.tiers.max_queued_bytes = 0;
    CHECK_ERR(kvc_kv_cache_create(&p, &a), KVC_ERR_INVALID_ARGUMENT, "max_queued_bytes > 0");
    p.prefix.tiers.max_queued_bytes = 1 << 20;
    CHECK_OK(kvc_kv_cache_create(&p, &a));
    kvc_block_store_free(store);
    kvc_batch* b = tok_batch(0, 0, 9, 100);
    decode(a, b, 16);
    kvc_batch_free(b);
    CHECK_OK(kvc_memory_prefix_publish(a));
    CHECK_OK(kvc_memory_prefix_tier_drain(a));
    CHECK(s->n == 2);
    kvc_tier_stats ts;
    CHECK_OK(kvc_memory_get_tier_stats(a, 0, &ts));
    CHECK(ts.written_blocks == 2 && ts.dropped_blocks == 0);
    CHECK_ERR(kvc_memory_prefix_tier_drain(NULL), KVC_ERR_INVALID_ARGUMENT, "mem");
    kvc_memory_free(a);
    CHECK(destroyed == 1);
}

/* A failing store: the attach recomputes, the error is counted. */
static void test_failing_store(void) {
    int destroyed = 0;
    mem_store* s = NULL;
    kvc_block_store* store = new_mem_store(&destroyed, &s);
    kvc_memory* a = tiered_cache(&store, 1, 7, KVC_TIER_WRITE_THROUGH);
    kvc_memory* m2 = tiered_cache(&store, 1, 7, KVC_TIER_WRITE_NEVER);
    kvc_batch* b = tok_batch(0, 0, 9, 100);
    decode(a, b, 16);
    kvc_batch_free(b);
    CHECK_OK(kvc_memory_prefix_publish(a));
    CHECK(s->n == 2);
    s->fail_reads = 1;
    int32_t prompt[9];
    for (int i = 0; i < 9; ++i) prompt[i] = 100 + i;
    uint32_t n = 99;
    CHECK_OK(kvc_memory_prefix_attach(m2, 0, prompt, 9, 0, 50, &n));
    CHECK(n == 0);
    kvc_block_store_stats ss;
    CHECK_OK(kvc_block_store_get_stats(store, &ss));
    CHECK(ss.errors == 1 && ss.hits == 0);
    /* values for keys not asked for, or empty: errors, not handed to the cache */
    s->fail_reads = 0;
    s->bad_values = 1;
    CHECK_OK(kvc_memory_prefix_attach(m2, 0, prompt, 9, 0, 50, &n));
    CHECK(n == 0);
    CHECK_OK(kvc_block_store_get_stats(store, &ss));
    CHECK(ss.errors == 3 && ss.hits == 0);
    kvc_memory_free(a);
    kvc_memory_free(m2);
    kvc_block_store_free(store);
    CHECK(destroyed == 1);
}

/* Bad parameters are refused naming the field and the limit; nothing leaks (the asan preset checks). */
static void test_bad_params(void) {
    char dir[] = "/tmp/kvc-capi-tiers-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    kvc_block_store* store = (kvc_block_store*)1;
    kvc_disk_store_params dp = kvc_disk_store_default_params();
    CHECK_ERR(kvc_disk_store_new(&dp, &store), KVC_ERR_INVALID_ARGUMENT, "params.dir is NULL or empty");
    CHECK(store == NULL);
    CHECK_ERR(kvc_disk_store_new(NULL, &store), KVC_ERR_INVALID_ARGUMENT, "params is NULL");
    dp.dir = dir;
    CHECK_ERR(kvc_disk_store_new(&dp, NULL), KVC_ERR_INVALID_ARGUMENT, "out is NULL");
    dp.dir = "/proc/version/not-a-dir";
    CHECK_ERR(kvc_disk_store_new(&dp, &store), KVC_ERR_IO, "/proc/version/not-a-dir");
    dp.dir = dir;
    dp.max_value_bytes = 0;
    CHECK_ERR(kvc_disk_store_new(&dp, &store), KVC_ERR_INVALID_ARGUMENT, "max_value_bytes is 0");
    dp.max_value_bytes = 1u << 20;
    CHECK_OK(kvc_disk_store_new(&dp, &store));

    kvc_block_store_callbacks cb;
    memset(&cb, 0, sizeof cb);
    kvc_block_store* cs = NULL;
    CHECK_ERR(kvc_block_store_from_callbacks(&cb, &cs), KVC_ERR_INVALID_ARGUMENT,
              "callbacks.read_many is NULL");
    cb.read_many = ms_read;
    CHECK_ERR(kvc_block_store_from_callbacks(&cb, &cs), KVC_ERR_INVALID_ARGUMENT,
              "callbacks.put_many is NULL");
    CHECK(cs == NULL);
    CHECK_ERR(kvc_block_store_get_stats(NULL, NULL), KVC_ERR_INVALID_ARGUMENT, "store is NULL");
    /* what libraries on the C API (kvcache_redis) record their errors with */
    CHECK(kvc_set_last_error(KVC_ERR_IO, "my_store_new", "disk gone") == KVC_ERR_IO);
    CHECK(strcmp(kvc_last_error(), "my_store_new: disk gone") == 0);
    CHECK(kvc_set_last_error(KVC_ERR_IO, NULL, NULL) == KVC_ERR_IO && strcmp(kvc_last_error(), "") == 0);
    kvc_block_store_free(NULL);

    kvc_block_store* four[4] = {store, store, store, store};
    kvc_kv_cache_params p = small_params(16, 1);
    CHECK(p.prefix.tiers.n_stores == 0 && p.prefix.tiers.stores == NULL && p.prefix.tiers.fetch);
    CHECK(p.prefix.tiers.write == KVC_TIER_WRITE_ON_EVICT && p.prefix.tiers.probe_every == 64);
    p.prefix.enabled = true;
    p.prefix.block_size = 4;
    kvc_memory* mem = (kvc_memory*)1;
    p.prefix.tiers.stores = four;
    p.prefix.tiers.n_stores = 4;
    CHECK_ERR(kvc_kv_cache_create(&p, &mem), KVC_ERR_INVALID_ARGUMENT,
              "params.prefix.tiers.n_stores = 4 exceeds 3");
    CHECK(mem == NULL);
    p.prefix.tiers.stores = NULL;
    p.prefix.tiers.n_stores = 1;
    CHECK_ERR(kvc_kv_cache_create(&p, &mem), KVC_ERR_INVALID_ARGUMENT, "params.prefix.tiers.stores is NULL");
    four[1] = NULL;
    p.prefix.tiers.stores = four;
    p.prefix.tiers.n_stores = 2;
    CHECK_ERR(kvc_kv_cache_create(&p, &mem), KVC_ERR_INVALID_ARGUMENT,
              "params.prefix.tiers.stores[1] is NULL");
    p.prefix.tiers.n_stores = 1;
    p.prefix.tiers.write = (kvc_tier_write)7;
    CHECK_ERR(kvc_kv_cache_create(&p, &mem), KVC_ERR_INVALID_ARGUMENT,
              "params.prefix.tiers.write = 7 is not a kvc_tier_write");
    p.prefix.tiers.write = KVC_TIER_WRITE_ON_EVICT;
    p.prefix.tiers.prefill_ns_per_token = -1;
    CHECK_ERR(kvc_kv_cache_create(&p, &mem), KVC_ERR_INVALID_ARGUMENT, "prefill_ns_per_token");
    p.prefix.tiers.prefill_ns_per_token = 0;
    p.n_swa = 4;
    p.swa_type = KVC_SWA_TYPE_STANDARD;
    CHECK_ERR(kvc_kv_cache_create(&p, &mem), KVC_ERR_INVALID_ARGUMENT, "sliding window");
    CHECK(mem == NULL);
    p.n_swa = 0;
    p.swa_type = KVC_SWA_TYPE_NONE;

    /* a recurrent memory takes tiers too (its snapshots go there) */
    kvc_recurrent_layer_desc rl = {4, 4};
    kvc_recurrent_params rp = kvc_recurrent_default_params();
    rp.layers = &rl;
    rp.n_layers = 1;
    rp.type_r = KVC_TYPE_F32;
    rp.type_s = KVC_TYPE_F32;
    rp.prefix.enabled = true;
    rp.prefix.block_size = 4;
    rp.prefix.tiers.stores = four;
    rp.prefix.tiers.n_stores = 1;
    CHECK_OK(kvc_recurrent_create(&rp, &mem));
    uint32_t n_rt = 0;
    CHECK_OK(kvc_memory_get_tier_count(mem, &n_rt));
    CHECK(n_rt == 1);
    kvc_memory_free(mem);

    /* counts and indexes */
    mem = small_cache(16, 1);
    uint32_t n = 9;
    CHECK_OK(kvc_memory_get_tier_count(mem, &n));
    CHECK(n == 0);
    kvc_tier_stats ts;
    CHECK_ERR(kvc_memory_get_tier_stats(mem, 0, &ts), KVC_ERR_OUT_OF_RANGE,
              "index = 0: the memory has 0 tier");
    CHECK_ERR(kvc_memory_get_tier_count(mem, NULL), KVC_ERR_INVALID_ARGUMENT, "out is NULL");
    kvc_memory_free(mem);
    mem = tiered_cache(&store, 1, 1, KVC_TIER_WRITE_ON_EVICT);
    CHECK_ERR(kvc_memory_get_tier_stats(mem, 1, &ts), KVC_ERR_OUT_OF_RANGE,
              "index = 1: the memory has 1 tier");
    kvc_memory_free(mem);
    kvc_block_store_free(store);
    remove_dir(dir);
}

int main(void) {
    test_disk_tier();
    test_callbacks_store();
    test_async_writes();
    test_failing_store();
    test_bad_params();
    return capi_report("capi_tiers");
}
