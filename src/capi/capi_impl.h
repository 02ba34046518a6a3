// What the files of the C API (include/kvcache/kvcache.h) share: the handles, the exception barrier every
// entry point runs behind, argument checks, conversions between the C and the C++ structs, and the way
// from a handle to the part of a memory (or context) a function needs.
//
//   handles.cpp      errors, logging, version, element types, parameter conversions and defaults, the
//                    parts of a memory
//   memories.cpp     creating memories, batches, placement through contexts, sequence operations
//   inputs.cpp       K/V rows and views, attention inputs, recurrent state rows
//   state_files.cpp  state buffers and session files
//   tiers.cpp        block stores (a directory, callbacks) and the counters of a prefix cache's tiers
//
// Built on the public C++ API only. The C layer keeps no state the C++ objects already have: a context
// handle is the C++ context plus what its batch needs to outlive the call that made it.
#pragma once

#include <kvcache/kvcache.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <kvcache/batch.h>
#include <kvcache/block_store.h>
#include <kvcache/dtype.h>
#include <kvcache/kv_cache.h>
#include <kvcache/kv_cache_iswa.h>
#include <kvcache/kv_storage_engine.h>
#include <kvcache/limits.h>
#include <kvcache/memory.h>
#include <kvcache/memory_recurrent.h>
#include <kvcache/prefix_cache.h>
#include <kvcache/types.h>

// -- handles --

/// A memory (what it can do: memory_i's capabilities) and the kind it was created as.
struct kvc_memory {
    std::unique_ptr<kvc::kv_storage_engine> engine;  // a C engine's adapter (declared first: outlives mem)
    kvc::memory_ptr mem;
    kvc_memory_kind kind = KVC_MEMORY_KIND_KV_CACHE;
};

/// A reference to a block store (kvcache_tiers.h); memories made with it hold their own.
struct kvc_block_store {
    std::shared_ptr<kvc::block_store_i> store;
};

struct kvc_batch {
    std::optional<kvc::batch_storage> storage;  // kvc_batch_init
    std::vector<kvc::token_t> tokens;           // kvc_batch_get_one: a copy of the caller's tokens
    int32_t n_embd = 0;

    kvc::batch view() const { return storage ? storage->view() : kvc::batch::get_one(tokens); }
};

struct kvc_memory_context {
    kvc::batch_allocr balloc;     // the validated batch (declared before ctx: it outlives it)
    kvc::memory_context_ptr ctx;  // refers to its memory, which outlives it
    kvc_memory* mem = nullptr;    // borrowed: the memory the context was made from (it outlives it)
};

namespace kvc::capi {

// -- errors --

/// Records this thread's message "fn: what" and returns status (never throws).
kvc_status fail(kvc_status status, const char* fn, std::string_view what) noexcept;

/// The C status of a C++ error code.
kvc_status to_status(errc code) noexcept;

/// Runs f, the body of the C function fn; every exception becomes a status and this thread's message.
template <class F>
kvc_status guarded(const char* fn, const F& f) noexcept {
    try {
        f();
        return KVC_OK;
    } catch (const error& e) {
        return fail(to_status(e.code()), fn, e.what());
    } catch (const std::bad_alloc&) {
        return fail(KVC_ERR_OUT_OF_MEMORY, fn, "out of memory");
    } catch (const std::exception& e) {
        return fail(KVC_ERR_INTERNAL, fn, e.what());
    } catch (...) {
        return fail(KVC_ERR_INTERNAL, fn, "unknown exception");
    }
}

/// guarded for queries returning a count: the value, or the (negative) status of the failure.
template <class F>
int64_t guarded_count(const char* fn, const F& f) noexcept {
    int64_t value = 0;
    const kvc_status st = guarded(fn, [&] { value = f(); });
    return st == KVC_OK ? value : static_cast<int64_t>(st);
}

[[noreturn]] void throw_error(errc code, const std::string& message);

// -- arguments --

/// A required pointer argument (invalid_argument "name is NULL").
template <class T>
T& need(T* p, const char* name) {
    if (p == nullptr) throw_error(errc::invalid_argument, std::string(name) + " is NULL");
    return *p;
}

/// A required pointer argument that is not dereferenced here.
void need_ptr(const void* p, const char* name);

/// An array argument: NULL only when empty.
void need_array(const void* p, size_t n, const char* name);

/// The token array argument `tokens` (NULL only when empty; at most INT32_MAX tokens).
std::span<const token_t> tokens_of(const int32_t* tokens, size_t n_tokens);

/// The value of a C enum read without loading it as the enum type: callers may pass any int, and a C++
/// enum holding a value outside its range is undefined behaviour.
template <class E>
int32_t raw(const E& e) {
    static_assert(sizeof(E) == sizeof(int32_t));
    int32_t v = 0;
    std::memcpy(&v, &e, sizeof v);
    return v;
}

/// A kvc_type argument (invalid_argument naming it and the valid values).
dtype to_dtype(const kvc_type& t, const char* name);

// -- conversions (name: the argument, e.g. "params.kv", prefixed to the fields in messages) --

kv_cache_params to_cpp(const kvc_kv_cache_params& c, const char* name);
recurrent_params to_cpp(const kvc_recurrent_params& c, const char* name);
prefix_cache_params prefix_to_cpp(const kvc_prefix_cache_params& c, const char* name);
kvc_prefix_cache_params to_c(const prefix_cache_params& p);
kvc_rope_params to_c(const rope_params& r);
kvc_recurrent_params to_c(const recurrent_params& p);
iswa_sizing to_cpp(const kvc_iswa_sizing& c);
/// The adapter of a C engine (storage_engine.cpp), null for NULL; invalid_argument for a missing callback.
std::unique_ptr<kv_storage_engine> to_cpp(const kvc_storage_engine* c, const char* name);
kvc_iswa_sizing to_c(const iswa_sizing& s);
void to_c(const tensor_view& v, kvc_tensor_view& out);

// -- parts of a memory, and of a context --

/// The KV cache of m that holds model layer il: unsupported for a memory without K/V, out_of_range for a
/// layer it keeps no K/V for.
const kv_cache& layer_cache(const kvc_memory& m, uint32_t il);

/// The KV cache context of c that holds model layer il (the context itself, an iSWA child, a hybrid's
/// attention child): the errors of layer_cache, and invalid_state for a failed context.
kv_cache_context& attn_of(const kvc_memory_context& c, uint32_t il);

/// Throws invalid_state: c failed (the status says how), so it has no `what`.
[[noreturn]] void throw_failed(const kvc_memory_context& c, const char* what);

/// The recurrent part of m: unsupported for a memory without recurrent state.
memory_recurrent& recurrent_of(const kvc_memory& m);

/// The prefix cache of m: unsupported for a memory made without one.
prefix_cache_i& prefix_of(const kvc_memory& m);

}  // namespace kvc::capi
