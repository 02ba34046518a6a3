// The C API of the tiers (kvcache_tiers.h): block store handles (a directory, a C engine's callbacks) and
// the counters of a KV cache's tiers.
#include <algorithm>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <kvcache/disk_store.h>
#include <kvcache/prefix_tiers.h>

#include "capi_impl.h"

using namespace kvc::capi;
using kvc::errc;

namespace {

// The tiers of a memory's prefix cache (none without one).
std::vector<kvc::prefix_tier_stats> tier_stats_of(const kvc_memory& m) {
    const kvc::prefix_cache_i* p = m.mem->prefix_cache();
    return p != nullptr ? p->get_tier_stats() : std::vector<kvc::prefix_tier_stats>{};
}

kvc_block_store_stats to_c(const kvc::block_store_stats& s) {
    return {.lookups = s.lookups,
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

kvc::block_store_stats to_cpp(const kvc_block_store_stats& c) {
    return {.lookups = c.lookups,
            .hits = c.hits,
            .puts = c.puts,
            .skipped = c.skipped,
            .bytes_in = c.bytes_in,
            .bytes_out = c.bytes_out,
            .errors = c.errors,
            .damaged = c.damaged,
            .evictions = c.evictions,
            .round_trips = c.round_trips,
            .calls = c.calls,
            .latency_ns = c.latency_ns,
            .max_latency_ns = c.max_latency_ns};
}

// A C engine's store. Calls are serialised here, as block_store_i promises, so the callbacks need no lock.
// Nothing thrown may cross the C frames of a callback: what the cache's on_value throws is kept and thrown
// again once read_many has returned.
class callback_store final : public kvc::block_store_i {
public:
    explicit callback_store(const kvc_block_store_callbacks& cb) : cb_(cb) {}
    ~callback_store() override {
        if (cb_.destroy != nullptr) cb_.destroy(cb_.user_data);
    }
    callback_store(const callback_store&) = delete;
    callback_store& operator=(const callback_store&) = delete;

    size_t read_many(std::span<const std::string> keys, const kvc::block_value_fn& on_value) override {
        std::lock_guard lock(mu_);
        kvc::block_store_call_timer timer(own_);
        const std::vector<const char*> ptrs = c_keys(keys);
        read_ctx ctx;
        ctx.fn = &on_value;
        ctx.n_keys = keys.size();
        const bool ok = cb_.read_many(cb_.user_data, ptrs.data(), ptrs.size(), &deliver, &ctx);
        own_.lookups += keys.size();
        own_.hits += ctx.delivered;
        own_.bytes_in += ctx.bytes;
        own_.errors += (ok ? 0 : 1) + ctx.bad;
        if (ctx.thrown) std::rethrow_exception(ctx.thrown);
        return ctx.delivered;
    }

    void put_many(std::span<const kvc::block_put> items) override {
        std::lock_guard lock(mu_);
        kvc::block_store_call_timer timer(own_);
        std::vector<std::string> keys;  // NUL-terminated copies: a string_view need not be
        keys.reserve(items.size());
        for (const kvc::block_put& it : items) keys.emplace_back(it.key);
        std::vector<kvc_block_put> c(items.size());
        uint64_t bytes = 0;
        for (size_t i = 0; i < items.size(); ++i) {
            c[i] = {.key = keys[i].c_str(), .value = items[i].value.data(), .size = items[i].value.size()};
            bytes += items[i].value.size();
        }
        if (cb_.put_many(cb_.user_data, c.data(), c.size())) {
            own_.puts += items.size();
            own_.bytes_out += bytes;
        } else {
            ++own_.errors;
        }
    }

    std::vector<uint8_t> contains_many(std::span<const std::string> keys) override {
        std::lock_guard lock(mu_);
        std::vector<uint8_t> out(keys.size(), 0);
        if (cb_.contains_many == nullptr) return out;  // all absent: put_many skips what it holds
        kvc::block_store_call_timer timer(own_);
        const std::vector<const char*> ptrs = c_keys(keys);
        if (!cb_.contains_many(cb_.user_data, ptrs.data(), ptrs.size(), out.data())) {
            ++own_.errors;
            std::fill(out.begin(), out.end(), 0);
        }
        for (uint8_t& v : out) v = v != 0 ? 1 : 0;
        return out;
    }

    kvc::block_store_stats stats() const override {
        std::lock_guard lock(mu_);
        if (cb_.get_stats == nullptr) return own_;
        kvc_block_store_stats c{};
        cb_.get_stats(cb_.user_data, &c);
        return to_cpp(c);
    }

    std::string describe() const override {
        std::lock_guard lock(mu_);
        const char* d = cb_.describe != nullptr ? cb_.describe(cb_.user_data) : nullptr;
        return d != nullptr ? std::string(d) : std::string("callbacks");
    }

private:
    struct read_ctx {
        const kvc::block_value_fn* fn = nullptr;
        size_t n_keys = 0;
        size_t delivered = 0;
        uint64_t bytes = 0;
        uint64_t bad = 0;  // values for an index out of range, or empty: errors, not delivered
        std::exception_ptr thrown;
    };

    static void deliver(size_t index, const uint8_t* value, size_t size, void* p) noexcept {
        auto& ctx = *static_cast<read_ctx*>(p);
        if (ctx.thrown) return;  // the cache failed on an earlier value: the rest are not wanted
        if (index >= ctx.n_keys || value == nullptr || size == 0) {
            ++ctx.bad;
            return;
        }
        try {
            (*ctx.fn)(index, std::span<const uint8_t>(value, size));
            ++ctx.delivered;
            ctx.bytes += size;
        } catch (...) {
            ctx.thrown = std::current_exception();
        }
    }

    static std::vector<const char*> c_keys(std::span<const std::string> keys) {
        std::vector<const char*> ptrs(keys.size());
        for (size_t i = 0; i < keys.size(); ++i) ptrs[i] = keys[i].c_str();
        return ptrs;
    }

    kvc_block_store_callbacks cb_;
    mutable std::mutex mu_;
    kvc::block_store_stats own_;
};

}  // namespace

kvc_disk_store_params kvc_disk_store_default_params(void) noexcept {
    const kvc::disk_store_params p;
    return {.dir = nullptr, .max_bytes = p.max_bytes, .max_value_bytes = p.max_value_bytes};
}

kvc_status kvc_disk_store_new(const kvc_disk_store_params* params, kvc_block_store** out) noexcept {
    if (out != nullptr) *out = nullptr;
    return guarded(__func__, [&] {
        const kvc_disk_store_params& c = need(params, "params");
        kvc_block_store*& o = need(out, "out");
        if (c.dir == nullptr || c.dir[0] == '\0')
            throw_error(errc::invalid_argument, "params.dir is NULL or empty (the directory of the store)");
        if (c.max_value_bytes == 0)
            throw_error(errc::invalid_argument, "params.max_value_bytes is 0 (no value would fit)");
        kvc::disk_store_params p;
        p.dir = c.dir;
        p.max_bytes = c.max_bytes;
        p.max_value_bytes = c.max_value_bytes;
        auto h = std::make_unique<kvc_block_store>();
        h->store = std::make_shared<kvc::disk_block_store>(std::move(p));
        o = h.release();
    });
}

kvc_status kvc_block_store_from_callbacks(const kvc_block_store_callbacks* callbacks,
                                          kvc_block_store** out) noexcept {
    if (out != nullptr) *out = nullptr;
    return guarded(__func__, [&] {
        const kvc_block_store_callbacks& cb = need(callbacks, "callbacks");
        kvc_block_store*& o = need(out, "out");
        if (cb.read_many == nullptr) throw_error(errc::invalid_argument, "callbacks.read_many is NULL");
        if (cb.put_many == nullptr) throw_error(errc::invalid_argument, "callbacks.put_many is NULL");
        auto h = std::make_unique<kvc_block_store>();
        // destroy runs only once the store exists: a failed call leaves user_data to the caller
        auto store = std::make_shared<callback_store>(cb);
        h->store = std::move(store);
        o = h.release();
    });
}

void kvc_block_store_free(kvc_block_store* store) noexcept {
    delete store;  // the store itself goes with its last reference (a memory may hold one)
}

kvc_status kvc_block_store_get_stats(const kvc_block_store* store, kvc_block_store_stats* out) noexcept {
    return guarded(__func__, [&] {
        const kvc_block_store& s = need(store, "store");
        need(out, "out") = to_c(s.store->stats());
    });
}

kvc_status kvc_memory_get_tier_count(const kvc_memory* mem, uint32_t* out) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory& m = need(mem, "mem");
        uint32_t& n = need(out, "out");
        n = static_cast<uint32_t>(tier_stats_of(m).size());
    });
}

kvc_status kvc_memory_get_tier_stats(const kvc_memory* mem, uint32_t index, kvc_tier_stats* out) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory& m = need(mem, "mem");
        kvc_tier_stats& o = need(out, "out");
        const std::vector<kvc::prefix_tier_stats> all = tier_stats_of(m);
        if (index >= all.size())
            throw_error(errc::out_of_range,
                        fmt::format("index = {}: the memory has {} tier(s)", index, all.size()));
        const kvc::prefix_tier_stats& s = all[index];
        kvc_tier_stats c{};
        const size_t n = std::min(s.where.size(), sizeof c.where - 1);
        std::memcpy(c.where, s.where.data(), n);
        c.where[n] = '\0';
        c.fetches = s.fetches;
        c.fetched_blocks = s.fetched_blocks;
        c.declined = s.declined;
        c.refused_blocks = s.refused_blocks;
        c.written_blocks = s.written_blocks;
        c.dropped_blocks = s.dropped_blocks;
        c.errors = s.errors;
        c.est_latency_ns = s.est_latency_ns;
        c.est_ns_per_byte = s.est_ns_per_byte;
        c.store = to_c(s.store);
        o = c;
    });
}

kvc_status kvc_memory_prefix_tier_drain(kvc_memory* mem) noexcept {
    return guarded(__func__, [&] {
        kvc_memory& m = need(mem, "mem");
        if (kvc::prefix_cache_i* p = m.mem->prefix_cache()) p->prefix_tier_drain();
    });
}
