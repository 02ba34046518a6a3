// libFuzzer target: arbitrary bytes as a program of C API calls on a KV cache with a prefix cache (one
// unified stream or one per sequence, LRU or SLRU):
// attach, lookup, pin, unpin, priorities, decodes, sequence edits, state round trips, valid and
// invalid arguments mixed. No call may crash or trip a sanitizer; a call that fails must leave the memory
// exactly as it was (its state bytes, positions and prefix counters); at the end, with every sequence
// removed, every used cell must belong to a cached block (no cell leaked).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include <kvcache/kvcache.h>

namespace {

constexpr uint32_t kv_size = 32, block = 4, n_seq = 3, n_embd = 8;
constexpr int32_t n_vocab = 6;

struct reader {
    const uint8_t* data;
    size_t size;
    size_t at = 0;
    bool done() const { return at >= size; }
    uint8_t u8() { return at < size ? data[at++] : 0; }
    int32_t small() { return static_cast<int8_t>(u8()); }
};

void check(bool ok) {
    if (!ok) std::abort();  // a broken promise of the API: a real bug
}

// What a failed call must not change.
struct snapshot {
    std::vector<uint8_t> state;
    std::vector<int32_t> pos;
    kvc_prefix_stats stats{};

    static snapshot of(kvc_memory* mem) {
        snapshot s;
        size_t n = 0;
        check(kvc_state_seq_get_size(mem, KVC_SEQ_ALL, 0, &n) == KVC_OK);
        s.state.resize(n);
        check(kvc_state_seq_get_data(mem, KVC_SEQ_ALL, s.state.data(), n, nullptr, 0) == KVC_OK);
        for (int32_t q = 0; q < static_cast<int32_t>(n_seq); ++q) {
            int32_t lo = 0, hi = 0;
            check(kvc_memory_seq_pos_min(mem, q, &lo) == KVC_OK &&
                  kvc_memory_seq_pos_max(mem, q, &hi) == KVC_OK);
            s.pos.push_back(lo);
            s.pos.push_back(hi);
        }
        check(kvc_memory_get_prefix_stats(mem, &s.stats) == KVC_OK);
        return s;
    }
    bool operator==(const snapshot& o) const {
        const kvc_prefix_stats &a = stats, &b = o.stats;  // index_bytes is capacity, not content
        return state == o.state && pos == o.pos && a.lookups == b.lookups &&
               a.tokens_looked_up == b.tokens_looked_up && a.hit_tokens == b.hit_tokens &&
               a.published_blocks == b.published_blocks && a.evicted_blocks == b.evicted_blocks &&
               a.unpublished_blocks == b.unpublished_blocks && a.bytes_copied == b.bytes_copied &&
               a.blocks == b.blocks && a.cached_cells == b.cached_cells && a.shared_cells == b.shared_cells &&
               a.pinned_cells == b.pinned_cells && a.free_cells == b.free_cells;
    }
};

// Decodes tokens for seq from its next position (or a fuzzed one); rows are a function of the token.
kvc_status decode(kvc_memory* mem, int32_t seq, const std::vector<int32_t>& toks, int32_t p0) {
    kvc_batch* b = kvc_batch_init(static_cast<int32_t>(toks.size()), 0, 1);
    check(b != nullptr);
    kvc_status st = KVC_OK;
    for (size_t i = 0; i < toks.size() && st == KVC_OK; ++i)
        st = kvc_batch_add(b, toks[i], p0 + static_cast<int32_t>(i), &seq, 1, i + 1 == toks.size());
    kvc_memory_context* ctx = nullptr;
    if (st == KVC_OK) st = kvc_memory_init_batch(mem, b, 8, false, &ctx);
    kvc_batch_free(b);
    if (st != KVC_OK) return st;
    kvc_memory_status ms = KVC_MEMORY_STATUS_SUCCESS;
    check(kvc_memory_context_get_status(ctx, &ms) == KVC_OK);
    if (ms == KVC_MEMORY_STATUS_SUCCESS) {
        bool more = true;
        while (more) {
            check(kvc_memory_context_apply(ctx) == KVC_OK);
            kvc_ubatch_view ub;
            check(kvc_memory_context_get_ubatch(ctx, &ub) == KVC_OK);
            std::vector<float> rows(size_t{n_embd} * ub.n_tokens);
            for (uint32_t t = 0; t < ub.n_tokens; ++t)
                for (uint32_t e = 0; e < n_embd; ++e)
                    rows[t * n_embd + e] = static_cast<float>(ub.token[t] + e);
            check(kvc_memory_cpy_k(ctx, 0, rows.data(), ub.n_tokens) == KVC_OK);
            check(kvc_memory_cpy_v(ctx, 0, rows.data(), ub.n_tokens) == KVC_OK);
            check(kvc_memory_context_next(ctx, &more) == KVC_OK);
        }
    }
    kvc_memory_context_free(ctx);
    return ms == KVC_MEMORY_STATUS_SUCCESS ? KVC_OK : KVC_ERR_INVALID_STATE;  // no room: nothing changed
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    reader r{data, size};
    static kvc_layer_desc layer = [] {
        kvc_layer_desc l = kvc_layer_desc_default();
        l.n_embd_head_k = l.n_embd_head_v = n_embd;
        return l;
    }();
    kvc_kv_cache_params p = kvc_kv_cache_default_params();
    p.layers = &layer;
    p.n_layers = 1;
    p.type_k = p.type_v = KVC_TYPE_F32;
    p.kv_size = kv_size;
    p.n_seq_max = n_seq;
    p.n_kv_pad = 1;
    p.prefix.enabled = true;
    p.prefix.block_size = block;
    p.prefix.n_vocab = n_vocab;
    const uint8_t shape = r.u8();
    p.prefix.policy = (shape & 1) == 0   ? KVC_EVICT_LRU
                      : (shape & 4) == 0 ? KVC_EVICT_SLRU
                                         : KVC_EVICT_ADAPTIVE;
    p.unified = (shape & 2) == 0;  // else one stream per sequence: attaches copy rows across streams
    kvc_memory* mem = nullptr;
    check(kvc_kv_cache_create(&p, &mem) == KVC_OK);

    // prompts come from a few stems, so that attaches hit
    const int32_t stems[3][8] = {
        {1, 2, 3, 4, 5, 1, 2, 3}, {1, 2, 3, 4, 0, 0, 0, 0}, {5, 4, 3, 2, 1, 0, 1, 2}};
    while (!r.done()) {
        check(kvc_memory_prefix_publish(mem) == KVC_OK);  // what the next call may publish anyway
        const snapshot before = snapshot::of(mem);
        const uint8_t op = r.u8() % 11;
        const int32_t seq = r.small() % 5;  // -4..4: some out of range
        const int32_t* stem = stems[r.u8() % 3];
        std::vector<int32_t> toks(stem, stem + 8);
        toks.resize(r.u8() % 12);
        for (auto& t : toks) t = t == 0 && r.u8() % 4 == 0 ? r.small() : t;  // a few bad tokens
        const uint64_t key = r.u8() % 2;
        const uint32_t prio = r.u8();  // above 100 is an error
        uint32_t n = 0;
        kvc_status st = KVC_OK;
        switch (op) {
            case 0:
                st = kvc_memory_prefix_attach(mem, seq, toks.data(), toks.size(), key, prio, &n);
                break;
            case 1:
                st = kvc_memory_prefix_lookup(mem, toks.data(), toks.size(), key, &n);
                break;
            case 2:
                st = kvc_memory_prefix_pin(mem, toks.data(), toks.size(), key, &n);
                break;
            case 3:
                st = kvc_memory_prefix_unpin(mem, toks.data(), toks.size(), key, &n);
                break;
            case 4:
                st = kvc_memory_prefix_set_priority(mem, toks.data(), toks.size(), key, prio, &n);
                break;
            case 5:
            case 6: {
                int32_t pmax = -1;
                if (kvc_memory_seq_pos_max(mem, seq, &pmax) != KVC_OK) pmax = -1;
                const int32_t p0 = op == 5 ? pmax + 1 : r.small();
                if (!toks.empty()) st = decode(mem, seq, toks, p0);
                break;
            }
            case 7:
                st = kvc_memory_seq_rm(mem, seq, r.small(), r.small(), nullptr);
                break;
            case 8:
                st = kvc_memory_seq_cp(mem, seq, r.small() % 4, r.small(), r.small());
                break;
            case 9:
                st = kvc_memory_seq_add(mem, seq, r.small(), r.small(), r.small());
                break;
            default: {  // one sequence through a state buffer into another
                size_t bytes = 0;
                if (kvc_state_seq_get_size(mem, seq, 0, &bytes) != KVC_OK) break;
                std::vector<uint8_t> buf(bytes);
                check(kvc_state_seq_get_data(mem, seq, buf.data(), bytes, nullptr, 0) == KVC_OK);
                if (r.u8() % 4 == 0 && bytes > 8) buf[8 + r.u8() % (bytes - 8)] ^= 0x5a;  // damaged
                st = kvc_state_seq_set_data(mem, buf.data(), bytes, r.small() % 4, 0, nullptr);
                break;
            }
        }
        if (st != KVC_OK) check(snapshot::of(mem) == before);
    }
    // no cell leaked: without sequences, every used cell is a cached block's
    check(kvc_memory_seq_rm(mem, -1, -1, -1, nullptr) == KVC_OK);
    kvc_prefix_stats s{};
    check(kvc_memory_get_prefix_stats(mem, &s) == KVC_OK);
    const uint32_t cells = p.unified ? kv_size : kv_size * n_seq;
    check(s.shared_cells == 0 && s.free_cells + s.cached_cells == cells &&
          s.cached_cells == s.blocks * block);
    kvc_memory_free(mem);
    return 0;
}
