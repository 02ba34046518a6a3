// libFuzzer target: kvc::limits (issue 21). Each input chooses the limits (set_limits) and one input they
// govern: a batch (batch::init, kvc_batch_init), the creation of a memory (kv_cache, memory_recurrent), a
// session file, a session file forged with any declared payload size, a state buffer, a GGUF file. Checked:
// - a refusal by a limit is the kvc::error the limit documents, naming the limit and the value (a file's
//   payload over the largest state of the memory it goes into, memory_i::state_max_bytes, naming both);
// - what is accepted is within every limit;
// - the bytes allocated during the call (every malloc, zstd's too, counted through the sanitizer's hooks)
//   stay within what the input may legitimately need (see each case);
// - a refused load leaves the cache byte for byte as it was; nothing crashes.
// The default limits are restored after every input. Sizes are kept small (memory_bytes <= 1 MiB) so that
// an input costs well under a millisecond.
//
// Input: one byte choosing the case (and the cache variant of a load), ten bytes of limits (file_bytes,
// metadata_bytes, batch_tokens and sequences as u16, memory_bytes as u16 KiB), then the case's own bytes.
#include <sanitizer/allocator_interface.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>

#include <fmt/format.h>
#include <xxhash.h>
#include <zstd.h>

#include <kvcache/batch.h>
#include <kvcache/kvcache.h>
#include <kvcache/limits.h>
#include <kvcache/memory_budget.h>
#include <kvcache/memory_recurrent.h>
#include <kvcache/runtime/gguf.h>
#include <kvcache/session.h>

#include "fuzz_caches.h"

using namespace kvc;
using namespace kvc::fuzz;

// What the current case did (sizes, the error), printed with a broken invariant.
std::string g_context;  // NOLINT: one fuzzing thread

// An invariant that must hold: else the condition, its line and the context, then abort (a finding).
#define require(cond)                                                                            \
    do {                                                                                         \
        if (!(cond)) {                                                                           \
            std::fprintf(stderr, "fuzz_limits.cpp:%d: %s does not hold (%s)\n", __LINE__, #cond, \
                         g_context.c_str());                                                     \
            std::abort();                                                                        \
        }                                                                                        \
    } while (0)

namespace {

// -- bytes allocated during a call --

// Net bytes allocated since arm(), and the most they reached. Frees of older blocks count too (the net
// extra memory of the call is what the target bounds).
std::atomic<bool> g_counting{false};
std::atomic<int64_t> g_live{0}, g_peak{0};

void on_malloc(const volatile void*, size_t n) {
    if (!g_counting.load(std::memory_order_relaxed)) return;
    const int64_t now = g_live.fetch_add(static_cast<int64_t>(n)) + static_cast<int64_t>(n);
    int64_t peak = g_peak.load();
    while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {}
}

void on_free(const volatile void* p) {
    if (!p || !g_counting.load(std::memory_order_relaxed)) return;
    g_live.fetch_sub(static_cast<int64_t>(__sanitizer_get_allocated_size(const_cast<const void*>(p))));
}

// Runs f with allocations counted; returns the peak of the net bytes it allocated.
template <class F>
uint64_t peak_of(F&& f) {
    g_live = 0;
    g_peak = 0;
    g_counting = true;
    try {
        f();
    } catch (...) {
        g_counting = false;
        throw;
    }
    g_counting = false;
    return static_cast<uint64_t>(g_peak.load());
}

// -- input --

struct reader {
    const uint8_t* data;
    size_t size;
    size_t at = 0;
    uint8_t u8() { return at < size ? data[at++] : 0; }
    uint16_t u16() { return static_cast<uint16_t>(u8() | (u8() << 8)); }
    uint32_t u32() { return u16() | (static_cast<uint32_t>(u16()) << 16); }
    uint64_t u64() { return u32() | (static_cast<uint64_t>(u32()) << 32); }
    // a size argument: usually small, sometimes anything (the refusals)
    int32_t arg() {
        const uint8_t how = u8();
        if (how % 4 == 0) return static_cast<int32_t>(u32());
        return static_cast<int32_t>(u16() % (how % 4 == 1 ? 64 : 4096));
    }
    std::span<const uint8_t> rest() {
        const auto out = std::span(data + std::min(at, size), size - std::min(at, size));
        at = size;
        return out;
    }
};

// f's kvc::error, if it throws one (anything else escapes: libFuzzer reports it).
template <class F>
std::optional<error> refusal(F&& f) {
    try {
        f();
    } catch (const error& e) {
        return e;
    }
    return std::nullopt;
}

bool says(const error& e, const std::string& what) {
    const bool yes = std::string(e.what()).find(what) != std::string::npos;
    if (!yes) std::fprintf(stderr, "fuzz_limits: \"%s\" does not say \"%s\"\n", e.what(), what.c_str());
    return yes;
}

// A refusal by check_limit: out_of_range "WHAT: VALUE, over the limit NAME of MAX (kvc::limits)".
void check_limit_refusal(const std::optional<error>& e, const char* name, uint64_t value, uint64_t max) {
    require(e.has_value() && e->code() == errc::out_of_range);
    require(says(*e, fmt::format("{}, over the limit {} of {} (kvc::limits)", value, name, max)));
}

// -- the cases --

// A batch of n tokens (embeddings of n_embd values, or token ids) for n_seq sequences: refused by
// batch_tokens, sequences or memory_bytes in that order, else allocated at exactly its bytes.
void batch_case(reader& r, const limits& lim, bool c_api) {
    const int32_t n = r.arg(), n_embd = r.arg() % 64, n_seq = r.arg();
    const uint64_t per_token = (n_embd == 0 ? 4 : 4 * static_cast<uint64_t>(std::max(n_embd, 0))) + 4 + 4 +
                               sizeof(void*) + 1 + 4 * static_cast<uint64_t>(std::max(n_seq, 0));
    const uint64_t need = mul_sat(per_token, static_cast<uint64_t>(std::max(n, 0)));
    std::optional<error> e;
    const uint64_t peak = peak_of([&] {
        if (!c_api) {
            e = refusal([&] {
                const batch_storage b = batch::init(n, n_embd, n_seq);
                require(b.capacity() == n);
            });
            return;
        }
        kvc_batch* b = kvc_batch_init(n, n_embd, n_seq);
        if (b == nullptr) e = error(errc::invalid_argument, kvc_last_error());  // the code is not kept
        kvc_batch_free(b);
    });
    g_context = fmt::format("batch of {} x {} embd x {} seqs: need {}, peak {}, {}", n, n_embd, n_seq, need,
                            peak, e ? e->what() : "made");
    if (n < 1 || n_embd < 0 || n_seq < 1) {
        require(e.has_value() && says(*e, "n_tokens_alloc >= 1"));
    } else if (static_cast<uint64_t>(n) > lim.batch_tokens) {
        if (!c_api) check_limit_refusal(e, "batch_tokens", static_cast<uint64_t>(n), lim.batch_tokens);
        require(e.has_value() && says(*e, fmt::format("{}, over the limit batch_tokens", n)));
    } else if (static_cast<uint64_t>(n_seq) > lim.sequences) {
        if (!c_api) check_limit_refusal(e, "sequences", static_cast<uint64_t>(n_seq), lim.sequences);
        require(e.has_value() && says(*e, fmt::format("{}, over the limit sequences", n_seq)));
    } else if (need > lim.memory_bytes) {
        require(e.has_value() && says(*e, "over the memory budget") &&
                (c_api || e->code() == errc::out_of_memory));
    } else {
        require(!e.has_value());
    }
    require(peak <= std::min(need, lim.memory_bytes) + 4096);  // refused: an error; accepted: its arrays
}

// A KV cache's creation: refused by sequences or by memory_bytes (its K/V bytes, computed before anything
// is allocated), else its reserved bytes are at least those, and its heap (bookkeeping) at most 1 KiB per
// stream and 128 bytes per cell.
void kv_cache_case(reader& r, const limits& lim) {
    kv_cache_params p;
    const uint32_t n_layer = 1 + r.u8() % 4;
    for (uint32_t il = 0; il < n_layer; ++il) {
        const uint8_t b = r.u8();
        p.layers.push_back(layer_desc{.n_head_kv = 1u + (b & 1),
                                      .n_embd_head_k = 32u * (1 + ((b >> 1) & 1)),
                                      .n_embd_head_v = 32u * (1 + ((b >> 2) & 1))});
    }
    p.kv_size = 1 + r.u16();
    p.n_seq_max = static_cast<uint32_t>(r.arg());
    const uint8_t flags = r.u8();
    p.unified = flags & 1;
    p.v_trans = flags & 2;
    p.type_k = p.type_v = dtype::f16;
    uint64_t e_vmax = 0;  // transposed V: every layer's rows as wide as the widest
    for (const layer_desc& d : p.layers) e_vmax = std::max<uint64_t>(e_vmax, d.n_head_kv * d.n_embd_head_v);
    uint64_t cell = 0;  // f16 K and V bytes of a cell
    for (const layer_desc& d : p.layers)
        cell += 2 * (uint64_t{d.n_head_kv} * d.n_embd_head_k +
                     (p.v_trans ? e_vmax : d.n_head_kv * d.n_embd_head_v));
    const uint64_t streams = p.unified ? 1 : p.n_seq_max;
    const uint64_t need = mul_sat(cell, mul_sat(p.kv_size, streams));
    std::optional<error> e;
    std::unique_ptr<kv_cache> c;
    const uint64_t peak = peak_of([&] { e = refusal([&] { c = std::make_unique<kv_cache>(p); }); });
    g_context =
        fmt::format("kv_cache: {} layers, {} cells, n_seq_max {}, unified {}: need {}, peak {}, {}",
                    p.layers.size(), p.kv_size, p.n_seq_max, p.unified, need, peak, e ? e->what() : "made");
    if (p.n_seq_max == 0 || (!p.unified && p.n_seq_max > 65536 && p.n_seq_max <= lim.sequences)) {
        require(e.has_value() && e->code() == errc::invalid_argument);
    } else if (p.n_seq_max > lim.sequences) {
        check_limit_refusal(e, "sequences", p.n_seq_max, lim.sequences);
    } else if (need > lim.memory_bytes) {
        require(e.has_value() && e->code() == errc::out_of_memory && says(*e, "over the memory budget"));
    } else {
        require(!e.has_value() && c->get_memory_breakdown().reserved >= need);  // tensors page-aligned
    }
    // K/V pages are reserved address space (not malloc'd); the heap holds the bookkeeping: a few hundred
    // bytes per stream and a few words per cell (issue 21: it once grew with n_seq_max squared)
    const uint64_t cells = uint64_t{p.kv_size} * streams;
    require(peak <= (e ? 4096 : 1024 * streams + 128 * cells + 65536));
}

// A recurrent memory's creation: refused by sequences or memory_bytes, else within them; its bookkeeping
// is a few words per cell beside its rows.
void recurrent_case(reader& r, const limits& lim) {
    recurrent_params p;
    const uint32_t n_layer = 1 + r.u8() % 4;
    for (uint32_t il = 0; il < n_layer; ++il)
        p.layers.push_back(recurrent_layer_desc{.n_embd_r = r.u8() % 16u, .n_embd_s = r.u8() % 128u});
    p.n_seq_max = static_cast<uint32_t>(r.arg());
    p.n_rs_seq = r.u8() % 3;
    uint64_t row = 0;
    for (const recurrent_layer_desc& d : p.layers) row += uint64_t{4} * (d.n_embd_r + d.n_embd_s);  // f32
    const uint64_t need = mul_sat(row, mul_sat(p.n_rs_seq + 1, p.n_seq_max));
    std::optional<error> e;
    std::unique_ptr<memory_recurrent> m;
    const uint64_t peak = peak_of([&] { e = refusal([&] { m = std::make_unique<memory_recurrent>(p); }); });
    g_context = fmt::format("memory_recurrent: {} layers, n_seq_max {}, n_rs_seq {}: need {}, peak {}, {}",
                            p.layers.size(), p.n_seq_max, p.n_rs_seq, need, peak, e ? e->what() : "made");
    if (p.n_seq_max == 0 || p.n_seq_max > static_cast<uint32_t>(INT32_MAX)) {
        require(e.has_value() && e->code() == errc::invalid_argument);
    } else if (p.n_seq_max > lim.sequences) {
        check_limit_refusal(e, "sequences", p.n_seq_max, lim.sequences);
    } else if (row == 0) {
        require(e.has_value() && e->code() == errc::invalid_argument);
    } else if (need > lim.memory_bytes) {
        require(e.has_value() && e->code() == errc::out_of_memory && says(*e, "over the memory budget"));
    } else {
        require(!e.has_value() && m->get_memory_breakdown().reserved <= lim.memory_bytes);
    }
    require(peak <= (e ? 4096 : need + 64 * uint64_t{p.n_seq_max} + 65536));
}

std::string file_path() {
    const char* dir = std::getenv("TMPDIR");
    return fmt::format("{}/kvc-fuzz-limits-{}.bin", dir ? dir : "/tmp", ::getpid());
}

void put_file(const std::string& path, std::span<const uint8_t> bytes) {
    FILE* f = std::fopen(path.c_str(), "wb");
    require(f != nullptr);
    if (!bytes.empty()) require(std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size());
    std::fclose(f);
}

template <class T>
void put_at(std::vector<uint8_t>& f, size_t at, T v) {
    std::memcpy(f.data() + at, &v, sizeof v);
}

// A session file around `stored` that passes every checksum, declaring `payload_bytes`
// (docs/state-format.md).
std::vector<uint8_t> forge(const std::string& layout, std::span<const uint8_t> stored, uint64_t payload_bytes,
                           bool zstd) {
    std::vector<uint8_t> f(session_header_size);
    f.insert(f.end(), layout.begin(), layout.end());
    f.insert(f.end(), stored.begin(), stored.end());
    put_at<uint32_t>(f, 0, session_magic);
    put_at<uint32_t>(f, 4, session_version);
    put_at<uint32_t>(f, 8, zstd ? session_flag_zstd : 0);
    put_at<int32_t>(f, 12, seq_all);
    put_at<uint32_t>(f, 24, static_cast<uint32_t>(layout.size()));
    put_at<uint64_t>(f, 32, payload_bytes);
    put_at<uint64_t>(f, 40, stored.size());
    put_at<uint64_t>(f, 48, XXH3_64bits(layout.data(), layout.size()));
    put_at<uint64_t>(f, 56, XXH3_64bits(f.data() + session_header_size, f.size() - session_header_size));
    put_at<uint64_t>(f, 64, XXH3_64bits(f.data(), 64));
    return f;
}

// A file of B bytes loaded into a small cache (as a session file, or a 'ggsq' one): refused by file_bytes
// from its size; a declared payload over the cache's largest state S refused before it is read; whatever
// the outcome, at most max(B, S) + S + 512 KiB allocated (read buffers of at most B, the stage of at most
// S, zstd's context and window of at most S), and a refusal changes nothing.
void file_case(reader& r, kv_cache* c, bool forged) {
    const uint8_t opt = r.u8();
    const seq_id_t dest = (opt >> 2) % 3 == 2 ? seq_all : (opt >> 2) % 3;
    const bool ggsq = !forged && (opt & 0x20);
    const bool zstd = opt & 0x40;
    std::vector<uint8_t> file;
    uint64_t declared = 0;
    if (forged) {
        // zstd: a frame header declaring any size (single segment, 8-byte content size), then any blocks;
        // plain: the payload's own size
        std::vector<uint8_t> stored;
        if (zstd) {
            declared = r.u8() & 1 ? r.u64() : r.u16();
            stored = {0x28, 0xb5, 0x2f, 0xfd, 0xe0};
            for (int k = 0; k < 8; ++k) stored.push_back(static_cast<uint8_t>(declared >> (8 * k)));
        }
        const auto rest = r.rest();
        stored.insert(stored.end(), rest.begin(), rest.end());
        if (!zstd) declared = stored.size();
        file = forge(c->state_layout(), stored, declared, zstd);
    } else {
        const auto rest = r.rest();
        file.assign(rest.begin(), rest.end());
    }
    const std::string path = file_path();
    put_file(path, file);
    const uint64_t max = c->state_max_bytes();
    const std::vector<uint8_t> before = state_seq_get_data(*c, seq_all);
    std::optional<error> e;
    const uint64_t peak = peak_of([&] {
        e = refusal([&] {
            if (ggsq)
                load_llama_seq_file(*c, path, dest);
            else
                load_file(*c, path, dest);
        });
    });
    std::remove(path.c_str());
    const uint64_t size = file.size();
    g_context = fmt::format("file of {} bytes ({}), declared {}, largest state {}: peak {}, {}", size,
                            ggsq ? "ggsq" : "session", declared, max, peak, e ? e->what() : "loaded");
    if (size > file_bytes_limit()) {
        check_limit_refusal(e, "file_bytes", size, file_bytes_limit());
    } else if (forged && declared > max && declared != ZSTD_CONTENTSIZE_UNKNOWN &&
               declared != ZSTD_CONTENTSIZE_ERROR) {
        require(e.has_value() && e->code() == errc::corrupt_data &&
                says(*e, fmt::format("the payload is {} bytes, more than the {} bytes", declared, max)));
    }
    if (e) require(state_seq_get_data(*c, seq_all) == before);
    require(peak <= std::max(size, max) + max + (uint64_t{512} << 10));
}

// A state buffer of B bytes: over the largest state S refused; at most S + 64 KiB allocated (the buffer is
// read in place, so its size decides nothing); a refusal changes nothing.
void state_case(reader& r, kv_cache* c) {
    const uint8_t opt = r.u8();
    const seq_id_t dest = (opt >> 2) % 3 == 2 ? seq_all : (opt >> 2) % 3;
    const auto payload = r.rest();
    const uint64_t max = c->state_max_bytes();
    const std::vector<uint8_t> before = state_seq_get_data(*c, seq_all);
    std::optional<error> e;
    const uint64_t peak = peak_of([&] { e = refusal([&] { state_set_payload(*c, payload, dest); }); });
    g_context = fmt::format("state of {} bytes, largest {}: peak {}, {}", payload.size(), max, peak,
                            e ? e->what() : "loaded");
    if (payload.size() > max)
        require(e.has_value() && e->code() == errc::corrupt_data);  // no state is larger
    if (e) require(state_seq_get_data(*c, seq_all) == before);
    require(peak <= max + 65536);
}

// A GGUF file of B bytes: metadata over metadata_bytes refused naming it; what is accepted holds at most
// that much metadata; the parse costs O(B) (a copy of the bytes and the index of keys and tensors).
void gguf_case(reader& r, const limits& lim) {
    const auto bytes = r.rest();
    std::optional<error> e;
    uint64_t metadata = 0;
    const uint64_t peak = peak_of([&] {
        e = refusal([&] {
            const gguf_file f = gguf_file::parse(bytes);
            for (const gguf_kv& kv : f.metadata()) metadata += kv.key.size();
        });
    });
    g_context = fmt::format("gguf of {} bytes: peak {}, {}", bytes.size(), peak, e ? e->what() : "parsed");
    if (e && e->code() == errc::out_of_range) require(says(*e, "over the limit metadata_bytes of"));
    if (!e) require(metadata <= lim.metadata_bytes);
    require(peak <= 16 * uint64_t{bytes.size()} + 65536);
}

std::vector<uint8_t> seed(uint8_t which, std::span<const uint8_t> rest) {
    std::vector<uint8_t> s = {which, 0, 0x10, 0, 0x10, 0, 0x10, 0, 0x10, 0, 4};  // 4 KiB of limits each
    s.insert(s.end(), rest.begin(), rest.end());
    return s;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
    require(__sanitizer_install_malloc_and_free_hooks(on_malloc, on_free) != 0);
    if (!std::getenv("KVC_FUZZ_SEEDS")) return 0;
    std::vector<std::vector<uint8_t>> seeds;
    for (uint8_t which = 0; which < 4; ++which) seeds.push_back(seed(which, std::vector<uint8_t>(16, 1)));
    const auto c = make(0, true);
    const std::string path = file_path();
    for (const bool zstd : {false, true}) {
        session_save_options o;
        o.compress = zstd;
        save_file(*c, path, seq_all, o);
        std::vector<uint8_t> rest = {2};
        const auto file = read_file_bytes(path);
        rest.insert(rest.end(), file.begin(), file.end());
        seeds.push_back(seed(4, rest));
    }
    save_llama_seq_file(*c, path, 0, {});
    std::vector<uint8_t> rest = {0x20};
    const auto file = read_file_bytes(path);
    rest.insert(rest.end(), file.begin(), file.end());
    seeds.push_back(seed(4, rest));
    std::remove(path.c_str());
    const auto state = state_seq_get_data(*c, seq_all);
    std::vector<uint8_t> payload = {2};
    payload.insert(payload.end(), state.begin() + 8, state.end());
    seeds.push_back(seed(6, payload));
    write_seeds(seeds);
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    reader r{data, size};
    g_context.clear();
    const uint8_t head = r.u8();
    const uint8_t which = head % 8;
    // the cache a load goes into, made under the default limits (a memory_bytes of 1 KiB would refuse it)
    const auto cache = which >= 4 && which <= 6 ? make((head / 8) % n_variants, true) : nullptr;
    limits want;
    want.file_bytes = r.u16();
    want.metadata_bytes = r.u16();
    want.batch_tokens = r.u16();
    want.sequences = r.u16();
    want.memory_bytes = (static_cast<uint64_t>(r.u16() % 1024) + 1)
                        << 10;  // never 0 (physical memory): inputs stay small
    const limits defaults;
    const std::optional<error> refused = refusal([&] { set_limits(want); });
    if (want.batch_tokens == 0 || want.sequences == 0) {
        require(refused.has_value() && refused->code() == errc::invalid_argument);
        const limits now = get_limits();  // unchanged
        require(now.batch_tokens == defaults.batch_tokens && now.sequences == defaults.sequences);
        return 0;
    }
    require(!refused.has_value());
    const limits lim = get_limits();
    require(lim.file_bytes == want.file_bytes && lim.metadata_bytes == want.metadata_bytes &&
            lim.batch_tokens == want.batch_tokens && lim.sequences == want.sequences &&
            lim.memory_bytes == want.memory_bytes);
    switch (which) {
        case 0:
        case 1:
            batch_case(r, lim, which == 1);
            break;
        case 2:
            kv_cache_case(r, lim);
            break;
        case 3:
            recurrent_case(r, lim);
            break;
        case 4:
        case 5:
            file_case(r, cache.get(), which == 5);
            break;
        case 6:
            state_case(r, cache.get());
            break;
        default:
            gguf_case(r, lim);
            break;
    }
    set_limits(defaults);
    return 0;
}
