/// @file kvcache_redis.h
/// @brief The C constructor of the Redis block store (the C++ kvc::redis_block_store, docs/tiers.md): a
/// ::kvc_block_store for kvc_prefix_tier_params::stores. Library kvcache_redis (link it, and kvcache);
/// built on the public C API, so that libkvcache and its C API never link hiredis.
#ifndef KVCACHE_REDIS_KVCACHE_REDIS_H
#define KVCACHE_REDIS_KVCACHE_REDIS_H

// Layer guard: this header belongs to kvcache_redis. The core library and the C API must not depend on it
// (nor on hiredis).
#if defined(KVC_LAYER_CORE) || defined(KVC_LAYER_CAPI)
#error "kvcache layers: a redis header (<kvcache/redis/...>) included from the core library or the C API"
#endif

#include <kvcache/kvcache.h>

#ifdef __cplusplus
extern "C" {
#endif

/// @brief How a Redis store is made (the C++ kvc::redis_store_params). Start from
/// kvc_redis_store_default_params().
typedef struct kvc_redis_store_params {
    const char* host;             ///< server address, a name or an IP ("127.0.0.1"); read during the call
    int32_t port;                 ///< server port (6379)
    const char* key_prefix;       ///< put before every key, a namespace on a shared server ("kvc:"; NULL: "")
    uint32_t ttl_seconds;         ///< expiry of stored values (0: none; the server's policy evicts)
    uint32_t connect_timeout_ms;  ///< the longest a connection attempt may take (200)
    uint32_t command_timeout_ms;  ///< the longest a send or a reply may take (500)
    uint32_t backoff_min_ms;      ///< wait after the first failure before connecting again (100)
    uint32_t backoff_max_ms;      ///< the longest wait; it doubles after each failed attempt (5000)
    uint64_t max_value_bytes;     ///< the largest value stored or returned (256 MiB)
} kvc_redis_store_params;

/// @brief The defaults of a Redis store (those of the C++ kvc::redis_store_params).
/// @return The defaults.
KVC_API kvc_redis_store_params kvc_redis_store_default_params(void) KVC_NOEXCEPT;

/// @brief Makes a store on a Redis (or Valkey) server. Connects lazily: nothing is sent before the first
/// read or write, so a server that is down costs the first call a connect timeout at most, and every
/// failure afterwards is a counted miss (kvc_block_store_get_stats()), never an error of the memory.
/// @param params The configuration; read during the call only.
/// @param out Receives the store (free it with kvc_block_store_free()); NULL on failure.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for a NULL pointer, an empty host or a port outside 1 to
/// 65535 (the message names the field).
KVC_API kvc_status kvc_redis_store_new(const kvc_redis_store_params* params,
                                       kvc_block_store** out) KVC_NOEXCEPT;

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // KVCACHE_REDIS_KVCACHE_REDIS_H
