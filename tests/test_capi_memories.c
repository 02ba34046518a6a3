/* The C API of the memories beyond the KV cache (kvc_iswa_create, kvc_recurrent_create, kvc_hybrid_create),
 * compiled as C11: a toy model run by a toy engine that follows each memory's contract, checked against the
 * states it must reach; per-layer inputs, rollback, partial-only states, wrong kinds of memory and
 * context. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kvcache/kvcache.h>

#include "capi_test.h"

/* -- the other memories: iSWA, recurrent, hybrid -- */

/* A toy model for them: layer il of n_layers has K/V when bit il of `attn` is set (2 heads of 4, rows from
 * kv_value) and recurrent state when bit il of `recr` is set (R values per r row, S per s row). */
enum { R = 2, S = 4, TOY_SEQ = 4, TOY_POS = 48, TOY_LAYERS = 4 };

typedef struct toy_model {
    uint32_t n_layers;
    uint32_t attn; /* bit il: layer il has K/V */
    uint32_t recr; /* bit il: layer il has r and s rows */
} toy_model;

/* An engine running the toy model, with a reference: the state each sequence must have after each of its
 * positions, recorded as the engine computes them. Every ubatch checks that each block starts from the
 * recorded state before its first position (zero at position 0), so a state the memory loses, mixes up
 * or rolls back wrongly shows. Tests mirror seq_cp and state restores with toy_copy_seq. */
typedef struct toy_engine {
    const toy_model* m;
    float r[TOY_SEQ][TOY_POS][TOY_LAYERS][R];
    float s[TOY_SEQ][TOY_POS][TOY_LAYERS][S];
} toy_engine;

static void toy_init(toy_engine* e, const toy_model* m) {
    memset(e, 0, sizeof *e);
    e->m = m;
}

static void toy_copy_seq(toy_engine* e, int32_t src, int32_t dst) {
    memcpy(e->r[dst], e->r[src], sizeof e->r[dst]);
    memcpy(e->s[dst], e->s[src], sizeof e->s[dst]);
}

/* Tokens differ between sequences, so that their states do. */
static int32_t toy_token(int32_t seq, int32_t pos) {
    return 1 + pos + 16 * seq;
}

/* Positions [p0, p1) of one sequence with toy tokens, the last one an output. */
static kvc_batch* toy_batch(int32_t seq, int32_t p0, int32_t p1) {
    kvc_batch* b = kvc_batch_init(p1 - p0, 0, 1);
    CHECK(b != NULL);
    for (int32_t p = p0; p < p1; ++p) CHECK_OK(kvc_batch_add(b, toy_token(seq, p), p, &seq, 1, p == p1 - 1));
    return b;
}

static void toy_attn_layers(kvc_layer_desc* layers, uint32_t n, uint32_t attn, uint32_t swa) {
    for (uint32_t il = 0; il < n; ++il) {
        layers[il] = kvc_layer_desc_default();
        layers[il].n_head_kv = 2;
        layers[il].n_embd_head_k = 4;
        layers[il].n_embd_head_v = 4;
        layers[il].has_kv = (attn >> il) & 1u;
        layers[il].is_swa = (swa >> il) & 1u;
    }
}

static void toy_recr_layers(kvc_recurrent_layer_desc* layers, uint32_t n, uint32_t recr) {
    for (uint32_t il = 0; il < n; ++il) {
        layers[il].n_embd_r = (recr >> il) & 1u ? R : 0;
        layers[il].n_embd_s = (recr >> il) & 1u ? S : 0;
    }
}

/* The toy recurrence of layer il folds a token into (r, s): r = (token, token + il) (the last token),
 * s[e] += token (e + 1) + il (a running sum). */
static void toy_step(uint32_t il, int32_t token, float* r, float* s) {
    r[0] = (float)token;
    r[1] = (float)(token + (int)il);
    for (int e = 0; e < S; ++e) s[e] += (float)(token * (e + 1) + (int)il);
}

/* Row `row` (plane * size + cell) of an r or s tensor [n_embd, size, planes] of f32. */
static float* rs_row(const kvc_tensor_view* t, int64_t row, uint32_t size) {
    return (float*)((char*)t->data + (size_t)(row % size) * t->nb[1] + (size_t)(row / size) * t->nb[2]);
}

/* Layer il of the current (applied) ubatch, as an engine runs a recurrent layer: the contract of
 * kvcache.h step by step; each block's initial state is checked against the reference. */
static void toy_recurrent_layer(toy_engine* en, kvc_memory_context* ctx, const kvc_ubatch_view* ub,
                                uint32_t il) {
    kvc_rs_view rs;
    kvc_tensor_view tr, ts;
    CHECK_OK(kvc_memory_context_get_rs(ctx, &rs));
    CHECK_OK(kvc_memory_get_r(ctx, il, &tr));
    CHECK_OK(kvc_memory_get_s(ctx, il, &ts));
    CHECK(tr.type == KVC_TYPE_F32 && tr.ne[0] == R && tr.ne[1] == rs.size && tr.ne[2] == 1 + rs.n_rs_seq);
    CHECK(ts.type == KVC_TYPE_F32 && ts.ne[0] == S && ts.ne[1] == rs.size && ts.ne[2] == 1 + rs.n_rs_seq);
    const uint32_t B = ub->n_seqs, T = ub->n_seq_tokens, k = rs.n_rs_seq;
    CHECK(ub->equal_seqs && rs.n_seqs == B && rs.n_rs >= B && rs.head + rs.n_rs <= rs.size);

    /* 1. zero row rs_z */
    if (rs.rs_z >= 0) {
        memset(rs_row(&tr, rs.rs_z, rs.size), 0, sizeof(float) * R);
        memset(rs_row(&ts, rs.rs_z, rs.size), 0, sizeof(float) * S);
    }
    /* 2. gather the sources and the history rows before anything is written */
    float(*gr)[R] = malloc(sizeof *gr * rs.n_rs);
    float(*gs)[S] = malloc(sizeof *gs * rs.n_rs);
    float(*hr)[R] = malloc(sizeof *hr * (rs.n_hist_copy + 1));
    float(*hs)[S] = malloc(sizeof *hs * (rs.n_hist_copy + 1));
    for (uint32_t i = 0; i < rs.n_rs; ++i) {
        memcpy(gr[i], rs_row(&tr, rs.s_copy[i], rs.size), sizeof gr[i]);
        memcpy(gs[i], rs_row(&ts, rs.s_copy[i], rs.size), sizeof gs[i]);
    }
    for (size_t h = 0; h < rs.n_hist_copy; ++h) {
        memcpy(hr[h], rs_row(&tr, rs.hist_copy[h].src, rs.size), sizeof hr[h]);
        memcpy(hs[h], rs_row(&ts, rs.hist_copy[h].src, rs.size), sizeof hs[h]);
    }
    /* 3. extra cells keep their gathered state */
    for (uint32_t i = B; i < rs.n_rs; ++i) {
        memcpy(rs_row(&tr, rs.head + i, rs.size), gr[i], sizeof gr[i]);
        memcpy(rs_row(&ts, rs.head + i, rs.size), gs[i], sizeof gs[i]);
    }
    /* 4. each block runs from its gathered state; plane r gets the state r tokens before the end */
    for (uint32_t b = 0; b < B; ++b) {
        const int32_t seq = ub->seq_id_data[ub->seq_id_begin[b * T]];
        const int32_t p0 = ub->pos[b * T];
        CHECK(seq >= 0 && seq < TOY_SEQ && p0 >= 0 && p0 + (int32_t)T <= TOY_POS);
        static const float zero_r[R], zero_s[S];
        const float* er = p0 == 0 ? zero_r : en->r[seq][p0 - 1][il];
        const float* es = p0 == 0 ? zero_s : en->s[seq][p0 - 1][il];
        CHECK(memcmp(er, gr[b], sizeof gr[b]) == 0 && memcmp(es, gs[b], sizeof gs[b]) == 0);
        for (uint32_t t = 0; t < T; ++t) {
            toy_step(il, ub->token[b * T + t], gr[b], gs[b]);
            memcpy(en->r[seq][p0 + (int32_t)t][il], gr[b], sizeof gr[b]);
            memcpy(en->s[seq][p0 + (int32_t)t][il], gs[b], sizeof gs[b]);
            const uint32_t plane = T - 1 - t;
            if (plane >= 1 && plane <= k) {
                const int64_t row = (int64_t)plane * rs.size + rs.head + b;
                memcpy(rs_row(&tr, row, rs.size), gr[b], sizeof gr[b]);
                memcpy(rs_row(&ts, row, rs.size), gs[b], sizeof gs[b]);
            }
        }
        memcpy(rs_row(&tr, rs.head + b, rs.size), gr[b], sizeof gr[b]);
        memcpy(rs_row(&ts, rs.head + b, rs.size), gs[b], sizeof gs[b]);
    }
    /* 5. history rows */
    for (size_t h = 0; h < rs.n_hist_copy; ++h) {
        memcpy(rs_row(&tr, rs.hist_copy[h].dst, rs.size), hr[h], sizeof hr[h]);
        memcpy(rs_row(&ts, rs.hist_copy[h].dst, rs.size), hs[h], sizeof hs[h]);
    }
    free(gr);
    free(gs);
    free(hr);
    free(hs);
}

/* The K/V rows of attention layer il for the current (applied) ubatch. */
static void toy_attention_layer(kvc_memory_context* ctx, const kvc_ubatch_view* ub, uint32_t il) {
    float* rows = malloc(sizeof(float) * E * ub->n_tokens);
    for (int is_v = 0; is_v < 2; ++is_v) {
        for (uint32_t t = 0; t < ub->n_tokens; ++t)
            for (int e = 0; e < E; ++e) rows[t * E + e] = kv_value(il, ub->pos[t], e, is_v);
        if (is_v)
            CHECK_OK(kvc_memory_cpy_v(ctx, il, rows, ub->n_tokens));
        else
            CHECK_OK(kvc_memory_cpy_k(ctx, il, rows, ub->n_tokens));
    }
    free(rows);
}

/* Every layer of the toy model for the current (applied) ubatch. */
static void toy_layers(toy_engine* e, kvc_memory_context* ctx) {
    kvc_ubatch_view ub;
    CHECK_OK(kvc_memory_context_get_ubatch(ctx, &ub));
    for (uint32_t il = 0; il < e->m->n_layers; ++il) {
        if ((e->m->attn >> il) & 1u) toy_attention_layer(ctx, &ub, il);
        if ((e->m->recr >> il) & 1u) toy_recurrent_layer(e, ctx, &ub, il);
    }
}

/* Decodes a batch through the toy model; false (nothing changed) when it does not fit. */
static bool toy_decode(toy_engine* e, kvc_memory* mem, const kvc_batch* batch, uint32_t n_ubatch) {
    kvc_memory_context* ctx = NULL;
    CHECK_OK(kvc_memory_init_batch(mem, batch, n_ubatch, false, &ctx));
    const bool fits = status_of(ctx) == KVC_MEMORY_STATUS_SUCCESS;
    if (fits) {
        do {
            CHECK_OK(kvc_memory_context_apply(ctx));
            toy_layers(e, ctx);
        } while (next_ubatch(ctx));
    }
    kvc_memory_context_free(ctx);
    return fits;
}

/* Decodes positions [p0, p1) of one sequence; they must fit. */
static void toy_decode_seq(toy_engine* e, kvc_memory* mem, int32_t seq, int32_t p0, int32_t p1,
                           uint32_t n_ubatch) {
    kvc_batch* b = toy_batch(seq, p0, p1);
    CHECK(toy_decode(e, mem, b, n_ubatch));
    kvc_batch_free(b);
}

/* The mask of attention layer il for the current ubatch (one sequence): cell c is visible to token t when
 * it holds a position p <= pos[t] (and p > pos[t] - n_swa when n_swa > 0). Cell positions are read back
 * from the layer's K rows (channel 1 of kv_value; 0: an empty cell of a fresh cache). */
static void check_toy_mask(kvc_memory_context* ctx, uint32_t il, int32_t n_swa) {
    kvc_ubatch_view ub;
    CHECK_OK(kvc_memory_context_get_ubatch(ctx, &ub));
    const int64_t n_kv = kvc_memory_context_n_kv(ctx, il);
    const int64_t n = kvc_memory_kq_mask_elements(ctx, il);
    CHECK(n_kv > 0 && n == n_kv * (int64_t)ub.n_tokens);
    float* mask = malloc(sizeof(float) * (size_t)n);
    uint16_t* mask16 = malloc(sizeof(uint16_t) * (size_t)n);
    CHECK_OK(kvc_memory_set_input_kq_mask(ctx, il, KVC_TYPE_F32, mask, (size_t)n, true, false));
    CHECK_OK(kvc_memory_set_input_kq_mask(ctx, il, KVC_TYPE_F16, mask16, (size_t)n, true, false));
    CHECK_ERR(kvc_memory_set_input_kq_mask(ctx, il, KVC_TYPE_F32, mask, (size_t)n + 1, true, false),
              KVC_ERR_INVALID_ARGUMENT, "kvc_memory_set_input_kq_mask: ");
    kvc_tensor_view k;
    CHECK_OK(kvc_memory_get_k(ctx, il, &k));
    CHECK(k.ne[2] == n_kv);
    for (uint32_t t = 0; t < ub.n_tokens; ++t)
        for (int64_t c = 0; c < n_kv; ++c) {
            const float key = k_at(&k, 1, 0, c);
            const int32_t p = (int32_t)((key - 1000.0f * (float)il - 1.0f) / 10.0f);
            const bool visible = key != 0.0f && p <= ub.pos[t] && (n_swa == 0 || p > ub.pos[t] - n_swa);
            const float x = mask[t * n_kv + c];
            CHECK(visible ? x == 0.0f : isinf(x) && x < 0);
            CHECK(mask16[t * n_kv + c] == (visible ? 0x0000 : 0xFC00));
        }
    free(mask);
    free(mask16);
}

/* State bytes with flags; caller frees. */
static uint8_t* state_with(const kvc_memory* mem, int32_t seq, uint32_t flags, size_t* size) {
    size_t n = 0, written = 0;
    CHECK_OK(kvc_state_seq_get_size(mem, seq, flags, &n));
    uint8_t* buf = malloc(n);
    CHECK_OK(kvc_state_seq_get_data(mem, seq, buf, n, &written, flags));
    CHECK(written == n);
    *size = n;
    return buf;
}

static int32_t pos_max(const kvc_memory* mem, int32_t seq) {
    int32_t pos = -2;
    CHECK_OK(kvc_memory_seq_pos_max(mem, seq, &pos));
    return pos;
}

static kvc_memory_kind kind_of(const kvc_memory* mem) {
    kvc_memory_kind kind = (kvc_memory_kind)-1;
    CHECK_OK(kvc_memory_get_kind(mem, &kind));
    return kind;
}

/* -- recurrent memory -- */

static bool keep_all_layers(uint32_t il, void* user_data) {
    (void)il;
    ++*(uint32_t*)user_data;
    return true;
}

static bool keep_no_layer(uint32_t il, void* user_data) {
    (void)il;
    (void)user_data;
    return false;
}

static const toy_model g_recr_model = {3, 0u, 0x5u}; /* layers 0 and 2 recurrent, layer 1 neither */

static kvc_memory* toy_recurrent(uint32_t n_seq_max, uint32_t n_rs_seq) {
    kvc_recurrent_layer_desc layers[3];
    toy_recr_layers(layers, 3, g_recr_model.recr);
    kvc_recurrent_params p = kvc_recurrent_default_params();
    p.layers = layers;
    p.n_layers = 3;
    p.n_seq_max = n_seq_max;
    p.n_rs_seq = n_rs_seq;
    kvc_memory* mem = NULL;
    CHECK_OK(kvc_recurrent_create(&p, &mem));
    return mem;
}

static void test_recurrent_create(void) {
    const kvc_recurrent_params d = kvc_recurrent_default_params();
    CHECK(d.layers == NULL && d.n_layers == 0 && d.layer_filter == NULL && d.layer_filter_user_data == NULL);
    CHECK(d.type_r == KVC_TYPE_F32 && d.type_s == KVC_TYPE_F32 && d.n_seq_max == 1 && d.n_rs_seq == 0);

    kvc_recurrent_layer_desc layers[3];
    toy_recr_layers(layers, 3, g_recr_model.recr);
    kvc_recurrent_params p = d;
    p.layers = layers;
    p.n_layers = 3;
    kvc_memory* mem = (kvc_memory*)&g_checks;
    CHECK_ERR(kvc_recurrent_create(NULL, &mem), KVC_ERR_INVALID_ARGUMENT,
              "kvc_recurrent_create: params is NULL");
    CHECK(mem == NULL);
    CHECK_ERR(kvc_recurrent_create(&p, NULL), KVC_ERR_INVALID_ARGUMENT, "out is NULL");
    CHECK_ERR(kvc_recurrent_create(&d, &mem), KVC_ERR_INVALID_ARGUMENT, "params.layers must list");
    p.type_r = KVC_TYPE_Q8_0;
    CHECK_ERR(kvc_recurrent_create(&p, &mem), KVC_ERR_INVALID_ARGUMENT, "f32, f16 or bf16");
    p.type_r = KVC_TYPE_F32;
    p.type_s = (kvc_type)77;
    CHECK_ERR(kvc_recurrent_create(&p, &mem), KVC_ERR_INVALID_ARGUMENT, "params.type_s = 77");
    p.type_s = KVC_TYPE_F32;
    p.n_seq_max = 0;
    CHECK_ERR(kvc_recurrent_create(&p, &mem), KVC_ERR_INVALID_ARGUMENT, "n_seq_max");
    p.n_seq_max = 1;
    p.layer_filter = keep_no_layer;
    CHECK_ERR(kvc_recurrent_create(&p, &mem), KVC_ERR_INVALID_ARGUMENT, "no layer has a state row");
    CHECK(mem == NULL);

    /* the filter is called for every layer with a row; f16 r, bf16 s */
    uint32_t calls = 0;
    p.layer_filter = keep_all_layers;
    p.layer_filter_user_data = &calls;
    p.type_r = KVC_TYPE_F16;
    p.type_s = KVC_TYPE_BF16;
    p.n_seq_max = 2;
    p.n_rs_seq = 1;
    layers[2].n_embd_r = 0; /* layer 2: s only */
    CHECK_OK(kvc_recurrent_create(&p, &mem));
    CHECK(calls == 2);
    CHECK(kind_of(mem) == KVC_MEMORY_KIND_RECURRENT);
    kvc_memory_context* full = NULL;
    CHECK_OK(kvc_memory_init_full(mem, &full));
    kvc_tensor_view v;
    CHECK_OK(kvc_memory_get_r(full, 0, &v));
    CHECK(v.type == KVC_TYPE_F16 && v.ne[0] == R && v.ne[1] == 2 && v.ne[2] == 2 && v.ne[3] == 1);
    CHECK(v.nb[0] == 2 && v.nb[1] == 2 * R && v.nb[2] == 2 * 2 * R && v.data != NULL);
    CHECK_OK(kvc_memory_get_s(full, 2, &v));
    CHECK(v.type == KVC_TYPE_BF16 && v.ne[0] == S && v.ne[1] == 2 && v.ne[2] == 2);
    CHECK_ERR(kvc_memory_get_r(full, 2, &v), KVC_ERR_OUT_OF_RANGE,
              "kvc_memory_get_r: memory_recurrent: layer 2 has no r");
    CHECK_ERR(kvc_memory_get_s(full, 1, &v), KVC_ERR_OUT_OF_RANGE, "model layer 1 has no state");
    CHECK_ERR(kvc_memory_get_s(full, 9, &v), KVC_ERR_OUT_OF_RANGE, "model layer 9");
    kvc_memory_context_free(full);
    kvc_memory_free(mem);
}

static void test_recurrent_decode_and_rollback(void) {
    kvc_memory* mem = toy_recurrent(3, 2);
    static toy_engine e;
    toy_init(&e, &g_recr_model);

    /* a full context covers every cell, each reading its own row */
    kvc_memory_context* ctx = NULL;
    CHECK_OK(kvc_memory_init_full(mem, &ctx));
    kvc_rs_view rs;
    CHECK_OK(kvc_memory_context_get_rs(ctx, &rs));
    CHECK(rs.head == 0 && rs.n_rs == 3 && rs.n_seqs == 3 && rs.rs_z == 0 && rs.size == 3 && rs.n_rs_seq == 2);
    CHECK(rs.s_copy != NULL && rs.s_copy[0] == 0 && rs.s_copy[1] == 1 && rs.s_copy[2] == 2);
    CHECK(rs.n_hist_copy == 0 && rs.hist_copy == NULL);
    kvc_tensor_view v;
    CHECK_OK(kvc_memory_get_s(ctx, 2, &v));
    CHECK(v.ne[0] == S && v.ne[1] == 3 && v.ne[2] == 3 && v.nb[1] == 4 * S && v.nb[2] == 3 * 4 * S);
    /* no K/V here: the attention functions say so */
    CHECK(kvc_memory_context_n_kv(ctx, 0) == KVC_ERR_UNSUPPORTED);
    CHECK_MSG("kvc_memory_context_n_kv: this memory holds no K/V");
    CHECK(kvc_memory_context_n_kv(ctx, 1) == KVC_ERR_UNSUPPORTED); /* whatever the layer */
    CHECK_ERR(kvc_memory_get_k(ctx, 0, &v), KVC_ERR_UNSUPPORTED,
              "kvc_memory_get_k: this memory holds no K/V");
    CHECK(kvc_memory_kq_mask_elements(ctx, 0) == KVC_ERR_UNSUPPORTED);
    CHECK(kvc_memory_kq_mask_elements(ctx, 9) == KVC_ERR_UNSUPPORTED);
    float f[4];
    CHECK_ERR(kvc_memory_set_input_kq_mask(ctx, 0, KVC_TYPE_F32, f, 4, true, false), KVC_ERR_UNSUPPORTED,
              "no K/V");
    int32_t buckets[4];
    CHECK_ERR(kvc_memory_set_input_pos_bucket(ctx, 0, buckets, 4, 32), KVC_ERR_UNSUPPORTED, "no K/V");
    CHECK(kvc_memory_k_shift_elements(mem, 0) == KVC_ERR_UNSUPPORTED);
    CHECK_MSG("kvc_memory_k_shift_elements: this memory holds no K/V");
    kvc_memory_context_free(ctx);

    /* positions 0..4 of sequence 0 in one ubatch, step by step */
    kvc_batch* b = toy_batch(0, 0, 5);
    CHECK_OK(kvc_memory_init_batch(mem, b, 8, false, &ctx));
    kvc_batch_free(b);
    CHECK(status_of(ctx) == KVC_MEMORY_STATUS_SUCCESS);
    CHECK_ERR(kvc_memory_context_get_rs(ctx, &rs), KVC_ERR_INVALID_STATE,
              "kvc_memory_context_get_rs: memory context: apply() the current ubatch first");
    CHECK_OK(kvc_memory_get_r(ctx, 0, &v)); /* the tensors do not depend on the ubatch */
    CHECK_OK(kvc_memory_context_apply(ctx));
    CHECK_OK(kvc_memory_context_get_rs(ctx, &rs));
    CHECK(rs.n_seqs == 1 && rs.n_rs == 1 && rs.rs_z >= 0 && rs.s_copy[0] == rs.rs_z); /* a fresh state */
    CHECK(rs.n_hist_copy == 0);
    toy_layers(&e, ctx);
    CHECK(!next_ubatch(ctx));
    CHECK_ERR(kvc_memory_context_get_rs(ctx, &rs), KVC_ERR_INVALID_STATE, "no current ubatch");
    CHECK_ERR(kvc_memory_context_get_rs(ctx, NULL), KVC_ERR_INVALID_ARGUMENT, "out is NULL");
    CHECK_ERR(kvc_memory_get_r(ctx, 0, NULL), KVC_ERR_INVALID_ARGUMENT, "out is NULL");
    CHECK_ERR(kvc_memory_get_s(ctx, 0, NULL), KVC_ERR_INVALID_ARGUMENT, "out is NULL");
    kvc_memory_context_free(ctx);
    CHECK(pos_max(mem, 0) == 4);

    /* rollback: remove the last token; the next ubatch starts from the state after position 3 */
    bool removed = false;
    CHECK_OK(kvc_memory_seq_rm(mem, 0, 4, -1, &removed));
    CHECK(removed && pos_max(mem, 0) == 3);
    toy_decode_seq(&e, mem, 0, 4, 5, 8); /* one token: its history comes through hist_copy */
    CHECK(pos_max(mem, 0) == 4);
    /* three tokens back is beyond the history of 2: refused, nothing changed */
    size_t n_before = 0;
    uint8_t* before = state_of(mem, KVC_SEQ_ALL, &n_before);
    removed = true;
    CHECK_OK(kvc_memory_seq_rm(mem, 0, 2, -1, &removed));
    CHECK(!removed && pos_max(mem, 0) == 4 && same_state(mem, before, n_before));
    free(before);
    /* two tokens back: the plane the short ubatch carried over */
    CHECK_OK(kvc_memory_seq_rm(mem, 0, 3, -1, &removed));
    CHECK(removed && pos_max(mem, 0) == 2);
    toy_decode_seq(&e, mem, 0, 3, 6, 2); /* ubatches of 2 then 1 token */

    /* sequence 1 shares sequence 0's state; a batch of both gives each its own cell */
    CHECK_OK(kvc_memory_seq_cp(mem, 0, 1, -1, -1));
    toy_copy_seq(&e, 0, 1);
    CHECK(pos_max(mem, 1) == 5);
    kvc_batch* two = kvc_batch_init(4, 0, 1);
    for (int32_t s = 0; s < 2; ++s)
        for (int32_t p = 6; p < 8; ++p) CHECK_OK(kvc_batch_add(two, toy_token(s, p), p, &s, 1, p == 7));
    CHECK_OK(kvc_memory_init_batch(mem, two, 8, false, &ctx));
    CHECK_OK(kvc_memory_context_apply(ctx));
    kvc_ubatch_view ub;
    CHECK_OK(kvc_memory_context_get_ubatch(ctx, &ub));
    CHECK_OK(kvc_memory_context_get_rs(ctx, &rs));
    CHECK(ub.n_seqs == 2 && ub.n_seq_tokens == 2 && rs.n_seqs == 2 && rs.n_rs >= 2);
    toy_layers(&e, ctx);
    CHECK(!next_ubatch(ctx));
    kvc_memory_context_free(ctx);
    kvc_batch_free(two);
    CHECK(pos_max(mem, 0) == 7 && pos_max(mem, 1) == 7);
    int32_t pos = 0;
    CHECK_OK(kvc_memory_seq_pos_min(mem, 1, &pos));
    CHECK(pos == 7); /* one state: min == max */

    /* no pending maintenance */
    CHECK_OK(kvc_memory_init_update(mem, true, &ctx));
    CHECK(status_of(ctx) == KVC_MEMORY_STATUS_NO_UPDATE);
    CHECK_OK(kvc_memory_context_apply(ctx));
    CHECK_ERR(kvc_memory_context_get_rs(ctx, &rs), KVC_ERR_INVALID_STATE, "update context");
    kvc_memory_context_free(ctx);
    bool updated = true;
    CHECK_OK(kvc_memory_update(mem, false, &updated));
    CHECK(!updated);

    /* shifting moves the tail positions */
    bool can = false;
    CHECK_OK(kvc_memory_can_shift(mem, &can));
    CHECK(can);
    CHECK_OK(kvc_memory_seq_keep(mem, 0));
    CHECK(pos_max(mem, 1) == -1 && pos_max(mem, 0) == 7);
    CHECK_ERR(kvc_memory_seq_rm(mem, 3, -1, -1, NULL), KVC_ERR_OUT_OF_RANGE, "seq_id 3");
    kvc_memory_free(mem);

    /* without rollback only whole sequences can be removed */
    mem = toy_recurrent(1, 0);
    toy_init(&e, &g_recr_model);
    toy_decode_seq(&e, mem, 0, 0, 4, 4);
    CHECK_OK(kvc_memory_seq_rm(mem, 0, 3, -1, &removed));
    CHECK(!removed && pos_max(mem, 0) == 3);
    CHECK_OK(kvc_memory_seq_rm(mem, 0, -1, -1, &removed));
    CHECK(removed && pos_max(mem, 0) == -1);
    toy_decode_seq(&e, mem, 0, 0, 2, 4); /* a fresh state again */
    kvc_memory_free(mem);

    /* cells 0, 1, 2 hold sequences 1, 0, 2; a ubatch of 1 and 2 (consecutive ids: the split is
     * sequential) gathers their cells into [0, 2), which moves sequence 0's state to an "extra" cell of
     * the range (step 3 of the contract) */
    mem = toy_recurrent(3, 0);
    toy_init(&e, &g_recr_model);
    const int32_t order[3] = {1, 0, 2};
    for (int i = 0; i < 3; ++i) toy_decode_seq(&e, mem, order[i], 0, 2, 4);
    kvc_batch* b12 = kvc_batch_init(2, 0, 1);
    for (int32_t s = 1; s < 3; ++s) CHECK_OK(kvc_batch_add(b12, toy_token(s, 2), 2, &s, 1, true));
    CHECK_OK(kvc_memory_init_batch(mem, b12, 8, false, &ctx));
    kvc_batch_free(b12);
    CHECK_OK(kvc_memory_context_apply(ctx));
    CHECK_OK(kvc_memory_context_get_rs(ctx, &rs));
    CHECK(rs.n_seqs == 2 && rs.n_rs == 3 && rs.head == 0);
    toy_layers(&e, ctx);
    CHECK(!next_ubatch(ctx));
    kvc_memory_context_free(ctx);
    toy_decode_seq(&e, mem, 0, 2, 3, 4); /* sequence 0 continues from its moved state */
    kvc_memory_free(mem);
}

static void test_recurrent_state(void) {
    static toy_engine e;
    toy_init(&e, &g_recr_model);
    kvc_memory* mem = toy_recurrent(3, 1);
    toy_decode_seq(&e, mem, 0, 0, 6, 4);

    /* partial-only means nothing to a plain memory */
    size_t n = 0, n_partial = 0, read = 0;
    uint8_t* seq0 = state_of(mem, 0, &n);
    uint8_t* partial = state_with(mem, 0, KVC_STATE_SEQ_FLAG_PARTIAL_ONLY, &n_partial);
    CHECK(n == n_partial && memcmp(seq0, partial, n) == 0);
    free(partial);

    /* sequence 0 restored into sequence 2 continues from the restored rows */
    CHECK_OK(kvc_state_seq_set_data(mem, seq0, n, 2, 0, &read));
    CHECK(read == n && pos_max(mem, 2) == 5);
    toy_copy_seq(&e, 0, 2);
    toy_decode_seq(&e, mem, 2, 6, 8, 4);
    /* a restored state has no history: rollback refused */
    bool removed = true;
    CHECK_OK(kvc_state_seq_set_data(mem, seq0, n, 1, KVC_STATE_SEQ_FLAG_PARTIAL_ONLY, NULL));
    toy_copy_seq(&e, 0, 1);
    CHECK_OK(kvc_memory_seq_rm(mem, 1, 5, -1, &removed));
    CHECK(!removed && pos_max(mem, 1) == 5);

    /* the whole memory into a fresh one; damaged bytes are refused with the memory unchanged */
    size_t n_whole = 0;
    uint8_t* whole = state_of(mem, KVC_SEQ_ALL, &n_whole);
    kvc_memory* other = toy_recurrent(3, 1);
    CHECK_OK(kvc_state_seq_set_data(other, whole, n_whole, KVC_SEQ_ALL, 0, NULL));
    CHECK(same_state(other, whole, n_whole));
    static toy_engine e2;
    e2 = e; /* the same states */
    toy_decode_seq(&e2, other, 2, 8, 9, 4);
    kvc_memory_free(other);
    CHECK_ERR(kvc_state_seq_set_data(mem, seq0, n - 1, 1, 0, NULL), KVC_ERR_CORRUPT_DATA, "");
    CHECK(same_state(mem, whole, n_whole));

    /* a recurrent state does not load into a KV cache */
    kvc_memory* kv = small_cache(8, 3);
    CHECK(kvc_state_seq_set_data(kv, seq0, n, 0, 0, NULL) != KVC_OK);
    kvc_memory_free(kv);
    free(seq0);
    free(whole);
    kvc_memory_free(mem);
}

/* -- iSWA -- */

static const toy_model g_iswa_model = {4, 0xFu, 0u}; /* layers 0, 2 full attention; 1, 3 sliding window */

static kvc_iswa_params toy_iswa_params(kvc_layer_desc* layers, bool swa_full) {
    toy_attn_layers(layers, 4, 0xFu, 0xAu);
    kvc_iswa_params p = kvc_iswa_default_params();
    p.kv.layers = layers;
    p.kv.n_layers = 4;
    p.kv.type_k = KVC_TYPE_F32;
    p.kv.type_v = KVC_TYPE_F32;
    p.kv.kv_size = 512;
    p.kv.n_seq_max = 2;
    p.kv.n_kv_pad = 4;
    p.kv.n_swa = 4;
    p.kv.swa_type = KVC_SWA_TYPE_STANDARD;
    p.swa_full = swa_full;
    p.n_ubatch = 8; /* sliding-window cache: 4 * 2 + 8 cells, padded to 256 */
    return p;
}

static void test_iswa(void) {
    static toy_engine e;
    toy_init(&e, &g_iswa_model);
    const kvc_iswa_params d = kvc_iswa_default_params();
    CHECK(d.swa_full && d.n_ubatch == 512 && d.kv.kv_size == 4096 && d.kv.layers == NULL);
    CHECK(d.kv.swa_type == KVC_SWA_TYPE_NONE && d.kv.type_k == KVC_TYPE_F16);

    kvc_layer_desc layers[4];
    kvc_iswa_params p = toy_iswa_params(layers, false);
    kvc_memory* mem = (kvc_memory*)&g_checks;
    CHECK_ERR(kvc_iswa_create(NULL, &mem), KVC_ERR_INVALID_ARGUMENT, "kvc_iswa_create: params is NULL");
    CHECK(mem == NULL);
    CHECK_ERR(kvc_iswa_create(&p, NULL), KVC_ERR_INVALID_ARGUMENT, "out is NULL");
    CHECK_ERR(kvc_iswa_create(&d, &mem), KVC_ERR_INVALID_ARGUMENT, "params.kv.layers must list");
    p.kv.swa_type = KVC_SWA_TYPE_NONE;
    CHECK_ERR(kvc_iswa_create(&p, &mem), KVC_ERR_INVALID_ARGUMENT, "need a window");
    p = toy_iswa_params(layers, false);
    p.kv.type_v = (kvc_type)77;
    CHECK_ERR(kvc_iswa_create(&p, &mem), KVC_ERR_INVALID_ARGUMENT, "params.kv.type_v = 77");
    p = toy_iswa_params(layers, false);
    for (int il = 0; il < 4; ++il) layers[il].is_swa = false;
    CHECK_ERR(kvc_iswa_create(&p, &mem), KVC_ERR_INVALID_ARGUMENT, "use a plain kv_cache");
    CHECK(mem == NULL);

    p = toy_iswa_params(layers, false);
    CHECK_OK(kvc_iswa_create(&p, &mem));
    CHECK(kind_of(mem) == KVC_MEMORY_KIND_ISWA);
    bool can = true;
    CHECK_OK(kvc_memory_can_shift(mem, &can));
    CHECK(!can);                                       /* the sliding-window cache is smaller */
    CHECK(kvc_memory_k_shift_elements(mem, 0) == 512); /* each cache its own: full attention ... */
    CHECK(kvc_memory_k_shift_elements(mem, 2) == 512);
    CHECK(kvc_memory_k_shift_elements(mem, 1) == 256); /* ... and sliding window */
    CHECK(kvc_memory_k_shift_elements(mem, 3) == 256);
    CHECK(kvc_memory_k_shift_elements(mem, 4) == KVC_ERR_OUT_OF_RANGE);
    CHECK_MSG("model layer 4 has no K/V in this memory");
    int32_t* shift = malloc(sizeof(int32_t) * 512);
    CHECK_OK(kvc_memory_set_input_k_shift(mem, 1, shift, 256));
    CHECK_ERR(kvc_memory_set_input_k_shift(mem, 1, shift, 512), KVC_ERR_INVALID_ARGUMENT, "256");
    CHECK_ERR(kvc_memory_set_input_k_shift(mem, 1, NULL, 256), KVC_ERR_INVALID_ARGUMENT, "dst is NULL");
    CHECK_OK(kvc_memory_set_input_k_shift(mem, 0, shift, 512));
    CHECK_ERR(kvc_memory_set_input_k_shift(mem, 0, shift, 256), KVC_ERR_INVALID_ARGUMENT, "512");
    CHECK_ERR(kvc_memory_set_input_k_shift(mem, 4, shift, 512), KVC_ERR_OUT_OF_RANGE,
              "kvc_memory_set_input_k_shift: model layer 4 has no K/V in this memory");
    free(shift);

    /* a full context: each cache's cells */
    kvc_memory_context* ctx = NULL;
    CHECK_OK(kvc_memory_init_full(mem, &ctx));
    CHECK(kvc_memory_context_n_kv(ctx, 0) == 512 && kvc_memory_context_n_kv(ctx, 1) == 256);
    CHECK(kvc_memory_context_n_kv(ctx, 4) == KVC_ERR_OUT_OF_RANGE);
    CHECK_MSG("kvc_memory_context_n_kv: model layer 4 has no K/V in this memory");
    kvc_tensor_view v;
    CHECK_OK(kvc_memory_get_k(ctx, 3, &v));
    CHECK(v.ne[0] == 4 && v.ne[1] == 2 && v.ne[2] == 256 && v.ne[3] == 1);
    CHECK_OK(kvc_memory_get_v(ctx, 2, &v));
    CHECK(v.ne[0] == 512); /* transposed: cells fastest */
    kvc_rs_view rs;
    CHECK_ERR(kvc_memory_context_get_rs(ctx, &rs), KVC_ERR_UNSUPPORTED, "no recurrent state");
    CHECK_ERR(kvc_memory_get_r(ctx, 0, &v), KVC_ERR_UNSUPPORTED,
              "kvc_memory_get_r: this memory holds no recurrent");
    kvc_memory_context_free(ctx);

    /* positions 0..5, then one more token inspected layer by layer */
    toy_decode_seq(&e, mem, 0, 0, 6, 4);
    kvc_batch* b = toy_batch(0, 6, 8);
    CHECK_OK(kvc_memory_init_batch(mem, b, 8, false, &ctx));
    kvc_batch_free(b);
    CHECK(kvc_memory_context_n_kv(ctx, 1) == 0); /* not applied yet */
    CHECK_ERR(kvc_memory_get_k(ctx, 1, &v), KVC_ERR_INVALID_STATE, "apply() the current ubatch first");
    CHECK(kvc_memory_kq_mask_elements(ctx, 1) == KVC_ERR_INVALID_STATE);
    CHECK_OK(kvc_memory_context_apply(ctx));
    toy_layers(&e, ctx);
    check_toy_mask(ctx, 0, 0); /* full attention: every past position */
    check_toy_mask(ctx, 2, 0);
    check_toy_mask(ctx, 1, 4); /* the window: the last 4 positions */
    check_toy_mask(ctx, 3, 4);
    CHECK(kvc_memory_context_n_kv(ctx, 0) == kvc_memory_context_n_kv(ctx, 2)); /* one cache, one n_kv */
    CHECK(kvc_memory_kq_mask_elements(ctx, 4) == KVC_ERR_OUT_OF_RANGE);
    CHECK_MSG("kvc_memory_kq_mask_elements: model layer 4 has no K/V");
    const int64_t n_mask = kvc_memory_kq_mask_elements(ctx, 3);
    float* mask = malloc(sizeof(float) * (size_t)n_mask);
    CHECK_ERR(kvc_memory_set_input_kq_mask(ctx, 4, KVC_TYPE_F16, mask, (size_t)n_mask, true, false),
              KVC_ERR_OUT_OF_RANGE, "model layer 4");
    int32_t* buckets = malloc(sizeof(int32_t) * (size_t)n_mask);
    CHECK_ERR(kvc_memory_set_input_pos_bucket(ctx, 5, buckets, (size_t)n_mask, 32), KVC_ERR_OUT_OF_RANGE,
              "model layer 5");
    CHECK_OK(kvc_memory_set_input_pos_bucket(ctx, 3, buckets, (size_t)n_mask, 32));
    CHECK_ERR(kvc_memory_set_input_pos_bucket(ctx, 3, buckets, 1, 32), KVC_ERR_INVALID_ARGUMENT,
              "pos_bucket");
    free(buckets);
    free(mask);
    float rows[4 * E] = {0};
    CHECK_ERR(kvc_memory_cpy_k(ctx, 4, rows, 2), KVC_ERR_OUT_OF_RANGE, "model layer 4 has no K/V");
    CHECK_ERR(kvc_memory_cpy_v(ctx, 1, rows, 3), KVC_ERR_INVALID_ARGUMENT, "cpy_v: expected");
    CHECK_ERR(kvc_memory_get_v(ctx, 7, &v), KVC_ERR_OUT_OF_RANGE, "model layer 7");
    CHECK(kvc_memory_context_n_kv(ctx, 9) == KVC_ERR_OUT_OF_RANGE);
    CHECK(!next_ubatch(ctx));
    kvc_memory_context_free(ctx);

    /* sequence operations run on both caches; positions come from the sliding-window cache */
    CHECK(pos_max(mem, 0) == 7);
    CHECK_OK(kvc_memory_seq_cp(mem, 0, 1, -1, -1));
    CHECK(pos_max(mem, 1) == 7);
    bool removed = false;
    CHECK_OK(kvc_memory_seq_rm(mem, 1, 6, -1, &removed));
    CHECK(removed && pos_max(mem, 1) == 5);
    CHECK_ERR(kvc_memory_seq_keep(mem, 2), KVC_ERR_OUT_OF_RANGE, "seq_id 2");

    /* state: partial-only is the sliding-window cache alone */
    size_t n_full = 0, n_partial = 0, n_whole = 0;
    uint8_t* full = state_of(mem, 0, &n_full);
    uint8_t* partial = state_with(mem, 0, KVC_STATE_SEQ_FLAG_PARTIAL_ONLY, &n_partial);
    CHECK(n_partial < n_full);
    uint8_t* whole = state_of(mem, KVC_SEQ_ALL, &n_whole);
    CHECK_ERR(kvc_state_seq_set_data(mem, partial, n_partial, 1, 0, NULL), KVC_ERR_CORRUPT_DATA, "");
    CHECK(same_state(mem, whole, n_whole)); /* written partial-only, read whole: refused, unchanged */
    CHECK_OK(kvc_state_seq_set_data(mem, partial, n_partial, 1, KVC_STATE_SEQ_FLAG_PARTIAL_ONLY, NULL));
    CHECK(pos_max(mem, 1) == 7);
    CHECK_OK(kvc_state_seq_set_data(mem, full, n_full, 1, 0, NULL));
    CHECK(pos_max(mem, 1) == 7);
    free(whole);
    whole = state_of(mem, KVC_SEQ_ALL, &n_whole);
    kvc_memory* other = NULL;
    CHECK_OK(kvc_iswa_create(&p, &other));
    CHECK_OK(kvc_state_seq_set_data(other, whole, n_whole, KVC_SEQ_ALL, 0, NULL));
    CHECK(same_state(other, whole, n_whole));
    kvc_memory_free(other);
    free(full);
    free(partial);
    free(whole);
    kvc_memory_free(mem);

    /* swa_full: both caches the same size, so positions can shift */
    p = toy_iswa_params(layers, true);
    CHECK_OK(kvc_iswa_create(&p, &mem));
    toy_init(&e, &g_iswa_model);
    CHECK_OK(kvc_memory_can_shift(mem, &can));
    CHECK(can);
    CHECK(kvc_memory_k_shift_elements(mem, 1) == 512);
    toy_decode_seq(&e, mem, 0, 0, 4, 8);
    CHECK_OK(kvc_memory_seq_add(mem, 0, 2, -1, 3));
    shift = malloc(sizeof(int32_t) * 512);
    CHECK_OK(kvc_memory_set_input_k_shift(mem, 3, shift, 512));
    CHECK(shift[1] == 0 && shift[2] == 3 && shift[3] == 3);
    free(shift);
    bool updated = false;
    CHECK_OK(kvc_memory_update(mem, false, &updated));
    CHECK(updated && pos_max(mem, 0) == 6);
    kvc_memory_free(mem);
}

/* -- hybrid -- */

/* Layers 0 and 2 recurrent, 1 and 3 attention (3 a sliding-window layer when iswa). */
static const toy_model g_hybrid_model = {4, 0xAu, 0x5u};

static kvc_hybrid_params toy_hybrid_params(kvc_layer_desc* attn, kvc_recurrent_layer_desc* recr, bool iswa) {
    toy_attn_layers(attn, 4, g_hybrid_model.attn, iswa ? 0x8u : 0u);
    toy_recr_layers(recr, 4, g_hybrid_model.recr);
    kvc_hybrid_params p = kvc_hybrid_default_params();
    p.attn.layers = attn;
    p.attn.n_layers = 4;
    p.attn.type_k = KVC_TYPE_F32;
    p.attn.type_v = KVC_TYPE_F32;
    p.attn.kv_size = 32;
    p.attn.n_seq_max = 2;
    p.attn.n_kv_pad = 4;
    p.recr.layers = recr;
    p.recr.n_layers = 4;
    p.recr.n_seq_max = 2;
    p.recr.n_rs_seq = 1;
    if (iswa) {
        p.iswa = true;
        p.attn.n_swa = 2;
        p.attn.swa_type = KVC_SWA_TYPE_STANDARD;
    }
    return p;
}

static void test_hybrid_create(void) {
    const kvc_hybrid_params d = kvc_hybrid_default_params();
    CHECK(!d.iswa && d.swa_full && d.n_ubatch == 512);
    CHECK(d.attn.layers == NULL && d.attn.kv_size == 4096 && d.recr.layers == NULL && d.recr.n_seq_max == 1);

    kvc_layer_desc attn[4];
    kvc_recurrent_layer_desc recr[4];
    kvc_hybrid_params p = toy_hybrid_params(attn, recr, false);
    kvc_memory* mem = (kvc_memory*)&g_checks;
    CHECK_ERR(kvc_hybrid_create(NULL, &mem), KVC_ERR_INVALID_ARGUMENT, "kvc_hybrid_create: params is NULL");
    CHECK(mem == NULL);
    CHECK_ERR(kvc_hybrid_create(&p, NULL), KVC_ERR_INVALID_ARGUMENT, "out is NULL");
    CHECK_ERR(kvc_hybrid_create(&d, &mem), KVC_ERR_INVALID_ARGUMENT, "params.attn.layers must list");
    p.recr.layers = NULL;
    CHECK_ERR(kvc_hybrid_create(&p, &mem), KVC_ERR_INVALID_ARGUMENT, "params.recr.layers must list");
    p = toy_hybrid_params(attn, recr, false);
    p.recr.type_s = (kvc_type)77;
    CHECK_ERR(kvc_hybrid_create(&p, &mem), KVC_ERR_INVALID_ARGUMENT, "params.recr.type_s = 77");
    p = toy_hybrid_params(attn, recr, false);
    p.recr.n_seq_max = 3;
    CHECK_ERR(kvc_hybrid_create(&p, &mem), KVC_ERR_INVALID_ARGUMENT, "n_seq_max");
    p = toy_hybrid_params(attn, recr, false);
    p.iswa = true; /* no window, no sliding-window layer */
    CHECK_ERR(kvc_hybrid_create(&p, &mem), KVC_ERR_INVALID_ARGUMENT, "kv_cache_iswa");
    CHECK(mem == NULL);

    p = toy_hybrid_params(attn, recr, false);
    CHECK_OK(kvc_hybrid_create(&p, &mem));
    CHECK(kind_of(mem) == KVC_MEMORY_KIND_HYBRID);
    kvc_memory_free(mem);
    p = toy_hybrid_params(attn, recr, true);
    CHECK_OK(kvc_hybrid_create(&p, &mem));
    CHECK(kind_of(mem) == KVC_MEMORY_KIND_HYBRID_ISWA);
    kvc_memory_free(mem);
}

static void test_hybrid(void) {
    static toy_engine e;
    toy_init(&e, &g_hybrid_model);
    kvc_layer_desc attn[4];
    kvc_recurrent_layer_desc recr[4];
    const kvc_hybrid_params p = toy_hybrid_params(attn, recr, false);
    kvc_memory* mem = NULL;
    CHECK_OK(kvc_hybrid_create(&p, &mem));
    CHECK(kvc_memory_k_shift_elements(mem, 1) == 32 && kvc_memory_k_shift_elements(mem, 3) == 32);
    CHECK(kvc_memory_k_shift_elements(mem, 0) == KVC_ERR_OUT_OF_RANGE); /* a recurrent layer */
    CHECK_MSG("kvc_memory_k_shift_elements: model layer 0 has no K/V in this memory");

    /* a batch the attention part has no room for: a failed context, nothing changed */
    size_t n_before = 0;
    uint8_t* before = state_of(mem, KVC_SEQ_ALL, &n_before);
    kvc_batch* b = toy_batch(1, 0, 40);
    kvc_memory_context* ctx = NULL;
    CHECK_OK(kvc_memory_init_batch(mem, b, 8, false, &ctx));
    kvc_batch_free(b);
    CHECK(status_of(ctx) == KVC_MEMORY_STATUS_FAILED_PREPARE);
    CHECK(kvc_memory_context_n_kv(ctx, 1) == KVC_ERR_INVALID_STATE);
    CHECK_MSG("the context failed");
    CHECK(kvc_memory_context_n_kv(ctx, 0) == KVC_ERR_OUT_OF_RANGE);
    kvc_tensor_view v;
    CHECK_ERR(kvc_memory_get_k(ctx, 1, &v), KVC_ERR_INVALID_STATE, "the context failed");
    kvc_rs_view rs;
    CHECK_ERR(kvc_memory_context_get_rs(ctx, &rs), KVC_ERR_INVALID_STATE,
              "kvc_memory_context_get_rs: the context failed (status KVC_MEMORY_STATUS_FAILED_PREPARE)");
    CHECK_OK(kvc_memory_get_r(ctx, 0, &v)); /* the tensors do not depend on the context */
    CHECK_ERR(kvc_memory_context_apply(ctx), KVC_ERR_INVALID_STATE, "failed context");
    kvc_memory_context_free(ctx);
    CHECK(same_state(mem, before, n_before));
    free(before);

    /* positions 0..4 in ubatches of 3 and 2, then one token inspected */
    toy_decode_seq(&e, mem, 0, 0, 5, 3);
    b = toy_batch(0, 5, 6);
    CHECK_OK(kvc_memory_init_batch(mem, b, 8, false, &ctx));
    kvc_batch_free(b);
    CHECK_OK(kvc_memory_context_apply(ctx));
    toy_layers(&e, ctx);
    CHECK_OK(kvc_memory_context_get_rs(ctx, &rs));
    CHECK(rs.n_seqs == 1 && rs.size == 2 && rs.n_rs_seq == 1);
    const int64_t n_kv = kvc_memory_context_n_kv(ctx, 1);
    CHECK(n_kv == 8 && kvc_memory_context_n_kv(ctx, 3) == n_kv);
    CHECK(kvc_memory_kq_mask_elements(ctx, 1) == n_kv && kvc_memory_kq_mask_elements(ctx, 3) == n_kv);
    float mask[8];
    CHECK_OK(kvc_memory_set_input_kq_mask(ctx, 1, KVC_TYPE_F32, mask, 8, true, false));
    check_mask_row(mask, n_kv, 5);
    check_toy_mask(ctx, 3, 0);
    int32_t buckets[8];
    CHECK_OK(kvc_memory_set_input_pos_bucket(ctx, 3, buckets, 8, 32));
    CHECK_OK(kvc_memory_get_k(ctx, 1, &v));
    CHECK(v.ne[2] == n_kv && k_at(&v, 0, 1, 5) == kv_value(1, 5, 4, 0));
    float rows[E] = {0};
    CHECK_ERR(kvc_memory_cpy_k(ctx, 0, rows, 1), KVC_ERR_OUT_OF_RANGE,
              "model layer 0 has no K/V in this memory");
    CHECK_ERR(kvc_memory_get_v(ctx, 2, &v), KVC_ERR_OUT_OF_RANGE, "model layer 2 has no K/V");
    CHECK_ERR(kvc_memory_get_r(ctx, 1, &v), KVC_ERR_OUT_OF_RANGE, "model layer 1 has no state");
    CHECK(!next_ubatch(ctx));
    kvc_memory_context_free(ctx);

    /* removing tokens is all or nothing: the recurrent part decides */
    bool removed = false;
    CHECK_OK(kvc_memory_seq_rm(mem, 0, 5, -1, &removed)); /* rollback of 1 */
    CHECK(removed && pos_max(mem, 0) == 4);
    before = state_of(mem, KVC_SEQ_ALL, &n_before);
    CHECK_OK(kvc_memory_seq_rm(mem, 0, 2, -1, &removed));
    CHECK(!removed && same_state(mem, before, n_before));
    free(before);
    toy_decode_seq(&e, mem, 0, 5, 6, 8);

    /* sequence 1 shares sequence 0; both continue */
    CHECK_OK(kvc_memory_seq_cp(mem, 0, 1, -1, -1));
    toy_copy_seq(&e, 0, 1);
    CHECK(pos_max(mem, 1) == 5);
    kvc_batch* two = kvc_batch_init(2, 0, 1);
    for (int32_t s = 0; s < 2; ++s) CHECK_OK(kvc_batch_add(two, toy_token(s, 6), 6, &s, 1, true));
    CHECK(toy_decode(&e, mem, two, 8));
    kvc_batch_free(two);
    CHECK(pos_max(mem, 0) == 6 && pos_max(mem, 1) == 6);

    /* state: partial-only is the recurrent part alone */
    size_t n_full = 0, n_partial = 0, n_whole = 0;
    uint8_t* full = state_of(mem, 0, &n_full);
    uint8_t* partial = state_with(mem, 0, KVC_STATE_SEQ_FLAG_PARTIAL_ONLY, &n_partial);
    CHECK(n_partial < n_full);
    uint8_t* whole = state_of(mem, KVC_SEQ_ALL, &n_whole);
    CHECK_ERR(kvc_state_seq_set_data(mem, partial, n_partial, 1, 0, NULL), KVC_ERR_CORRUPT_DATA, "");
    CHECK(same_state(mem, whole, n_whole));
    CHECK_OK(kvc_state_seq_set_data(mem, partial, n_partial, 1, KVC_STATE_SEQ_FLAG_PARTIAL_ONLY, NULL));
    toy_copy_seq(&e, 0, 1);
    CHECK(pos_max(mem, 1) == 6);
    kvc_memory* other = NULL;
    CHECK_OK(kvc_hybrid_create(&p, &other));
    CHECK_OK(kvc_state_seq_set_data(other, whole, n_whole, KVC_SEQ_ALL, 0, NULL));
    CHECK(same_state(other, whole, n_whole));
    static toy_engine e2;
    e2 = e;
    toy_decode_seq(&e2, other, 0, 7, 9, 8); /* the restored rows carry on */
    CHECK_OK(kvc_memory_clear(other, true));
    CHECK(pos_max(other, 0) == -1);
    CHECK_OK(kvc_state_seq_set_data(other, full, n_full, 1, 0, NULL));
    CHECK(pos_max(other, 1) == 6);
    kvc_memory_free(other);
    free(full);
    free(partial);
    free(whole);

    /* shifting: both parts */
    CHECK_OK(kvc_memory_seq_keep(mem, 1));
    CHECK_OK(kvc_memory_seq_add(mem, 1, 0, -1, 2));
    CHECK(pos_max(mem, 1) == 8 && kvc_memory_k_shift_elements(mem, 3) == 32);
    int32_t shift[32];
    CHECK_OK(kvc_memory_set_input_k_shift(mem, 1, shift, 32));
    CHECK_OK(kvc_memory_update(mem, false, NULL));
    kvc_memory_free(mem);
}

static void test_hybrid_iswa(void) {
    static toy_engine e;
    toy_init(&e, &g_hybrid_model);
    kvc_layer_desc attn[4];
    kvc_recurrent_layer_desc recr[4];
    const kvc_hybrid_params p = toy_hybrid_params(attn, recr, true);
    kvc_memory* mem = NULL;
    CHECK_OK(kvc_hybrid_create(&p, &mem));
    CHECK(kvc_memory_k_shift_elements(mem, 2) == KVC_ERR_OUT_OF_RANGE); /* a recurrent layer */
    CHECK(kvc_memory_k_shift_elements(mem, 1) == 32 && kvc_memory_k_shift_elements(mem, 3) == 32);

    kvc_memory_context* ctx = NULL;
    CHECK_OK(kvc_memory_init_full(mem, &ctx));
    CHECK(kvc_memory_context_n_kv(ctx, 1) == 32 && kvc_memory_context_n_kv(ctx, 3) == 32);
    kvc_rs_view rs;
    CHECK_OK(kvc_memory_context_get_rs(ctx, &rs));
    CHECK(rs.n_rs == 2 && rs.head == 0 && rs.s_copy[1] == 1);
    kvc_memory_context_free(ctx);

    toy_decode_seq(&e, mem, 0, 0, 5, 2);
    kvc_batch* b = toy_batch(0, 5, 7);
    CHECK_OK(kvc_memory_init_batch(mem, b, 8, false, &ctx));
    kvc_batch_free(b);
    CHECK_OK(kvc_memory_context_apply(ctx));
    toy_layers(&e, ctx);
    check_toy_mask(ctx, 1, 0);
    check_toy_mask(ctx, 3, 2); /* the window of 2 */
    CHECK(kvc_memory_context_n_kv(ctx, 0) == KVC_ERR_OUT_OF_RANGE);
    CHECK_MSG("kvc_memory_context_n_kv: model layer 0 has no K/V in this memory");
    float mask[64];
    CHECK_ERR(kvc_memory_set_input_kq_mask(ctx, 2, KVC_TYPE_F32, mask, 64, true, false), KVC_ERR_OUT_OF_RANGE,
              "kvc_memory_set_input_kq_mask: model layer 2 has no K/V");
    CHECK_ERR(kvc_memory_cpy_v(ctx, 2, mask, 2), KVC_ERR_OUT_OF_RANGE, "model layer 2 has no K/V");
    CHECK(!next_ubatch(ctx));
    kvc_memory_context_free(ctx);
    CHECK(pos_max(mem, 0) == 6);

    bool removed = false;
    CHECK_OK(kvc_memory_seq_rm(mem, 0, 6, -1, &removed));
    CHECK(removed && pos_max(mem, 0) == 5);
    toy_decode_seq(&e, mem, 0, 6, 8, 8);

    size_t n_full = 0, n_partial = 0;
    uint8_t* full = state_of(mem, 0, &n_full);
    uint8_t* partial = state_with(mem, 0, KVC_STATE_SEQ_FLAG_PARTIAL_ONLY, &n_partial);
    CHECK(n_partial < n_full);
    CHECK_OK(kvc_state_seq_set_data(mem, full, n_full, 1, 0, NULL));
    CHECK(pos_max(mem, 1) == 7);
    free(full);
    free(partial);
    kvc_memory_free(mem);
}

/* Functions of one kind of memory on another: an error, never a crash. */
static void test_wrong_kind(void) {
    kvc_memory* kv = small_cache(8, 1);
    CHECK(kind_of(kv) == KVC_MEMORY_KIND_KV_CACHE);
    kvc_memory_context* ctx = NULL;
    CHECK_OK(kvc_memory_init_full(kv, &ctx));
    kvc_rs_view rs;
    kvc_tensor_view v;
    CHECK_ERR(kvc_memory_context_get_rs(ctx, &rs), KVC_ERR_UNSUPPORTED,
              "kvc_memory_context_get_rs: this memory holds no recurrent state");
    CHECK_ERR(kvc_memory_get_r(ctx, 0, &v), KVC_ERR_UNSUPPORTED, "no recurrent state");
    CHECK_ERR(kvc_memory_get_s(ctx, 0, &v), KVC_ERR_UNSUPPORTED, "no recurrent state");
    CHECK(kvc_memory_context_n_kv(ctx, 1) == 8 && kvc_memory_context_n_kv(ctx, 2) == KVC_ERR_OUT_OF_RANGE);
    kvc_memory_context_free(ctx);
    CHECK(kvc_memory_k_shift_elements(kv, 1) == 8);
    kvc_memory_free(kv);

    kvc_memory_kind kind;
    CHECK_ERR(kvc_memory_get_kind(NULL, &kind), KVC_ERR_INVALID_ARGUMENT, "kvc_memory_get_kind: mem is NULL");
    kvc_memory* recr = toy_recurrent(1, 0);
    CHECK_ERR(kvc_memory_get_kind(recr, NULL), KVC_ERR_INVALID_ARGUMENT, "out is NULL");
    int32_t shift[4];
    CHECK_ERR(kvc_memory_set_input_k_shift(recr, 0, shift, 4), KVC_ERR_UNSUPPORTED, "no K/V");
    CHECK_ERR(kvc_memory_set_input_k_shift(recr, 1, shift, 4), KVC_ERR_UNSUPPORTED, "no K/V");
    kvc_memory_free(recr);
}

int main(void) {
    test_recurrent_create();
    test_recurrent_decode_and_rollback();
    test_recurrent_state();
    test_iswa();
    test_hybrid_create();
    test_hybrid();
    test_hybrid_iswa();
    test_wrong_kind();
    return capi_report("capi_memories");
}
