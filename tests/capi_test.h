/* The C API tests' runner and fixtures (test_capi.c, test_capi_memories.c), C11: CHECK counts failures,
 * capi_report prints the tally and gives main's exit status. */
#ifndef KVC_TESTS_CAPI_TEST_H
#define KVC_TESTS_CAPI_TEST_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kvcache/kvcache.h>

static int g_checks = 0;
static int g_failures = 0;

#define CHECK(cond)                                                                                     \
    do {                                                                                                \
        ++g_checks;                                                                                     \
        if (!(cond)) {                                                                                  \
            ++g_failures;                                                                               \
            fprintf(stderr, "%s:%d: CHECK(%s) failed; last error: \"%s\"\n", __FILE__, __LINE__, #cond, \
                    kvc_last_error());                                                                  \
        }                                                                                               \
    } while (0)

/* The call succeeds. */
#define CHECK_OK(call)                                                                \
    do {                                                                              \
        const kvc_status st_ok_ = (call);                                             \
        ++g_checks;                                                                   \
        if (st_ok_ != KVC_OK) {                                                       \
            ++g_failures;                                                             \
            fprintf(stderr, "%s:%d: %s returned %s: %s\n", __FILE__, __LINE__, #call, \
                    kvc_status_string(st_ok_), kvc_last_error());                     \
        }                                                                             \
    } while (0)

/* The call fails with `code` and this thread's message contains `text`. */
#define CHECK_ERR(call, code, text)                                                                          \
    do {                                                                                                     \
        const kvc_status st_err_ = (call);                                                                   \
        ++g_checks;                                                                                          \
        if (st_err_ != (code) || strstr(kvc_last_error(), (text)) == NULL) {                                 \
            ++g_failures;                                                                                    \
            fprintf(stderr, "%s:%d: %s returned %s (\"%s\"), expected %s with \"%s\"\n", __FILE__, __LINE__, \
                    #call, kvc_status_string(st_err_), kvc_last_error(), kvc_status_string(code), (text));   \
        }                                                                                                    \
    } while (0)

/* The last error contains `text`. */
#define CHECK_MSG(text) CHECK(strstr(kvc_last_error(), (text)) != NULL)

static inline int capi_report(const char* name) {
    printf("%s: %d checks, %d failed\n", name, g_checks, g_failures);
    return g_failures == 0 ? 0 : 1;
}

/* -- fixtures -- */

enum { E = 8 }; /* values per token of K and V rows: 2 heads of 4 */

static kvc_layer_desc g_layers[2];

/* Two layers of 2 KV heads of 4 values, f32 K and V (transposed V), no RoPE padding surprises. */
static inline kvc_kv_cache_params small_params(uint32_t kv_size, uint32_t n_seq_max) {
    kvc_kv_cache_params p = kvc_kv_cache_default_params();
    for (int il = 0; il < 2; ++il) {
        g_layers[il] = kvc_layer_desc_default();
        g_layers[il].n_head_kv = 2;
        g_layers[il].n_embd_head_k = 4;
        g_layers[il].n_embd_head_v = 4;
    }
    p.layers = g_layers;
    p.n_layers = 2;
    p.type_k = KVC_TYPE_F32;
    p.type_v = KVC_TYPE_F32;
    p.kv_size = kv_size;
    p.n_seq_max = n_seq_max;
    p.n_kv_pad = 4;
    return p;
}

static inline kvc_memory* small_cache(uint32_t kv_size, uint32_t n_seq_max) {
    const kvc_kv_cache_params p = small_params(kv_size, n_seq_max);
    kvc_memory* mem = NULL;
    CHECK_OK(kvc_kv_cache_create(&p, &mem));
    return mem;
}

/* The value written for layer il, position pos, channel e (K; V adds 0.5). */
static inline float kv_value(uint32_t il, int32_t pos, int e, int is_v) {
    return (float)(1000 * (int)il + 10 * pos + e) + (is_v ? 0.5f : 0.0f);
}

/* Whole-memory (seq -1) or one sequence's state bytes; *size receives the length. Caller frees. */
static inline uint8_t* state_of(const kvc_memory* mem, int32_t seq, size_t* size) {
    size_t n = 0, written = 0;
    CHECK_OK(kvc_state_seq_get_size(mem, seq, 0, &n));
    uint8_t* buf = malloc(n);
    CHECK(buf != NULL);
    CHECK_OK(kvc_state_seq_get_data(mem, seq, buf, n, &written, 0));
    CHECK(written == n);
    *size = n;
    return buf;
}

static inline int same_state(const kvc_memory* mem, const uint8_t* before, size_t n_before) {
    size_t n = 0;
    uint8_t* now = state_of(mem, KVC_SEQ_ALL, &n);
    const int same = n == n_before && memcmp(now, before, n) == 0;
    free(now);
    return same;
}

/* The status of a context (the call must succeed). */
static inline kvc_memory_status status_of(const kvc_memory_context* ctx) {
    kvc_memory_status st = (kvc_memory_status)-1;
    CHECK_OK(kvc_memory_context_get_status(ctx, &st));
    return st;
}

/* Moves to the next ubatch (the call must succeed); whether there is one. */
static inline bool next_ubatch(kvc_memory_context* ctx) {
    bool more = false;
    CHECK_OK(kvc_memory_context_next(ctx, &more));
    return more;
}

/* Runs every ubatch of the batch: apply, write K/V rows of both layers from kv_value. */
static inline void decode(kvc_memory* mem, const kvc_batch* batch, uint32_t n_ubatch) {
    kvc_memory_context* ctx = NULL;
    CHECK_OK(kvc_memory_init_batch(mem, batch, n_ubatch, false, &ctx));
    CHECK(status_of(ctx) == KVC_MEMORY_STATUS_SUCCESS);
    do {
        CHECK_OK(kvc_memory_context_apply(ctx));
        kvc_ubatch_view ub;
        CHECK_OK(kvc_memory_context_get_ubatch(ctx, &ub));
        float* rows = malloc(sizeof(float) * E * ub.n_tokens);
        for (uint32_t il = 0; il < 2; ++il) {
            for (int is_v = 0; is_v < 2; ++is_v) {
                for (uint32_t t = 0; t < ub.n_tokens; ++t)
                    for (int e = 0; e < E; ++e) rows[t * E + e] = kv_value(il, ub.pos[t], e, is_v);
                if (is_v)
                    CHECK_OK(kvc_memory_cpy_v(ctx, il, rows, ub.n_tokens));
                else
                    CHECK_OK(kvc_memory_cpy_k(ctx, il, rows, ub.n_tokens));
            }
        }
        free(rows);
    } while (next_ubatch(ctx));
    kvc_memory_context_free(ctx);
}

/* A batch of positions [p0, p1) of one sequence, the last token an output. */
static inline kvc_batch* seq_batch(int32_t seq, int32_t p0, int32_t p1) {
    kvc_batch* b = kvc_batch_init(p1 - p0, 0, 1);
    CHECK(b != NULL);
    for (int32_t p = p0; p < p1; ++p) CHECK_OK(kvc_batch_add(b, 100 + p, p, &seq, 1, p == p1 - 1));
    return b;
}

static inline float k_at(const kvc_tensor_view* v, int64_t d, int64_t h, int64_t cell) {
    float x;
    memcpy(&x, (const char*)v->data + d * v->nb[0] + h * v->nb[1] + cell * v->nb[2], sizeof x);
    return x;
}

static inline void check_mask_row(const float* row, int64_t n_kv, int32_t visible_up_to) {
    for (int64_t c = 0; c < n_kv; ++c) {
        if (c <= visible_up_to)
            CHECK(row[c] == 0.0f);
        else
            CHECK(isinf(row[c]) && row[c] < 0);
    }
}

#endif
