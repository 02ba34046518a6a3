// The C API's data and inputs: K/V rows and views, the attention inputs (n_kv, KQ mask, position buckets,
// K-shift) of the cache holding a layer, and the recurrent state rows. Everything is read from the C++
// context of the current ubatch (memory_context_i::get_attn / get_recr), which checks that the ubatch was
// applied; the arrays handed out are the context's own.
#include <cstddef>
#include <limits>
#include <span>
#include <type_traits>

#include <fmt/format.h>

#include "capi_impl.h"

using namespace kvc::capi;
using kvc::errc;

// kvc_rs_view::hist_copy points at the context's own kvc::rs_copy array: the two structs must match.
static_assert(std::is_standard_layout_v<kvc_rs_copy>);
static_assert(std::is_standard_layout_v<kvc::rs_copy>);
static_assert(sizeof(kvc_rs_copy) == sizeof(kvc::rs_copy));
static_assert(alignof(kvc_rs_copy) == alignof(kvc::rs_copy));
static_assert(offsetof(kvc_rs_copy, src) == offsetof(kvc::rs_copy, src));
static_assert(offsetof(kvc_rs_copy, dst) == offsetof(kvc::rs_copy, dst));
static_assert(std::is_same_v<decltype(kvc_rs_copy::src), decltype(kvc::rs_copy::src)>);
static_assert(std::is_same_v<decltype(kvc_rs_copy::dst), decltype(kvc::rs_copy::dst)>);
// and kvc_rs_view::snaps at its kvc::rs_snap array
static_assert(std::is_standard_layout_v<kvc_rs_snap>);
static_assert(std::is_standard_layout_v<kvc::rs_snap>);
static_assert(sizeof(kvc_rs_snap) == sizeof(kvc::rs_snap));
static_assert(alignof(kvc_rs_snap) == alignof(kvc::rs_snap));
static_assert(offsetof(kvc_rs_snap, block) == offsetof(kvc::rs_snap, block));
static_assert(offsetof(kvc_rs_snap, token) == offsetof(kvc::rs_snap, token));
static_assert(offsetof(kvc_rs_snap, dst) == offsetof(kvc::rs_snap, dst));
static_assert(std::is_same_v<decltype(kvc_rs_snap::dst), decltype(kvc::rs_snap::dst)>);

namespace {

// Values per token of layer il's K (or V) rows in the cache that holds it.
size_t layer_width(const kvc::kv_cache& cache, uint32_t il, bool values) {
    const kvc::layer_desc& d = cache.params().layers[il];
    return size_t{d.n_head_kv} * (values ? d.n_embd_head_v : d.n_embd_head_k);
}

kvc::const_tensor_view f32_rows(const float* src, size_t width, size_t n_tokens) {
    if (n_tokens > std::numeric_limits<uint32_t>::max())
        throw_error(errc::invalid_argument, fmt::format("n_tokens = {} is too large", n_tokens));
    return kvc::const_tensor_view::contiguous(kvc::dtype::f32, reinterpret_cast<const std::byte*>(src),
                                              static_cast<int64_t>(width), static_cast<int64_t>(n_tokens));
}

void cpy_rows(kvc_memory_context* ctx, uint32_t il, const float* src, size_t n_tokens, bool values) {
    const kvc_memory_context& c = need(ctx, "ctx");
    need_ptr(src, "src");
    kvc::kv_cache_context& k = attn_of(c, il);
    const kvc::const_tensor_view rows = f32_rows(src, layer_width(k.cache(), il, values), n_tokens);
    if (values)
        k.cpy_v(il, rows);
    else
        k.cpy_k(il, rows);
}

}  // namespace

// -- K/V rows and views --

kvc_status kvc_memory_cpy_k(kvc_memory_context* ctx, uint32_t il, const float* src,
                            size_t n_tokens) noexcept {
    return guarded(__func__, [&] { cpy_rows(ctx, il, src, n_tokens, false); });
}

kvc_status kvc_memory_cpy_v(kvc_memory_context* ctx, uint32_t il, const float* src,
                            size_t n_tokens) noexcept {
    return guarded(__func__, [&] { cpy_rows(ctx, il, src, n_tokens, true); });
}

kvc_status kvc_memory_get_k(kvc_memory_context* ctx, uint32_t il, kvc_tensor_view* out) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory_context& c = need(ctx, "ctx");
        kvc_tensor_view& v = need(out, "out");
        to_c(attn_of(c, il).get_k(il), v);
    });
}

kvc_status kvc_memory_get_v(kvc_memory_context* ctx, uint32_t il, kvc_tensor_view* out) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory_context& c = need(ctx, "ctx");
        kvc_tensor_view& v = need(out, "out");
        to_c(attn_of(c, il).get_v(il), v);
    });
}

// -- attention inputs of the cache holding a layer --

int64_t kvc_memory_context_n_kv(const kvc_memory_context* ctx, uint32_t il) noexcept {
    return guarded_count(__func__, [&] { return int64_t{attn_of(need(ctx, "ctx"), il).get_n_kv()}; });
}

int64_t kvc_memory_kq_mask_elements(const kvc_memory_context* ctx, uint32_t il) noexcept {
    return guarded_count(
        __func__, [&] { return static_cast<int64_t>(attn_of(need(ctx, "ctx"), il).kq_mask_elements()); });
}

kvc_status kvc_memory_set_input_kq_mask(const kvc_memory_context* ctx, uint32_t il, kvc_type type, void* dst,
                                        size_t n_elements, bool causal, bool alibi) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory_context& c = need(ctx, "ctx");
        const kvc::dtype t = to_dtype(type, "type");
        if (t != kvc::dtype::f32 && t != kvc::dtype::f16)
            throw_error(errc::invalid_argument,
                        fmt::format("type = {} ({}) is not a mask type (KVC_TYPE_F32 or KVC_TYPE_F16)",
                                    raw(type), kvc::to_string(t)));
        need_ptr(dst, "dst");
        if (n_elements > static_cast<size_t>(std::numeric_limits<int64_t>::max()))
            throw_error(errc::invalid_argument, fmt::format("n_elements = {} is too large", n_elements));
        attn_of(c, il).set_input_kq_mask(
            kvc::tensor_view::contiguous(t, static_cast<std::byte*>(dst), static_cast<int64_t>(n_elements)),
            {.causal = causal, .alibi = alibi});
    });
}

kvc_status kvc_memory_set_input_pos_bucket(const kvc_memory_context* ctx, uint32_t il, int32_t* dst, size_t n,
                                           uint32_t n_buckets) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory_context& c = need(ctx, "ctx");
        need_ptr(dst, "dst");
        attn_of(c, il).set_input_pos_bucket(std::span<int32_t>(dst, n), n_buckets);
    });
}

int64_t kvc_memory_k_shift_elements(const kvc_memory* mem, uint32_t il) noexcept {
    return guarded_count(__func__, [&] {
        const kvc::kv_cache& kv = layer_cache(need(mem, "mem"), il);
        return int64_t{kv.get_size()} * kv.get_n_stream();
    });
}

kvc_status kvc_memory_set_input_k_shift(const kvc_memory* mem, uint32_t il, int32_t* dst, size_t n) noexcept {
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
        const kvc::memory_recurrent_context* r = c.ctx->get_recr();
        if (r == nullptr) {
            (void)recurrent_of(*c.mem);     // a memory without recurrent state
            throw_failed(c, "state rows");  // only a failed context has no recurrent part then
        }
        const std::span<const int64_t> s_copy = r->s_copies();  // throws before apply, past the last ubatch
        const std::span<const kvc::rs_copy> hist = r->hist_copies();
        kvc_rs_view w;
        w.head = r->get_head();
        w.n_rs = r->get_n_rs();
        w.n_seqs = r->get_n_seqs();
        w.rs_z = r->get_rs_z();
        w.size = r->get_size();
        w.n_rs_seq = r->get_n_rs_seq();
        w.s_copy = s_copy.empty() ? nullptr : s_copy.data();
        w.hist_copy = hist.empty() ? nullptr : reinterpret_cast<const kvc_rs_copy*>(hist.data());
        w.n_hist_copy = hist.size();
        const std::span<const kvc::rs_snap> snaps = r->snaps();
        w.snaps = snaps.empty() ? nullptr : reinterpret_cast<const kvc_rs_snap*>(snaps.data());
        w.n_snaps = snaps.size();
        v = w;
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
