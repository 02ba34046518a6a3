/* The C API of the hybrid memory (kvc_hybrid_create), compiled as C11: the toy model of capi_toy.h with
 * attention and recurrent layers (plain and iSWA attention), checked against the states it must reach;
 * wrong kinds of memory and context. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kvcache/kvcache.h>

#include "capi_test.h"
#include "capi_toy.h"

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
    CHECK(!d.iswa && d.sizing.swa_full && d.sizing.n_ubatch == 512);
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
    test_hybrid_create();
    test_hybrid();
    test_hybrid_iswa();
    test_wrong_kind();
    return capi_report("capi_hybrid");
}
