/* The C API of the prefix cache, compiled as C11: lookups, attaches, pins, priorities, events and the
 * errors of each call. The runner and fixtures are in capi_test.h. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <kvcache/kvcache.h>

#include "capi_test.h"
#include "capi_toy.h"

/* Lookups, attaches, stats and the errors of each call. */
static void test_prefix_cache(void) {
    kvc_kv_cache_params p = small_params(32, 3);
    CHECK(!p.prefix.enabled && p.prefix.block_size == 16);
    p.prefix.enabled = true;
    p.prefix.block_size = 4;
    kvc_memory* mem = NULL;
    CHECK_OK(kvc_kv_cache_create(&p, &mem));
    kvc_batch* b = seq_batch(0, 0, 10); /* tokens 100..109 */
    decode(mem, b, 16);
    kvc_batch_free(b);
    int32_t prompt[12];
    for (int i = 0; i < 12; ++i) prompt[i] = 100 + i;
    uint32_t n = 99;
    CHECK_OK(kvc_memory_prefix_lookup(mem, prompt, 12, 0, &n)); /* two full blocks of seq 0 */
    CHECK(n == 8);
    CHECK_OK(kvc_memory_prefix_lookup(mem, prompt, 12, 5, &n)); /* another key: nothing */
    CHECK(n == 0);
    CHECK_ERR(kvc_memory_prefix_attach(mem, 0, prompt, 12, 0, 50, &n), KVC_ERR_INVALID_ARGUMENT,
              "seq 0 is not empty");
    CHECK_ERR(kvc_memory_prefix_attach(mem, 7, prompt, 12, 0, 50, &n), KVC_ERR_OUT_OF_RANGE, "seq_id 7");
    CHECK_ERR(kvc_memory_prefix_attach(mem, 1, NULL, 12, 0, 50, &n), KVC_ERR_INVALID_ARGUMENT,
              "tokens is NULL");
    CHECK_ERR(kvc_memory_prefix_attach(mem, 1, prompt, 12, 0, 50, NULL), KVC_ERR_INVALID_ARGUMENT, "out");
    CHECK_ERR(kvc_memory_prefix_lookup(NULL, prompt, 12, 0, &n), KVC_ERR_INVALID_ARGUMENT, "mem");
    int32_t pos = 0;
    CHECK_OK(kvc_memory_seq_pos_max(mem, 1, &pos));
    CHECK(pos == -1); /* the failed attaches changed nothing */
    CHECK_OK(kvc_memory_prefix_attach(mem, 1, prompt, 12, 0, 50, &n));
    CHECK(n == 8);
    CHECK_OK(kvc_memory_seq_pos_max(mem, 1, &pos));
    CHECK(pos == 7);
    kvc_prefix_stats st;
    CHECK_OK(kvc_memory_get_prefix_stats(mem, &st));
    CHECK(st.blocks == 2 && st.hit_tokens == 8 && st.shared_cells == 8 && st.lookups == 3);
    CHECK(st.tokens_looked_up == 36 && st.index_bytes > 0);
    /* both sequences end: the blocks stay cached, the other cells are free */
    CHECK_OK(kvc_memory_seq_rm(mem, 0, -1, -1, NULL));
    CHECK_OK(kvc_memory_seq_rm(mem, 1, -1, -1, NULL));
    CHECK_OK(kvc_memory_get_prefix_stats(mem, &st));
    CHECK(st.cached_cells == 8 && st.shared_cells == 0 && st.free_cells == 24);
    CHECK_OK(kvc_memory_prefix_publish(mem));
    kvc_memory_free(mem);

    mem = small_cache(16, 1);
    CHECK_ERR(kvc_memory_prefix_publish(mem), KVC_ERR_UNSUPPORTED, "no prefix cache");
    CHECK_ERR(kvc_memory_get_prefix_stats(mem, &st), KVC_ERR_UNSUPPORTED, "no prefix cache");
    kvc_memory_free(mem);
    p.n_pos = 4;
    mem = NULL;
    CHECK_ERR(kvc_kv_cache_create(&p, &mem), KVC_ERR_INVALID_ARGUMENT, "one position per token");
    CHECK(mem == NULL);
    p.n_pos = 1;
    p.prefix.policy = (kvc_evict_policy)3;
    CHECK_ERR(kvc_kv_cache_create(&p, &mem), KVC_ERR_INVALID_ARGUMENT, "is not a kvc_evict_policy (0 to 2)");
    CHECK(mem == NULL);
}

/* An event listener that mirrors the index: the hashes stored and not removed. */
typedef struct mirror {
    uint64_t hashes[64];
    uint64_t parents[64];
    int n;
    int cleared;
} mirror;

static void on_event(const kvc_prefix_event* e, void* user_data) {
    mirror* m = (mirror*)user_data;
    if (e->type == KVC_PREFIX_EVENT_STORED) {
        CHECK(m->n < 64 && e->n_tokens == 4 && e->tokens != NULL);
        m->parents[m->n] = e->parent_hash;
        m->hashes[m->n++] = e->hash;
    } else if (e->type == KVC_PREFIX_EVENT_REMOVED) {
        int found = 0;
        for (int i = 0; i < m->n && !found; ++i)
            if (m->hashes[i] == e->hash) {
                m->hashes[i] = m->hashes[--m->n];
                m->parents[i] = m->parents[m->n];
                found = 1;
            }
        CHECK(found);
    } else {
        CHECK(e->type == KVC_PREFIX_EVENT_CLEARED && e->tokens == NULL && e->n_tokens == 0);
        m->n = 0;
        ++m->cleared;
    }
}

/* Pins hold a prefix through churn, priorities order eviction, events mirror the index. */
static void test_pins_priorities_events(void) {
    mirror m;
    memset(&m, 0, sizeof m);
    kvc_kv_cache_params p = small_params(32, 2);
    p.prefix.enabled = true;
    p.prefix.block_size = 4;
    p.prefix.policy = KVC_EVICT_SLRU;
    p.prefix.n_vocab = 1000;
    p.prefix.on_event = on_event;
    p.prefix.on_event_user_data = &m;
    kvc_memory* mem = NULL;
    CHECK_OK(kvc_kv_cache_create(&p, &mem));
    int32_t prompt[9];
    for (int i = 0; i < 9; ++i) prompt[i] = 100 + i;
    uint32_t n = 0;
    CHECK_OK(kvc_memory_prefix_attach(mem, 0, prompt, 9, 7, 80, &n));
    CHECK(n == 0);
    kvc_batch* b = seq_batch(0, 0, 9); /* tokens 100..108 */
    decode(mem, b, 16);
    kvc_batch_free(b);
    CHECK_OK(kvc_memory_prefix_publish(mem));
    CHECK(m.n == 2 && m.parents[0] == 7 && m.parents[1] == m.hashes[0]); /* a root's parent is its key */

    CHECK_ERR(kvc_memory_prefix_pin(mem, prompt, 9, 7, NULL), KVC_ERR_INVALID_ARGUMENT, "out");
    CHECK_OK(kvc_memory_prefix_pin(mem, prompt, 9, 7, &n));
    CHECK(n == 8);
    CHECK_OK(kvc_memory_seq_rm(mem, 0, -1, -1, NULL));
    kvc_prefix_stats st;
    CHECK_OK(kvc_memory_get_prefix_stats(mem, &st));
    CHECK(st.pinned_cells == 8 && st.cached_cells == 8 && st.free_cells == 24);
    /* 24 new cells fit only around the pinned blocks; 25 do not, and nothing changes */
    b = seq_batch(1, 0, 25);
    kvc_memory_context* ctx = NULL;
    CHECK_OK(kvc_memory_init_batch(mem, b, 32, false, &ctx));
    CHECK(status_of(ctx) == KVC_MEMORY_STATUS_FAILED_PREPARE);
    kvc_memory_context_free(ctx);
    kvc_batch_free(b);
    b = seq_batch(1, 0, 24);
    decode(mem, b, 32);
    kvc_batch_free(b);
    CHECK_OK(kvc_memory_seq_rm(mem, 1, -1, -1, NULL));
    CHECK_OK(kvc_memory_prefix_lookup(mem, prompt, 9, 7, &n));
    CHECK(n == 8);

    /* the limit: max_pinned_fraction 0.5 of 32 cells */
    CHECK_OK(kvc_memory_prefix_pin(mem, prompt, 9, 7, &n)); /* the same blocks again: no new cells */
    CHECK_OK(kvc_memory_prefix_unpin(mem, prompt, 9, 7, &n));
    CHECK_OK(kvc_memory_prefix_unpin(mem, prompt, 9, 7, &n));
    CHECK(n == 8);
    CHECK_OK(kvc_memory_get_prefix_stats(mem, &st));
    CHECK(st.pinned_cells == 0);

    CHECK_ERR(kvc_memory_prefix_set_priority(mem, prompt, 9, 7, 101, &n), KVC_ERR_INVALID_ARGUMENT, "101");
    CHECK_OK(kvc_memory_prefix_set_priority(mem, prompt, 9, 7, 0, &n));
    CHECK(n == 8);
    CHECK_ERR(kvc_memory_prefix_attach(mem, 1, prompt, 9, 7, 200, &n), KVC_ERR_INVALID_ARGUMENT, "200");
    prompt[3] = 1000;
    CHECK_ERR(kvc_memory_prefix_lookup(mem, prompt, 9, 7, &n), KVC_ERR_INVALID_ARGUMENT, "not in [0, 1000)");
    prompt[3] = 103;

    CHECK_OK(kvc_memory_clear(mem, false));
    CHECK(m.n == 0 && m.cleared == 1);
    kvc_memory_free(mem);

    p.prefix.policy = (kvc_evict_policy)9;
    CHECK_ERR(kvc_kv_cache_create(&p, &mem), KVC_ERR_INVALID_ARGUMENT, "kvc_evict_policy");
    p.prefix.policy = KVC_EVICT_LRU;
    p.prefix.block_size = 5;
    CHECK_ERR(kvc_kv_cache_create(&p, &mem), KVC_ERR_INVALID_ARGUMENT, "must divide kv_size 32");
}

/* A recurrent memory resumes from a snapshot (the toy engine checks the state it gathers against its
 * reference); a hybrid memory takes one prefix cache for both parts; pins are a KV cache's. */
static void test_recurrent_and_hybrid(void) {
    static const toy_model recr_model = {2, 0x0u, 0x3u};
    kvc_recurrent_layer_desc rl[2];
    toy_recr_layers(rl, 2, recr_model.recr);
    kvc_recurrent_params p = kvc_recurrent_default_params();
    CHECK(!p.prefix.enabled && p.prefix.snapshot_interval == 64 && p.prefix.max_snapshots == 0);
    p.layers = rl;
    p.n_layers = 2;
    p.n_seq_max = 2;
    p.prefix.enabled = true;
    p.prefix.block_size = 4;
    kvc_memory* mem = NULL;
    CHECK_OK(kvc_recurrent_create(&p, &mem));
    toy_engine* e = malloc(sizeof *e);
    CHECK(e != NULL);
    toy_init(e, &recr_model);
    toy_decode_seq(e, mem, 0, 0, 10, 3); /* a prompt in ubatches of 3: its newest boundary, 8, is kept */
    CHECK_OK(kvc_memory_seq_rm(mem, 0, -1, -1, NULL));
    int32_t prompt[12];
    for (int32_t i = 0; i < 12; ++i) prompt[i] = toy_token(0, i);
    uint32_t n = 0;
    CHECK_OK(kvc_memory_prefix_lookup(mem, prompt, 12, 0, &n));
    CHECK(n == 8);
    CHECK_OK(kvc_memory_prefix_attach(mem, 1, prompt, 12, 0, 50, &n));
    CHECK(n == 8);
    int32_t pos = 0;
    CHECK_OK(kvc_memory_seq_pos_max(mem, 1, &pos));
    CHECK(pos == 7);
    toy_copy_seq(e, 0, 1);                /* the reference: seq 1 has seq 0's states up to position 7 */
    toy_decode_seq(e, mem, 1, 8, 12, 16); /* gathers the resumed state and checks it */
    kvc_prefix_stats st;
    CHECK_OK(kvc_memory_get_prefix_stats(mem, &st));
    CHECK(st.hit_tokens == 8 && st.snapshots_saved >= 1 && st.snapshots >= 1 && st.blocks >= 2);
    CHECK_ERR(kvc_memory_prefix_pin(mem, prompt, 12, 0, &n), KVC_ERR_UNSUPPORTED, "KV cache");
    kvc_memory_free(mem);
    free(e);

    kvc_layer_desc attn[4];
    kvc_recurrent_layer_desc recr[4];
    toy_attn_layers(attn, 4, 0xAu, 0u);
    toy_recr_layers(recr, 4, 0x5u);
    kvc_hybrid_params h = kvc_hybrid_default_params();
    h.attn.layers = attn;
    h.attn.n_layers = 4;
    h.attn.kv_size = 32;
    h.attn.n_seq_max = 2;
    h.recr.layers = recr;
    h.recr.n_layers = 4;
    h.recr.n_seq_max = 2;
    h.attn.prefix.enabled = true; /* a part alone: refused */
    mem = NULL;
    CHECK_ERR(kvc_hybrid_create(&h, &mem), KVC_ERR_INVALID_ARGUMENT, "memory_hybrid_params::prefix");
    h.attn.prefix.enabled = false;
    h.prefix.enabled = true;
    h.prefix.block_size = 4;
    CHECK_OK(kvc_hybrid_create(&h, &mem));
    CHECK_OK(kvc_memory_prefix_lookup(mem, prompt, 12, 0, &n));
    CHECK(n == 0);
    CHECK_OK(kvc_memory_prefix_publish(mem));
    CHECK_OK(kvc_memory_get_prefix_stats(mem, &st));
    CHECK(st.lookups == 1 && st.snapshots == 0);
    kvc_memory_free(mem);
}

/* Events counted by part (kvc_prefix_part) and type. */
typedef struct part_counts {
    uint64_t n[3][3]; /* [part][type] */
    int bad;
} part_counts;

static void count_parts(const kvc_prefix_event* e, void* user_data) {
    part_counts* c = (part_counts*)user_data;
    if ((unsigned)e->part > KVC_PREFIX_PART_SNAPSHOT || (unsigned)e->type > KVC_PREFIX_EVENT_CLEARED) {
        ++c->bad;
        return;
    }
    ++c->n[e->part][e->type];
}

/* An iSWA pair resumes a prefix where both caches have it: the base cache's blocks before the hit and the
 * SWA cache's window before it (positions n - 3 .. n - 1 for a window of 4). Its listener hears both
 * caches, each block tagged with its part. */
static void test_iswa_windows(void) {
    static const toy_model m = {2, 0x3u, 0x0u};
    kvc_layer_desc layers[2];
    toy_attn_layers(layers, 2, 0x3u, 0x1u); /* layer 0 slides a window */
    kvc_iswa_params ip = kvc_iswa_default_params();
    ip.kv = small_params(256, 2);
    ip.kv.layers = layers;
    ip.kv.n_layers = 2;
    ip.kv.n_swa = 4;
    ip.kv.swa_type = KVC_SWA_TYPE_STANDARD;
    ip.kv.prefix.enabled = true;
    ip.kv.prefix.block_size = 4;
    ip.sizing.swa_full = false;
    ip.sizing.n_ubatch = 8;
    part_counts events;
    memset(&events, 0, sizeof events);
    ip.kv.prefix.on_event = count_parts;
    ip.kv.prefix.on_event_user_data = &events;
    kvc_memory* mem = NULL;
    CHECK_OK(kvc_iswa_create(&ip, &mem));
    toy_engine* e = malloc(sizeof *e);
    toy_init(e, &m);
    toy_decode_seq(e, mem, 0, 0, 18, 8);
    CHECK_OK(kvc_memory_seq_rm(mem, 0, -1, -1, NULL));
    int32_t prompt[20];
    for (int32_t i = 0; i < 20; ++i) prompt[i] = toy_token(0, i);
    uint32_t n = 0;
    CHECK_OK(kvc_memory_prefix_lookup(mem, prompt, 20, 0, &n));
    CHECK(n == 16);
    CHECK_OK(kvc_memory_prefix_attach(mem, 1, prompt, 20, 0, 50, &n));
    CHECK(n == 16);
    int32_t pos = 0;
    CHECK_OK(kvc_memory_seq_pos_min(mem, 1, &pos)); /* of the SWA cache: the window only */
    CHECK(pos == 13);
    CHECK(pos_max(mem, 1) == 15);
    toy_decode_seq(e, mem, 1, 16, 20, 8);
    CHECK_OK(kvc_memory_prefix_publish(mem)); /* block 4, which seq 1 completed */
    kvc_prefix_stats st;
    CHECK_OK(kvc_memory_get_prefix_stats(mem, &st));
    CHECK(st.hit_tokens == 16 && st.blocks == 5 && st.swa_blocks == 5 && st.swa_published_blocks == 5);
    CHECK(st.swa_evicted_blocks == 0);
    CHECK(events.bad == 0 && events.n[KVC_PREFIX_PART_KV][KVC_PREFIX_EVENT_STORED] == st.published_blocks);
    CHECK(events.n[KVC_PREFIX_PART_SWA][KVC_PREFIX_EVENT_STORED] == st.swa_published_blocks);
    CHECK(events.n[KVC_PREFIX_PART_SNAPSHOT][KVC_PREFIX_EVENT_STORED] == 0);
    CHECK_ERR(kvc_memory_prefix_pin(mem, prompt, 20, 0, &n), KVC_ERR_UNSUPPORTED, "KV cache");
    CHECK_OK(kvc_memory_clear(mem, false));
    CHECK(events.n[KVC_PREFIX_PART_KV][KVC_PREFIX_EVENT_CLEARED] == 1);
    CHECK(events.n[KVC_PREFIX_PART_SWA][KVC_PREFIX_EVENT_CLEARED] == 1);
    kvc_memory_free(mem);
    free(e);
}

/* A hybrid memory whose attention part is an iSWA pair takes a prefix cache: a hit resumes where the base
 * cache has the blocks, the SWA cache the window and the recurrent part a snapshot (the toy engine checks
 * the resumed state). Its listener hears all three parts. Tiers are refused with it. */
static void test_hybrid_iswa(void) {
    static const toy_model m = {4, 0xAu, 0x5u}; /* 0 and 2 recurrent, 1 and 3 attention */
    kvc_layer_desc attn[4];
    kvc_recurrent_layer_desc recr[4];
    toy_attn_layers(attn, 4, m.attn, 0x2u); /* layer 1 slides a window */
    toy_recr_layers(recr, 4, m.recr);
    kvc_hybrid_params h = kvc_hybrid_default_params();
    h.attn.layers = attn;
    h.attn.n_layers = 4;
    h.attn.type_k = KVC_TYPE_F32;
    h.attn.type_v = KVC_TYPE_F32;
    h.attn.kv_size = 64;
    h.attn.n_seq_max = 2;
    h.attn.n_swa = 4;
    h.attn.swa_type = KVC_SWA_TYPE_STANDARD;
    h.recr.layers = recr;
    h.recr.n_layers = 4;
    h.recr.n_seq_max = 2;
    h.iswa = true;
    h.sizing.swa_full = false;
    h.sizing.n_ubatch = 8;
    h.prefix.enabled = true;
    h.prefix.block_size = 4;
    part_counts events;
    memset(&events, 0, sizeof events);
    h.prefix.on_event = count_parts;
    h.prefix.on_event_user_data = &events;
    kvc_memory* mem = NULL;
    CHECK_OK(kvc_hybrid_create(&h, &mem));
    toy_engine* e = malloc(sizeof *e);
    CHECK(e != NULL);
    toy_init(e, &m);
    toy_decode_seq(e, mem, 0, 0, 18, 8); /* a prompt in ubatches of 8: its newest boundary, 16, is kept */
    CHECK_OK(kvc_memory_seq_rm(mem, 0, -1, -1, NULL));
    int32_t prompt[20];
    for (int32_t i = 0; i < 20; ++i) prompt[i] = toy_token(0, i);
    uint32_t n = 0;
    CHECK_OK(kvc_memory_prefix_lookup(mem, prompt, 20, 0, &n));
    CHECK(n == 16);
    CHECK_OK(kvc_memory_prefix_attach(mem, 1, prompt, 20, 0, 50, &n));
    CHECK(n == 16);
    CHECK(pos_max(mem, 1) == 15);
    toy_copy_seq(e, 0, 1);                /* the reference: seq 1 has seq 0's states up to position 15 */
    toy_decode_seq(e, mem, 1, 16, 20, 8); /* gathers the resumed state and checks it */
    CHECK_OK(kvc_memory_prefix_publish(mem));
    kvc_prefix_stats st;
    CHECK_OK(kvc_memory_get_prefix_stats(mem, &st));
    CHECK(st.hit_tokens == 16 && st.snapshots >= 1 && st.swa_published_blocks >= 4);
    CHECK(events.bad == 0 && events.n[KVC_PREFIX_PART_KV][KVC_PREFIX_EVENT_STORED] == st.published_blocks);
    CHECK(events.n[KVC_PREFIX_PART_SWA][KVC_PREFIX_EVENT_STORED] == st.swa_published_blocks);
    CHECK(events.n[KVC_PREFIX_PART_SNAPSHOT][KVC_PREFIX_EVENT_STORED] >= 4);
    kvc_memory_free(mem);
    free(e);

    char dir[] = "/tmp/kvc-capi-hybrid-iswa-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    kvc_disk_store_params dp = kvc_disk_store_default_params();
    dp.dir = dir;
    kvc_block_store* store = NULL;
    CHECK_OK(kvc_disk_store_new(&dp, &store));
    kvc_block_store* stores[1] = {store};
    h.prefix.tiers.stores = stores;
    h.prefix.tiers.n_stores = 1;
    CHECK_ERR(kvc_hybrid_create(&h, &mem), KVC_ERR_INVALID_ARGUMENT,
              "not supported with an iSWA attention part");
    CHECK(mem == NULL);
    kvc_block_store_free(store);
    rmdir(dir);
}

int main(void) {
    test_prefix_cache();
    test_iswa_windows();
    test_hybrid_iswa();
    test_recurrent_and_hybrid();
    test_pins_priorities_events();
    return capi_report("capi_prefix");
}
