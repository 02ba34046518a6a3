// The C API (include/kvcache/kvcache.h): handles over the C++ objects, every entry point behind one
// exception barrier (guarded) that turns kvc::error into its status and message.
#include <kvcache/kvcache.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <kvcache/batch.h>
#include <kvcache/dtype.h>
#include <kvcache/kv_cache.h>
#include <kvcache/kv_cache_iswa.h>
#include <kvcache/memory.h>
#include <kvcache/memory_hybrid.h>
#include <kvcache/memory_recurrent.h>
#include <kvcache/session.h>
#include <kvcache/state.h>
#include <kvcache/types.h>

static_assert(sizeof(kvc::token_t) == sizeof(int32_t) && sizeof(kvc::pos_t) == sizeof(int32_t) &&
              sizeof(kvc::seq_id_t) == sizeof(int32_t));

// -- handles --

struct kvc_memory {
    kvc::memory_ptr mem;
    kvc_memory_kind kind = KVC_MEMORY_KIND_KV_CACHE;
    // The parts of mem (owned by mem), null when it has none of that kind:
    kvc::kv_cache* kv = nullptr;  // its only KV cache: a KV cache, or a hybrid's plain attention part (null
                                  // without K/V, and with two caches: iSWA)
    kvc::kv_cache_iswa* iswa = nullptr;     // an iSWA memory, or a hybrid's iSWA attention part
    kvc::memory_recurrent* recr = nullptr;  // a recurrent memory, or a hybrid's recurrent part
    uint32_t n_seq_max = 1;                 // what batches are validated against
    uint32_t n_pos = 1;
};

struct kvc_batch {
    std::optional<kvc::batch_storage> storage;  // kvc_batch_init
    std::vector<kvc::token_t> tokens;           // kvc_batch_get_one: a copy of the caller's tokens
    int32_t n_embd = 0;

    kvc::batch view() const { return storage ? storage->view() : kvc::batch::get_one(tokens); }
};

struct kvc_memory_context {
    enum class purpose : uint8_t { batch, full, update };

    // The state inputs of the applied ubatch (or of the full range), copied from the recurrent context
    // for kvc_memory_context_get_rs. The arrays' capacity is reserved with the context, so that copying
    // them after apply does not allocate.
    struct rs_inputs {
        bool valid = false;
        uint32_t head = 0;
        uint32_t n = 0;
        uint32_t n_seqs = 0;
        int32_t rs_z = -1;
        std::vector<int64_t> s_copy;         // [n]
        std::vector<kvc_rs_copy> hist_copy;  // history rows to carry over
    };

    kvc::batch_allocr balloc;     // the validated batch (declared before ctx: it outlives it)
    kvc::memory_context_ptr ctx;  // refers to its memory, which outlives it
    kvc_memory* mem = nullptr;    // borrowed: the memory the context was made from (it outlives it)
    purpose made_for = purpose::batch;
    // The current ubatch has been applied (K/V rows, views, masks and state inputs refer to it only then);
    // a full context counts as applied.
    bool applied = false;
    rs_inputs rs;
};

namespace {

using kvc::errc;

// -- errors --

struct error_slot {
    std::string text;
    const char* message = "";  // text, "" or a static fallback
};

thread_local error_slot t_error;

kvc_status to_status(errc code) {
    switch (code) {
        case errc::invalid_argument:
            return KVC_ERR_INVALID_ARGUMENT;
        case errc::out_of_range:
            return KVC_ERR_OUT_OF_RANGE;
        case errc::invalid_state:
            return KVC_ERR_INVALID_STATE;
        case errc::corrupt_data:
            return KVC_ERR_CORRUPT_DATA;
        case errc::unsupported:
            return KVC_ERR_UNSUPPORTED;
        case errc::io:
            return KVC_ERR_IO;
        case errc::out_of_memory:
            return KVC_ERR_OUT_OF_MEMORY;
    }
    return KVC_ERR_INTERNAL;
}

kvc_status fail(kvc_status status, const char* fn, std::string_view what) noexcept {
    error_slot& e = t_error;
    try {
        e.text.assign(fn).append(": ").append(what);
        e.message = e.text.c_str();
    } catch (...) {
        e.message = "kvcache: out of memory while recording an error";
    }
    return status;
}

// Runs f, the body of the C function fn; every exception becomes a status and this thread's message.
template <class F>
kvc_status guarded(const char* fn, const F& f) noexcept {
    try {
        f();
        return KVC_OK;
    } catch (const kvc::error& e) {
        return fail(to_status(e.code()), fn, e.what());
    } catch (const std::bad_alloc&) {
        return fail(KVC_ERR_OUT_OF_MEMORY, fn, "out of memory");
    } catch (const std::exception& e) {
        return fail(KVC_ERR_INTERNAL, fn, e.what());
    } catch (...) {
        return fail(KVC_ERR_INTERNAL, fn, "unknown exception");
    }
}

// guarded for queries returning a count: the value, or the (negative) status of the failure.
template <class F>
int64_t guarded_count(const char* fn, const F& f) noexcept {
    int64_t value = 0;
    const kvc_status st = guarded(fn, [&] { value = f(); });
    return st == KVC_OK ? value : static_cast<int64_t>(st);
}

[[noreturn]] void throw_error(errc code, const std::string& message) {
    throw kvc::error(code, message);
}

// A required pointer argument.
template <class T>
T& need(T* p, const char* name) {
    if (p == nullptr) throw_error(errc::invalid_argument, fmt::format("{} is NULL", name));
    return *p;
}

void need_ptr(const void* p, const char* name) {
    if (p == nullptr) throw_error(errc::invalid_argument, fmt::format("{} is NULL", name));
}

// An array argument: NULL only when empty.
void need_array(const void* p, size_t n, const char* name) {
    if (p == nullptr && n > 0)
        throw_error(errc::invalid_argument, fmt::format("{} is NULL but has {} entries", name, n));
}

// The value of a C enum read without loading it as the enum type: callers may pass any int, and a C++
// enum holding a value outside its range is undefined behaviour.
template <class E>
int32_t raw(const E& e) {
    static_assert(sizeof(E) == sizeof(int32_t));
    int32_t v = 0;
    std::memcpy(&v, &e, sizeof v);
    return v;
}

kvc::dtype to_dtype(const kvc_type& t, const char* name) {
    const auto d = kvc::dtype_from_ggml(raw(t));
    if (!d)
        throw_error(errc::invalid_argument,
                    fmt::format("{} = {} is not an element type (f32 0, f16 1, q4_0 2, q8_0 8, bf16 30)",
                                name, raw(t)));
    return *d;
}

// -- the parts of a memory, and of a context --

[[noreturn]] void throw_no_kv() {
    throw_error(errc::unsupported, "this memory holds no K/V (a recurrent memory)");
}

// The KV cache of a memory with exactly one, for the functions that take no layer; layer_fn names their
// variant that takes one.
const kvc::kv_cache& single_cache(const kvc_memory& m, const char* layer_fn) {
    if (m.kv != nullptr) return *m.kv;
    if (m.iswa != nullptr)
        throw_error(errc::unsupported,
                    fmt::format("this memory has two KV caches (iSWA: full-attention and sliding-window "
                                "layers); use {}, which takes a layer",
                                layer_fn));
    throw_no_kv();
}

// The KV cache of m that holds model layer il.
const kvc::kv_cache& layer_cache(const kvc_memory& m, uint32_t il) {
    if (m.kv == nullptr && m.iswa == nullptr) throw_no_kv();
    if (m.kv != nullptr && m.kv->has_layer(il)) return *m.kv;
    if (m.iswa != nullptr) {
        if (m.iswa->get_base().has_layer(il)) return m.iswa->get_base();
        if (m.iswa->get_swa().has_layer(il)) return m.iswa->get_swa();
    }
    throw_error(errc::out_of_range, fmt::format("model layer {} has no K/V in this memory", il));
}

kvc::memory_recurrent& recurrent_of(const kvc_memory& m) {
    if (m.recr == nullptr)
        throw_error(errc::unsupported,
                    "this memory holds no recurrent state (only recurrent and hybrid memories do)");
    return *m.recr;
}

void require_applied(const kvc_memory_context& c) {
    if (!c.applied)
        throw_error(errc::invalid_state,
                    "the current ubatch is not applied (call kvc_memory_context_apply first)");
}

// The KV context of a memory with one KV cache (the context itself, or a hybrid's attention child), whose
// current ubatch must be applied (what data, views and masks refer to).
kvc::kv_cache_context& applied_single_kv(const kvc_memory_context& c, const char* layer_fn) {
    require_applied(c);  // an applied context is not a failed one: composite contexts have their children
    const kvc::kv_cache& cache = single_cache(*c.mem, layer_fn);
    return need(c.ctx->get_attn(cache.layer_ids()[0]), "KV cache context");
}

// The KV context of the cache holding model layer il (the context itself, the iSWA child, or the hybrid's
// attention child), whose current ubatch must be applied.
kvc::kv_cache_context& applied_kv_layer(const kvc_memory_context& c, uint32_t il) {
    (void)layer_cache(*c.mem, il);
    require_applied(c);
    return need(c.ctx->get_attn(il), "KV cache context");
}

// Copies the recurrent context's inputs for kvc_memory_context_get_rs (after apply, or for a full context).
void capture_rs(kvc_memory_context& c) {
    const kvc::memory_recurrent_context& r = need(c.ctx->get_recr(), "recurrent context");
    kvc_memory_context::rs_inputs& in = c.rs;
    in.head = r.get_head();
    in.n = r.get_n_rs();
    in.rs_z = r.get_rs_z();
    in.n_seqs = c.made_for == kvc_memory_context::purpose::batch ? c.ctx->get_ubatch().n_seqs : in.n;
    in.s_copy.resize(in.n);
    for (uint32_t i = 0; i < in.n; ++i) in.s_copy[i] = r.s_copy(i);
    in.hist_copy.clear();
    for (const kvc::rs_copy& h : r.hist_copies()) in.hist_copy.push_back(kvc_rs_copy{h.src, h.dst});
    in.valid = true;
}

// Values per token of layer il's K (or V) rows; out_of_range for a layer without K/V, as kv_cache says.
size_t layer_width(const kvc::kv_cache& cache, uint32_t il, bool values) {
    if (!cache.has_layer(il))
        throw_error(errc::out_of_range, fmt::format("model layer {} has no K/V in this cache", il));
    const kvc::layer_desc& d = cache.params().layers[il];
    return size_t{d.n_head_kv} * (values ? d.n_embd_head_v : d.n_embd_head_k);
}

kvc::const_tensor_view f32_rows(const float* src, size_t width, size_t n_tokens) {
    if (n_tokens > std::numeric_limits<uint32_t>::max())
        throw_error(errc::invalid_argument, fmt::format("n_tokens = {} is too large", n_tokens));
    return kvc::const_tensor_view::contiguous(kvc::dtype::f32, reinterpret_cast<const std::byte*>(src),
                                              static_cast<int64_t>(width), static_cast<int64_t>(n_tokens));
}

void to_c(const kvc::tensor_view& v, kvc_tensor_view& out) {
    out.type = static_cast<kvc_type>(v.type);
    for (int i = 0; i < 4; ++i) {
        out.ne[i] = v.ne[i];
        out.nb[i] = v.nb[i];
    }
    out.data = v.data;
}

kvc_rope_params to_c(const kvc::rope_params& r) {
    kvc_rope_params c;
    c.type = static_cast<kvc_rope_type>(r.type);
    c.n_rot = r.n_rot;
    c.freq_base = r.freq_base;
    c.freq_scale = r.freq_scale;
    c.ext_factor = r.ext_factor;
    c.attn_factor = r.attn_factor;
    c.beta_fast = r.beta_fast;
    c.beta_slow = r.beta_slow;
    c.n_ctx_orig = r.n_ctx_orig;
    return c;
}

kvc::layer_desc to_cpp(const kvc_layer_desc& c, const char* name, size_t il) {
    kvc::layer_desc d;
    d.n_head_kv = c.n_head_kv;
    d.n_embd_head_k = c.n_embd_head_k;
    d.n_embd_head_v = c.n_embd_head_v;
    d.is_swa = c.is_swa;
    d.has_kv = c.has_kv;
    const int32_t rope = raw(c.rope.type);
    if (rope < 0 || rope > static_cast<int32_t>(kvc::rope_type::neox))
        throw_error(
            errc::invalid_argument,
            fmt::format("{}.layers[{}].rope.type = {} is not a kvc_rope_type (0 to 2)", name, il, rope));
    d.rope.type = static_cast<kvc::rope_type>(rope);
    d.rope.n_rot = c.rope.n_rot;
    d.rope.freq_base = c.rope.freq_base;
    d.rope.freq_scale = c.rope.freq_scale;
    d.rope.ext_factor = c.rope.ext_factor;
    d.rope.attn_factor = c.rope.attn_factor;
    d.rope.beta_fast = c.rope.beta_fast;
    d.rope.beta_slow = c.rope.beta_slow;
    d.rope.n_ctx_orig = c.rope.n_ctx_orig;
    return d;
}

// The C++ parameters of a KV cache; name ("params", "params.kv", ...) prefixes the fields in messages.
kvc::kv_cache_params to_cpp(const kvc_kv_cache_params& c, const char* name) {
    if (c.layers == nullptr || c.n_layers == 0)
        throw_error(errc::invalid_argument,
                    fmt::format("{}.layers must list every model layer (layers {}, n_layers {})", name,
                                c.layers ? "set" : "NULL", c.n_layers));
    kvc::kv_cache_params p;
    p.layers.reserve(c.n_layers);
    for (size_t il = 0; il < c.n_layers; ++il) p.layers.push_back(to_cpp(c.layers[il], name, il));
    if (c.layer_filter != nullptr) {
        const kvc_layer_filter filter = c.layer_filter;
        void* user_data = c.layer_filter_user_data;
        p.filter = [filter, user_data](uint32_t il) { return filter(il, user_data); };
    }
    p.type_k = to_dtype(c.type_k, fmt::format("{}.type_k", name).c_str());
    p.type_v = to_dtype(c.type_v, fmt::format("{}.type_v", name).c_str());
    p.v_trans = c.v_trans;
    p.kv_size = c.kv_size;
    p.n_seq_max = c.n_seq_max;
    p.unified = c.unified;
    p.n_pad = c.n_pad;
    p.n_kv_pad = c.n_kv_pad;
    p.n_swa = c.n_swa;
    const int32_t swa = raw(c.swa_type);
    if (swa < 0 || swa > static_cast<int32_t>(kvc::swa_type::symmetric))
        throw_error(errc::invalid_argument,
                    fmt::format("{}.swa_type = {} is not a kvc_swa_type (0 to 3)", name, swa));
    p.swa = static_cast<kvc::swa_type>(swa);
    p.n_pos = c.n_pos;
    p.compact_threshold = c.compact_threshold;
    return p;
}

// The C++ parameters of a recurrent memory.
kvc::recurrent_params to_cpp(const kvc_recurrent_params& c, const char* name) {
    if (c.layers == nullptr || c.n_layers == 0)
        throw_error(errc::invalid_argument,
                    fmt::format("{}.layers must list every model layer (layers {}, n_layers {})", name,
                                c.layers ? "set" : "NULL", c.n_layers));
    kvc::recurrent_params p;
    p.layers.reserve(c.n_layers);
    for (size_t il = 0; il < c.n_layers; ++il)
        p.layers.push_back(kvc::recurrent_layer_desc{c.layers[il].n_embd_r, c.layers[il].n_embd_s});
    if (c.layer_filter != nullptr) {
        const kvc_layer_filter filter = c.layer_filter;
        void* user_data = c.layer_filter_user_data;
        p.filter = [filter, user_data](uint32_t il) { return filter(il, user_data); };
    }
    p.type_r = to_dtype(c.type_r, fmt::format("{}.type_r", name).c_str());
    p.type_s = to_dtype(c.type_s, fmt::format("{}.type_s", name).c_str());
    p.n_seq_max = c.n_seq_max;
    p.n_rs_seq = c.n_rs_seq;
    return p;
}

kvc_recurrent_params to_c(const kvc::recurrent_params& p) {
    kvc_recurrent_params c;
    c.layers = nullptr;
    c.n_layers = 0;
    c.layer_filter = nullptr;
    c.layer_filter_user_data = nullptr;
    c.type_r = static_cast<kvc_type>(p.type_r);
    c.type_s = static_cast<kvc_type>(p.type_s);
    c.n_seq_max = p.n_seq_max;
    c.n_rs_seq = p.n_rs_seq;
    return c;
}

kvc_memory_context* new_context(kvc_memory& m, kvc_memory_context::purpose made_for,
                                kvc::memory_context_ptr ctx,
                                std::unique_ptr<kvc_memory_context> c = nullptr) {
    if (!c) c = std::make_unique<kvc_memory_context>();
    c->mem = &m;
    c->made_for = made_for;
    c->ctx = std::move(ctx);
    if (m.recr != nullptr && made_for != kvc_memory_context::purpose::update) {
        c->rs.s_copy.reserve(m.recr->get_size());
        c->rs.hist_copy.reserve(size_t{m.recr->get_size()} * m.recr->get_n_rs_seq());
    }
    return c.release();
}

// -- batches and masks --

kvc::batch_storage& editable(kvc_batch* batch) {
    kvc_batch& b = need(batch, "batch");
    if (!b.storage)
        throw_error(errc::invalid_argument, "the batch comes from kvc_batch_get_one and cannot be changed");
    return *b.storage;
}

// The KQ mask of the current ubatch in one KV context: that of the memory's only cache (no layer), or that
// of the cache holding layer il.
void set_kq_mask(const kvc_memory_context* ctx, std::optional<uint32_t> il, kvc::dtype type, void* dst,
                 size_t n_elements, bool causal, bool alibi) {
    const kvc_memory_context& c = need(ctx, "ctx");
    need_ptr(dst, "dst");
    kvc::kv_cache_context& k =
        il ? applied_kv_layer(c, *il)
           : applied_single_kv(c, type == kvc::dtype::f32 ? "kvc_memory_set_input_kq_mask_layer"
                                                          : "kvc_memory_set_input_kq_mask_f16_layer");
    if (n_elements > static_cast<size_t>(std::numeric_limits<int64_t>::max()))
        throw_error(errc::invalid_argument, fmt::format("n_elements = {} is too large", n_elements));
    k.set_input_kq_mask(
        kvc::tensor_view::contiguous(type, static_cast<std::byte*>(dst), static_cast<int64_t>(n_elements)),
        {.causal = causal, .alibi = alibi});
}

// -- session files --

// Tokens a file's header announces (u32 at `at`), if the file starts with `magic`; nullopt when the header
// cannot be read (the load then reports the problem properly). Offsets: docs/state-format.md.
std::optional<uint32_t> announced_tokens(const std::string& path, uint32_t magic, size_t at) {
    try {
        kvc::io_file_reader r(path);
        if (r.size() < at + 4) return std::nullopt;
        std::vector<uint8_t> head(at + 4);
        r.read(head.data(), head.size());
        uint32_t m = 0, n = 0;
        std::memcpy(&m, head.data(), 4);
        std::memcpy(&n, head.data() + at, 4);
        if (m != magic) return std::nullopt;
        return n;
    } catch (const kvc::error&) {
        return std::nullopt;
    }
}

// The shared part of both loaders: checks the token capacity before anything is loaded, then loads.
template <class Load>
void load_with_tokens(const std::string& path, uint32_t magic, size_t at, int32_t* tokens_out,
                      size_t capacity, size_t* n_tokens_out, const Load& load) {
    if (tokens_out != nullptr)
        if (const auto n = announced_tokens(path, magic, at); n && *n > capacity)
            throw_error(errc::out_of_range,
                        fmt::format("'{}' holds {} tokens, tokens_out has room for {}", path, *n, capacity));
    const std::vector<kvc::token_t> tokens = load();
    // The file was checked above; should it have been replaced in between, the first `capacity` tokens
    // are returned and n_tokens_out says how many there were.
    if (tokens_out != nullptr && !tokens.empty())
        std::memcpy(tokens_out, tokens.data(), std::min(capacity, tokens.size()) * sizeof(int32_t));
    if (n_tokens_out != nullptr) *n_tokens_out = tokens.size();
}

// -- logging --

struct c_log_sink {
    kvc_log_callback callback;
    void* user_data;
};

std::mutex g_log_mutex;
c_log_sink* g_log_sink = nullptr;  // owned; kept until replaced (a log call may come at any time)

void log_trampoline(kvc::log_level level, const char* message, void* user_data) {
    const auto* sink = static_cast<const c_log_sink*>(user_data);
    sink->callback(static_cast<kvc_log_level>(level), message, sink->user_data);
}

}  // namespace

// -- the C functions (C linkage from their declarations in kvcache.h) --

// -- errors, version --

const char* kvc_status_string(kvc_status status) noexcept {
    switch (raw(status)) {
        case KVC_OK:
            return "ok";
        case KVC_ERR_INVALID_ARGUMENT:
            return "invalid_argument";
        case KVC_ERR_OUT_OF_RANGE:
            return "out_of_range";
        case KVC_ERR_INVALID_STATE:
            return "invalid_state";
        case KVC_ERR_CORRUPT_DATA:
            return "corrupt_data";
        case KVC_ERR_UNSUPPORTED:
            return "unsupported";
        case KVC_ERR_IO:
            return "io";
        case KVC_ERR_OUT_OF_MEMORY:
            return "out_of_memory";
        case KVC_ERR_INTERNAL:
            return "internal";
        default:
            return "unknown";
    }
}

const char* kvc_last_error(void) noexcept {
    return t_error.message;
}

void kvc_clear_last_error(void) noexcept {
    t_error.message = "";
}

void kvc_set_log_callback(kvc_log_callback callback, void* user_data) noexcept {
    (void)guarded(__func__, [&] {
        const std::lock_guard lock(g_log_mutex);
        auto next = callback ? std::make_unique<c_log_sink>(c_log_sink{callback, user_data}) : nullptr;
        kvc::set_log_callback(callback ? log_trampoline : nullptr, next.get());
        // set_log_callback waited for calls in flight: nothing uses the previous sink any more
        delete g_log_sink;
        g_log_sink = next.release();
    });
}

const char* kvc_version_string(void) noexcept {
    return kvc::version_string();
}

// -- element types --

const char* kvc_type_name(kvc_type type) noexcept {
    const char* name = nullptr;
    (void)guarded(__func__, [&] { name = kvc::to_string(to_dtype(type, "type")); });
    return name;
}

int64_t kvc_type_block_size(kvc_type type) noexcept {
    return guarded_count(__func__, [&] { return kvc::block_size(to_dtype(type, "type")); });
}

int64_t kvc_row_size(kvc_type type, int64_t n) noexcept {
    return guarded_count(__func__,
                         [&] { return static_cast<int64_t>(kvc::row_size(to_dtype(type, "type"), n)); });
}

// -- memory creation --

kvc_layer_desc kvc_layer_desc_default(void) noexcept {
    const kvc::layer_desc d;
    kvc_layer_desc c;
    c.n_head_kv = d.n_head_kv;
    c.n_embd_head_k = d.n_embd_head_k;
    c.n_embd_head_v = d.n_embd_head_v;
    c.is_swa = d.is_swa;
    c.has_kv = d.has_kv;
    c.rope = to_c(d.rope);
    return c;
}

kvc_kv_cache_params kvc_kv_cache_default_params(void) noexcept {
    const kvc::kv_cache_params p;
    kvc_kv_cache_params c;
    c.layers = nullptr;
    c.n_layers = 0;
    c.layer_filter = nullptr;
    c.layer_filter_user_data = nullptr;
    c.type_k = static_cast<kvc_type>(p.type_k);
    c.type_v = static_cast<kvc_type>(p.type_v);
    c.v_trans = p.v_trans;
    c.kv_size = p.kv_size;
    c.n_seq_max = p.n_seq_max;
    c.unified = p.unified;
    c.n_pad = p.n_pad;
    c.n_kv_pad = p.n_kv_pad;
    c.n_swa = p.n_swa;
    c.swa_type = static_cast<kvc_swa_type>(p.swa);
    c.n_pos = p.n_pos;
    c.compact_threshold = p.compact_threshold;
    return c;
}

kvc_status kvc_kv_cache_create(const kvc_kv_cache_params* params, kvc_memory** out) noexcept {
    if (out) *out = nullptr;
    return guarded(__func__, [&] {
        const kvc_kv_cache_params& c = need(params, "params");
        need(out, "out");
        auto m = std::make_unique<kvc_memory>();
        auto cache = std::make_unique<kvc::kv_cache>(to_cpp(c, "params"));
        m->kind = KVC_MEMORY_KIND_KV_CACHE;
        m->kv = cache.get();
        m->n_seq_max = cache->params().n_seq_max;
        m->n_pos = cache->params().n_pos;
        m->mem = std::move(cache);
        *out = m.release();
    });
}

kvc_iswa_params kvc_iswa_default_params(void) noexcept {
    const kvc::kv_cache_iswa_params p;
    kvc_iswa_params c;
    c.kv = kvc_kv_cache_default_params();
    c.swa_full = p.swa_full;
    c.n_ubatch = p.n_ubatch;
    return c;
}

kvc_status kvc_iswa_create(const kvc_iswa_params* params, kvc_memory** out) noexcept {
    if (out) *out = nullptr;
    return guarded(__func__, [&] {
        const kvc_iswa_params& c = need(params, "params");
        need(out, "out");
        kvc::kv_cache_iswa_params p;
        p.kv = to_cpp(c.kv, "params.kv");
        p.swa_full = c.swa_full;
        p.n_ubatch = c.n_ubatch;
        auto m = std::make_unique<kvc_memory>();
        auto iswa = std::make_unique<kvc::kv_cache_iswa>(std::move(p));
        m->kind = KVC_MEMORY_KIND_ISWA;
        m->iswa = iswa.get();
        m->n_seq_max = iswa->params().kv.n_seq_max;
        m->n_pos = iswa->params().kv.n_pos;
        m->mem = std::move(iswa);
        *out = m.release();
    });
}

kvc_recurrent_params kvc_recurrent_default_params(void) noexcept {
    return to_c(kvc::recurrent_params{});
}

kvc_status kvc_recurrent_create(const kvc_recurrent_params* params, kvc_memory** out) noexcept {
    if (out) *out = nullptr;
    return guarded(__func__, [&] {
        const kvc_recurrent_params& c = need(params, "params");
        need(out, "out");
        auto m = std::make_unique<kvc_memory>();
        auto recr = std::make_unique<kvc::memory_recurrent>(to_cpp(c, "params"));
        m->kind = KVC_MEMORY_KIND_RECURRENT;
        m->recr = recr.get();
        m->n_seq_max = recr->params().n_seq_max;
        m->n_pos = 1;
        m->mem = std::move(recr);
        *out = m.release();
    });
}

kvc_hybrid_params kvc_hybrid_default_params(void) noexcept {
    const kvc::memory_hybrid_params p;
    kvc_hybrid_params c;
    c.attn = kvc_kv_cache_default_params();
    c.recr = to_c(p.recr);
    c.iswa = p.iswa;
    c.swa_full = p.swa_full;
    c.n_ubatch = p.n_ubatch;
    return c;
}

kvc_status kvc_hybrid_create(const kvc_hybrid_params* params, kvc_memory** out) noexcept {
    if (out) *out = nullptr;
    return guarded(__func__, [&] {
        const kvc_hybrid_params& c = need(params, "params");
        need(out, "out");
        kvc::memory_hybrid_params p;
        p.attn = to_cpp(c.attn, "params.attn");
        p.recr = to_cpp(c.recr, "params.recr");
        p.iswa = c.iswa;
        p.swa_full = c.swa_full;
        p.n_ubatch = c.n_ubatch;
        auto m = std::make_unique<kvc_memory>();
        auto hybrid = std::make_unique<kvc::memory_hybrid>(std::move(p));
        m->kind = c.iswa ? KVC_MEMORY_KIND_HYBRID_ISWA : KVC_MEMORY_KIND_HYBRID;
        m->kv = dynamic_cast<kvc::kv_cache*>(&hybrid->get_attn());
        m->iswa = dynamic_cast<kvc::kv_cache_iswa*>(&hybrid->get_attn());
        m->recr = &hybrid->get_recr();
        m->n_seq_max = hybrid->params().attn.n_seq_max;
        m->n_pos = hybrid->params().attn.n_pos;
        m->mem = std::move(hybrid);
        *out = m.release();
    });
}

kvc_status kvc_memory_get_kind(const kvc_memory* mem, kvc_memory_kind* out) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory& m = need(mem, "mem");
        need(out, "out") = m.kind;
    });
}

void kvc_memory_free(kvc_memory* mem) noexcept {
    delete mem;
}

// -- batches --

kvc_batch* kvc_batch_init(int32_t n_tokens_alloc, int32_t n_embd, int32_t n_seq_max) noexcept {
    kvc_batch* out = nullptr;
    (void)guarded(__func__, [&] {
        auto b = std::make_unique<kvc_batch>();
        b->storage.emplace(n_tokens_alloc, n_embd, n_seq_max);
        b->n_embd = n_embd;
        out = b.release();
    });
    return out;
}

kvc_batch* kvc_batch_get_one(const int32_t* tokens, size_t n_tokens) noexcept {
    kvc_batch* out = nullptr;
    (void)guarded(__func__, [&] {
        need_ptr(tokens, "tokens");
        if (n_tokens == 0 || n_tokens > static_cast<size_t>(std::numeric_limits<int32_t>::max()))
            throw_error(errc::invalid_argument, fmt::format("n_tokens = {} not in [1, INT32_MAX]", n_tokens));
        auto b = std::make_unique<kvc_batch>();
        b->tokens.assign(tokens, tokens + n_tokens);
        out = b.release();
    });
    return out;
}

void kvc_batch_free(kvc_batch* batch) noexcept {
    delete batch;
}

kvc_status kvc_batch_add(kvc_batch* batch, int32_t token, int32_t pos, const int32_t* seq_ids,
                         size_t n_seq_ids, bool output) noexcept {
    return guarded(__func__, [&] {
        kvc::batch_storage& s = editable(batch);
        need_ptr(seq_ids, "seq_ids");
        s.add(token, pos, std::span<const kvc::seq_id_t>(seq_ids, n_seq_ids), output);
    });
}

kvc_status kvc_batch_add_embd(kvc_batch* batch, const float* embd, int32_t pos, const int32_t* seq_ids,
                              size_t n_seq_ids, bool output) noexcept {
    return guarded(__func__, [&] {
        kvc::batch_storage& s = editable(batch);
        need_ptr(embd, "embd");
        need_ptr(seq_ids, "seq_ids");
        if (batch->n_embd == 0)
            throw_error(errc::invalid_argument,
                        "this batch holds tokens, not embeddings (use kvc_batch_add)");
        s.add(std::span<const float>(embd, static_cast<size_t>(batch->n_embd)), pos,
              std::span<const kvc::seq_id_t>(seq_ids, n_seq_ids), output);
    });
}

kvc_status kvc_batch_clear(kvc_batch* batch) noexcept {
    return guarded(__func__, [&] { editable(batch).clear(); });
}

kvc_status kvc_batch_set_output(kvc_batch* batch, int32_t i, bool output) noexcept {
    return guarded(__func__, [&] { editable(batch).set_output(i, output); });
}

int32_t kvc_batch_n_tokens(const kvc_batch* batch) noexcept {
    return static_cast<int32_t>(guarded_count(__func__, [&] {
        const kvc_batch& b = need(batch, "batch");
        return int64_t{b.storage ? b.storage->size() : static_cast<int32_t>(b.tokens.size())};
    }));
}

int32_t kvc_batch_capacity(const kvc_batch* batch) noexcept {
    return static_cast<int32_t>(guarded_count(__func__, [&] {
        const kvc_batch& b = need(batch, "batch");
        return int64_t{b.storage ? b.storage->capacity() : static_cast<int32_t>(b.tokens.size())};
    }));
}

// -- placement --

kvc_status kvc_memory_init_batch(kvc_memory* mem, const kvc_batch* batch, uint32_t n_ubatch, bool embd_all,
                                 kvc_memory_context** out) noexcept {
    if (out) *out = nullptr;
    return guarded(__func__, [&] {
        kvc_memory& m = need(mem, "mem");
        const kvc_batch& b = need(batch, "batch");
        need(out, "out");
        auto c = std::make_unique<kvc_memory_context>();
        kvc::batch_options opt;
        opt.n_seq_max = m.n_seq_max;
        opt.n_embd = b.n_embd;
        opt.n_pos = m.n_pos;
        opt.output_all = embd_all;
        c->balloc.init(b.view(), positions_of(m.mem.get()), opt);
        kvc::memory_context_ptr ctx = m.mem->init_batch(c->balloc, n_ubatch, embd_all);
        *out = new_context(m, kvc_memory_context::purpose::batch, std::move(ctx), std::move(c));
    });
}

kvc_status kvc_memory_init_full(kvc_memory* mem, kvc_memory_context** out) noexcept {
    if (out) *out = nullptr;
    return guarded(__func__, [&] {
        kvc_memory& m = need(mem, "mem");
        need(out, "out");
        std::unique_ptr<kvc_memory_context> c(
            new_context(m, kvc_memory_context::purpose::full, m.mem->init_full()));
        c->applied = true;  // views of every cell, nothing to apply
        if (m.recr != nullptr) capture_rs(*c);
        *out = c.release();
    });
}

kvc_status kvc_memory_init_update(kvc_memory* mem, bool optimize, kvc_memory_context** out) noexcept {
    if (out) *out = nullptr;
    return guarded(__func__, [&] {
        kvc_memory& m = need(mem, "mem");
        need(out, "out");
        *out = new_context(m, kvc_memory_context::purpose::update, m.mem->init_update(optimize));
    });
}

kvc_status kvc_memory_update(kvc_memory* mem, bool optimize, bool* updated) noexcept {
    return guarded(__func__, [&] {
        kvc_memory& m = need(mem, "mem");
        const kvc::memory_context_ptr ctx = m.mem->init_update(optimize);
        const bool work = ctx->get_status() == kvc::memory_status::success;
        if (work) ctx->apply();
        if (updated) *updated = work;
    });
}

void kvc_memory_context_free(kvc_memory_context* ctx) noexcept {
    delete ctx;
}

kvc_memory_status kvc_memory_context_status(const kvc_memory_context* ctx) noexcept {
    kvc_memory_status st = KVC_MEMORY_STATUS_FAILED_PREPARE;
    (void)guarded(__func__, [&] { st = static_cast<kvc_memory_status>(need(ctx, "ctx").ctx->get_status()); });
    return st;
}

kvc_status kvc_memory_context_apply(kvc_memory_context* ctx) noexcept {
    return guarded(__func__, [&] {
        kvc_memory_context& c = need(ctx, "ctx");
        c.ctx->apply();
        c.applied = true;
        if (c.made_for == kvc_memory_context::purpose::batch && c.mem->recr != nullptr) capture_rs(c);
    });
}

bool kvc_memory_context_next(kvc_memory_context* ctx) noexcept {
    bool more = false;
    (void)guarded(__func__, [&] {
        kvc_memory_context& c = need(ctx, "ctx");
        more = c.ctx->next();
        if (c.made_for == kvc_memory_context::purpose::batch) c.rs.valid = false;
        if (more) c.applied = false;
    });
    return more;
}

int64_t kvc_memory_context_n_kv(const kvc_memory_context* ctx) noexcept {
    return guarded_count(__func__, [&] {
        const kvc_memory_context& c = need(ctx, "ctx");
        (void)single_cache(*c.mem, "kvc_memory_context_n_kv_layer");
        return c.applied ? int64_t{applied_single_kv(c, "kvc_memory_context_n_kv_layer").get_n_kv()} : 0;
    });
}

int64_t kvc_memory_context_n_kv_layer(const kvc_memory_context* ctx, uint32_t il) noexcept {
    return guarded_count(__func__, [&] {
        const kvc_memory_context& c = need(ctx, "ctx");
        (void)layer_cache(*c.mem, il);
        return c.applied ? int64_t{applied_kv_layer(c, il).get_n_kv()} : 0;
    });
}

int64_t kvc_memory_context_n_tokens(const kvc_memory_context* ctx) noexcept {
    return guarded_count(__func__, [&] { return int64_t{need(ctx, "ctx").ctx->get_ubatch().n_tokens}; });
}

kvc_status kvc_memory_context_get_ubatch(const kvc_memory_context* ctx, kvc_ubatch_view* out) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory_context& c = need(ctx, "ctx");
        kvc_ubatch_view& v = need(out, "out");
        const kvc::ubatch& ub = c.ctx->get_ubatch();
        const auto ptr = [](const auto& vec) { return vec.empty() ? nullptr : vec.data(); };
        v.n_tokens = ub.n_tokens;
        v.n_seq_tokens = ub.n_seq_tokens;
        v.n_seqs = ub.n_seqs;
        v.n_seqs_unq = ub.n_seqs_unq;
        v.n_pos = ub.n_pos;
        v.n_embd = ub.n_embd;
        v.equal_seqs = ub.equal_seqs;
        v.token = ptr(ub.token);
        v.embd = ptr(ub.embd);
        v.pos = ptr(ub.pos);
        v.n_seq_id = ptr(ub.n_seq_id);
        v.seq_id_begin = ptr(ub.seq_id_begin);
        v.seq_id_data = ptr(ub.seq_id_data);
        v.seq_id_unq = ptr(ub.seq_id_unq);
        v.output = ptr(ub.output);
        v.batch_idx = ptr(ub.batch_idx);
    });
}

kvc_status kvc_memory_context_out_ids(const kvc_memory_context* ctx, const int32_t** ids,
                                      size_t* n) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory_context& c = need(ctx, "ctx");
        need(ids, "ids");
        need(n, "n");
        const std::span<const int32_t> o = c.ctx->out_ids();
        *ids = o.empty() ? nullptr : o.data();
        *n = o.size();
    });
}

// -- K/V data and attention inputs --

kvc_status kvc_memory_cpy_k(kvc_memory_context* ctx, uint32_t il, const float* src,
                            size_t n_tokens) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory_context& c = need(ctx, "ctx");
        need_ptr(src, "src");
        kvc::kv_cache_context& k = applied_kv_layer(c, il);
        k.cpy_k(il, f32_rows(src, layer_width(k.cache(), il, false), n_tokens));
    });
}

kvc_status kvc_memory_cpy_v(kvc_memory_context* ctx, uint32_t il, const float* src,
                            size_t n_tokens) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory_context& c = need(ctx, "ctx");
        need_ptr(src, "src");
        kvc::kv_cache_context& k = applied_kv_layer(c, il);
        k.cpy_v(il, f32_rows(src, layer_width(k.cache(), il, true), n_tokens));
    });
}

kvc_status kvc_memory_get_k(kvc_memory_context* ctx, uint32_t il, kvc_tensor_view* out) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory_context& c = need(ctx, "ctx");
        kvc_tensor_view& v = need(out, "out");
        kvc::kv_cache_context& k = applied_kv_layer(c, il);
        to_c(k.get_k(il), v);
    });
}

kvc_status kvc_memory_get_v(kvc_memory_context* ctx, uint32_t il, kvc_tensor_view* out) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory_context& c = need(ctx, "ctx");
        kvc_tensor_view& v = need(out, "out");
        kvc::kv_cache_context& k = applied_kv_layer(c, il);
        to_c(k.get_v(il), v);
    });
}

int64_t kvc_memory_kq_mask_elements(const kvc_memory_context* ctx) noexcept {
    return guarded_count(__func__, [&] {
        kvc::kv_cache_context& k = applied_single_kv(need(ctx, "ctx"), "kvc_memory_kq_mask_elements_layer");
        return static_cast<int64_t>(k.kq_mask_elements());
    });
}

int64_t kvc_memory_kq_mask_elements_layer(const kvc_memory_context* ctx, uint32_t il) noexcept {
    return guarded_count(__func__, [&] {
        kvc::kv_cache_context& k = applied_kv_layer(need(ctx, "ctx"), il);
        return static_cast<int64_t>(k.kq_mask_elements());
    });
}

kvc_status kvc_memory_set_input_kq_mask(const kvc_memory_context* ctx, float* dst, size_t n_elements,
                                        bool causal, bool alibi) noexcept {
    return guarded(__func__,
                   [&] { set_kq_mask(ctx, std::nullopt, kvc::dtype::f32, dst, n_elements, causal, alibi); });
}

kvc_status kvc_memory_set_input_kq_mask_f16(const kvc_memory_context* ctx, uint16_t* dst, size_t n_elements,
                                            bool causal, bool alibi) noexcept {
    return guarded(__func__,
                   [&] { set_kq_mask(ctx, std::nullopt, kvc::dtype::f16, dst, n_elements, causal, alibi); });
}

kvc_status kvc_memory_set_input_kq_mask_layer(const kvc_memory_context* ctx, uint32_t il, float* dst,
                                              size_t n_elements, bool causal, bool alibi) noexcept {
    return guarded(__func__, [&] { set_kq_mask(ctx, il, kvc::dtype::f32, dst, n_elements, causal, alibi); });
}

kvc_status kvc_memory_set_input_kq_mask_f16_layer(const kvc_memory_context* ctx, uint32_t il, uint16_t* dst,
                                                  size_t n_elements, bool causal, bool alibi) noexcept {
    return guarded(__func__, [&] { set_kq_mask(ctx, il, kvc::dtype::f16, dst, n_elements, causal, alibi); });
}

kvc_status kvc_memory_set_input_pos_bucket(const kvc_memory_context* ctx, int32_t* dst, size_t n,
                                           uint32_t n_buckets) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory_context& c = need(ctx, "ctx");
        need_ptr(dst, "dst");
        kvc::kv_cache_context& k = applied_single_kv(c, "kvc_memory_set_input_pos_bucket_layer");
        k.set_input_pos_bucket(std::span<int32_t>(dst, n), n_buckets);
    });
}

kvc_status kvc_memory_set_input_pos_bucket_layer(const kvc_memory_context* ctx, uint32_t il, int32_t* dst,
                                                 size_t n, uint32_t n_buckets) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory_context& c = need(ctx, "ctx");
        need_ptr(dst, "dst");
        applied_kv_layer(c, il).set_input_pos_bucket(std::span<int32_t>(dst, n), n_buckets);
    });
}

int64_t kvc_memory_k_shift_elements(const kvc_memory* mem) noexcept {
    return guarded_count(__func__, [&] {
        const kvc::kv_cache& kv = single_cache(need(mem, "mem"), "kvc_memory_k_shift_elements_layer");
        return int64_t{kv.get_size()} * kv.get_n_stream();
    });
}

int64_t kvc_memory_k_shift_elements_layer(const kvc_memory* mem, uint32_t il) noexcept {
    return guarded_count(__func__, [&] {
        const kvc::kv_cache& kv = layer_cache(need(mem, "mem"), il);
        return int64_t{kv.get_size()} * kv.get_n_stream();
    });
}

kvc_status kvc_memory_set_input_k_shift(const kvc_memory* mem, int32_t* dst, size_t n) noexcept {
    return guarded(__func__, [&] {
        const kvc::kv_cache& kv = single_cache(need(mem, "mem"), "kvc_memory_set_input_k_shift_layer");
        need_ptr(dst, "dst");
        kv.set_input_k_shift(std::span<int32_t>(dst, n));
    });
}

kvc_status kvc_memory_set_input_k_shift_layer(const kvc_memory* mem, uint32_t il, int32_t* dst,
                                              size_t n) noexcept {
    return guarded(__func__, [&] {
        const kvc::kv_cache& kv = layer_cache(need(mem, "mem"), il);
        need_ptr(dst, "dst");
        kv.set_input_k_shift(std::span<int32_t>(dst, n));
    });
}

// -- recurrent state --

kvc_status kvc_memory_context_get_rs(const kvc_memory_context* ctx, kvc_rs_view* out) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory_context& c = need(ctx, "ctx");
        kvc_rs_view& v = need(out, "out");
        const kvc::memory_recurrent& r = recurrent_of(*c.mem);
        require_applied(c);
        const kvc_memory_context::rs_inputs& in = c.rs;
        if (!in.valid)
            throw_error(errc::invalid_state, c.made_for == kvc_memory_context::purpose::update
                                                 ? "an update context has no state rows"
                                                 : "no current ubatch (every ubatch has been consumed)");
        v.head = in.head;
        v.n_rs = in.n;
        v.n_seqs = in.n_seqs;
        v.rs_z = in.rs_z;
        v.size = r.get_size();
        v.n_rs_seq = r.get_n_rs_seq();
        v.s_copy = in.s_copy.empty() ? nullptr : in.s_copy.data();
        v.hist_copy = in.hist_copy.empty() ? nullptr : in.hist_copy.data();
        v.n_hist_copy = in.hist_copy.size();
    });
}

kvc_status kvc_memory_get_r(kvc_memory_context* ctx, uint32_t il, kvc_tensor_view* out) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory_context& c = need(ctx, "ctx");
        kvc_tensor_view& v = need(out, "out");
        to_c(recurrent_of(*c.mem).get_r(il), v);
    });
}

kvc_status kvc_memory_get_s(kvc_memory_context* ctx, uint32_t il, kvc_tensor_view* out) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory_context& c = need(ctx, "ctx");
        kvc_tensor_view& v = need(out, "out");
        to_c(recurrent_of(*c.mem).get_s(il), v);
    });
}

// -- sequences --

kvc_status kvc_memory_clear(kvc_memory* mem, bool data) noexcept {
    return guarded(__func__, [&] { need(mem, "mem").mem->clear(data); });
}

kvc_status kvc_memory_seq_rm(kvc_memory* mem, int32_t seq_id, int32_t p0, int32_t p1,
                             bool* removed) noexcept {
    return guarded(__func__, [&] {
        const bool r = need(mem, "mem").mem->seq_rm(seq_id, p0, p1);
        if (removed) *removed = r;
    });
}

kvc_status kvc_memory_seq_cp(kvc_memory* mem, int32_t src, int32_t dst, int32_t p0, int32_t p1) noexcept {
    return guarded(__func__, [&] { need(mem, "mem").mem->seq_cp(src, dst, p0, p1); });
}

kvc_status kvc_memory_seq_keep(kvc_memory* mem, int32_t seq_id) noexcept {
    return guarded(__func__, [&] { need(mem, "mem").mem->seq_keep(seq_id); });
}

kvc_status kvc_memory_seq_add(kvc_memory* mem, int32_t seq_id, int32_t p0, int32_t p1,
                              int32_t shift) noexcept {
    return guarded(__func__, [&] { need(mem, "mem").mem->seq_add(seq_id, p0, p1, shift); });
}

kvc_status kvc_memory_seq_div(kvc_memory* mem, int32_t seq_id, int32_t p0, int32_t p1, int d) noexcept {
    return guarded(__func__, [&] { need(mem, "mem").mem->seq_div(seq_id, p0, p1, d); });
}

kvc_status kvc_memory_seq_pos_min(const kvc_memory* mem, int32_t seq_id, int32_t* out) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory& m = need(mem, "mem");
        need(out, "out") = m.mem->seq_pos_min(seq_id);
    });
}

kvc_status kvc_memory_seq_pos_max(const kvc_memory* mem, int32_t seq_id, int32_t* out) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory& m = need(mem, "mem");
        need(out, "out") = m.mem->seq_pos_max(seq_id);
    });
}

kvc_status kvc_memory_can_shift(const kvc_memory* mem, bool* out) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory& m = need(mem, "mem");
        need(out, "out") = m.mem->get_can_shift();
    });
}

// -- state --

kvc_status kvc_state_seq_get_size(const kvc_memory* mem, int32_t seq_id, uint32_t flags,
                                  size_t* out) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory& m = need(mem, "mem");
        need(out, "out") = kvc::state_seq_get_size(*m.mem, seq_id, flags);
    });
}

kvc_status kvc_state_seq_get_data(const kvc_memory* mem, int32_t seq_id, uint8_t* dst, size_t capacity,
                                  size_t* written, uint32_t flags) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory& m = need(mem, "mem");
        need_ptr(dst, "dst");
        const size_t n = kvc::state_seq_get_data(*m.mem, seq_id, std::span<uint8_t>(dst, capacity), flags);
        if (written) *written = n;
    });
}

kvc_status kvc_state_seq_set_data(kvc_memory* mem, const uint8_t* src, size_t size, int32_t dest,
                                  uint32_t flags, size_t* read) noexcept {
    return guarded(__func__, [&] {
        kvc_memory& m = need(mem, "mem");
        need_ptr(src, "src");
        const size_t n = kvc::state_seq_set_data(*m.mem, std::span<const uint8_t>(src, size), dest, flags);
        if (read) *read = n;
    });
}

kvc_status kvc_state_set_payload(kvc_memory* mem, const uint8_t* payload, size_t size, int32_t dest,
                                 uint32_t flags, size_t* read) noexcept {
    return guarded(__func__, [&] {
        kvc_memory& m = need(mem, "mem");
        need_ptr(payload, "payload");
        const size_t n = kvc::state_set_payload(*m.mem, std::span<const uint8_t>(payload, size), dest, flags);
        if (read) *read = n;
    });
}

kvc_status kvc_state_seq_save_file(const kvc_memory* mem, const char* path, int32_t seq_id,
                                   const int32_t* tokens, size_t n_tokens, bool compress) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory& m = need(mem, "mem");
        need_ptr(path, "path");
        need_array(tokens, n_tokens, "tokens");
        kvc::session_save_options opt;
        opt.compress = compress;
        if (n_tokens > 0) opt.tokens = std::span<const kvc::token_t>(tokens, n_tokens);
        kvc::save_file(*m.mem, path, seq_id, opt);
    });
}

kvc_status kvc_state_seq_load_file(kvc_memory* mem, const char* path, int32_t dest, int32_t* tokens_out,
                                   size_t capacity, size_t* n_tokens_out) noexcept {
    return guarded(__func__, [&] {
        kvc_memory& m = need(mem, "mem");
        need_ptr(path, "path");
        // header: u32 magic "KVCS" ... u32 n_tokens at byte 20 (docs/state-format.md)
        load_with_tokens(path, kvc::session_magic, 20, tokens_out, capacity, n_tokens_out,
                         [&] { return kvc::load_file(*m.mem, path, dest).tokens; });
    });
}

kvc_status kvc_state_seq_save_llama_file(const kvc_memory* mem, const char* path, int32_t seq_id,
                                         const int32_t* tokens, size_t n_tokens) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory& m = need(mem, "mem");
        need_ptr(path, "path");
        need_array(tokens, n_tokens, "tokens");
        const std::span<const kvc::token_t> toks =
            n_tokens > 0 ? std::span<const kvc::token_t>(tokens, n_tokens) : std::span<const kvc::token_t>();
        kvc::save_llama_seq_file(*m.mem, path, seq_id, toks);
    });
}

kvc_status kvc_state_seq_load_llama_file(kvc_memory* mem, const char* path, int32_t dest, int32_t* tokens_out,
                                         size_t capacity, size_t* n_tokens_out) noexcept {
    return guarded(__func__, [&] {
        kvc_memory& m = need(mem, "mem");
        need_ptr(path, "path");
        // header: u32 magic 'ggsq', u32 version, u32 n_tokens at byte 8
        load_with_tokens(path, kvc::llama_seq_file_magic, 8, tokens_out, capacity, n_tokens_out,
                         [&] { return kvc::load_llama_seq_file(*m.mem, path, dest); });
    });
}
