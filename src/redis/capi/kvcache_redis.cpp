// kvc_redis_store_new (redis/kvcache_redis.h): the C++ redis_block_store handed to the C API as a store of
// callbacks, so that the C API itself never sees hiredis (docs/design/decisions.md D31).
#include <kvcache/redis/kvcache_redis.h>

#include <exception>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include <kvcache/redis/redis_store.h>
#include <kvcache/types.h>

namespace {

// The store and its description, which describe() hands out as a C string (it never changes).
struct holder {
    explicit holder(kvc::redis_store_params p) : store(std::move(p)), where(store.describe()) {}
    kvc::redis_block_store store;
    std::string where;
};

holder& of(void* user) {
    return *static_cast<holder*>(user);
}

std::vector<std::string> keys_of(const char* const* keys, size_t n) {
    std::vector<std::string> k;
    k.reserve(n);
    for (size_t i = 0; i < n; ++i) k.emplace_back(keys[i]);
    return k;
}

// Nothing may be thrown into the C API's C frames: a failure is false (the store counted it already).
bool read_many(void* user, const char* const* keys, size_t n, kvc_block_value_fn on_value, void* ctx) {
    try {
        of(user).store.read_many(keys_of(keys, n), [&](size_t i, std::span<const uint8_t> v) {
            on_value(i, v.data(), v.size(), ctx);
        });
        return true;
    } catch (...) {
        return false;
    }
}

bool put_many(void* user, const kvc_block_put* items, size_t n) {
    try {
        std::vector<kvc::block_put> puts(n);
        for (size_t i = 0; i < n; ++i)
            puts[i] = {.key = items[i].key, .value = std::span<const uint8_t>(items[i].value, items[i].size)};
        of(user).store.put_many(puts);
        return true;
    } catch (...) {
        return false;
    }
}

bool contains_many(void* user, const char* const* keys, size_t n, uint8_t* out) {
    try {
        const std::vector<uint8_t> has = of(user).store.contains_many(keys_of(keys, n));
        for (size_t i = 0; i < n; ++i) out[i] = i < has.size() ? has[i] : 0;
        return true;
    } catch (...) {
        return false;
    }
}

const char* describe(void* user) {
    return of(user).where.c_str();
}

void get_stats(void* user, kvc_block_store_stats* out) {
    const kvc::block_store_stats s = of(user).store.stats();
    *out = {.lookups = s.lookups,
            .hits = s.hits,
            .puts = s.puts,
            .skipped = s.skipped,
            .bytes_in = s.bytes_in,
            .bytes_out = s.bytes_out,
            .errors = s.errors,
            .damaged = s.damaged,
            .evictions = s.evictions,
            .round_trips = s.round_trips,
            .calls = s.calls,
            .latency_ns = s.latency_ns,
            .max_latency_ns = s.max_latency_ns};
}

void destroy(void* user) {
    delete static_cast<holder*>(user);
}

kvc_status status_of(kvc::errc code) {
    switch (code) {
        case kvc::errc::invalid_argument:
            return KVC_ERR_INVALID_ARGUMENT;
        case kvc::errc::io:
            return KVC_ERR_IO;
        case kvc::errc::out_of_memory:
            return KVC_ERR_OUT_OF_MEMORY;
        default:
            return KVC_ERR_INTERNAL;
    }
}

}  // namespace

kvc_redis_store_params kvc_redis_store_default_params(void) noexcept {
    static const kvc::redis_store_params p;  // its strings outlive the returned pointers
    return {.host = p.host.c_str(),
            .port = p.port,
            .key_prefix = p.key_prefix.c_str(),
            .ttl_seconds = p.ttl_seconds,
            .connect_timeout_ms = p.connect_timeout_ms,
            .command_timeout_ms = p.command_timeout_ms,
            .backoff_min_ms = p.backoff_min_ms,
            .backoff_max_ms = p.backoff_max_ms,
            .max_value_bytes = p.max_value_bytes};
}

kvc_status kvc_redis_store_new(const kvc_redis_store_params* params, kvc_block_store** out) noexcept {
    const char* fn = __func__;
    if (out != nullptr) *out = nullptr;
    if (params == nullptr) return kvc_set_last_error(KVC_ERR_INVALID_ARGUMENT, fn, "params is NULL");
    if (out == nullptr) return kvc_set_last_error(KVC_ERR_INVALID_ARGUMENT, fn, "out is NULL");
    if (params->host == nullptr || params->host[0] == '\0')
        return kvc_set_last_error(KVC_ERR_INVALID_ARGUMENT, fn, "params.host is NULL or empty");
    std::unique_ptr<holder> h;
    try {
        kvc::redis_store_params p;
        p.host = params->host;
        p.port = params->port;
        p.key_prefix = params->key_prefix != nullptr ? params->key_prefix : "";
        p.ttl_seconds = params->ttl_seconds;
        p.connect_timeout_ms = params->connect_timeout_ms;
        p.command_timeout_ms = params->command_timeout_ms;
        p.backoff_min_ms = params->backoff_min_ms;
        p.backoff_max_ms = params->backoff_max_ms;
        p.max_value_bytes = params->max_value_bytes;
        h = std::make_unique<holder>(std::move(p));
    } catch (const kvc::error& e) {
        return kvc_set_last_error(status_of(e.code()), fn, e.what());
    } catch (const std::bad_alloc&) {
        return kvc_set_last_error(KVC_ERR_OUT_OF_MEMORY, fn, "out of memory");
    } catch (const std::exception& e) {
        return kvc_set_last_error(KVC_ERR_INTERNAL, fn, e.what());
    }
    kvc_block_store_callbacks cb{.read_many = read_many,
                                 .put_many = put_many,
                                 .contains_many = contains_many,
                                 .describe = describe,
                                 .get_stats = get_stats,
                                 .destroy = destroy,
                                 .user_data = h.get()};
    const kvc_status st = kvc_block_store_from_callbacks(&cb, out);
    if (st == KVC_OK) (void)h.release();  // the store's destroy deletes it now
    return st;
}
