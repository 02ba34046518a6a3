/* The harness of docs/c-api.md's C fragments (scripts/doc_snippets.py, ctest docs.snippets): each
 * SNIPPET line below is replaced by the doc's next block that names this file, in the doc's order, and
 * the program must exit 0. Each fragment runs in a function that made the objects it uses. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kvcache/kvcache.h>

/* as in the doc's complete example */
#define TRY(call)                                                                                     \
    do {                                                                                              \
        const kvc_status st_ = (call);                                                                \
        if (st_ != KVC_OK) {                                                                          \
            fprintf(stderr, "%s failed (%s): %s\n", #call, kvc_status_string(st_), kvc_last_error()); \
            goto done;                                                                                \
        }                                                                                             \
    } while (0)

#define CHECK(cond)                                                    \
    do {                                                               \
        if (!(cond)) {                                                 \
            fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, #cond); \
            goto done;                                                 \
        }                                                              \
    } while (0)

enum { N_HEAD_KV = 2, HEAD_DIM = 64, E = N_HEAD_KV * HEAD_DIM, N_TOKENS = 6 };

static kvc_layer_desc layer(bool is_swa) {
    kvc_layer_desc d = kvc_layer_desc_default();
    d.n_head_kv = N_HEAD_KV;
    d.n_embd_head_k = HEAD_DIM;
    d.n_embd_head_v = HEAD_DIM;
    d.is_swa = is_swa;
    return d;
}

static kvc_batch* prompt_batch(void) {
    kvc_batch* batch = kvc_batch_init(N_TOKENS, 0, 1);
    const int32_t seq0 = 0;
    for (int i = 0; batch != NULL && i < N_TOKENS; ++i)
        if (kvc_batch_add(batch, 10 + i, i, &seq0, 1, i == N_TOKENS - 1) != KVC_OK) {
            kvc_batch_free(batch);
            return NULL;
        }
    return batch;
}

/* "Conventions": the iteration over a context's ubatches */
static int iterate(void) {
    int ok = 0;
    kvc_memory* mem = NULL;
    kvc_memory_context* ctx = NULL;
    kvc_batch* batch = prompt_batch();
    kvc_layer_desc layers[2] = {layer(false), layer(false)};
    kvc_kv_cache_params params = kvc_kv_cache_default_params();
    params.layers = layers;
    params.n_layers = 2;
    params.kv_size = 256;
    CHECK(batch != NULL);
    TRY(kvc_kv_cache_create(&params, &mem));
    TRY(kvc_memory_init_batch(mem, batch, 4, false, &ctx)); /* two ubatches */
    /* SNIPPET */
    int32_t p_max = -1;
    TRY(kvc_memory_seq_pos_max(mem, 0, &p_max));
    CHECK(p_max == N_TOKENS - 1);
    ok = 1;
done:
    kvc_memory_context_free(ctx);
    kvc_batch_free(batch);
    kvc_memory_free(mem);
    return ok;
}

/* "Attention layers and the caches that hold them": an iSWA model's masks and layers */
static int iswa(void) {
    int ok = 0;
    kvc_memory* mem = NULL;
    kvc_memory_context* ctx = NULL;
    kvc_batch* batch = prompt_batch();
    float* mask_full = NULL;
    float* mask_swa = NULL;
    float* k_rows = NULL;
    float* v_rows = NULL;
    const uint32_t n_layer = 4;
    kvc_layer_desc layers[4] = {layer(false), layer(true), layer(true), layer(true)};
    const uint32_t il_full = 0, il_swa = 1;
    kvc_iswa_params params = kvc_iswa_default_params();
    params.kv.layers = layers;
    params.kv.n_layers = n_layer;
    params.kv.kv_size = 256;
    params.kv.n_swa = 4;
    params.kv.swa_type = KVC_SWA_TYPE_STANDARD;
    CHECK(batch != NULL);
    TRY(kvc_iswa_create(&params, &mem));
    TRY(kvc_memory_init_batch(mem, batch, 512, false, &ctx));
    TRY(kvc_memory_context_apply(ctx));
    kvc_ubatch_view ub;
    TRY(kvc_memory_context_get_ubatch(ctx, &ub));
    mask_full = calloc((size_t)kvc_memory_kq_mask_elements(ctx, il_full), sizeof(float));
    mask_swa = calloc((size_t)kvc_memory_kq_mask_elements(ctx, il_swa), sizeof(float));
    k_rows = calloc((size_t)E * ub.n_tokens, sizeof(float));
    v_rows = calloc((size_t)E * ub.n_tokens, sizeof(float));
    CHECK(mask_full != NULL && mask_swa != NULL && k_rows != NULL && v_rows != NULL);
    /* SNIPPET */
    /* the window of 4 hides the first token from the last one in the SWA mask only */
    const int64_t n_kv_swa = kvc_memory_context_n_kv(ctx, il_swa);
    const int64_t n_kv_full = kvc_memory_context_n_kv(ctx, il_full);
    CHECK(mask_full[(N_TOKENS - 1) * n_kv_full] == 0.0f);
    CHECK(mask_swa[(N_TOKENS - 1) * n_kv_swa] != 0.0f);
    ok = 1;
done:
    free(mask_full);
    free(mask_swa);
    free(k_rows);
    free(v_rows);
    kvc_memory_context_free(ctx);
    kvc_batch_free(batch);
    kvc_memory_free(mem);
    return ok;
}

/* "Limits" */
static int limit_batch(void) {
    int ok = 0;
    const kvc_limits before = kvc_get_limits();
    /* SNIPPET */
    CHECK(b == NULL);
    CHECK(strstr(kvc_last_error(), "over the limit batch_tokens of 65536") != NULL);
    ok = 1;
done:
    kvc_set_limits(&before, NULL);
    return ok;
}

int main(void) {
    const int ok = iterate() & iswa() & limit_batch();
    printf("%s\n", ok ? "every fragment ran" : "FAILED");
    return ok ? 0 : 1;
}
