/* The toy model and toy engine of the C tests of the memories beyond the KV cache (test_capi_memories.c,
 * test_capi_hybrid.c): a model whose layers have K/V, recurrent state or both, and an engine that follows
 * each memory's contract through the C API. */
#ifndef KVC_TESTS_CAPI_TOY_H
#define KVC_TESTS_CAPI_TOY_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kvcache/kvcache.h>

#include "capi_test.h"

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

static inline void toy_init(toy_engine* e, const toy_model* m) {
    memset(e, 0, sizeof *e);
    e->m = m;
}

static inline void toy_copy_seq(toy_engine* e, int32_t src, int32_t dst) {
    memcpy(e->r[dst], e->r[src], sizeof e->r[dst]);
    memcpy(e->s[dst], e->s[src], sizeof e->s[dst]);
}

/* Tokens differ between sequences, so that their states do. */
static inline int32_t toy_token(int32_t seq, int32_t pos) {
    return 1 + pos + 16 * seq;
}

/* Positions [p0, p1) of one sequence with toy tokens, the last one an output. */
static inline kvc_batch* toy_batch(int32_t seq, int32_t p0, int32_t p1) {
    kvc_batch* b = kvc_batch_init(p1 - p0, 0, 1);
    CHECK(b != NULL);
    for (int32_t p = p0; p < p1; ++p) CHECK_OK(kvc_batch_add(b, toy_token(seq, p), p, &seq, 1, p == p1 - 1));
    return b;
}

static inline void toy_attn_layers(kvc_layer_desc* layers, uint32_t n, uint32_t attn, uint32_t swa) {
    for (uint32_t il = 0; il < n; ++il) {
        layers[il] = kvc_layer_desc_default();
        layers[il].n_head_kv = 2;
        layers[il].n_embd_head_k = 4;
        layers[il].n_embd_head_v = 4;
        layers[il].has_kv = (attn >> il) & 1u;
        layers[il].is_swa = (swa >> il) & 1u;
    }
}

static inline void toy_recr_layers(kvc_recurrent_layer_desc* layers, uint32_t n, uint32_t recr) {
    for (uint32_t il = 0; il < n; ++il) {
        layers[il].n_embd_r = (recr >> il) & 1u ? R : 0;
        layers[il].n_embd_s = (recr >> il) & 1u ? S : 0;
    }
}

/* The toy recurrence of layer il folds a token into (r, s): r = (token, token + il) (the last token),
 * s[e] += token (e + 1) + il (a running sum). */
static inline void toy_step(uint32_t il, int32_t token, float* r, float* s) {
    r[0] = (float)token;
    r[1] = (float)(token + (int)il);
    for (int e = 0; e < S; ++e) s[e] += (float)(token * (e + 1) + (int)il);
}

/* Row `row` (plane * size + cell) of an r or s tensor [n_embd, size, planes] of f32. */
static inline float* rs_row(const kvc_tensor_view* t, int64_t row, uint32_t size) {
    return (float*)((char*)t->data + (size_t)(row % size) * t->nb[1] + (size_t)(row / size) * t->nb[2]);
}

/* Layer il of the current (applied) ubatch, as an engine runs a recurrent layer: the contract of
 * kvcache.h step by step; each block's initial state is checked against the reference. */
static inline void toy_recurrent_layer(toy_engine* en, kvc_memory_context* ctx, const kvc_ubatch_view* ub,
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
            for (size_t q = 0; q < rs.n_snaps; ++q) /* snapshots: rows after the planes */
                if (rs.snaps[q].block == b && rs.snaps[q].token == t) {
                    memcpy((char*)tr.data + (size_t)rs.snaps[q].dst * tr.nb[1], gr[b], sizeof gr[b]);
                    memcpy((char*)ts.data + (size_t)rs.snaps[q].dst * ts.nb[1], gs[b], sizeof gs[b]);
                }
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
static inline void toy_attention_layer(kvc_memory_context* ctx, const kvc_ubatch_view* ub, uint32_t il) {
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
static inline void toy_layers(toy_engine* e, kvc_memory_context* ctx) {
    kvc_ubatch_view ub;
    CHECK_OK(kvc_memory_context_get_ubatch(ctx, &ub));
    for (uint32_t il = 0; il < e->m->n_layers; ++il) {
        if ((e->m->attn >> il) & 1u) toy_attention_layer(ctx, &ub, il);
        if ((e->m->recr >> il) & 1u) toy_recurrent_layer(e, ctx, &ub, il);
    }
}

/* Decodes a batch through the toy model; false (nothing changed) when it does not fit. */
static inline bool toy_decode(toy_engine* e, kvc_memory* mem, const kvc_batch* batch, uint32_t n_ubatch) {
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
static inline void toy_decode_seq(toy_engine* e, kvc_memory* mem, int32_t seq, int32_t p0, int32_t p1,
                                  uint32_t n_ubatch) {
    kvc_batch* b = toy_batch(seq, p0, p1);
    CHECK(toy_decode(e, mem, b, n_ubatch));
    kvc_batch_free(b);
}

/* The mask of attention layer il for the current ubatch (one sequence): cell c is visible to token t when
 * it holds a position p <= pos[t] (and p > pos[t] - n_swa when n_swa > 0). Cell positions are read back
 * from the layer's K rows (channel 1 of kv_value; 0: an empty cell of a fresh cache). */
static inline void check_toy_mask(kvc_memory_context* ctx, uint32_t il, int32_t n_swa) {
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
static inline uint8_t* state_with(const kvc_memory* mem, int32_t seq, uint32_t flags, size_t* size) {
    size_t n = 0, written = 0;
    CHECK_OK(kvc_state_seq_get_size(mem, seq, flags, &n));
    uint8_t* buf = malloc(n);
    CHECK_OK(kvc_state_seq_get_data(mem, seq, buf, n, &written, flags));
    CHECK(written == n);
    *size = n;
    return buf;
}

static inline int32_t pos_max(const kvc_memory* mem, int32_t seq) {
    int32_t pos = -2;
    CHECK_OK(kvc_memory_seq_pos_max(mem, seq, &pos));
    return pos;
}

static inline kvc_memory_kind kind_of(const kvc_memory* mem) {
    kvc_memory_kind kind = (kvc_memory_kind)-1;
    CHECK_OK(kvc_memory_get_kind(mem, &kind));
    return kind;
}

/* -- a recurrent memory of the toy model -- */

static const toy_model g_recr_model = {3, 0u, 0x5u}; /* layers 0 and 2 recurrent, layer 1 neither */

static inline kvc_memory* toy_recurrent(uint32_t n_seq_max, uint32_t n_rs_seq) {
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

#endif
