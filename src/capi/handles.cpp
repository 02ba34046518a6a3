// The C API's foundations: the error barrier's message slot, logging, the version, element types, the
// conversions between C and C++ parameters and their defaults, and the parts of a memory.
#include <functional>
#include <limits>
#include <memory>
#include <mutex>

#include <fmt/format.h>
#include <kvcache/memory_hybrid.h>

#include "capi_impl.h"

static_assert(sizeof(kvc::token_t) == sizeof(int32_t) && sizeof(kvc::pos_t) == sizeof(int32_t) &&
              sizeof(kvc::seq_id_t) == sizeof(int32_t));
// prefix events cross by static_cast: the C enumerators are the C++ ones
static_assert(KVC_PREFIX_EVENT_STORED == static_cast<int>(kvc::prefix_event::kind::stored) &&
              KVC_PREFIX_EVENT_REMOVED == static_cast<int>(kvc::prefix_event::kind::removed) &&
              KVC_PREFIX_EVENT_CLEARED == static_cast<int>(kvc::prefix_event::kind::cleared));
static_assert(KVC_PREFIX_PART_KV == static_cast<int>(kvc::prefix_part::kv) &&
              KVC_PREFIX_PART_SWA == static_cast<int>(kvc::prefix_part::swa) &&
              KVC_PREFIX_PART_SNAPSHOT == static_cast<int>(kvc::prefix_part::snapshot));

namespace kvc::capi {

// -- errors --

namespace {

struct error_slot {
    std::string text;
    const char* message = "";  // text, "" or a static fallback
};

thread_local error_slot t_error;

}  // namespace

kvc_status to_status(errc code) noexcept {
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

[[noreturn]] void throw_error(errc code, const std::string& message) {
    throw error(code, message);
}

// -- arguments --

void need_ptr(const void* p, const char* name) {
    if (p == nullptr) throw_error(errc::invalid_argument, fmt::format("{} is NULL", name));
}

void need_array(const void* p, size_t n, const char* name) {
    if (p == nullptr && n > 0)
        throw_error(errc::invalid_argument, fmt::format("{} is NULL but has {} entries", name, n));
}

std::span<const token_t> tokens_of(const int32_t* tokens, size_t n_tokens) {
    if (n_tokens > static_cast<size_t>(std::numeric_limits<int32_t>::max()))
        throw_error(errc::invalid_argument,
                    fmt::format("n_tokens = {} exceeds {}", n_tokens, std::numeric_limits<int32_t>::max()));
    need_array(tokens, n_tokens, "tokens");
    return n_tokens > 0 ? std::span<const token_t>(tokens, n_tokens) : std::span<const token_t>();
}

dtype to_dtype(const kvc_type& t, const char* name) {
    const auto d = dtype_from_ggml(raw(t));
    if (!d)
        throw_error(errc::invalid_argument,
                    fmt::format("{} = {} is not an element type (f32 0, f16 1, q4_0 2, q8_0 8, bf16 30)",
                                name, raw(t)));
    return *d;
}

// -- conversions --

namespace {

layer_desc to_cpp(const kvc_layer_desc& c, const char* name, size_t il) {
    layer_desc d;
    d.n_head_kv = c.n_head_kv;
    d.n_embd_head_k = c.n_embd_head_k;
    d.n_embd_head_v = c.n_embd_head_v;
    d.is_swa = c.is_swa;
    d.has_kv = c.has_kv;
    const int32_t rope = raw(c.rope.type);
    if (rope < 0 || rope > static_cast<int32_t>(rope_type::neox))
        throw_error(
            errc::invalid_argument,
            fmt::format("{}.layers[{}].rope.type = {} is not a kvc_rope_type (0 to 2)", name, il, rope));
    d.rope.type = static_cast<rope_type>(rope);
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

// A C layer filter as a C++ one.
std::function<bool(uint32_t)> to_cpp(kvc_layer_filter filter, void* user_data) {
    if (filter == nullptr) return {};
    return [filter, user_data](uint32_t il) { return filter(il, user_data); };
}

}  // namespace

namespace {

prefix_tier_params tiers_to_cpp(const kvc_prefix_tier_params& c, const char* name) {
    if (c.n_stores > prefix_max_tiers)
        throw_error(errc::invalid_argument,
                    fmt::format("{}.prefix.tiers.n_stores = {} exceeds {} (KVC_PREFIX_MAX_TIERS)", name,
                                c.n_stores, prefix_max_tiers));
    if (c.n_stores > 0 && c.stores == nullptr)
        throw_error(errc::invalid_argument,
                    fmt::format("{}.prefix.tiers.stores is NULL for {} stores", name, c.n_stores));
    const int32_t write = raw(c.write);
    if (write < 0 || write > static_cast<int32_t>(tier_write::never))
        throw_error(errc::invalid_argument,
                    fmt::format("{}.prefix.tiers.write = {} is not a kvc_tier_write (0 to 2)", name, write));
    prefix_tier_params p{.stores = {},
                         .model_id = c.model_id,
                         .write = static_cast<tier_write>(write),
                         .fetch = c.fetch,
                         .prefill_ns_per_token = c.prefill_ns_per_token,
                         .probe_every = c.probe_every,
                         .async_writes = c.async_writes,
                         .max_queued_bytes = c.max_queued_bytes};
    for (size_t i = 0; i < c.n_stores; ++i) {
        if (c.stores[i] == nullptr || !c.stores[i]->store)
            throw_error(errc::invalid_argument, fmt::format("{}.prefix.tiers.stores[{}] is NULL", name, i));
        p.stores.push_back(c.stores[i]->store);  // the memory's own reference
    }
    return p;
}

}  // namespace

prefix_cache_params prefix_to_cpp(const kvc_prefix_cache_params& c, const char* name) {
    const int32_t policy = raw(c.policy);
    if (policy < 0 || policy > static_cast<int32_t>(evict_policy::adaptive))
        throw_error(errc::invalid_argument,
                    fmt::format("{}.prefix.policy = {} is not a kvc_evict_policy (0 to 2)", name, policy));
    prefix_cache_params p{.enabled = c.enabled,
                          .block_size = c.block_size,
                          .policy = static_cast<evict_policy>(policy),
                          .protected_fraction = c.protected_fraction,
                          .max_pinned_fraction = c.max_pinned_fraction,
                          .n_vocab = c.n_vocab,
                          .snapshot_interval = c.snapshot_interval,
                          .max_snapshots = c.max_snapshots,
                          .on_event = {},
                          .tiers = tiers_to_cpp(c.tiers, name)};
    if (c.on_event != nullptr)
        p.on_event = [fn = c.on_event, user = c.on_event_user_data](const prefix_event& e) {
            const kvc_prefix_event ce{.type = static_cast<kvc_prefix_event_type>(e.type),
                                      .hash = e.hash,
                                      .parent_hash = e.parent_hash,
                                      .depth = e.depth,
                                      .tokens = e.tokens.empty() ? nullptr : e.tokens.data(),
                                      .n_tokens = static_cast<uint32_t>(e.tokens.size()),
                                      .part = static_cast<kvc_prefix_part>(e.part)};
            fn(&ce, user);
        };
    return p;
}

kvc_prefix_cache_params to_c(const prefix_cache_params& p) {
    return {.enabled = p.enabled,
            .block_size = p.block_size,
            .policy = static_cast<kvc_evict_policy>(p.policy),
            .protected_fraction = p.protected_fraction,
            .max_pinned_fraction = p.max_pinned_fraction,
            .n_vocab = p.n_vocab,
            .on_event = nullptr,
            .on_event_user_data = nullptr,
            .snapshot_interval = p.snapshot_interval,
            .max_snapshots = p.max_snapshots,
            .tiers = {.stores = nullptr,
                      .n_stores = 0,
                      .model_id = p.tiers.model_id,
                      .write = static_cast<kvc_tier_write>(p.tiers.write),
                      .fetch = p.tiers.fetch,
                      .prefill_ns_per_token = p.tiers.prefill_ns_per_token,
                      .probe_every = p.tiers.probe_every,
                      .async_writes = p.tiers.async_writes,
                      .max_queued_bytes = p.tiers.max_queued_bytes}};
}

namespace {

[[noreturn]] void no_layers(const char* name, const void* layers, size_t n_layers) {
    throw_error(errc::invalid_argument,
                fmt::format("{}.layers must list every model layer (layers {}, n_layers {})", name,
                            layers ? "set" : "NULL", n_layers));
}

}  // namespace

kv_cache_params to_cpp(const kvc_kv_cache_params& c, const char* name) {
    if (c.layers == nullptr || c.n_layers == 0) no_layers(name, c.layers, c.n_layers);
    kv_cache_params p;
    p.layers.reserve(c.n_layers);
    for (size_t il = 0; il < c.n_layers; ++il) p.layers.push_back(to_cpp(c.layers[il], name, il));
    p.filter = to_cpp(c.layer_filter, c.layer_filter_user_data);
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
    if (swa < 0 || swa > static_cast<int32_t>(swa_type::symmetric))
        throw_error(errc::invalid_argument,
                    fmt::format("{}.swa_type = {} is not a kvc_swa_type (0 to 3)", name, swa));
    p.swa = static_cast<swa_type>(swa);
    p.n_pos = c.n_pos;
    p.compact_threshold = c.compact_threshold;
    p.auto_update = c.auto_update;
    p.prefix = prefix_to_cpp(c.prefix, name);
    p.memory_budget = c.memory_budget;
    return p;
}

recurrent_params to_cpp(const kvc_recurrent_params& c, const char* name) {
    if (c.layers == nullptr || c.n_layers == 0) no_layers(name, c.layers, c.n_layers);
    recurrent_params p;
    p.layers.reserve(c.n_layers);
    for (size_t il = 0; il < c.n_layers; ++il)
        p.layers.push_back(recurrent_layer_desc{c.layers[il].n_embd_r, c.layers[il].n_embd_s});
    p.filter = to_cpp(c.layer_filter, c.layer_filter_user_data);
    p.type_r = to_dtype(c.type_r, fmt::format("{}.type_r", name).c_str());
    p.type_s = to_dtype(c.type_s, fmt::format("{}.type_s", name).c_str());
    p.n_seq_max = c.n_seq_max;
    p.n_rs_seq = c.n_rs_seq;
    p.memory_budget = c.memory_budget;
    p.prefix = prefix_to_cpp(c.prefix, name);
    return p;
}

kvc_rope_params to_c(const rope_params& r) {
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

iswa_sizing to_cpp(const kvc_iswa_sizing& c) {
    return iswa_sizing{.swa_full = c.swa_full, .n_ubatch = c.n_ubatch, .n_swa_retain = c.n_swa_retain};
}

kvc_iswa_sizing to_c(const iswa_sizing& s) {
    return kvc_iswa_sizing{.swa_full = s.swa_full, .n_ubatch = s.n_ubatch, .n_swa_retain = s.n_swa_retain};
}

kvc_recurrent_params to_c(const recurrent_params& p) {
    kvc_recurrent_params c;
    c.layers = nullptr;
    c.n_layers = 0;
    c.layer_filter = nullptr;
    c.layer_filter_user_data = nullptr;
    c.type_r = static_cast<kvc_type>(p.type_r);
    c.type_s = static_cast<kvc_type>(p.type_s);
    c.n_seq_max = p.n_seq_max;
    c.n_rs_seq = p.n_rs_seq;
    c.memory_budget = p.memory_budget;
    c.prefix = to_c(p.prefix);
    return c;
}

void to_c(const tensor_view& v, kvc_tensor_view& out) {
    out.type = static_cast<kvc_type>(v.type);
    for (int i = 0; i < 4; ++i) {
        out.ne[i] = v.ne[i];
        out.nb[i] = v.nb[i];
    }
    out.data = v.data;
}

// -- parts of a memory, and of a context --

namespace {

// The model's layer count n tells a layer the model lacks from one whose K/V this memory does not keep.
[[noreturn]] void no_kv_for(uint32_t il, size_t n) {
    if (il >= n) throw_error(errc::out_of_range, fmt::format("no model layer {} (the model has {})", il, n));
    throw_error(errc::out_of_range, fmt::format("model layer {} has no K/V in this memory", il));
}

}  // namespace

const kv_cache& layer_cache(const kvc_memory& m, uint32_t il) {
    if (const kv_cache* kv = m.mem->layer_cache(il)) return *kv;
    const uint32_t n = m.mem->n_layer();
    for (uint32_t l = 0; l < n; ++l)
        if (m.mem->layer_cache(l) != nullptr) no_kv_for(il, n);  // the same messages for every memory
    throw_error(errc::unsupported, "this memory holds no K/V (a recurrent memory)");
}

void throw_failed(const kvc_memory_context& c, const char* what) {
    const char* status =
        c.ctx->get_status() == memory_status::failed_compute ? "FAILED_COMPUTE" : "FAILED_PREPARE";
    throw_error(errc::invalid_state,
                fmt::format("the context failed (status KVC_MEMORY_STATUS_{}): it has no {}", status, what));
}

kv_cache_context& attn_of(const kvc_memory_context& c, uint32_t il) {
    if (kv_cache_context* k = c.ctx->get_attn(il)) return *k;
    (void)layer_cache(*c.mem, il);  // no K/V at all, or none for layer il
    throw_failed(c, "ubatch");      // only a failed context has no part for a layer the memory has
}

memory_recurrent& recurrent_of(const kvc_memory& m) {
    memory_recurrent* r = m.mem->recurrent();
    if (r == nullptr)
        throw_error(errc::unsupported,
                    "this memory holds no recurrent state (only recurrent and hybrid memories do)");
    return *r;
}

prefix_cache_i& prefix_of(const kvc_memory& m) {
    prefix_cache_i* p = m.mem->prefix_cache();
    if (p == nullptr)
        throw_error(errc::unsupported,
                    "this memory has no prefix cache (a memory created with prefix.enabled)");
    return *p;
}

// -- logging --

namespace {

struct c_log_sink {
    kvc_log_callback callback;
    void* user_data;
};

std::mutex g_log_mutex;
c_log_sink* g_log_sink = nullptr;  // owned; kept until replaced (a log call may come at any time)

void log_trampoline(log_level level, const char* message, void* user_data) {
    const auto* sink = static_cast<const c_log_sink*>(user_data);
    sink->callback(static_cast<kvc_log_level>(level), message, sink->user_data);
}

}  // namespace

}  // namespace kvc::capi

using namespace kvc::capi;

// -- the C functions (C linkage from their declarations in kvcache.h) --

// -- errors, logging, version --

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

kvc_status kvc_set_last_error(kvc_status status, const char* function, const char* message) noexcept {
    const char* what = message != nullptr ? message : "";
    if (function != nullptr) return fail(status, function, what);
    error_slot& e = t_error;  // no function: the message alone
    try {
        e.text.assign(what);
        e.message = e.text.c_str();
    } catch (...) {
        e.message = "kvcache: out of memory while recording an error";
    }
    return status;
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

// -- limits --

kvc_limits kvc_get_limits(void) noexcept {
    const kvc::limits l = kvc::get_limits();
    return {l.file_bytes, l.metadata_bytes, l.batch_tokens, l.sequences, l.memory_bytes};
}

kvc_status kvc_set_limits(const kvc_limits* limits, kvc_limits* old) noexcept {
    return guarded(__func__, [&] {
        need_ptr(limits, "limits");
        const kvc::limits prev =
            kvc::set_limits({limits->file_bytes, limits->metadata_bytes, limits->batch_tokens,
                             limits->sequences, limits->memory_bytes});
        if (old)
            *old = {prev.file_bytes, prev.metadata_bytes, prev.batch_tokens, prev.sequences,
                    prev.memory_bytes};
    });
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

// -- default parameters --

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
    c.auto_update = true;  // the C API's convenience: a decode after seq_add meets rotated keys
    c.prefix = kvc::capi::to_c(p.prefix);
    c.memory_budget = p.memory_budget;
    c.engine = nullptr;
    return c;
}

kvc_iswa_params kvc_iswa_default_params(void) noexcept {
    kvc_iswa_params c;
    c.kv = kvc_kv_cache_default_params();
    c.sizing = kvc::capi::to_c(kvc::kv_cache_iswa_params{}.sizing);
    return c;
}

kvc_recurrent_params kvc_recurrent_default_params(void) noexcept {
    return to_c(kvc::recurrent_params{});
}

kvc_hybrid_params kvc_hybrid_default_params(void) noexcept {
    const kvc::memory_hybrid_params p;
    kvc_hybrid_params c;
    c.attn = kvc_kv_cache_default_params();
    c.recr = to_c(p.recr);
    c.iswa = p.iswa.has_value();
    c.sizing = kvc::capi::to_c(p.iswa.value_or(kvc::iswa_sizing{}));
    c.memory_budget = p.memory_budget;
    c.prefix = kvc::capi::to_c(p.prefix);
    return c;
}
