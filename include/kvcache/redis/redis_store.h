/// @file
/// redis_block_store: a block_store_i on a Redis (or Valkey) server shared by any number of engine
/// processes and hosts. Library kvcache_redis (kvcache::redis), on hiredis; the core does not link it.
///
/// One round trip per call: read_many (get_many) is one MGET, put_many one pipeline of SET ... EX ttl,
/// contains_many one pipeline of EXISTS. Keys are key_prefix + the caller's key, values binary-safe. Every
/// call has a timeout (connect and command); a failure (refused, reset, timeout, a server error) drops the
/// connection, counts an error, logs once until the server answers again, and makes the calls within
/// the back-off return misses at once (no connection attempt); the back-off doubles up to its maximum.
/// Values the check refuses (damaged, foreign, truncated) are counted as damaged and are misses. A
/// Redis Cluster is not spoken to (no MOVED handling): use one server, or a proxy that routes by key.
/// docs/tiers.md.
#pragma once

// Layer guard: this header belongs to kvcache_redis. The core library and the C API must not depend on it
// (nor on hiredis).
#if defined(KVC_LAYER_CORE) || defined(KVC_LAYER_CAPI)
#error "kvcache layers: a redis header (<kvcache/redis/...>) included from the core library or the C API"
#endif

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include <kvcache/block_store.h>

namespace kvc {

/// How a redis_block_store is made.
struct redis_store_params {
    std::string host = "127.0.0.1";     ///< server address (a name or an IP)
    int port = 6379;                    ///< server port
    std::string key_prefix = "kvc:";    ///< put before every key (a namespace on a shared server)
    uint32_t ttl_seconds = 0;           ///< expiry of stored values (0: none; the server's policy evicts)
    uint32_t connect_timeout_ms = 200;  ///< the longest a connection attempt may take
    uint32_t command_timeout_ms = 500;  ///< the longest a send or a reply may take
    uint32_t backoff_min_ms = 100;      ///< wait after the first failure before connecting again
    uint32_t backoff_max_ms = 5000;     ///< the longest wait (it doubles after each failed attempt)
    /// The largest value stored or returned (a larger reply is refused as damaged).
    uint64_t max_value_bytes = uint64_t{256} << 20;
    block_value_check_fn check;  ///< refuses damaged or foreign values on read (empty: accept all)
    bool throw_errors = false;   ///< throw kvc::error(io) on failures instead of counting them
};

/// A Redis server as a block store (redis/redis_store.h).
class redis_block_store final : public block_store_i {
public:
    /// Connects lazily: nothing is sent before the first call, so a server that is down at start costs
    /// the first call a connect timeout at most. Throws kvc::error(invalid_argument) for a bad port or
    /// an empty host.
    explicit redis_block_store(redis_store_params params);
    ~redis_block_store() override;                                    ///< closes the connection
    redis_block_store(const redis_block_store&) = delete;             ///< not copyable
    redis_block_store& operator=(const redis_block_store&) = delete;  ///< not copyable

    size_t read_many(std::span<const std::string> keys, const block_value_fn& on_value) override;
    void put_many(std::span<const block_put> items) override;
    std::vector<uint8_t> contains_many(std::span<const std::string> keys) override;
    block_store_stats stats() const override;
    std::string describe() const override;

    /// Whether the store has a connection now (false before the first call and after a failure).
    bool connected() const;

private:
    struct conn;                           // the hiredis context
    bool connect();                        // a connection, or false (within the back-off, or it failed)
    void failed(const std::string& what);  // drops the connection, counts, logs once, starts the back-off
    void succeeded();                      // a round trip worked: back-off reset, recovery logged

    redis_store_params p_;
    mutable std::mutex mu_;
    std::unique_ptr<conn> c_;
    std::chrono::steady_clock::time_point next_attempt_{};
    uint32_t backoff_ms_ = 0;
    bool down_logged_ = false;
    block_store_stats stats_;
};

}  // namespace kvc
