/* The C API's state functions over a KV cache, compiled as C11: state buffers (whole memory and one
 * sequence, into the caller's memory, bad bytes refused with the memory unchanged), session files and
 * llama.cpp's 'ggsq' files. The runner and fixtures are in capi_test.h. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <kvcache/kvcache.h>

#include "capi_test.h"

/* -- state buffers -- */

static void test_state(void) {
    kvc_memory* mem = small_cache(16, 2);
    kvc_batch* b = seq_batch(0, 0, 4);
    decode(mem, b, 8);
    kvc_batch_free(b);

    size_t n = 0, n_whole = 0, written = 0, read = 0;
    uint8_t* seq0 = state_of(mem, 0, &n);
    uint8_t* whole = state_of(mem, KVC_SEQ_ALL, &n_whole);
    CHECK(n > 8 && seq0[0] == 0xd8 && seq0[1] == 0x3c && seq0[2] == 0x14 && seq0[3] == 0xaf); /* magic, LE */

    /* too small: out_of_range; the memory is untouched */
    uint8_t* small = malloc(n - 1);
    CHECK_ERR(kvc_state_seq_get_data(mem, 0, small, n - 1, &written, 0), KVC_ERR_OUT_OF_RANGE,
              "kvc_state_seq_get_data: ");
    free(small);
    CHECK_ERR(kvc_state_seq_get_data(mem, 0, NULL, n, &written, 0), KVC_ERR_INVALID_ARGUMENT, "dst is NULL");
    CHECK_ERR(kvc_state_seq_get_data(NULL, 0, seq0, n, &written, 0), KVC_ERR_INVALID_ARGUMENT, "mem is NULL");
    uint8_t* again = malloc(n + 16); /* a larger buffer; written may be NULL */
    CHECK_OK(kvc_state_seq_get_data(mem, 0, again, n + 16, NULL, 0));
    CHECK(memcmp(again, seq0, n) == 0);
    free(again);
    CHECK_ERR(kvc_state_seq_get_data(mem, 9, seq0, n, &written, 0), KVC_ERR_OUT_OF_RANGE, "seq_id 9");
    CHECK_ERR(kvc_state_seq_get_size(mem, 9, 0, &written), KVC_ERR_OUT_OF_RANGE, "seq_id 9");
    CHECK_ERR(kvc_state_seq_get_size(mem, 0, 0, NULL), KVC_ERR_INVALID_ARGUMENT, "out is NULL");
    CHECK_ERR(kvc_state_seq_get_size(NULL, 0, 0, &written), KVC_ERR_INVALID_ARGUMENT, "mem is NULL");
    uint64_t max_bytes = 0; /* the largest payload a load accepts: at least the whole memory's now */
    CHECK_OK(kvc_memory_state_max_bytes(mem, &max_bytes));
    CHECK(max_bytes >= n_whole - 8 && max_bytes < 1u << 30);
    CHECK_ERR(kvc_memory_state_max_bytes(mem, NULL), KVC_ERR_INVALID_ARGUMENT, "out is NULL");
    CHECK(same_state(mem, whole, n_whole));

    /* sequence 0 restored into sequence 1 */
    CHECK_OK(kvc_state_seq_set_data(mem, seq0, n, 1, 0, &read));
    CHECK(read == n);
    int32_t pos = 0;
    CHECK_OK(kvc_memory_seq_pos_max(mem, 1, &pos));
    CHECK(pos == 3);
    free(whole);
    whole = state_of(mem, KVC_SEQ_ALL, &n_whole);

    /* bad bytes: refused, the memory exactly as before */
    uint8_t* bad = malloc(n);
    memcpy(bad, seq0, n);
    bad[0] ^= 0xff;
    CHECK_ERR(kvc_state_seq_set_data(mem, bad, n, 1, 0, &read), KVC_ERR_CORRUPT_DATA,
              "kvc_state_seq_set_data: ");
    CHECK(same_state(mem, whole, n_whole));
    CHECK_ERR(kvc_state_seq_set_data(mem, seq0, n - 3, 1, 0, NULL), KVC_ERR_CORRUPT_DATA, "");
    CHECK(same_state(mem, whole, n_whole));
    memcpy(bad, seq0, n);
    bad[8] = 7; /* stream count */
    CHECK(kvc_state_seq_set_data(mem, bad, n, 1, 0, NULL) != KVC_OK);
    CHECK(same_state(mem, whole, n_whole));
    for (size_t i = 8; i < n; i += 7) { /* scattered corruptions: refused or accepted, never a crash */
        memcpy(bad, seq0, n);
        bad[i] ^= 0x5a;
        (void)kvc_state_seq_set_data(mem, bad, n, 1, 0, NULL);
    }
    free(bad);
    CHECK_ERR(kvc_state_seq_set_data(mem, NULL, n, 1, 0, NULL), KVC_ERR_INVALID_ARGUMENT, "src is NULL");
    CHECK_ERR(kvc_state_seq_set_data(NULL, seq0, n, 1, 0, NULL), KVC_ERR_INVALID_ARGUMENT, "mem is NULL");
    CHECK_ERR(kvc_state_seq_set_data(mem, seq0, n, 5, 0, NULL), KVC_ERR_OUT_OF_RANGE, "");

    /* the raw payload (the buffer after its 8-byte header) */
    CHECK_OK(kvc_memory_seq_rm(mem, 1, -1, -1, NULL));
    CHECK_OK(kvc_state_set_payload(mem, seq0 + 8, n - 8, 1, 0, &read));
    CHECK(read == n - 8);
    CHECK_OK(kvc_memory_seq_pos_max(mem, 1, &pos));
    CHECK(pos == 3);
    free(whole);
    whole = state_of(mem, KVC_SEQ_ALL, &n_whole);
    CHECK_ERR(kvc_state_set_payload(mem, seq0, n, 1, 0, NULL), KVC_ERR_CORRUPT_DATA,
              "kvc_state_set_payload: ");
    CHECK(same_state(mem, whole, n_whole));
    CHECK_ERR(kvc_state_set_payload(mem, NULL, 4, 1, 0, NULL), KVC_ERR_INVALID_ARGUMENT, "payload is NULL");
    CHECK_ERR(kvc_state_set_payload(NULL, seq0, 4, 1, 0, NULL), KVC_ERR_INVALID_ARGUMENT, "mem is NULL");

    /* the whole memory into a fresh cache */
    kvc_memory* other = small_cache(16, 2);
    CHECK_OK(kvc_state_seq_set_data(other, whole, n_whole, KVC_SEQ_ALL, 0, NULL));
    CHECK(same_state(other, whole, n_whole));
    kvc_memory_free(other);

    /* ... but not into a cache with other K types: refused, unchanged */
    kvc_kv_cache_params p = small_params(16, 2);
    p.type_k = KVC_TYPE_BF16;
    CHECK_OK(kvc_kv_cache_create(&p, &other));
    size_t n_empty = 0;
    uint8_t* empty = state_of(other, KVC_SEQ_ALL, &n_empty);
    CHECK_ERR(kvc_state_seq_set_data(other, whole, n_whole, KVC_SEQ_ALL, 0, NULL), KVC_ERR_CORRUPT_DATA,
              "K type");
    CHECK(same_state(other, empty, n_empty));
    free(empty);
    kvc_memory_free(other);

    free(seq0);
    free(whole);
    kvc_memory_free(mem);
}

/* -- session files -- */

static void test_files(void) {
    char path[256], llama_path[256], junk_path[256];
    snprintf(path, sizeof path, "/tmp/kvc_test_capi_%ld.session", (long)getpid());
    snprintf(llama_path, sizeof llama_path, "/tmp/kvc_test_capi_%ld.ggsq", (long)getpid());
    snprintf(junk_path, sizeof junk_path, "/tmp/kvc_test_capi_%ld.junk", (long)getpid());

    kvc_memory* mem = small_cache(16, 2);
    kvc_batch* b = seq_batch(0, 0, 4);
    decode(mem, b, 8);
    kvc_batch_free(b);
    const int32_t tokens[4] = {100, 101, 102, 103};

    for (int compress = 0; compress < 2; ++compress) {
        CHECK_OK(kvc_state_seq_save_file(mem, path, 0, tokens, 4, compress));
        kvc_memory* other = small_cache(16, 2);
        int32_t got[8] = {0};
        size_t n_got = 0;
        CHECK_OK(kvc_state_seq_load_file(other, path, 0, got, 8, &n_got));
        CHECK(n_got == 4 && memcmp(got, tokens, sizeof tokens) == 0);
        size_t a = 0, c = 0;
        uint8_t* sa = state_of(mem, 0, &a);
        uint8_t* sc = state_of(other, 0, &c);
        CHECK(a == c && memcmp(sa, sc, a) == 0); /* the same sequence, K/V rows included */
        free(sa);
        free(sc);
        /* a sequence loads into any destination */
        CHECK_OK(kvc_state_seq_load_file(other, path, 1, NULL, 0, NULL));
        int32_t pos = 0;
        CHECK_OK(kvc_memory_seq_pos_max(other, 1, &pos));
        CHECK(pos == 3);
        kvc_memory_free(other);
    }

    /* too few token slots: refused before anything is loaded */
    kvc_memory* other = small_cache(16, 2);
    size_t n_before = 0, n_got = 0;
    uint8_t* before = state_of(other, KVC_SEQ_ALL, &n_before);
    int32_t got[4] = {0};
    CHECK_ERR(kvc_state_seq_load_file(other, path, 1, got, 3, &n_got), KVC_ERR_OUT_OF_RANGE,
              "holds 4 tokens, room for 3");
    CHECK(same_state(other, before, n_before));
    /* regression: a damaged file is reported damaged, not short of token slots */
    {
        FILE* f = fopen(path, "rb");
        CHECK(f != NULL);
        fseek(f, 0, SEEK_END);
        const long n = ftell(f);
        fseek(f, 0, SEEK_SET);
        uint8_t* bytes = malloc((size_t)n);
        CHECK(fread(bytes, 1, (size_t)n, f) == (size_t)n);
        fclose(f);
        bytes[n - 1] ^= 0x40;
        char damaged[4096];
        snprintf(damaged, sizeof damaged, "%s.damaged", path);
        f = fopen(damaged, "wb");
        CHECK(fwrite(bytes, 1, (size_t)n, f) == (size_t)n);
        fclose(f);
        free(bytes);
        CHECK_ERR(kvc_state_seq_load_file(other, damaged, 1, got, 3, &n_got), KVC_ERR_CORRUPT_DATA,
                  "checksum mismatch");
        CHECK(same_state(other, before, n_before));
        remove(damaged);
    }
    CHECK_OK(kvc_state_seq_load_file(other, path, KVC_SEQ_ALL, NULL, 0, &n_got)); /* tokens not wanted */
    CHECK(n_got == 4);
    CHECK_OK(kvc_memory_clear(other, true));
    free(before);
    before = state_of(other, KVC_SEQ_ALL, &n_before);

    /* whole memory, no tokens */
    CHECK_OK(kvc_state_seq_save_file(mem, path, KVC_SEQ_ALL, NULL, 0, false));
    CHECK_ERR(kvc_state_seq_save_file(mem, path, 0, NULL, 2, false), KVC_ERR_INVALID_ARGUMENT,
              "tokens is NULL but has 2 entries");
    CHECK_ERR(kvc_state_seq_save_file(mem, path, 5, tokens, 4, false), KVC_ERR_OUT_OF_RANGE, "seq_id 5");
    CHECK_ERR(kvc_state_seq_save_file(mem, NULL, 0, tokens, 4, false), KVC_ERR_INVALID_ARGUMENT,
              "path is NULL");
    CHECK_ERR(kvc_state_seq_save_file(NULL, path, 0, tokens, 4, false), KVC_ERR_INVALID_ARGUMENT,
              "mem is NULL");
    CHECK_ERR(kvc_state_seq_save_file(mem, "/nonexistent-dir/x.session", 0, tokens, 4, false), KVC_ERR_IO,
              "nonexistent-dir");

    /* load errors: missing, foreign, damaged, layout mismatch; the memory unchanged every time */
    CHECK_ERR(kvc_state_seq_load_file(other, "/nonexistent-dir/x.session", 0, got, 4, &n_got), KVC_ERR_IO,
              "kvc_state_seq_load_file: load_file '/nonexistent-dir/x.session'");
    FILE* f = fopen(junk_path, "wb");
    CHECK(f != NULL);
    fputs("this is not a session file at all, just text long enough for a header of 72 bytes.......", f);
    fclose(f);
    CHECK_ERR(kvc_state_seq_load_file(other, junk_path, 0, got, 4, &n_got), KVC_ERR_CORRUPT_DATA,
              "not a kvcache session file");
    CHECK_ERR(kvc_state_seq_load_llama_file(other, junk_path, 0, got, 4, &n_got), KVC_ERR_CORRUPT_DATA,
              "not a llama.cpp sequence file");
    kvc_kv_cache_params p = small_params(16, 2);
    p.type_k = KVC_TYPE_F16;
    kvc_memory* f16 = NULL;
    CHECK_OK(kvc_kv_cache_create(&p, &f16));
    CHECK_ERR(kvc_state_seq_load_file(f16, path, KVC_SEQ_ALL, NULL, 0, NULL), KVC_ERR_INVALID_STATE,
              "layout mismatch");
    kvc_memory_free(f16);
    CHECK_ERR(kvc_state_seq_load_file(other, path, 7, NULL, 0, NULL), KVC_ERR_OUT_OF_RANGE, "");
    CHECK_ERR(kvc_state_seq_load_file(NULL, path, 0, NULL, 0, NULL), KVC_ERR_INVALID_ARGUMENT, "mem is NULL");
    CHECK_ERR(kvc_state_seq_load_file(other, NULL, 0, NULL, 0, NULL), KVC_ERR_INVALID_ARGUMENT,
              "path is NULL");
    CHECK(same_state(other, before, n_before));

    /* llama.cpp's 'ggsq' files */
    CHECK_OK(kvc_state_seq_save_llama_file(mem, llama_path, 0, tokens, 4));
    CHECK_ERR(kvc_state_seq_load_llama_file(other, llama_path, 1, got, 2, &n_got), KVC_ERR_OUT_OF_RANGE,
              "holds 4 tokens");
    CHECK(same_state(other, before, n_before));
    CHECK_ERR(kvc_state_seq_load_file(other, llama_path, 1, got, 4, &n_got), KVC_ERR_CORRUPT_DATA, "ggsq");
    memset(got, 0, sizeof got);
    CHECK_OK(kvc_state_seq_load_llama_file(other, llama_path, 1, got, 4, &n_got));
    CHECK(n_got == 4 && memcmp(got, tokens, sizeof tokens) == 0);
    int32_t pos = 0;
    CHECK_OK(kvc_memory_seq_pos_max(other, 1, &pos));
    CHECK(pos == 3);
    CHECK_OK(kvc_state_seq_save_llama_file(mem, llama_path, 0, NULL, 0));
    CHECK_OK(kvc_state_seq_load_llama_file(other, llama_path, 0, got, 4, &n_got)); /* no tokens */
    CHECK(n_got == 0);
    CHECK_OK(kvc_state_seq_load_llama_file(other, llama_path, 0, NULL, 0, NULL));
    CHECK_ERR(kvc_state_seq_save_llama_file(mem, llama_path, 0, NULL, 1), KVC_ERR_INVALID_ARGUMENT, "tokens");
    CHECK_ERR(kvc_state_seq_save_llama_file(NULL, llama_path, 0, tokens, 4), KVC_ERR_INVALID_ARGUMENT, "mem");
    CHECK_ERR(kvc_state_seq_save_llama_file(mem, NULL, 0, tokens, 4), KVC_ERR_INVALID_ARGUMENT,
              "path is NULL");
    CHECK_ERR(kvc_state_seq_load_llama_file(NULL, llama_path, 0, NULL, 0, NULL), KVC_ERR_INVALID_ARGUMENT,
              "mem");
    CHECK_ERR(kvc_state_seq_load_llama_file(other, NULL, 0, NULL, 0, NULL), KVC_ERR_INVALID_ARGUMENT, "path");

    free(before);
    kvc_memory_free(other);
    kvc_memory_free(mem);
    remove(path);
    remove(llama_path);
    remove(junk_path);
}

int main(void) {
    test_state();
    test_files();
    return capi_report("capi_state");
}
