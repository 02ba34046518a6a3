/// @file
/// block_store_i: a byte store below the in-memory prefix cache (a tier), batched so that the blocks of
/// one lookup cost one round trip. Implementations: disk_block_store (a directory, disk_store.h) and
/// redis_block_store (kvcache_redis, redis/redis_store.h). docs/tiers.md.
///
/// Stores keep opaque values under string keys (block_key() names blocks; block_record.h encodes them).
/// A tier is a cache, never the truth: every failure (an I/O error, a full disk, a server that is down,
/// slow or returns damaged values) is counted, logged once, and looks like a miss, so the engine
/// recomputes; only a store made with throw_errors throws it.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <kvcache/types.h>

namespace kvc {

/// What a store did (block_store_i::stats). Every counter only grows.
struct block_store_stats {
    uint64_t lookups = 0;         ///< keys asked for by read_many / get_many
    uint64_t hits = 0;            ///< keys they returned a value for
    uint64_t puts = 0;            ///< values put_many stored
    uint64_t skipped = 0;         ///< values put_many did not store: present already, or larger than allowed
    uint64_t bytes_in = 0;        ///< value bytes read from the store (hits)
    uint64_t bytes_out = 0;       ///< value bytes written to the store
    uint64_t errors = 0;          ///< calls or keys that failed (I/O, full disk, connection, timeout)
    uint64_t damaged = 0;         ///< values refused by the check (damaged, foreign, truncated): misses
    uint64_t evictions = 0;       ///< values the store removed to stay within its budget (disk)
    uint64_t round_trips = 0;     ///< requests sent to a server and answered (Redis; a pipeline is one)
    uint64_t calls = 0;           ///< read_many (get_many), put_many and contains_many calls
    uint64_t latency_ns = 0;      ///< time spent in those calls, summed
    uint64_t max_latency_ns = 0;  ///< the longest of those calls
};

/// For stores: counts one call into the stats (calls, latency_ns, max_latency_ns) when it goes out of
/// scope, however the call ends.
class block_store_call_timer {
public:
    /// Starts timing a call that `stats` counts.
    explicit block_store_call_timer(block_store_stats& stats)
        : s_(stats), t0_(std::chrono::steady_clock::now()) {}
    ~block_store_call_timer() {
        const auto ns = static_cast<uint64_t>(
            std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0_)
                .count());
        ++s_.calls;
        s_.latency_ns += ns;
        s_.max_latency_ns = std::max(s_.max_latency_ns, ns);
    }
    block_store_call_timer(const block_store_call_timer&) = delete;             ///< not copyable
    block_store_call_timer& operator=(const block_store_call_timer&) = delete;  ///< not copyable

private:
    block_store_stats& s_;
    std::chrono::steady_clock::time_point t0_;
};

/// A check of a value read from a store: false refuses it (counted as damaged, a miss). block_value_check
/// (block_record.h) makes one that decodes block records of a layout.
using block_value_check_fn = std::function<bool(std::string_view key, std::span<const uint8_t> value)>;

/// One value to store.
struct block_put {
    std::string_view key;            ///< its key
    std::span<const uint8_t> value;  ///< its bytes (not empty)
};

/// Receives a value read_many found: the index of its key and its bytes, valid during the call only (a
/// store hands out its own buffer: the caller decodes or copies, no copy is made for it).
using block_value_fn = std::function<void(size_t index, std::span<const uint8_t> value)>;

/// A byte store for prefix blocks. Every call takes all the keys of one lookup at once. Calls are
/// thread-safe (a store serialises them; a callback must not call back into its store). Values are never
/// empty.
class block_store_i {
public:
    virtual ~block_store_i() = default;
    /// Calls on_value for each key whose value the store holds, passes the check and could be read, in
    /// key order; keys absent, refused or unreadable are misses (no call). Returns the number of calls.
    virtual size_t read_many(std::span<const std::string> keys, const block_value_fn& on_value) = 0;
    /// read_many into copies: the value of each key, in order; an empty vector for a miss.
    std::vector<std::vector<uint8_t>> get_many(std::span<const std::string> keys) {
        std::vector<std::vector<uint8_t>> out(keys.size());
        read_many(keys, [&](size_t i, std::span<const uint8_t> v) { out[i].assign(v.begin(), v.end()); });
        return out;
    }
    /// Stores the values whose keys are not stored yet. A value that could not be stored is counted (and
    /// is a miss later), not thrown, unless the store was made with throw_errors.
    virtual void put_many(std::span<const block_put> items) = 0;
    /// For each key, whether the store holds it now (1) or not (0); 0 as well when it cannot tell.
    virtual std::vector<uint8_t> contains_many(std::span<const std::string> keys) = 0;
    /// What the store did so far.
    virtual block_store_stats stats() const = 0;
    /// Where the store is: "disk:DIR", "redis:HOST:PORT".
    virtual std::string describe() const = 0;
};

}  // namespace kvc
