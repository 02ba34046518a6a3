/* kvcache from C, through the C API (<kvcache/kvcache.h>), built with pkg-config (see Makefile):
 *   cc $(pkg-config --cflags kvcache) main.c $(pkg-config --libs kvcache)
 * A small cache, two sequences decoded through kvc_memory_init_batch / apply with their K/V rows
 * written by kvc_memory_cpy_k / cpy_v, then seq_cp, seq_rm, and a sequence saved with
 * kvc_state_seq_get_data and restored into another. Every step is checked; the exit status is 0 only if
 * every check passed. */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kvcache/kvcache.h>
#include <kvcache/version.h>

enum { N_LAYER = 2, N_HEAD_KV = 2, HEAD_DIM = 8, N_EMBD_KV = N_HEAD_KV * HEAD_DIM, KV_SIZE = 64 };

static int failures = 0;

static void check(bool ok, const char* what) {
    printf("  [%s] %s\n", ok ? "ok" : "FAILED", what);
    if (!ok) ++failures;
}

/* Stops on an API error, with kvcache's message. */
static void must(kvc_status st, const char* call) {
    if (st != KVC_OK) {
        fprintf(stderr, "error: %s: %s (%s)\n", call, kvc_status_string(st), kvc_last_error());
        exit(EXIT_FAILURE);
    }
}

/* What an engine would compute for channel e of token (seq, pos) in layer il; V is the negation. */
static float value(int32_t seq, int32_t pos, uint32_t il, int e) {
    return (float)(seq * 100 + pos * 10 + (int)il) + (float)e / 8.0f;
}

/* Decodes one batch: places every ubatch and writes each token's K/V rows. False if it does not fit. */
static bool decode(kvc_memory* mem, const kvc_batch* batch) {
    kvc_memory_context* ctx = NULL;
    must(kvc_memory_init_batch(mem, batch, 4, false, &ctx), "kvc_memory_init_batch");
    kvc_memory_status status;
    must(kvc_memory_context_get_status(ctx, &status), "kvc_memory_context_get_status");
    if (status != KVC_MEMORY_STATUS_SUCCESS) {
        kvc_memory_context_free(ctx); /* no room: the memory is unchanged */
        return false;
    }
    bool more = true;
    while (more) { /* one ubatch per turn; next says whether another follows */
        must(kvc_memory_context_apply(ctx), "kvc_memory_context_apply");
        kvc_ubatch_view ub;
        must(kvc_memory_context_get_ubatch(ctx, &ub), "kvc_memory_context_get_ubatch");
        float* k = malloc(sizeof(float) * ub.n_tokens * N_EMBD_KV);
        float* v = malloc(sizeof(float) * ub.n_tokens * N_EMBD_KV);
        if (!k || !v) exit(EXIT_FAILURE);
        for (uint32_t il = 0; il < N_LAYER; ++il) {
            for (uint32_t t = 0; t < ub.n_tokens; ++t) {
                const int32_t seq = ub.seq_id_data[ub.seq_id_begin[t]];
                for (int e = 0; e < N_EMBD_KV; ++e) {
                    k[t * N_EMBD_KV + e] = value(seq, ub.pos[t], il, e);
                    v[t * N_EMBD_KV + e] = -value(seq, ub.pos[t], il, e);
                }
            }
            must(kvc_memory_cpy_k(ctx, il, k, ub.n_tokens), "kvc_memory_cpy_k");
            must(kvc_memory_cpy_v(ctx, il, v, ub.n_tokens), "kvc_memory_cpy_v");
        }
        free(k);
        free(v);
        must(kvc_memory_context_next(ctx, &more), "kvc_memory_context_next");
    }
    kvc_memory_context_free(ctx);
    return true;
}

static int32_t pos_min(const kvc_memory* mem, int32_t seq) {
    int32_t p = 0;
    must(kvc_memory_seq_pos_min(mem, seq, &p), "kvc_memory_seq_pos_min");
    return p;
}

static int32_t pos_max(const kvc_memory* mem, int32_t seq) {
    int32_t p = 0;
    must(kvc_memory_seq_pos_max(mem, seq, &p), "kvc_memory_seq_pos_max");
    return p;
}

/* Cells of layer 0 whose K row is the row of (seq, pos), over every cell (a full context's view). */
static int cells_holding(kvc_memory* mem, int32_t seq, int32_t pos) {
    kvc_memory_context* full = NULL;
    must(kvc_memory_init_full(mem, &full), "kvc_memory_init_full");
    kvc_tensor_view k;
    must(kvc_memory_get_k(full, 0, &k), "kvc_memory_get_k");
    int n = 0;
    for (int64_t c = 0; c < k.ne[2]; ++c) {
        bool same = true;
        for (int64_t h = 0; h < k.ne[1]; ++h)
            for (int64_t d = 0; d < k.ne[0]; ++d) {
                const float* x =
                    (const float*)((const char*)k.data + d * k.nb[0] + h * k.nb[1] + c * k.nb[2]);
                if (*x != value(seq, pos, 0, (int)(h * k.ne[0] + d))) same = false;
            }
        n += same;
    }
    kvc_memory_context_free(full);
    return n;
}

int main(void) {
    printf("kvcache %s (headers %s), C API\n", kvc_version_string(), KVC_VERSION_STRING);

    kvc_layer_desc layers[N_LAYER];
    for (int il = 0; il < N_LAYER; ++il) {
        layers[il] = kvc_layer_desc_default();
        layers[il].n_head_kv = N_HEAD_KV;
        layers[il].n_embd_head_k = HEAD_DIM;
        layers[il].n_embd_head_v = HEAD_DIM;
    }
    kvc_kv_cache_params params = kvc_kv_cache_default_params();
    params.layers = layers;
    params.n_layers = N_LAYER;
    params.type_k = KVC_TYPE_F32;
    params.type_v = KVC_TYPE_F32;
    params.kv_size = KV_SIZE;
    params.n_seq_max = 4;
    kvc_memory* mem = NULL;
    must(kvc_kv_cache_create(&params, &mem), "kvc_kv_cache_create");
    printf("cache: %d cells, %d layers, K/V f32\n", KV_SIZE, N_LAYER);

    printf("decode: sequence 0 at positions 0-4, sequence 1 at 0-2, in one batch\n");
    kvc_batch* batch = kvc_batch_init(8, 0, 4);
    if (!batch) must(KVC_ERR_OUT_OF_MEMORY, "kvc_batch_init");
    const int32_t seq0 = 0, seq1 = 1;
    for (int32_t p = 0; p < 5; ++p) must(kvc_batch_add(batch, 10 + p, p, &seq0, 1, p == 4), "kvc_batch_add");
    for (int32_t p = 0; p < 3; ++p) must(kvc_batch_add(batch, 20 + p, p, &seq1, 1, p == 2), "kvc_batch_add");
    check(decode(mem, batch), "the batch fits");
    kvc_batch_free(batch);
    check(pos_min(mem, 0) == 0 && pos_max(mem, 0) == 4, "sequence 0 holds positions 0-4");
    check(pos_min(mem, 1) == 0 && pos_max(mem, 1) == 2, "sequence 1 holds positions 0-2");
    check(cells_holding(mem, 0, 4) == 1 && cells_holding(mem, 1, 2) == 1, "K rows read back as written");

    printf("seq_cp(0 -> 2, [0, 3)), seq_rm(0, [3, end))\n");
    must(kvc_memory_seq_cp(mem, 0, 2, 0, 3), "kvc_memory_seq_cp");
    bool removed = false;
    must(kvc_memory_seq_rm(mem, 0, 3, -1, &removed), "kvc_memory_seq_rm");
    check(pos_max(mem, 2) == 2, "sequence 2 holds positions 0-2");
    check(removed && pos_max(mem, 0) == 2, "sequence 0 ends at 2");

    printf("state: save sequence 1, restore it as sequence 3\n");
    size_t size = 0, written = 0, read = 0;
    must(kvc_state_seq_get_size(mem, 1, 0, &size), "kvc_state_seq_get_size");
    uint8_t* buf = malloc(size);
    if (!buf) return EXIT_FAILURE;
    must(kvc_state_seq_get_data(mem, 1, buf, size, &written, 0), "kvc_state_seq_get_data");
    check(written == size, "buffer size is kvc_state_seq_get_size");
    must(kvc_state_seq_set_data(mem, buf, size, 3, 0, &read), "kvc_state_seq_set_data");
    check(read == size, "every byte of the buffer was read");
    check(pos_min(mem, 3) == 0 && pos_max(mem, 3) == 2, "sequence 3 holds positions 0-2");
    check(cells_holding(mem, 1, 0) == 2 && cells_holding(mem, 1, 2) == 2,
          "sequence 3's cells hold sequence 1's rows");
    const kvc_status bad = kvc_state_seq_set_data(mem, buf, size - 1, 3, 0, NULL);
    check(bad == KVC_ERR_CORRUPT_DATA && pos_max(mem, 3) == 2,
          "a truncated buffer is refused and changes nothing");
    free(buf);

    kvc_memory_free(mem);
    if (failures != 0) {
        printf("%d check(s) FAILED\n", failures);
        return EXIT_FAILURE;
    }
    printf("all checks passed\n");
    return EXIT_SUCCESS;
}
