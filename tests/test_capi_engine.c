/* The C API of engine-owned storage (kvcache_engine.h), C11: a C engine that keeps the K/V tensors in its
 * own arrays, writes ubatches at the row indices and runs the operations kvcache hands it, driven beside a
 * memory that owns its storage. Both must hold the same rows and write the same state bytes. */
#include <kvcache/kvcache.h>

#include "capi_test.h"

/* -- the engine: per layer, K and V tensors in kvcache's layout (f32: rows of E floats, V transposed) -- */

enum { N_LAYERS = 2 };

typedef struct engine {
    float* k[N_LAYERS];
    float* v[N_LAYERS];
    uint32_t kv_size, n_stream, e_vmax;
    size_t n_rows;
    int allocations, n_zero, n_copy, n_shift;
    bool refuse_allocate, fail_reads;
} engine;

static bool e_allocate(const kvc_storage_shape* s, void* user) {
    engine* g = user;
    ++g->allocations;
    if (g->refuse_allocate) return false;
    CHECK(s->n_layers <= N_LAYERS && s->type_k == KVC_TYPE_F32 && s->v_trans && s->k_row_bytes[0] == E * 4);
    g->kv_size = s->kv_size;
    g->n_stream = s->n_stream;
    g->e_vmax = s->e_vmax;
    g->n_rows = (size_t)s->kv_size * s->n_stream;
    for (size_t i = 0; i < s->n_layers; ++i) {
        g->k[s->layers[i]] = calloc(g->n_rows, s->k_row_bytes[i]); /* zeroed */
        g->v[s->layers[i]] = calloc(g->n_rows, s->v_row_bytes[i]);
    }
    return true;
}

/* Transposed V: element (channel e, row) of stream row / kv_size. */
static size_t v_at(const engine* g, uint64_t row, uint32_t e) {
    return (size_t)(row / g->kv_size * g->kv_size * g->e_vmax + (uint64_t)e * g->kv_size + row % g->kv_size);
}

/* Normal RoPE of one head of 4 values by delta positions (base 10000, every dim rotated). */
static void rotate(float* x, int32_t delta) {
    for (int i = 0; i < 2; ++i) {
        const double theta = delta * pow(10000.0, -2.0 * i / 4.0);
        const float c = (float)cos(theta), s = (float)sin(theta);
        const float a = x[2 * i], b = x[2 * i + 1];
        x[2 * i] = a * c - b * s;
        x[2 * i + 1] = a * s + b * c;
    }
}

static void e_run(const kvc_storage_op* op, void* user) {
    engine* g = user;
    for (size_t j = 0; j < op->n_layers; ++j) {
        const uint32_t il = op->layers[j];
        float *k = g->k[il], *v = g->v[il];
        if (op->kind == KVC_STORAGE_OP_ZERO) {
            memset(k, 0, g->n_rows * E * sizeof(float));
            memset(v, 0, g->n_rows * g->e_vmax * sizeof(float));
        } else if (op->kind == KVC_STORAGE_OP_COPY) {
            for (size_t c = 0; c < op->n_copies; ++c) {
                const kvc_row_copy rc = op->copies[c];
                memcpy(k + rc.dst * E, k + rc.src * E, E * sizeof(float));
                for (uint32_t e = 0; e < g->e_vmax; ++e) v[v_at(g, rc.dst, e)] = v[v_at(g, rc.src, e)];
            }
        } else if (op->kind == KVC_STORAGE_OP_SHIFT) {
            for (size_t s = 0; s < op->n_shifts; ++s)
                for (int h = 0; h < 2; ++h) rotate(k + op->shifts[s].row * E + h * 4, op->shifts[s].delta);
        }
    }
    g->n_zero += op->kind == KVC_STORAGE_OP_ZERO;
    g->n_copy += op->kind == KVC_STORAGE_OP_COPY;
    g->n_shift += op->kind == KVC_STORAGE_OP_SHIFT;
}

/* The state payload layout: K rows back to back; transposed V channel-major. */
static bool e_read_rows(uint32_t il, kvc_kv_part part, const uint64_t* rows, size_t n, void* dst,
                        void* user) {
    const engine* g = user;
    float* out = dst;
    if (g->fail_reads) return false;
    for (size_t j = 0; j < n; ++j)
        for (uint32_t e = 0; e < E; ++e)
            if (part == KVC_KV_PART_K)
                out[j * E + e] = g->k[il][rows[j] * E + e];
            else
                out[e * n + j] = g->v[il][v_at(g, rows[j], e)];
    return true;
}

static void e_write_rows(uint32_t il, kvc_kv_part part, const uint64_t* rows, size_t n, const void* src,
                         void* user) {
    engine* g = user;
    const float* in = src;
    for (size_t j = 0; j < n; ++j)
        for (uint32_t e = 0; e < E; ++e)
            if (part == KVC_KV_PART_K)
                g->k[il][rows[j] * E + e] = in[j * E + e];
            else
                g->v[il][v_at(g, rows[j], e)] = in[e * n + j];
}

static void engine_free(engine* g) {
    for (int il = 0; il < N_LAYERS; ++il) {
        free(g->k[il]);
        free(g->v[il]);
    }
}

/* Every ubatch of the batch through the engine: apply, then K and V of both layers written at the indices. */
static void engine_decode(kvc_memory* mem, engine* g, const kvc_batch* batch) {
    kvc_memory_context* ctx = NULL;
    CHECK_OK(kvc_memory_init_batch(mem, batch, 64, false, &ctx));
    CHECK(status_of(ctx) == KVC_MEMORY_STATUS_SUCCESS);
    do {
        CHECK_OK(kvc_memory_context_apply(ctx));
        kvc_ubatch_view ub;
        CHECK_OK(kvc_memory_context_get_ubatch(ctx, &ub));
        float rows[E] = {0};
        CHECK_ERR(kvc_memory_cpy_k(ctx, 0, rows, 1), KVC_ERR_UNSUPPORTED, "k_idxs");
        kvc_tensor_view view;
        CHECK_ERR(kvc_memory_get_v(ctx, 1, &view), KVC_ERR_UNSUPPORTED, "engine");
        const int64_t n_v = kvc_memory_v_idxs_elements(ctx, 0);
        CHECK(n_v == (int64_t)ub.n_tokens * g->e_vmax);
        int64_t* k_idx = malloc(sizeof(int64_t) * ub.n_tokens);
        int64_t* v_idx = malloc(sizeof(int64_t) * (size_t)n_v);
        CHECK_ERR(kvc_memory_k_idxs(ctx, 0, k_idx, ub.n_tokens + 1), KVC_ERR_INVALID_ARGUMENT, "indices");
        for (uint32_t il = 0; il < N_LAYERS; ++il) {
            CHECK_OK(kvc_memory_k_idxs(ctx, il, k_idx, ub.n_tokens));
            CHECK_OK(kvc_memory_v_idxs(ctx, il, v_idx, (size_t)n_v));
            for (uint32_t t = 0; t < ub.n_tokens; ++t)
                for (uint32_t e = 0; e < g->e_vmax; ++e) {
                    if (e < E) g->k[il][k_idx[t] * E + e] = kv_value(il, ub.pos[t], (int)e, 0);
                    g->v[il][v_idx[t * g->e_vmax + e]] = kv_value(il, ub.pos[t], (int)e, 1);
                }
        }
        free(k_idx);
        free(v_idx);
    } while (next_ubatch(ctx));
    kvc_memory_context_free(ctx);
}

/* The engine's K rows equal the host memory's (within tol, after rotations), stream by stream. */
static void check_same_rows(kvc_memory* host, const engine* g, float tol) {
    kvc_memory_context* full = NULL;
    CHECK_OK(kvc_memory_init_full(host, &full));
    for (uint32_t il = 0; il < N_LAYERS; ++il) {
        kvc_tensor_view k, v;
        CHECK_OK(kvc_memory_get_k(full, il, &k));
        CHECK_OK(kvc_memory_get_v(full, il, &v));
        for (uint64_t row = 0; row < g->n_rows; ++row)
            for (int e = 0; e < E; ++e) {
                const size_t cell = row % g->kv_size, s = row / g->kv_size;
                float hk, hv;
                memcpy(&hk, (const char*)k.data + s * k.nb[3] + cell * k.nb[2] + (size_t)e * k.nb[0],
                       sizeof hk);
                memcpy(&hv, (const char*)v.data + s * v.nb[3] + (size_t)e * v.nb[2] + cell * v.nb[0],
                       sizeof hv);
                CHECK(fabsf(hk - g->k[il][row * E + e]) <= tol * (1.0f + fabsf(hk)));
                CHECK(hv == g->v[il][v_at(g, row, (uint32_t)e)]);
            }
    }
    kvc_memory_context_free(full);
}

static void check_same_state(const kvc_memory* a, const kvc_memory* b, int32_t seq) {
    size_t na = 0, nb = 0;
    uint8_t* sa = state_of(a, seq, &na);
    uint8_t* sb = state_of(b, seq, &nb);
    CHECK(na == nb && memcmp(sa, sb, na) == 0);
    free(sa);
    free(sb);
}

static void test_engine_matches_host_storage(void) {
    engine g = {0};
    const kvc_storage_engine cb = {e_allocate, e_run, e_read_rows, e_write_rows, &g};
    kvc_kv_cache_params p = small_params(16, 2);
    p.unified = false; /* a stream per sequence: seq_cp copies rows */
    kvc_memory* host = NULL;
    CHECK_OK(kvc_kv_cache_create(&p, &host));
    p.engine = &cb;
    kvc_memory* own = NULL;
    CHECK_OK(kvc_kv_cache_create(&p, &own));
    CHECK(g.allocations == 1 && g.n_stream == 2 && g.e_vmax == E);

    kvc_batch* b = seq_batch(0, 0, 6);
    decode(host, b, 64);
    engine_decode(own, &g, b);
    kvc_batch_free(b);
    check_same_rows(host, &g, 0.0f);
    check_same_state(host, own, KVC_SEQ_ALL);

    /* a copy into the other stream, then a context shift of seq 0 */
    for (int i = 0; i < 2; ++i) {
        kvc_memory* m = i == 0 ? host : own;
        CHECK_OK(kvc_memory_seq_cp(m, 0, 1, -1, -1));
        CHECK_OK(kvc_memory_seq_rm(m, 0, 1, 3, NULL));
        CHECK_OK(kvc_memory_seq_add(m, 0, 3, -1, -2));
    }
    CHECK(g.n_copy == 1 && g.n_shift == 0);
    check_same_state(host, own, KVC_SEQ_ALL); /* saved rotated while pending: kvcache rotates the rows read */
    for (int i = 0; i < 2; ++i) {
        bool updated = false;
        CHECK_OK(kvc_memory_update(i == 0 ? host : own, false, &updated));
        CHECK(updated);
    }
    CHECK(g.n_shift == 1);
    check_same_rows(host, &g, 1e-5f);
    check_same_state(host, own, 1);

    /* seq 1 restored into seq 0, through write_rows */
    size_t n = 0;
    uint8_t* s1 = state_of(host, 1, &n);
    for (int i = 0; i < 2; ++i) {
        kvc_memory* m = i == 0 ? host : own;
        CHECK_OK(kvc_memory_seq_rm(m, 0, -1, -1, NULL));
        CHECK_OK(kvc_state_seq_set_data(m, s1, n, 0, 0, NULL));
    }
    free(s1);
    check_same_rows(host, &g, 1e-5f);
    check_same_state(host, own, 0);

    /* a failing read fails the save, nothing else */
    g.fail_reads = true;
    uint8_t buf[4096];
    CHECK_ERR(kvc_state_seq_get_data(own, 0, buf, sizeof buf, NULL, 0), KVC_ERR_IO, "read_rows");
    g.fail_reads = false;
    check_same_state(host, own, 0);

    CHECK_OK(kvc_memory_clear(own, true));
    CHECK(g.n_zero == 1);
    for (size_t i = 0; i < g.n_rows * E; ++i) CHECK(g.k[0][i] == 0.0f && g.k[1][i] == 0.0f);

    kvc_memory_free(own);
    kvc_memory_free(host);
    engine_free(&g);
}

static void test_bad_engines_are_refused(void) {
    engine g = {0};
    kvc_storage_engine cb = {e_allocate, NULL, e_read_rows, e_write_rows, &g};
    kvc_kv_cache_params p = small_params(16, 2);
    p.engine = &cb;
    kvc_memory* mem = NULL;
    CHECK_ERR(kvc_kv_cache_create(&p, &mem), KVC_ERR_INVALID_ARGUMENT, "params.engine->run is NULL");
    CHECK(mem == NULL && g.allocations == 0);
    cb.run = e_run;
    g.refuse_allocate = true;
    CHECK_ERR(kvc_kv_cache_create(&p, &mem), KVC_ERR_OUT_OF_MEMORY, "allocate refused");
    CHECK(mem == NULL && g.allocations == 1);
    /* an iSWA memory asks once per cache */
    g.refuse_allocate = false;
    g.allocations = 0;
    kvc_iswa_params ip = kvc_iswa_default_params();
    ip.kv = small_params(16, 2);
    g_layers[0].is_swa = true;
    ip.kv.n_swa = 4;
    ip.kv.swa_type = KVC_SWA_TYPE_STANDARD;
    ip.kv.engine = &cb;
    CHECK_OK(kvc_iswa_create(&ip, &mem));
    CHECK(g.allocations == 2);
    kvc_memory_free(mem);
    g_layers[0].is_swa = false;
    engine_free(&g);
    /* and a hybrid memory once, for its attention part */
    engine h = {0};
    cb.user_data = &h;
    kvc_recurrent_layer_desc recr[2] = {{0, 0}, {4, 4}};
    kvc_hybrid_params hp = kvc_hybrid_default_params();
    hp.attn = small_params(16, 2);
    hp.attn.engine = &cb;
    hp.recr.layers = recr;
    hp.recr.n_layers = 2;
    hp.recr.n_seq_max = 2;
    CHECK_OK(kvc_hybrid_create(&hp, &mem));
    CHECK(h.allocations == 1 && h.n_stream == 1);
    kvc_memory_free(mem);
    engine_free(&h);
}

int main(void) {
    test_engine_matches_host_storage();
    test_bad_engines_are_refused();
    return capi_report("test_capi_engine");
}
