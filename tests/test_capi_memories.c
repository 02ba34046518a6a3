/* The C API of the recurrent and iSWA memories (kvc_recurrent_create, kvc_iswa_create), compiled as C11:
 * the toy model of capi_toy.h run by its toy engine, checked against the states it must reach; per-layer
 * inputs, rollback, partial-only states. The hybrid memory is in test_capi_hybrid.c. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kvcache/kvcache.h>

#include "capi_test.h"
#include "capi_toy.h"

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
    p.sizing.swa_full = swa_full;
    p.sizing.n_ubatch = 8; /* sliding-window cache: 4 * 2 + 8 cells, padded to 256 */
    return p;
}

static void test_iswa(void) {
    static toy_engine e;
    toy_init(&e, &g_iswa_model);
    const kvc_iswa_params d = kvc_iswa_default_params();
    CHECK(d.sizing.swa_full && d.sizing.n_ubatch == 512 && d.kv.kv_size == 4096 && d.kv.layers == NULL);
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
    CHECK_MSG("no model layer 4 (the model has 4)");
    int32_t* shift = malloc(sizeof(int32_t) * 512);
    CHECK_OK(kvc_memory_set_input_k_shift(mem, 1, shift, 256));
    CHECK_ERR(kvc_memory_set_input_k_shift(mem, 1, shift, 512), KVC_ERR_INVALID_ARGUMENT, "256");
    CHECK_ERR(kvc_memory_set_input_k_shift(mem, 1, NULL, 256), KVC_ERR_INVALID_ARGUMENT, "dst is NULL");
    CHECK_OK(kvc_memory_set_input_k_shift(mem, 0, shift, 512));
    CHECK_ERR(kvc_memory_set_input_k_shift(mem, 0, shift, 256), KVC_ERR_INVALID_ARGUMENT, "512");
    CHECK_ERR(kvc_memory_set_input_k_shift(mem, 4, shift, 512), KVC_ERR_OUT_OF_RANGE,
              "kvc_memory_set_input_k_shift: no model layer 4 (the model has 4)");
    free(shift);

    /* a full context: each cache's cells */
    kvc_memory_context* ctx = NULL;
    CHECK_OK(kvc_memory_init_full(mem, &ctx));
    CHECK(kvc_memory_context_n_kv(ctx, 0) == 512 && kvc_memory_context_n_kv(ctx, 1) == 256);
    CHECK(kvc_memory_context_n_kv(ctx, 4) == KVC_ERR_OUT_OF_RANGE);
    CHECK_MSG("kvc_memory_context_n_kv: no model layer 4 (the model has 4)");
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
    CHECK_MSG("kvc_memory_kq_mask_elements: no model layer 4");
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
    CHECK_ERR(kvc_memory_cpy_k(ctx, 4, rows, 2), KVC_ERR_OUT_OF_RANGE, "no model layer 4");
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

int main(void) {
    test_recurrent_create();
    test_recurrent_decode_and_rollback();
    test_recurrent_state();
    test_iswa();
    return capi_report("capi_memories");
}
