// kvcache from an engine's point of view, in one file: a small cache, two sequences decoded through
// batch_allocr / init_batch / apply with their K/V rows written by cpy_k / cpy_v, then seq_cp, seq_rm,
// and a sequence saved with state_seq_get_data and restored into another. Every step is checked; the
// exit status is 0 only if every check passed.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <kvcache/batch.h>
#include <kvcache/kv_cache.h>
#include <kvcache/state.h>
#include <kvcache/version.h>

namespace {

constexpr uint32_t n_layer = 2;
constexpr uint32_t n_head_kv = 2;
constexpr uint32_t head_dim = 8;
constexpr uint32_t n_embd_kv = n_head_kv * head_dim;  // values per K (or V) row

int failures = 0;

void check(bool ok, const std::string& what) {
    std::printf("  [%s] %s\n", ok ? "ok" : "FAILED", what.c_str());
    if (!ok) ++failures;
}

// The value an engine would compute for channel e of token (seq, pos) in layer il; K and V differ by
// sign. Small multiples of 1/8: exact in f16, so stored rows compare exactly.
float value(kvc::seq_id_t seq, kvc::pos_t pos, uint32_t il, uint32_t e, bool is_v) {
    const float x =
        static_cast<float>(seq * 100 + pos * 10 + static_cast<int>(il)) + static_cast<float>(e) / 8.0f;
    return is_v ? -x : x;
}

// Decodes one batch: validates it, places every ubatch and writes each token's K/V rows.
bool decode(kvc::kv_cache& cache, const kvc::batch_storage& b, uint32_t n_seq_max) {
    kvc::batch_allocr balloc;
    balloc.init(b.view(), kvc::positions_of(cache), {.n_seq_max = n_seq_max});
    kvc::memory_context_ptr ctx = cache.init_batch(balloc, /*n_ubatch=*/4, /*embd_all=*/false);
    if (kvc::is_fail(ctx->get_status())) return false;  // no room: the cache is unchanged
    do {
        ctx->apply();
        const kvc::ubatch& ub = ctx->get_ubatch();
        for (uint32_t il = 0; il < n_layer; ++il) {
            std::vector<float> k(size_t{ub.n_tokens} * n_embd_kv), v(k.size());
            for (uint32_t t = 0; t < ub.n_tokens; ++t)
                for (uint32_t e = 0; e < n_embd_kv; ++e) {
                    k[t * n_embd_kv + e] = value(ub.primary_seq(t), ub.pos[t], il, e, false);
                    v[t * n_embd_kv + e] = value(ub.primary_seq(t), ub.pos[t], il, e, true);
                }
            const auto as_view = [&](const std::vector<float>& rows) {
                return kvc::const_tensor_view::contiguous(
                    kvc::dtype::f32, reinterpret_cast<const std::byte*>(rows.data()), n_embd_kv, ub.n_tokens);
            };
            ctx->get_attn(il)->cpy_k(il, as_view(k));
            ctx->get_attn(il)->cpy_v(il, as_view(v));
        }
    } while (ctx->next());
    return true;
}

// Every cell of `seq` holds the rows of (data_seq, its position) in every layer.
bool rows_match(const kvc::kv_cache& cache, kvc::seq_id_t seq, kvc::seq_id_t data_seq) {
    std::vector<uint32_t> cells;
    cache.cells(0).seq_cells(seq, -1, -1, cells);
    if (cells.empty()) return false;
    std::vector<float> row(n_embd_kv);
    for (uint32_t cell : cells) {
        const kvc::pos_t pos = cache.cells(0).pos_get(cell);
        for (uint32_t il = 0; il < n_layer; ++il) {
            cache.read_row(kvc::kv_part::k, il, 0, cell, row);
            for (uint32_t e = 0; e < n_embd_kv; ++e)
                if (row[e] != value(data_seq, pos, il, e, false)) return false;
            cache.read_row(kvc::kv_part::v, il, 0, cell, row);
            for (uint32_t e = 0; e < n_embd_kv; ++e)
                if (row[e] != value(data_seq, pos, il, e, true)) return false;
        }
    }
    return true;
}

int run() {
    std::printf("kvcache %s (headers %s)\n", kvc::version_string(), KVC_VERSION_STRING);

    kvc::kv_cache_params params;
    params.layers.assign(
        n_layer,
        kvc::layer_desc{.n_head_kv = n_head_kv, .n_embd_head_k = head_dim, .n_embd_head_v = head_dim});
    params.type_k = kvc::dtype::f16;
    params.type_v = kvc::dtype::f16;
    params.kv_size = 64;
    params.n_seq_max = 4;
    kvc::kv_cache cache(params);
    std::printf("cache: %u cells, %u layers, K/V f16, %zu bytes\n", cache.get_size(), n_layer,
                cache.size_bytes());

    std::printf("decode: sequence 0 at positions 0-4, sequence 1 at 0-2, in one batch\n");
    kvc::batch_storage b = kvc::batch::init(8, 0, 4);
    for (kvc::pos_t p = 0; p < 5; ++p) b.add(/*token=*/10 + p, p, std::vector<kvc::seq_id_t>{0}, p == 4);
    for (kvc::pos_t p = 0; p < 3; ++p) b.add(/*token=*/20 + p, p, std::vector<kvc::seq_id_t>{1}, p == 2);
    check(decode(cache, b, params.n_seq_max), "the batch fits");
    check(cache.cells(0).get_used() == 8, "8 cells used");
    check(cache.seq_pos_min(0) == 0 && cache.seq_pos_max(0) == 4, "sequence 0 holds positions 0-4");
    check(cache.seq_pos_min(1) == 0 && cache.seq_pos_max(1) == 2, "sequence 1 holds positions 0-2");
    check(rows_match(cache, 0, 0) && rows_match(cache, 1, 1), "K/V rows read back as written");

    std::printf("seq_cp(0 -> 2, [0, 3)): sequence 2 shares the first three cells of sequence 0\n");
    cache.seq_cp(0, 2, 0, 3);
    check(cache.cells(0).get_used() == 8, "no cell added (cells are shared)");
    check(cache.seq_pos_max(2) == 2 && cache.cells(0).seq_n_cells(2) == 3, "sequence 2 holds positions 0-2");
    check(rows_match(cache, 2, 0), "sequence 2 sees sequence 0's rows");

    std::printf("seq_rm(0, [3, end)): sequence 0 drops positions 3 and 4\n");
    check(cache.seq_rm(0, 3, -1), "seq_rm succeeds");
    check(cache.seq_pos_max(0) == 2 && cache.cells(0).get_used() == 6, "sequence 0 ends at 2, 6 cells used");

    std::printf("state: save sequence 1, restore it as sequence 3\n");
    const std::vector<uint8_t> saved = kvc::state_seq_get_data(cache, 1);
    check(saved.size() == kvc::state_seq_get_size(cache, 1), "buffer size is state_seq_get_size");
    const size_t read = kvc::state_seq_set_data(cache, saved, 3);
    check(read == saved.size(), "every byte of the buffer was read");
    check(cache.seq_pos_min(3) == 0 && cache.seq_pos_max(3) == 2, "sequence 3 holds positions 0-2");
    check(rows_match(cache, 3, 1), "sequence 3 holds sequence 1's rows");
    check(rows_match(cache, 1, 1), "sequence 1 is unchanged");
    std::printf("cells: %s\n", cache.cells(0).picture().substr(0, 16).c_str());

    bool refused = false;
    try {
        std::vector<uint8_t> truncated(saved.begin(), saved.end() - 1);
        kvc::state_seq_set_data(cache, truncated, 3);
    } catch (const kvc::error& e) {
        refused = e.code() == kvc::errc::corrupt_data;
    }
    check(refused && rows_match(cache, 3, 1), "a truncated buffer is refused and changes nothing");

    if (failures != 0) {
        std::printf("%d check(s) FAILED\n", failures);
        return EXIT_FAILURE;
    }
    std::printf("all checks passed\n");
    return EXIT_SUCCESS;
}

}  // namespace

int main() {
    try {
        return run();
    } catch (const std::exception& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return EXIT_FAILURE;
    }
}
