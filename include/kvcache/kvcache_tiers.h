/// @file kvcache_tiers.h
/// @brief The C API of the tiers of a KV cache's prefix cache (docs/tiers.md): block stores (a directory,
/// a store of the engine's own made of callbacks, Redis through kvcache_redis's
/// `<kvcache/redis/kvcache_redis.h>`), set in kvc_prefix_cache_params::tiers, and their counters.
///
/// Included by kvcache.h. A ::kvc_block_store handle holds one reference to its store: a memory created
/// with it holds another, so the handle may be freed at once; the store goes when the last reference does.
/// Several memories (and processes, through the directory or the server) may share one store.
#ifndef KVCACHE_KVCACHE_TIERS_H
#define KVCACHE_KVCACHE_TIERS_H

#include <kvcache/kvcache.h>

#ifdef __cplusplus
extern "C" {
#endif

/// @brief What a store did (the C++ kvc::block_store_stats). Every counter only grows.
typedef struct kvc_block_store_stats {
    uint64_t lookups;         ///< keys asked for by reads
    uint64_t hits;            ///< keys they returned a value for
    uint64_t puts;            ///< values stored
    uint64_t skipped;         ///< values not stored: present already, or larger than allowed
    uint64_t bytes_in;        ///< value bytes read from the store (hits)
    uint64_t bytes_out;       ///< value bytes written to the store
    uint64_t errors;          ///< calls or keys that failed (I/O, full disk, connection, a callback's false)
    uint64_t damaged;         ///< values refused by the store's check: misses
    uint64_t evictions;       ///< values the store removed to stay within its budget (disk)
    uint64_t round_trips;     ///< requests sent to a server and answered (Redis)
    uint64_t calls;           ///< read, put and contains calls
    uint64_t latency_ns;      ///< time spent in those calls, summed
    uint64_t max_latency_ns;  ///< the longest of those calls
} kvc_block_store_stats;

/// @brief How a disk store is made (the C++ kvc::disk_store_params). Start from
/// kvc_disk_store_default_params().
typedef struct kvc_disk_store_params {
    const char* dir;  ///< the directory (created if missing); read during the call
    /// the most bytes its files may take (0: no limit); the least recently used go first
    uint64_t max_bytes;
    uint64_t max_value_bytes;  ///< the largest value stored or read (1 GiB by default)
} kvc_disk_store_params;

/// @brief The defaults of a disk store: no directory (set dir), no byte limit, values up to 1 GiB.
/// @return The defaults.
KVC_API kvc_disk_store_params kvc_disk_store_default_params(void) KVC_NOEXCEPT;

/// @brief Opens (or creates) a directory of blocks, one file per value, written atomically; its files
/// are indexed now, so blocks another run left there are found. One process per directory.
/// @param params The configuration; read during the call only.
/// @param out Receives the store (free it with kvc_block_store_free()); NULL on failure.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for a NULL pointer or an empty dir; #KVC_ERR_IO when the
/// directory cannot be created or listed (the message names it).
KVC_API kvc_status kvc_disk_store_new(const kvc_disk_store_params* params,
                                      kvc_block_store** out) KVC_NOEXCEPT;

/// @brief Receives one value a read found (kvc_block_store_callbacks::read_many).
/// @param index The index of its key in the keys asked for.
/// @param value [size] its bytes, read during the call only.
/// @param size Their count (> 0).
/// @param ctx The `ctx` read_many was given.
typedef void (*kvc_block_value_fn)(size_t index, const uint8_t* value, size_t size, void* ctx);

/// @brief One value to store (kvc_block_store_callbacks::put_many).
typedef struct kvc_block_put {
    const char* key;       ///< its key (NUL-terminated; letters, digits, '.', '_' and '-')
    const uint8_t* value;  ///< [size] its bytes
    size_t size;           ///< their count (> 0)
} kvc_block_put;

/// @brief A store of the engine's own, made of callbacks (kvc_block_store_from_callbacks()). Calls are
/// serialised (one at a time per store) and come from the thread calling into the memory, or, with
/// kvc_prefix_tier_params::async_writes, put_many from the memory's writer thread; a callback must not
/// call into a memory using the store. A store is a cache: a failure is a miss, never an error
/// of the memory (return false, or deliver nothing). kvcache verifies every value it reads on its
/// layout, position and tokens, so a damaged value is refused, not used.
typedef struct kvc_block_store_callbacks {
    /// Calls on_value(i, bytes, size, ctx) for each keys[i] (NUL-terminated) the store holds, in key
    /// order, values valid during that call only. Returns false when the read failed (counted as an
    /// error; the values delivered before count). Required.
    bool (*read_many)(void* user_data, const char* const* keys, size_t n_keys, kvc_block_value_fn on_value,
                      void* ctx);
    /// Stores the values whose keys are not stored yet. Returns false when it failed (counted). Required.
    bool (*put_many)(void* user_data, const kvc_block_put* items, size_t n_items);
    /// Sets out[i] to 1 when the store holds keys[i] now, else 0. Returns false when it failed (all
    /// taken as absent). NULL: every key is taken as absent (put_many then skips those it holds), and
    /// recurrent and hybrid memories, which find snapshots through it, fetch none.
    bool (*contains_many)(void* user_data, const char* const* keys, size_t n_keys, uint8_t* out);
    /// Where the store is (e.g. "s3:bucket"), a NUL-terminated string copied at once. NULL: "callbacks".
    const char* (*describe)(void* user_data);
    /// The store's own counters. NULL: kvcache counts the calls, keys, hits and bytes it sees.
    void (*get_stats)(void* user_data, kvc_block_store_stats* out);
    /// Called once, when the last reference to the store goes (its handle and every memory using it):
    /// releases user_data. NULL: nothing to release.
    void (*destroy)(void* user_data);
    void* user_data;  ///< passed to every callback
} kvc_block_store_callbacks;

/// @brief Makes a store of the engine's callbacks (a C engine's own tier: a remote cache, a device).
/// @param callbacks The callbacks; read during the call only (the pointers are kept).
/// @param out Receives the store (free it with kvc_block_store_free()); NULL on failure.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for a NULL pointer or a missing required callback (the
/// message names it). On failure destroy is not called: user_data is still the caller's.
KVC_API kvc_status kvc_block_store_from_callbacks(const kvc_block_store_callbacks* callbacks,
                                                  kvc_block_store** out) KVC_NOEXCEPT;

/// @brief Drops the handle's reference; the store goes when no memory uses it either.
/// @param store The handle (NULL is ignored).
KVC_API void kvc_block_store_free(kvc_block_store* store) KVC_NOEXCEPT;

/// @brief What the store did so far (shared by every user of the store).
/// @param store The store.
/// @param out Receives the counters.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL pointers.
KVC_API kvc_status kvc_block_store_get_stats(const kvc_block_store* store,
                                             kvc_block_store_stats* out) KVC_NOEXCEPT;

/// @brief What a prefix cache did with one of its stores (the C++ kvc::prefix_tier_stats).
typedef struct kvc_tier_stats {
    char where[128];              ///< the store's description, NUL-terminated (cut to 127 bytes)
    uint64_t fetches;             ///< reads of attaches
    uint64_t fetched_blocks;      ///< blocks they brought back into memory
    uint64_t declined;            ///< attaches that did not ask it: it would have cost more than computing
    uint64_t refused_blocks;      ///< values it returned that were not the block asked for (chain ended)
    uint64_t written_blocks;      ///< blocks written to it
    uint64_t dropped_blocks;      ///< async_writes: blocks not written, the queue being full
    uint64_t errors;              ///< calls that failed (counted, never passed on)
    double est_latency_ns;        ///< the cost model: ns of a call, whatever it returns
    double est_ns_per_byte;       ///< the cost model: ns per byte returned
    kvc_block_store_stats store;  ///< the store's own counters (shared with other users of the store)
} kvc_tier_stats;

/// @brief How many tiers the memory's prefix cache has (kvc_prefix_tier_params::n_stores).
/// @param mem A memory (0 for one without a prefix cache or tiers).
/// @param out Receives the count.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL pointers.
KVC_API kvc_status kvc_memory_get_tier_count(const kvc_memory* mem, uint32_t* out) KVC_NOEXCEPT;

/// @brief What the memory's prefix cache did with its tier `index` (the order of
/// kvc_prefix_tier_params::stores).
/// @param mem A memory with tiers.
/// @param index The tier, below kvc_memory_get_tier_count().
/// @param out Receives the counters.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL pointers; #KVC_ERR_OUT_OF_RANGE for an index
/// beyond the tiers (the message names both).
KVC_API kvc_status kvc_memory_get_tier_stats(const kvc_memory* mem, uint32_t index,
                                             kvc_tier_stats* out) KVC_NOEXCEPT;

/// @brief With kvc_prefix_tier_params::async_writes: returns when every write queued so far is done
/// (before reading the stores from elsewhere, or counters that must include them). Nothing otherwise.
/// @param mem A memory (one without tiers returns at once).
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL.
KVC_API kvc_status kvc_memory_prefix_tier_drain(kvc_memory* mem) KVC_NOEXCEPT;

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // KVCACHE_KVCACHE_TIERS_H
