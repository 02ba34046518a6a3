/* The C API (include/kvcache/kvcache.h) over a KV cache, compiled as C11: every function, its error paths
 * (NULL handles, bad ids, small buffers, bad state bytes with the memory unchanged, a batch that does not
 * fit), a full decode loop with the values read back, and kvc_last_error. The runner and fixtures are in
 * capi_test.h; state buffers and files are in test_capi_state.c, the other memories in
 * test_capi_memories.c. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <kvcache/kvcache.h>
#include <kvcache/version.h>

#include "capi_test.h"

/* -- errors, version, types -- */

static void test_errors_and_version(void) {
    CHECK(strcmp(kvc_last_error(), "") == 0); /* nothing failed on this thread yet */
    CHECK(strcmp(kvc_status_string(KVC_OK), "ok") == 0);
    CHECK(strcmp(kvc_status_string(KVC_ERR_INVALID_ARGUMENT), "invalid_argument") == 0);
    CHECK(strcmp(kvc_status_string(KVC_ERR_OUT_OF_RANGE), "out_of_range") == 0);
    CHECK(strcmp(kvc_status_string(KVC_ERR_INVALID_STATE), "invalid_state") == 0);
    CHECK(strcmp(kvc_status_string(KVC_ERR_CORRUPT_DATA), "corrupt_data") == 0);
    CHECK(strcmp(kvc_status_string(KVC_ERR_UNSUPPORTED), "unsupported") == 0);
    CHECK(strcmp(kvc_status_string(KVC_ERR_IO), "io") == 0);
    CHECK(strcmp(kvc_status_string(KVC_ERR_OUT_OF_MEMORY), "out_of_memory") == 0);
    CHECK(strcmp(kvc_status_string(KVC_ERR_INTERNAL), "internal") == 0);
    CHECK(strcmp(kvc_status_string((kvc_status)12345), "unknown") == 0);
    CHECK(strcmp(kvc_status_string((kvc_status)-12345), "unknown") == 0);
    CHECK(strcmp(kvc_version_string(), KVC_VERSION_STRING) == 0);

    /* the message names the function and the parameter; successes keep it; clear forgets it */
    CHECK_ERR(kvc_memory_clear(NULL, false), KVC_ERR_INVALID_ARGUMENT, "kvc_memory_clear: mem is NULL");
    CHECK(strncmp(kvc_last_error(), "kvc_memory_clear: ", 18) == 0);
    CHECK(kvc_row_size(KVC_TYPE_F32, 4) == 16);
    CHECK(strcmp(kvc_last_error(), "kvc_memory_clear: mem is NULL") == 0);
    kvc_clear_last_error();
    CHECK(strcmp(kvc_last_error(), "") == 0);
}

static void test_types(void) {
    CHECK(strcmp(kvc_type_name(KVC_TYPE_F32), "f32") == 0);
    CHECK(strcmp(kvc_type_name(KVC_TYPE_F16), "f16") == 0);
    CHECK(strcmp(kvc_type_name(KVC_TYPE_BF16), "bf16") == 0);
    CHECK(strcmp(kvc_type_name(KVC_TYPE_Q8_0), "q8_0") == 0);
    CHECK(strcmp(kvc_type_name(KVC_TYPE_Q4_0), "q4_0") == 0);
    CHECK(kvc_type_name((kvc_type)3) == NULL); /* ggml's q4_1: not supported */
    CHECK_MSG("kvc_type_name: type = 3 is not an element type");
    CHECK(kvc_type_name((kvc_type)-7) == NULL);
    CHECK(kvc_type_name((kvc_type)1000000) == NULL);

    CHECK(kvc_type_block_size(KVC_TYPE_F16) == 1);
    CHECK(kvc_type_block_size(KVC_TYPE_Q8_0) == 32);
    CHECK(kvc_type_block_size((kvc_type)99) == KVC_ERR_INVALID_ARGUMENT);

    CHECK(kvc_row_size(KVC_TYPE_F32, 8) == 32);
    CHECK(kvc_row_size(KVC_TYPE_F16, 8) == 16);
    CHECK(kvc_row_size(KVC_TYPE_BF16, 8) == 16);
    CHECK(kvc_row_size(KVC_TYPE_Q8_0, 64) == 68);
    CHECK(kvc_row_size(KVC_TYPE_Q4_0, 32) == 18);
    CHECK(kvc_row_size(KVC_TYPE_F32, 0) == 0);
    CHECK(kvc_row_size(KVC_TYPE_Q8_0, 31) == KVC_ERR_INVALID_ARGUMENT);
    CHECK_MSG("kvc_row_size: ");
    CHECK(kvc_row_size(KVC_TYPE_F32, -1) == KVC_ERR_INVALID_ARGUMENT);
    CHECK(kvc_row_size((kvc_type)5, 32) == KVC_ERR_INVALID_ARGUMENT);
}

/* -- creation -- */

static uint32_t g_filter_calls = 0;

static bool keep_even_layers(uint32_t il, void* user_data) {
    ++*(uint32_t*)user_data;
    return il % 2 == 0;
}

static void test_create(void) {
    const kvc_kv_cache_params d = kvc_kv_cache_default_params();
    CHECK(d.layers == NULL && d.n_layers == 0 && d.layer_filter == NULL);
    CHECK(d.type_k == KVC_TYPE_F16 && d.type_v == KVC_TYPE_F16 && d.v_trans);
    CHECK(d.kv_size == 4096 && d.n_seq_max == 1 && d.unified && d.n_pad == 1 && d.n_kv_pad == 256);
    CHECK(d.n_swa == 0 && d.swa_type == KVC_SWA_TYPE_NONE && d.n_pos == 1 && d.compact_threshold == 0.0f);
    const kvc_layer_desc l = kvc_layer_desc_default();
    CHECK(l.n_head_kv == 1 && l.n_embd_head_k == 0 && l.has_kv && !l.is_swa);
    CHECK(l.rope.type == KVC_ROPE_TYPE_NORMAL && l.rope.freq_base == 10000.0f && l.rope.freq_scale == 1.0f);

    kvc_memory* mem = (kvc_memory*)&g_checks; /* garbage: must be set to NULL on failure */
    CHECK_ERR(kvc_kv_cache_create(NULL, &mem), KVC_ERR_INVALID_ARGUMENT, "params is NULL");
    CHECK(mem == NULL);
    kvc_kv_cache_params p = small_params(16, 1);
    CHECK_ERR(kvc_kv_cache_create(&p, NULL), KVC_ERR_INVALID_ARGUMENT, "out is NULL");
    CHECK_ERR(kvc_kv_cache_create(&d, &mem), KVC_ERR_INVALID_ARGUMENT, "params.layers");

    p = small_params(16, 1);
    p.kv_size = 0;
    CHECK_ERR(kvc_kv_cache_create(&p, &mem), KVC_ERR_INVALID_ARGUMENT, "kv_size must be positive");
    p = small_params(16, 1);
    p.type_v = KVC_TYPE_Q8_0; /* quantized V must not be transposed */
    CHECK_ERR(kvc_kv_cache_create(&p, &mem), KVC_ERR_INVALID_ARGUMENT, "transposed V");
    p = small_params(16, 1);
    p.type_k = (kvc_type)77;
    CHECK_ERR(kvc_kv_cache_create(&p, &mem), KVC_ERR_INVALID_ARGUMENT, "params.type_k = 77");
    p = small_params(16, 1);
    p.swa_type = (kvc_swa_type)9;
    CHECK_ERR(kvc_kv_cache_create(&p, &mem), KVC_ERR_INVALID_ARGUMENT, "params.swa_type = 9");
    p = small_params(16, 1);
    g_layers[1].rope.type = (kvc_rope_type)-3;
    CHECK_ERR(kvc_kv_cache_create(&p, &mem), KVC_ERR_INVALID_ARGUMENT, "layers[1].rope.type = -3");
    p = small_params(16, 1);
    g_layers[0].n_embd_head_k = 3; /* odd n_rot with normal RoPE */
    CHECK_ERR(kvc_kv_cache_create(&p, &mem), KVC_ERR_INVALID_ARGUMENT, "layer 0");
    CHECK(mem == NULL);

    /* a filter keeps layers 0 and 2 of 3: layer 1 has no K/V */
    kvc_layer_desc three[3];
    for (int il = 0; il < 3; ++il) {
        three[il] = kvc_layer_desc_default();
        three[il].n_embd_head_k = three[il].n_embd_head_v = 8;
    }
    p = small_params(16, 1);
    p.layers = three;
    p.n_layers = 3;
    p.layer_filter = keep_even_layers;
    p.layer_filter_user_data = &g_filter_calls;
    p.type_k = KVC_TYPE_Q8_0; /* 8 values are not a whole q8_0 block */
    CHECK_ERR(kvc_kv_cache_create(&p, &mem), KVC_ERR_INVALID_ARGUMENT, "q8_0");
    p.type_k = KVC_TYPE_F16;
    g_filter_calls = 0;
    CHECK_OK(kvc_kv_cache_create(&p, &mem));
    CHECK(g_filter_calls == 3);
    kvc_memory_context* full = NULL;
    CHECK_OK(kvc_memory_init_full(mem, &full));
    kvc_tensor_view v;
    CHECK_OK(kvc_memory_get_k(full, 0, &v));
    CHECK(v.type == KVC_TYPE_F16 && v.ne[0] == 8 && v.ne[1] == 1 && v.ne[2] == 16 && v.ne[3] == 1);
    CHECK_OK(kvc_memory_get_k(full, 2, &v));
    CHECK_ERR(kvc_memory_get_k(full, 1, &v), KVC_ERR_OUT_OF_RANGE, "model layer 1 has no K/V");
    CHECK_ERR(kvc_memory_get_v(full, 3, &v), KVC_ERR_OUT_OF_RANGE, "no model layer 3 (the model has 3)");
    kvc_memory_context_free(full);
    kvc_memory_free(mem);
    kvc_memory_free(NULL); /* harmless */
}

/* -- limits (issue 21) -- */

static void test_limits(void) {
    const kvc_limits d = kvc_get_limits();
    CHECK(d.file_bytes == 0 && d.metadata_bytes == (1ull << 30) && d.batch_tokens == (1u << 20) &&
          d.sequences == 65536 && d.memory_bytes == 0);
    /* kvc_batch_init(INT32_MAX, 0, INT32_MAX) zero-filled 14.8 GB before anyone stopped it */
    CHECK(kvc_batch_init(INT32_MAX, 0, INT32_MAX) == NULL);
    CHECK_MSG(
        "kvc_batch_init: batch::init: n_tokens_alloc: 2147483647, over the limit batch_tokens of 1048576");

    kvc_limits l = d;
    l.batch_tokens = 16;
    kvc_limits old;
    CHECK_OK(kvc_set_limits(&l, &old));
    CHECK(old.batch_tokens == d.batch_tokens);
    CHECK(kvc_get_limits().batch_tokens == 16);
    CHECK(kvc_batch_init(17, 0, 1) == NULL);
    CHECK_MSG("over the limit batch_tokens of 16");
    kvc_batch* b = kvc_batch_init(16, 0, 1);
    CHECK(b != NULL);
    kvc_batch_free(b);

    l.sequences = 0; /* refused: nothing changes */
    CHECK_ERR(kvc_set_limits(&l, NULL), KVC_ERR_INVALID_ARGUMENT, "sequences (0) must be at least 1");
    CHECK_ERR(kvc_set_limits(NULL, NULL), KVC_ERR_INVALID_ARGUMENT, "limits is NULL");
    CHECK(kvc_get_limits().sequences == 65536 && kvc_get_limits().batch_tokens == 16);
    CHECK_OK(kvc_set_limits(&d, NULL));
}

/* -- batches -- */

static void test_batch(void) {
    CHECK(kvc_batch_init(0, 0, 1) == NULL);
    CHECK_MSG("kvc_batch_init: ");
    CHECK(kvc_batch_init(4, -1, 1) == NULL);
    CHECK(kvc_batch_init(4, 0, 0) == NULL);

    kvc_batch* b = kvc_batch_init(2, 0, 2);
    CHECK(b != NULL);
    CHECK(kvc_batch_n_tokens(b) == 0 && kvc_batch_capacity(b) == 2);
    const int32_t seqs[3] = {0, 1, 0};
    CHECK_OK(kvc_batch_add(b, 7, 0, seqs, 2, false));
    CHECK_ERR(kvc_batch_add(b, 8, 1, NULL, 1, false), KVC_ERR_INVALID_ARGUMENT, "seq_ids is NULL");
    CHECK_ERR(kvc_batch_add(b, 8, 1, seqs, 0, false), KVC_ERR_INVALID_ARGUMENT, "0 sequence ids");
    CHECK_ERR(kvc_batch_add(b, 8, 1, seqs, 3, false), KVC_ERR_INVALID_ARGUMENT, "3 sequence ids");
    const float row[4] = {1, 2, 3, 4};
    CHECK_ERR(kvc_batch_add_embd(b, row, 1, seqs, 1, false), KVC_ERR_INVALID_ARGUMENT, "holds tokens");
    CHECK(kvc_batch_n_tokens(b) == 1); /* failures changed nothing */
    CHECK_OK(kvc_batch_add(b, 8, 1, seqs, 1, false));
    CHECK_ERR(kvc_batch_add(b, 9, 2, seqs, 1, false), KVC_ERR_OUT_OF_RANGE, "full");
    CHECK_OK(kvc_batch_set_output(b, 1, true));
    CHECK_ERR(kvc_batch_set_output(b, 2, true), KVC_ERR_OUT_OF_RANGE, "token 2");
    CHECK_ERR(kvc_batch_set_output(b, -1, true), KVC_ERR_OUT_OF_RANGE, "token -1");
    CHECK(kvc_batch_n_tokens(b) == 2);
    CHECK_OK(kvc_batch_clear(b));
    CHECK(kvc_batch_n_tokens(b) == 0 && kvc_batch_capacity(b) == 2);
    kvc_batch_free(b);

    kvc_batch* e = kvc_batch_init(2, 4, 1);
    CHECK(e != NULL);
    CHECK_OK(kvc_batch_add_embd(e, row, 0, seqs, 1, true));
    CHECK_ERR(kvc_batch_add_embd(e, NULL, 1, seqs, 1, true), KVC_ERR_INVALID_ARGUMENT, "embd is NULL");
    CHECK_ERR(kvc_batch_add(e, 5, 1, seqs, 1, true), KVC_ERR_INVALID_ARGUMENT, "holds embeddings");
    CHECK(kvc_batch_n_tokens(e) == 1);
    kvc_batch_free(e);

    const int32_t toks[3] = {5, 6, 7};
    CHECK(kvc_batch_get_one(NULL, 3) == NULL);
    CHECK_MSG("kvc_batch_get_one: tokens is NULL");
    CHECK(kvc_batch_get_one(toks, 0) == NULL);
    CHECK_MSG("n_tokens = 0");
    kvc_batch* one = kvc_batch_get_one(toks, 3);
    CHECK(one != NULL);
    CHECK(kvc_batch_n_tokens(one) == 3 && kvc_batch_capacity(one) == 3);
    CHECK_ERR(kvc_batch_add(one, 1, 3, seqs, 1, false), KVC_ERR_INVALID_ARGUMENT, "kvc_batch_get_one");
    CHECK_ERR(kvc_batch_clear(one), KVC_ERR_INVALID_ARGUMENT, "kvc_batch_get_one");
    CHECK_ERR(kvc_batch_set_output(one, 0, true), KVC_ERR_INVALID_ARGUMENT, "kvc_batch_get_one");
    kvc_batch_free(one);

    CHECK(kvc_batch_n_tokens(NULL) == KVC_ERR_INVALID_ARGUMENT);
    CHECK_MSG("kvc_batch_n_tokens: batch is NULL");
    CHECK(kvc_batch_capacity(NULL) == KVC_ERR_INVALID_ARGUMENT);
    CHECK_ERR(kvc_batch_add(NULL, 1, 0, seqs, 1, false), KVC_ERR_INVALID_ARGUMENT, "batch is NULL");
    CHECK_ERR(kvc_batch_add_embd(NULL, row, 0, seqs, 1, false), KVC_ERR_INVALID_ARGUMENT, "batch is NULL");
    CHECK_ERR(kvc_batch_clear(NULL), KVC_ERR_INVALID_ARGUMENT, "batch is NULL");
    CHECK_ERR(kvc_batch_set_output(NULL, 0, true), KVC_ERR_INVALID_ARGUMENT, "batch is NULL");
    kvc_batch_free(NULL);
}

/* -- the decode loop -- */

static void test_decode_loop(void) {
    kvc_memory* mem = small_cache(16, 2);
    kvc_batch* b = seq_batch(0, 0, 5); /* positions 0..4, output for the last */
    kvc_memory_context* ctx = NULL;
    CHECK_OK(kvc_memory_init_batch(mem, b, 3, false, &ctx));
    kvc_batch_free(b); /* the context copied what it needs */
    CHECK(status_of(ctx) == KVC_MEMORY_STATUS_SUCCESS);

    const int32_t* out_ids = NULL;
    size_t n_out = 0;
    CHECK_OK(kvc_memory_context_out_ids(ctx, &out_ids, &n_out));
    CHECK(n_out == 1 && out_ids[0] == 4);

    float rows[5 * E];
    int ubatch = 0;
    int32_t first_pos = 0;
    do {
        kvc_ubatch_view ub;
        CHECK_OK(kvc_memory_context_get_ubatch(ctx, &ub));
        CHECK(kvc_memory_context_n_tokens(ctx) == (ubatch == 0 ? 3 : 2));
        CHECK(ub.n_tokens == (ubatch == 0 ? 3u : 2u) && ub.n_pos == 1 && ub.n_embd == 0 && ub.embd == NULL);
        CHECK(ub.token != NULL && ub.token[0] == 100 + first_pos && ub.pos[0] == first_pos);
        CHECK(ub.n_seq_id[0] == 1 && ub.seq_id_data[ub.seq_id_begin[0]] == 0 && ub.n_seqs_unq == 1 &&
              ub.seq_id_unq[0] == 0);
        CHECK(ub.batch_idx[0] == first_pos);
        CHECK(ub.output[ub.n_tokens - 1] == (ubatch == 1));

        /* nothing refers to a ubatch before it is applied */
        CHECK_ERR(kvc_memory_cpy_k(ctx, 0, rows, ub.n_tokens), KVC_ERR_INVALID_STATE,
                  "kvc_memory_cpy_k: cpy_k: apply() the current ubatch first");
        CHECK(kvc_memory_kq_mask_elements(ctx, 0) == KVC_ERR_INVALID_STATE);
        CHECK_MSG("kvc_memory_kq_mask_elements: kq_mask_elements: apply() the current ubatch first");
        CHECK(kvc_memory_context_n_kv(ctx, 1) == 0);
        kvc_tensor_view v;
        CHECK_ERR(kvc_memory_get_k(ctx, 0, &v), KVC_ERR_INVALID_STATE,
                  "kvc_memory_get_k: get_k: apply() the current ubatch first");
        float m0[4];
        CHECK_ERR(kvc_memory_set_input_kq_mask(ctx, 0, KVC_TYPE_F32, m0, 4, true, false),
                  KVC_ERR_INVALID_STATE, "apply() the current ubatch first");

        CHECK_OK(kvc_memory_context_apply(ctx));
        CHECK_ERR(kvc_memory_context_apply(ctx), KVC_ERR_INVALID_STATE, "already applied");
        const int64_t n_kv = kvc_memory_context_n_kv(ctx, 0);
        CHECK(n_kv == (ubatch == 0 ? 4 : 8)); /* used cells padded to n_kv_pad 4 */

        for (uint32_t il = 0; il < 2; ++il) {
            for (uint32_t t = 0; t < ub.n_tokens; ++t)
                for (int e = 0; e < E; ++e) rows[t * E + e] = kv_value(il, ub.pos[t], e, 0);
            CHECK_OK(kvc_memory_cpy_k(ctx, il, rows, ub.n_tokens));
            for (uint32_t t = 0; t < ub.n_tokens; ++t)
                for (int e = 0; e < E; ++e) rows[t * E + e] = kv_value(il, ub.pos[t], e, 1);
            CHECK_OK(kvc_memory_cpy_v(ctx, il, rows, ub.n_tokens));
        }
        CHECK_ERR(kvc_memory_cpy_k(ctx, 0, rows, ub.n_tokens + 1), KVC_ERR_INVALID_ARGUMENT,
                  "cpy_k: expected");
        CHECK_ERR(kvc_memory_cpy_v(ctx, 0, rows, 0), KVC_ERR_INVALID_ARGUMENT, "cpy_v: expected");
        CHECK_ERR(kvc_memory_cpy_k(ctx, 5, rows, ub.n_tokens), KVC_ERR_OUT_OF_RANGE, "model layer 5");
        CHECK_ERR(kvc_memory_cpy_v(ctx, 0, NULL, ub.n_tokens), KVC_ERR_INVALID_ARGUMENT, "src is NULL");

        /* K: [4 values, 2 heads, n_kv cells, 1 stream]; a fresh cache fills cells 0, 1, 2, ... */
        CHECK_OK(kvc_memory_get_k(ctx, 1, &v));
        CHECK(v.type == KVC_TYPE_F32 && v.ne[0] == 4 && v.ne[1] == 2 && v.ne[2] == n_kv && v.ne[3] == 1);
        CHECK(v.nb[0] == 4 && v.nb[1] == 16 && v.nb[2] == 32 && v.nb[3] == 32 * 16);
        for (uint32_t t = 0; t < ub.n_tokens; ++t) {
            const int32_t p = ub.pos[t];
            for (int h = 0; h < 2; ++h)
                for (int dd = 0; dd < 4; ++dd) CHECK(k_at(&v, dd, h, p) == kv_value(1, p, h * 4 + dd, 0));
        }
        /* V transposed: [n_kv cells, 2 heads, 4 values, 1 stream], cells fastest */
        CHECK_OK(kvc_memory_get_v(ctx, 0, &v));
        CHECK(v.ne[0] == n_kv && v.ne[1] == 2 && v.ne[2] == 4 && v.ne[3] == 1 && v.nb[0] == 4);
        for (int32_t p = 0; p < first_pos + (int32_t)ub.n_tokens; ++p)
            for (int h = 0; h < 2; ++h)
                for (int dd = 0; dd < 4; ++dd) {
                    float x;
                    memcpy(&x, (const char*)v.data + p * v.nb[0] + h * v.nb[1] + dd * v.nb[2], sizeof x);
                    CHECK(x == kv_value(0, p, h * 4 + dd, 1));
                }

        /* masks: token at position p sees cells 0..p (causal) or every cell of its sequence */
        const int64_t n_mask = kvc_memory_kq_mask_elements(ctx, 0);
        CHECK(n_mask == n_kv * (int64_t)ub.n_tokens);
        float mask[8 * 3];
        uint16_t mask16[8 * 3];
        CHECK_OK(kvc_memory_set_input_kq_mask(ctx, 0, KVC_TYPE_F32, mask, (size_t)n_mask, true, false));
        for (uint32_t t = 0; t < ub.n_tokens; ++t) check_mask_row(mask + t * n_kv, n_kv, ub.pos[t]);
        CHECK_OK(kvc_memory_set_input_kq_mask(ctx, 0, KVC_TYPE_F32, mask, (size_t)n_mask, false, false));
        for (uint32_t t = 0; t < ub.n_tokens; ++t)
            check_mask_row(mask + t * n_kv, n_kv, first_pos + (int32_t)ub.n_tokens - 1);
        CHECK_OK(
            kvc_memory_set_input_kq_mask(ctx, 0, KVC_TYPE_F32, mask, (size_t)n_mask, true, true)); /* ALiBi */
        CHECK(mask[(ub.n_tokens - 1) * n_kv] == -(float)ub.pos[ub.n_tokens - 1]);
        CHECK_OK(kvc_memory_set_input_kq_mask(ctx, 0, KVC_TYPE_F16, mask16, (size_t)n_mask, true, false));
        CHECK(mask16[0] == 0x0000 && mask16[n_kv - 1] == 0xFC00);
        CHECK_ERR(kvc_memory_set_input_kq_mask(ctx, 0, KVC_TYPE_F32, mask, (size_t)n_mask - 1, true, false),
                  KVC_ERR_INVALID_ARGUMENT, "contiguous elements");
        CHECK_ERR(kvc_memory_set_input_kq_mask(ctx, 0, KVC_TYPE_F32, NULL, (size_t)n_mask, true, false),
                  KVC_ERR_INVALID_ARGUMENT, "dst is NULL");
        CHECK_ERR(kvc_memory_set_input_kq_mask(ctx, 1, KVC_TYPE_F16, mask16, 1, true, false),
                  KVC_ERR_INVALID_ARGUMENT, "kvc_memory_set_input_kq_mask: ");
        CHECK_ERR(kvc_memory_set_input_kq_mask(ctx, 0, KVC_TYPE_Q8_0, mask, (size_t)n_mask, true, false),
                  KVC_ERR_INVALID_ARGUMENT,
                  "type = 8 (q8_0) is not a mask type (KVC_TYPE_F32 or KVC_TYPE_F16)");
        CHECK_ERR(kvc_memory_set_input_kq_mask(ctx, 0, (kvc_type)77, mask, (size_t)n_mask, true, false),
                  KVC_ERR_INVALID_ARGUMENT, "type = 77 is not an element type");
        CHECK_ERR(kvc_memory_set_input_kq_mask(ctx, 2, KVC_TYPE_F32, mask, (size_t)n_mask, true, false),
                  KVC_ERR_OUT_OF_RANGE, "no model layer 2 (the model has 2)");
        CHECK(kvc_memory_kq_mask_elements(ctx, 1) == n_mask); /* the layers of a cache share it */
        CHECK(kvc_memory_kq_mask_elements(ctx, 2) == KVC_ERR_OUT_OF_RANGE);
        CHECK(kvc_memory_context_n_kv(ctx, 1) == n_kv &&
              kvc_memory_context_n_kv(ctx, 2) == KVC_ERR_OUT_OF_RANGE);

        int32_t buckets[8 * 3];
        CHECK_OK(kvc_memory_set_input_pos_bucket(ctx, 0, buckets, (size_t)n_mask, 32));
        CHECK(buckets[0 * n_kv + ub.pos[0]] == 0); /* relative position 0 */
        CHECK_ERR(kvc_memory_set_input_pos_bucket(ctx, 0, buckets, 3, 32), KVC_ERR_INVALID_ARGUMENT,
                  "pos_bucket");
        CHECK_ERR(kvc_memory_set_input_pos_bucket(ctx, 0, NULL, 3, 32), KVC_ERR_INVALID_ARGUMENT,
                  "dst is NULL");
        CHECK_ERR(kvc_memory_set_input_pos_bucket(ctx, 3, buckets, (size_t)n_mask, 32), KVC_ERR_OUT_OF_RANGE,
                  "model layer 3");

        first_pos += (int32_t)ub.n_tokens;
        ++ubatch;
    } while (next_ubatch(ctx));
    CHECK(ubatch == 2);
    CHECK(!next_ubatch(ctx));
    CHECK(kvc_memory_context_n_tokens(ctx) == KVC_ERR_INVALID_STATE); /* past the last ubatch */
    CHECK_MSG("no current ubatch");
    kvc_ubatch_view ub;
    CHECK_ERR(kvc_memory_context_get_ubatch(ctx, &ub), KVC_ERR_INVALID_STATE, "no current ubatch");
    kvc_memory_context_free(ctx);

    int32_t pos = 0;
    CHECK_OK(kvc_memory_seq_pos_min(mem, 0, &pos));
    CHECK(pos == 0);
    CHECK_OK(kvc_memory_seq_pos_max(mem, 0, &pos));
    CHECK(pos == 4);
    CHECK_OK(kvc_memory_seq_pos_max(mem, 1, &pos));
    CHECK(pos == -1);

    /* kvc_batch_get_one continues sequence 0 from the memory */
    const int32_t toks[2] = {42, 43};
    kvc_batch* one = kvc_batch_get_one(toks, 2);
    CHECK_OK(kvc_memory_init_batch(mem, one, 8, false, &ctx));
    CHECK_OK(kvc_memory_context_get_ubatch(ctx, &ub));
    CHECK(ub.n_tokens == 2 && ub.pos[0] == 5 && ub.pos[1] == 6 && ub.token[1] == 43);
    CHECK(ub.output[0] == 0 && ub.output[1] == 1);
    kvc_memory_context_free(ctx); /* never applied: the memory is unchanged */
    CHECK_OK(kvc_memory_seq_pos_max(mem, 0, &pos));
    CHECK(pos == 4);
    kvc_batch_free(one);

    /* a full context: every cell, nothing to apply */
    CHECK_OK(kvc_memory_init_full(mem, &ctx));
    CHECK(status_of(ctx) == KVC_MEMORY_STATUS_SUCCESS);
    CHECK(kvc_memory_context_n_kv(ctx, 0) == 16);
    kvc_tensor_view v;
    CHECK_OK(kvc_memory_get_k(ctx, 0, &v));
    CHECK(v.ne[2] == 16 && k_at(&v, 1, 1, 3) == kv_value(0, 3, 5, 0));
    CHECK_OK(kvc_memory_context_apply(ctx));
    CHECK(!next_ubatch(ctx));
    CHECK(kvc_memory_context_n_tokens(ctx) == KVC_ERR_INVALID_STATE);
    CHECK_OK(kvc_memory_context_out_ids(ctx, &out_ids, &n_out));
    CHECK(n_out == 0);
    kvc_memory_context_free(ctx);
    kvc_memory_free(mem);
}

/* An embeddings batch goes through the same path; the ubatch carries the rows. */
static void test_embeddings_batch(void) {
    kvc_memory* mem = small_cache(8, 1);
    kvc_batch* e = kvc_batch_init(2, 3, 1);
    const int32_t s0 = 0;
    const float r0[3] = {1, 2, 3}, r1[3] = {4, 5, 6};
    CHECK_OK(kvc_batch_add_embd(e, r0, 0, &s0, 1, false));
    CHECK_OK(kvc_batch_add_embd(e, r1, 1, &s0, 1, true));
    kvc_memory_context* ctx = NULL;
    CHECK_OK(kvc_memory_init_batch(mem, e, 4, false, &ctx));
    kvc_ubatch_view ub;
    CHECK_OK(kvc_memory_context_get_ubatch(ctx, &ub));
    CHECK(ub.token == NULL && ub.n_embd == 3 && ub.embd != NULL && ub.embd[3] == 4.0f && ub.pos[1] == 1);
    kvc_memory_context_free(ctx);
    kvc_batch_free(e);
    kvc_memory_free(mem);
}

/* -- batches that are refused or do not fit -- */

static void test_batch_errors_and_no_fit(void) {
    kvc_memory* mem = small_cache(8, 2);
    kvc_batch* b = seq_batch(0, 0, 3);
    decode(mem, b, 8);
    kvc_batch_free(b);
    size_t n_before = 0;
    uint8_t* before = state_of(mem, KVC_SEQ_ALL, &n_before);

    /* 10 tokens in 8 cells: valid, does not fit; a failed context, nothing changed */
    b = seq_batch(1, 0, 10);
    kvc_memory_context* ctx = (kvc_memory_context*)&g_checks;
    CHECK_OK(kvc_memory_init_batch(mem, b, 4, false, &ctx));
    CHECK(ctx != NULL && status_of(ctx) == KVC_MEMORY_STATUS_FAILED_PREPARE);
    CHECK_ERR(kvc_memory_context_apply(ctx), KVC_ERR_INVALID_STATE, "failed context");
    CHECK(!next_ubatch(ctx));
    CHECK(kvc_memory_context_n_tokens(ctx) == KVC_ERR_INVALID_STATE);
    CHECK(kvc_memory_context_n_kv(ctx, 0) == KVC_ERR_INVALID_STATE);
    CHECK_MSG("kvc_memory_context_n_kv: the context failed (status KVC_MEMORY_STATUS_FAILED_PREPARE)");
    CHECK(kvc_memory_context_n_kv(ctx, 2) == KVC_ERR_OUT_OF_RANGE); /* a bad layer is named first */
    kvc_tensor_view v;
    CHECK_ERR(kvc_memory_get_k(ctx, 0, &v), KVC_ERR_INVALID_STATE, "kvc_memory_get_k: the context failed");
    float f[4];
    CHECK_ERR(kvc_memory_cpy_k(ctx, 0, f, 1), KVC_ERR_INVALID_STATE, "the context failed");
    kvc_memory_context_free(ctx);
    CHECK(same_state(mem, before, n_before));
    kvc_batch_free(b);

    /* invalid batches are errors: no context */
    b = seq_batch(5, 0, 2); /* seq 5 with n_seq_max 2 */
    ctx = (kvc_memory_context*)&g_checks;
    CHECK_ERR(kvc_memory_init_batch(mem, b, 4, false, &ctx), KVC_ERR_OUT_OF_RANGE, "seq_id[0][0] = 5");
    CHECK(ctx == NULL);
    kvc_batch_free(b);
    b = seq_batch(0, 5, 7); /* positions 5, 6 after 0..2: the sequence must continue at 3 */
    CHECK_ERR(kvc_memory_init_batch(mem, b, 4, false, &ctx), KVC_ERR_INVALID_STATE,
              "kvc_memory_init_batch: batch: ");
    kvc_batch_free(b);
    b = seq_batch(0, 3, 4);
    CHECK_ERR(kvc_memory_init_batch(mem, b, 0, false, &ctx), KVC_ERR_INVALID_ARGUMENT,
              "n_ubatch must be at least 1");
    kvc_batch_free(b);
    b = kvc_batch_init(2, 0, 1);
    CHECK_ERR(kvc_memory_init_batch(mem, b, 4, false, &ctx), KVC_ERR_INVALID_ARGUMENT, "n_tokens = 0");
    CHECK_ERR(kvc_memory_init_batch(NULL, b, 4, false, &ctx), KVC_ERR_INVALID_ARGUMENT, "mem is NULL");
    CHECK_ERR(kvc_memory_init_batch(mem, NULL, 4, false, &ctx), KVC_ERR_INVALID_ARGUMENT, "batch is NULL");
    CHECK_ERR(kvc_memory_init_batch(mem, b, 4, false, NULL), KVC_ERR_INVALID_ARGUMENT, "out is NULL");
    kvc_batch_free(b);
    CHECK(same_state(mem, before, n_before));
    free(before);
    kvc_memory_free(mem);
}

/* -- sequence operations, K-shift, update -- */

static void test_sequence_ops(void) {
    kvc_memory* mem = small_cache(16, 2);
    kvc_batch* b = seq_batch(0, 0, 5);
    decode(mem, b, 8);
    kvc_batch_free(b);
    int32_t pos = 0;
    bool flag = false;

    CHECK_OK(kvc_memory_can_shift(mem, &flag));
    CHECK(flag);
    CHECK_OK(kvc_memory_seq_cp(mem, 0, 1, 0, 3));
    CHECK_OK(kvc_memory_seq_pos_max(mem, 1, &pos));
    CHECK(pos == 2);
    flag = false;
    CHECK_OK(kvc_memory_seq_rm(mem, 1, 1, -1, &flag));
    CHECK(flag);
    CHECK_OK(kvc_memory_seq_pos_max(mem, 1, &pos));
    CHECK(pos == 0);
    CHECK_OK(kvc_memory_seq_rm(mem, 1, -1, -1, NULL));
    CHECK_OK(kvc_memory_seq_pos_min(mem, 1, &pos));
    CHECK(pos == -1);

    /* context shift: drop [1, 3), move [3, end) down by 2 -> keys re-rotated by the update */
    kvc_tensor_view v;
    kvc_memory_context* full = NULL;
    CHECK_OK(kvc_memory_init_full(mem, &full));
    CHECK_OK(kvc_memory_get_k(full, 0, &v));
    const float k_before = k_at(&v, 0, 0, 3);
    CHECK(k_before == kv_value(0, 3, 0, 0));
    CHECK_OK(kvc_memory_seq_rm(mem, 0, 1, 3, NULL));
    CHECK_OK(kvc_memory_seq_add(mem, 0, 3, -1, -2));
    CHECK_OK(kvc_memory_seq_pos_max(mem, 0, &pos));
    CHECK(pos == 2);
    CHECK(kvc_memory_k_shift_elements(mem, 0) == 16);
    int32_t shift[16];
    CHECK_OK(kvc_memory_set_input_k_shift(mem, 0, shift, 16));
    CHECK(shift[0] == 0 && shift[3] == -2 && shift[4] == -2 && shift[5] == 0);
    CHECK_ERR(kvc_memory_set_input_k_shift(mem, 0, shift, 15), KVC_ERR_INVALID_ARGUMENT, "need 16 elements");
    CHECK_ERR(kvc_memory_set_input_k_shift(mem, 0, NULL, 16), KVC_ERR_INVALID_ARGUMENT, "dst is NULL");
    CHECK(kvc_memory_k_shift_elements(mem, 1) == 16); /* the layers of a cache share it */
    CHECK(kvc_memory_k_shift_elements(mem, 2) == KVC_ERR_OUT_OF_RANGE);
    CHECK_MSG("kvc_memory_k_shift_elements: no model layer 2 (the model has 2)"); /* regression (issue 20) */
    CHECK_ERR(kvc_memory_set_input_k_shift(mem, 9, shift, 16), KVC_ERR_OUT_OF_RANGE, "model layer 9");

    kvc_memory_context* up = NULL;
    CHECK_OK(kvc_memory_init_update(mem, false, &up));
    CHECK(status_of(up) == KVC_MEMORY_STATUS_SUCCESS);
    CHECK(!next_ubatch(up));
    CHECK(kvc_memory_context_n_tokens(up) == KVC_ERR_INVALID_STATE);
    CHECK_OK(kvc_memory_context_apply(up));
    CHECK_ERR(kvc_memory_get_k(up, 0, &v), KVC_ERR_INVALID_STATE, "no current slot");
    kvc_memory_context_free(up);
    CHECK(k_at(&v, 0, 0, 3) != k_before); /* rotated back by 2 positions (v still views layer 0) */
    CHECK_OK(kvc_memory_set_input_k_shift(mem, 0, shift, 16));
    CHECK(shift[3] == 0 && shift[4] == 0);
    CHECK_OK(kvc_memory_init_update(mem, false, &up));
    CHECK(status_of(up) == KVC_MEMORY_STATUS_NO_UPDATE);
    CHECK_OK(kvc_memory_context_apply(up)); /* nothing to do, harmless */
    kvc_memory_context_free(up);
    kvc_memory_context_free(full);

    /* cells 1, 2 are holes below used cells: optimize compacts them */
    flag = true;
    CHECK_OK(kvc_memory_update(mem, false, &flag));
    CHECK(!flag);
    CHECK_OK(kvc_memory_update(mem, true, &flag));
    CHECK(flag);
    CHECK_OK(kvc_memory_update(mem, true, NULL));

    CHECK_OK(kvc_memory_seq_div(mem, 0, 0, -1, 2));
    CHECK_OK(kvc_memory_seq_pos_max(mem, 0, &pos));
    CHECK(pos == 1);
    CHECK_ERR(kvc_memory_seq_div(mem, 0, 0, -1, 0), KVC_ERR_INVALID_ARGUMENT, "divisor 0");
    CHECK_OK(kvc_memory_seq_cp(mem, 0, 1, -1, -1));
    CHECK_OK(kvc_memory_seq_keep(mem, 1));
    CHECK_OK(kvc_memory_seq_pos_max(mem, 0, &pos));
    CHECK(pos == -1);
    CHECK_OK(kvc_memory_seq_pos_max(mem, 1, &pos));
    CHECK(pos == 1);
    CHECK_OK(kvc_memory_seq_rm(mem, KVC_SEQ_ALL, -1, -1, NULL));
    CHECK_OK(kvc_memory_seq_pos_max(mem, 1, &pos));
    CHECK(pos == -1);

    /* bad sequence ids change nothing */
    b = seq_batch(0, 0, 4);
    decode(mem, b, 8);
    kvc_batch_free(b);
    size_t n_before = 0;
    uint8_t* before = state_of(mem, KVC_SEQ_ALL, &n_before);
    CHECK_ERR(kvc_memory_seq_rm(mem, 7, -1, -1, &flag), KVC_ERR_OUT_OF_RANGE,
              "kvc_memory_seq_rm: seq_rm: seq_id 7 not in [0, 2)");
    CHECK_ERR(kvc_memory_seq_rm(mem, -2, -1, -1, NULL), KVC_ERR_OUT_OF_RANGE, "seq_id -2");
    CHECK_ERR(kvc_memory_seq_cp(mem, 0, 2, -1, -1), KVC_ERR_OUT_OF_RANGE, "seq_id 2");
    CHECK_ERR(kvc_memory_seq_cp(mem, -1, 1, -1, -1), KVC_ERR_OUT_OF_RANGE, "seq_id -1");
    CHECK_ERR(kvc_memory_seq_keep(mem, 2), KVC_ERR_OUT_OF_RANGE, "seq_keep");
    CHECK_ERR(kvc_memory_seq_add(mem, 3, 0, -1, 1), KVC_ERR_OUT_OF_RANGE, "seq_add");
    CHECK_ERR(kvc_memory_seq_div(mem, 3, 0, -1, 2), KVC_ERR_OUT_OF_RANGE, "seq_div");
    CHECK_ERR(kvc_memory_seq_pos_min(mem, 2, &pos), KVC_ERR_OUT_OF_RANGE, "seq_pos_min");
    CHECK_ERR(kvc_memory_seq_pos_max(mem, -1, &pos), KVC_ERR_OUT_OF_RANGE, "seq_pos_max");
    CHECK(same_state(mem, before, n_before));
    free(before);

    /* NULL handles and out pointers */
    CHECK_ERR(kvc_memory_seq_rm(NULL, 0, -1, -1, NULL), KVC_ERR_INVALID_ARGUMENT,
              "kvc_memory_seq_rm: mem is NULL");
    CHECK_ERR(kvc_memory_seq_cp(NULL, 0, 1, -1, -1), KVC_ERR_INVALID_ARGUMENT,
              "kvc_memory_seq_cp: mem is NULL");
    CHECK_ERR(kvc_memory_seq_keep(NULL, 0), KVC_ERR_INVALID_ARGUMENT, "mem is NULL");
    CHECK_ERR(kvc_memory_seq_add(NULL, 0, -1, -1, 1), KVC_ERR_INVALID_ARGUMENT, "mem is NULL");
    CHECK_ERR(kvc_memory_seq_div(NULL, 0, -1, -1, 2), KVC_ERR_INVALID_ARGUMENT, "mem is NULL");
    CHECK_ERR(kvc_memory_seq_pos_min(NULL, 0, &pos), KVC_ERR_INVALID_ARGUMENT, "mem is NULL");
    CHECK_ERR(kvc_memory_seq_pos_max(mem, 0, NULL), KVC_ERR_INVALID_ARGUMENT, "out is NULL");
    CHECK_ERR(kvc_memory_can_shift(NULL, &flag), KVC_ERR_INVALID_ARGUMENT, "mem is NULL");
    CHECK_ERR(kvc_memory_can_shift(mem, NULL), KVC_ERR_INVALID_ARGUMENT, "out is NULL");
    CHECK_ERR(kvc_memory_update(NULL, false, &flag), KVC_ERR_INVALID_ARGUMENT, "mem is NULL");
    CHECK(kvc_memory_k_shift_elements(NULL, 0) == KVC_ERR_INVALID_ARGUMENT);
    CHECK_ERR(kvc_memory_set_input_k_shift(NULL, 0, shift, 16), KVC_ERR_INVALID_ARGUMENT, "mem is NULL");

    CHECK_OK(kvc_memory_clear(mem, true));
    CHECK_OK(kvc_memory_seq_pos_max(mem, 0, &pos));
    CHECK(pos == -1);
    kvc_memory_free(mem);
}

/* M-RoPE caches cannot shift positions. */
static void test_mrope_cannot_shift(void) {
    kvc_kv_cache_params p = small_params(8, 1);
    p.n_pos = 4;
    kvc_memory* mem = NULL;
    CHECK_OK(kvc_kv_cache_create(&p, &mem));
    bool can = true;
    CHECK_OK(kvc_memory_can_shift(mem, &can));
    CHECK(!can);
    CHECK_ERR(kvc_memory_seq_add(mem, 0, 0, -1, 1), KVC_ERR_UNSUPPORTED, "M-RoPE");
    CHECK_ERR(kvc_memory_seq_div(mem, 0, 0, -1, 2), KVC_ERR_UNSUPPORTED, "M-RoPE");
    kvc_memory_free(mem);
}

static int g_split_warnings = 0;

static void count_split_warnings(kvc_log_level level, const char* message, void* user_data) {
    if (level == KVC_LOG_WARN && strstr(message, "sequential split") != NULL) ++*(int*)user_data;
}

/* One stream per sequence: views span the streams of the ubatch; position buckets need one stream. V is
 * not transposed here. */
static void test_split_streams(void) {
    kvc_kv_cache_params p = small_params(8, 2);
    p.unified = false;
    p.v_trans = false;
    p.type_v = KVC_TYPE_F16;
    kvc_memory* mem = NULL;
    CHECK_OK(kvc_kv_cache_create(&p, &mem));
    CHECK(kvc_memory_k_shift_elements(mem, 0) == 16);
    kvc_batch* b = kvc_batch_init(4, 0, 2);
    const int32_t s0 = 0, s1 = 1, both[2] = {0, 1};
    CHECK_OK(kvc_batch_add(b, 1, 0, &s0, 1, false));
    CHECK_OK(kvc_batch_add(b, 2, 0, &s1, 1, true));
    kvc_memory_context* ctx = NULL;
    CHECK_OK(kvc_memory_init_batch(mem, b, 4, false, &ctx));
    CHECK_OK(kvc_memory_context_apply(ctx));
    kvc_tensor_view v;
    CHECK_OK(kvc_memory_get_k(ctx, 0, &v));
    CHECK(v.ne[3] == 2 && v.nb[3] == 8 * 32); /* a stream is kv_size rows of 8 f32 */
    CHECK_OK(kvc_memory_get_v(ctx, 1, &v));
    CHECK(v.type == KVC_TYPE_F16 && v.ne[0] == 4 && v.ne[1] == 2 &&
          v.ne[2] == kvc_memory_context_n_kv(ctx, 1));
    CHECK(v.ne[3] == 2 && v.nb[0] == 2 && v.nb[1] == 8 && v.nb[2] == 16 && v.nb[3] == 8 * 16);
    const int64_t n_mask = kvc_memory_kq_mask_elements(ctx, 0);
    CHECK(n_mask == 2 * kvc_memory_context_n_kv(ctx, 0));
    int32_t buckets[64];
    CHECK_ERR(kvc_memory_set_input_pos_bucket(ctx, 0, buckets, (size_t)n_mask, 32), KVC_ERR_UNSUPPORTED,
              "unified");
    kvc_memory_context_free(ctx);

    /* a token shared by two sequences cannot be split per stream: a failed context, not an error */
    CHECK_OK(kvc_batch_clear(b));
    CHECK_OK(kvc_batch_add(b, 3, 1, both, 2, true));
    kvc_set_log_callback(count_split_warnings, &g_split_warnings);
    CHECK_OK(kvc_memory_init_batch(mem, b, 4, false, &ctx));
    kvc_set_log_callback(NULL, NULL);
    CHECK(g_split_warnings == 1);
    CHECK(status_of(ctx) == KVC_MEMORY_STATUS_FAILED_PREPARE);
    kvc_memory_context_free(ctx);
    kvc_batch_free(b);
    kvc_memory_free(mem);
}

/* -- NULL contexts -- */

static void test_null_contexts(void) {
    kvc_memory_context* ctx = NULL;
    kvc_tensor_view v;
    kvc_ubatch_view ub;
    kvc_memory_status st = KVC_MEMORY_STATUS_NO_UPDATE;
    bool more = true;
    float f[4];
    uint16_t h[4];
    int32_t i[4];
    const int32_t* ids = NULL;
    size_t n = 0;
    /* a NULL context is an argument error, never a memory status or the end of the ubatches */
    CHECK_ERR(kvc_memory_context_get_status(NULL, &st), KVC_ERR_INVALID_ARGUMENT,
              "kvc_memory_context_get_status: ctx is NULL");
    CHECK(st == KVC_MEMORY_STATUS_NO_UPDATE); /* out pointers are written only on success */
    CHECK_ERR(kvc_memory_context_next(NULL, &more), KVC_ERR_INVALID_ARGUMENT,
              "kvc_memory_context_next: ctx is NULL");
    CHECK(more);
    CHECK_ERR(kvc_memory_context_apply(NULL), KVC_ERR_INVALID_ARGUMENT, "ctx is NULL");
    CHECK(kvc_memory_context_n_kv(NULL, 0) == KVC_ERR_INVALID_ARGUMENT);
    CHECK_MSG("kvc_memory_context_n_kv: ctx is NULL");
    CHECK(kvc_memory_context_n_tokens(NULL) == KVC_ERR_INVALID_ARGUMENT);
    CHECK(kvc_memory_kq_mask_elements(NULL, 0) == KVC_ERR_INVALID_ARGUMENT);
    CHECK_MSG("kvc_memory_kq_mask_elements: ctx is NULL");
    CHECK_ERR(kvc_memory_context_get_ubatch(NULL, &ub), KVC_ERR_INVALID_ARGUMENT, "ctx is NULL");
    CHECK_ERR(kvc_memory_context_out_ids(NULL, &ids, &n), KVC_ERR_INVALID_ARGUMENT, "ctx is NULL");
    CHECK_ERR(kvc_memory_cpy_k(NULL, 0, f, 1), KVC_ERR_INVALID_ARGUMENT, "kvc_memory_cpy_k: ctx is NULL");
    CHECK_ERR(kvc_memory_cpy_v(NULL, 0, f, 1), KVC_ERR_INVALID_ARGUMENT, "kvc_memory_cpy_v: ctx is NULL");
    CHECK_ERR(kvc_memory_get_k(NULL, 0, &v), KVC_ERR_INVALID_ARGUMENT, "ctx is NULL");
    CHECK_ERR(kvc_memory_get_v(NULL, 0, &v), KVC_ERR_INVALID_ARGUMENT, "ctx is NULL");
    CHECK_ERR(kvc_memory_set_input_kq_mask(NULL, 0, KVC_TYPE_F32, f, 4, true, false),
              KVC_ERR_INVALID_ARGUMENT, "kvc_memory_set_input_kq_mask: ctx is NULL");
    CHECK_ERR(kvc_memory_set_input_kq_mask(NULL, 0, KVC_TYPE_F16, h, 4, true, false),
              KVC_ERR_INVALID_ARGUMENT, "ctx is NULL");
    CHECK_ERR(kvc_memory_set_input_pos_bucket(NULL, 0, i, 4, 32), KVC_ERR_INVALID_ARGUMENT,
              "kvc_memory_set_input_pos_bucket: ctx is NULL");
    kvc_rs_view rs;
    CHECK_ERR(kvc_memory_context_get_rs(NULL, &rs), KVC_ERR_INVALID_ARGUMENT,
              "kvc_memory_context_get_rs: ctx is NULL");
    CHECK_ERR(kvc_memory_get_r(NULL, 0, &v), KVC_ERR_INVALID_ARGUMENT, "kvc_memory_get_r: ctx is NULL");
    CHECK_ERR(kvc_memory_get_s(NULL, 0, &v), KVC_ERR_INVALID_ARGUMENT, "kvc_memory_get_s: ctx is NULL");
    CHECK(kvc_memory_k_shift_elements(NULL, 0) == KVC_ERR_INVALID_ARGUMENT);
    CHECK_MSG("kvc_memory_k_shift_elements: mem is NULL");
    CHECK_ERR(kvc_memory_set_input_k_shift(NULL, 0, i, 4), KVC_ERR_INVALID_ARGUMENT, "mem is NULL");
    CHECK_ERR(kvc_memory_init_full(NULL, &ctx), KVC_ERR_INVALID_ARGUMENT, "mem is NULL");
    CHECK_ERR(kvc_memory_init_update(NULL, false, &ctx), KVC_ERR_INVALID_ARGUMENT, "mem is NULL");
    CHECK_ERR(kvc_memory_clear(NULL, true), KVC_ERR_INVALID_ARGUMENT, "mem is NULL");
    kvc_memory_context_free(NULL);

    kvc_memory* mem = small_cache(8, 1);
    CHECK_ERR(kvc_memory_init_full(mem, NULL), KVC_ERR_INVALID_ARGUMENT, "out is NULL");
    CHECK_ERR(kvc_memory_init_update(mem, false, NULL), KVC_ERR_INVALID_ARGUMENT, "out is NULL");
    CHECK_OK(kvc_memory_init_full(mem, &ctx));
    CHECK_ERR(kvc_memory_get_k(ctx, 0, NULL), KVC_ERR_INVALID_ARGUMENT, "out is NULL");
    CHECK_ERR(kvc_memory_context_get_ubatch(ctx, NULL), KVC_ERR_INVALID_ARGUMENT, "out is NULL");
    CHECK_ERR(kvc_memory_context_out_ids(ctx, NULL, &n), KVC_ERR_INVALID_ARGUMENT, "ids is NULL");
    CHECK_ERR(kvc_memory_context_out_ids(ctx, &ids, NULL), KVC_ERR_INVALID_ARGUMENT, "n is NULL");
    CHECK_ERR(kvc_memory_context_get_status(ctx, NULL), KVC_ERR_INVALID_ARGUMENT,
              "kvc_memory_context_get_status: out is NULL");
    CHECK_ERR(kvc_memory_context_next(ctx, NULL), KVC_ERR_INVALID_ARGUMENT,
              "kvc_memory_context_next: more is NULL");
    CHECK_OK(kvc_memory_context_get_status(ctx, &st));
    CHECK(st == KVC_MEMORY_STATUS_SUCCESS);
    CHECK_OK(kvc_memory_context_next(ctx, &more));
    CHECK(!more); /* a full context has no next ubatch */
    CHECK_ERR(kvc_memory_set_input_kq_mask(ctx, 0, KVC_TYPE_F32, NULL, 4, true, false),
              KVC_ERR_INVALID_ARGUMENT, "dst is NULL");
    CHECK_ERR(kvc_memory_set_input_pos_bucket(ctx, 0, NULL, 4, 32), KVC_ERR_INVALID_ARGUMENT, "dst is NULL");
    kvc_memory_context_free(ctx);
    kvc_memory_free(mem);
}

/* -- logging -- */

static int g_warnings = 0;

static void count_warnings(kvc_log_level level, const char* message, void* user_data) {
    if (level == KVC_LOG_WARN && strstr(message, "output_all") != NULL) ++*(int*)user_data;
}

static void test_log_callback(void) {
    kvc_memory* mem = small_cache(8, 1);
    kvc_batch* b = seq_batch(0, 0, 2);                             /* only the last token is an output */
    kvc_set_log_callback(count_split_warnings, &g_split_warnings); /* replaced right away */
    kvc_set_log_callback(count_warnings, &g_warnings);
    kvc_memory_context* ctx = NULL;
    CHECK_OK(kvc_memory_init_batch(mem, b, 4, true, &ctx)); /* embd_all: every token must be an output */
    CHECK(g_warnings == 1);
    kvc_ubatch_view ub;
    CHECK_OK(kvc_memory_context_get_ubatch(ctx, &ub));
    CHECK(ub.output[0] == 1 && ub.output[1] == 1);
    kvc_memory_context_free(ctx);
    kvc_set_log_callback(NULL, NULL); /* back to stderr */
    kvc_batch_free(b);
    kvc_memory_free(mem);
}

/* -- errors are per thread -- */

static void* other_thread(void* arg) {
    (void)arg;
    const int clean = strcmp(kvc_last_error(), "") == 0; /* the main thread's failure is not seen here */
    (void)kvc_row_size(KVC_TYPE_Q8_0, 3);
    const int own = strstr(kvc_last_error(), "kvc_row_size") != NULL;
    return (void*)(size_t)(clean && own);
}

static void test_errors_per_thread(void) {
    CHECK_ERR(kvc_memory_seq_keep(NULL, 0), KVC_ERR_INVALID_ARGUMENT, "kvc_memory_seq_keep: mem is NULL");
    pthread_t t;
    void* ok = NULL;
    CHECK(pthread_create(&t, NULL, other_thread, NULL) == 0);
    CHECK(pthread_join(t, &ok) == 0);
    CHECK(ok == (void*)1);
    CHECK(strcmp(kvc_last_error(), "kvc_memory_seq_keep: mem is NULL") == 0);
}

/* A budget refuses a cache that could outgrow it; the breakdown counts what cells hold. */
static void test_memory_budget_and_breakdown(void) {
    CHECK(kvc_kv_cache_default_params().memory_budget == 0);
    CHECK(kvc_kv_cache_default_params().auto_update); /* a decode after seq_add applies the K-shift */
    kvc_kv_cache_params p = small_params(64, 2);      /* a cell: 2 layers x (K 32 + V 32 bytes) */
    p.memory_budget = 64 * 128 - 1;
    kvc_memory* mem = NULL;
    CHECK_ERR(kvc_kv_cache_create(&p, &mem), KVC_ERR_OUT_OF_MEMORY, "(8192 bytes), over the memory budget");
    CHECK_MSG("(8191 bytes)");
    CHECK(mem == NULL);
    p.memory_budget = 64 * 128;
    CHECK_OK(kvc_kv_cache_create(&p, &mem));
    kvc_batch* b = seq_batch(1, 0, 10);
    decode(mem, b, 16);
    kvc_batch_free(b);
    kvc_memory_breakdown bd;
    uint64_t seq[3] = {9, 9, 9};
    CHECK_OK(kvc_memory_get_breakdown(mem, &bd, seq, 3));
    /* transposed V commits a page of each channel: the granule is the whole stream here */
    CHECK(bd.reserved == 8192 && bd.committed == 8192 && bd.used == 1280 && bd.cached == 0 && bd.pinned == 0);
    CHECK(bd.free == 8192 - 1280);
    CHECK(seq[0] == 0 && seq[1] == 1280 && seq[2] == 0);
    /* auto_update (default): the decode after seq_add ran the K-shift, nothing is left pending */
    CHECK_OK(kvc_memory_seq_add(mem, 1, 0, -1, 3));
    b = seq_batch(1, 13, 14);
    decode(mem, b, 16);
    kvc_batch_free(b);
    bool pending = true;
    CHECK_OK(kvc_memory_update(mem, false, &pending));
    CHECK(!pending);
    CHECK_OK(kvc_memory_seq_rm(mem, 1, -1, -1, NULL));
    CHECK_OK(kvc_memory_get_breakdown(mem, &bd, NULL, 0));
    CHECK(bd.committed == 0 && bd.used == 0 && bd.free == 0);
    CHECK_ERR(kvc_memory_get_breakdown(NULL, &bd, NULL, 0), KVC_ERR_INVALID_ARGUMENT, "mem is NULL");
    CHECK_ERR(kvc_memory_get_breakdown(mem, NULL, NULL, 0), KVC_ERR_INVALID_ARGUMENT, "out is NULL");
    CHECK_ERR(kvc_memory_get_breakdown(mem, &bd, NULL, 2), KVC_ERR_INVALID_ARGUMENT, "seq_bytes is NULL");
    kvc_memory_free(mem);
}

int main(void) {
    test_errors_and_version();
    test_types();
    test_create();
    test_limits();
    test_batch();
    test_decode_loop();
    test_embeddings_batch();
    test_batch_errors_and_no_fit();
    test_sequence_ops();
    test_mrope_cannot_shift();
    test_split_streams();
    test_null_contexts();
    test_log_callback();
    test_errors_per_thread();
    test_memory_budget_and_breakdown();
    return capi_report("capi");
}
