// The C API of the prefix cache: the prefix_* calls of a KV cache, a recurrent or a hybrid memory.
#include <cstdint>
#include <span>

#include <fmt/format.h>

#include "capi_impl.h"

using namespace kvc::capi;
using kvc::errc;

namespace {

uint8_t priority_of(uint32_t priority) {
    if (priority > kvc::prefix_max_priority)
        throw_error(errc::invalid_argument,
                    fmt::format("priority = {} above {}", priority, kvc::prefix_max_priority));
    return static_cast<uint8_t>(priority);
}

}  // namespace

kvc_status kvc_memory_prefix_lookup(kvc_memory* mem, const int32_t* tokens, size_t n_tokens, uint64_t key,
                                    uint32_t* out) noexcept {
    return guarded(__func__, [&] {
        kvc::prefix_cache_i& c = prefix_of(need(mem, "mem"));
        uint32_t& n = need(out, "out");  // checked before the lookup publishes anything
        n = c.prefix_lookup(tokens_of(tokens, n_tokens), key);
    });
}

kvc_status kvc_memory_prefix_attach(kvc_memory* mem, int32_t seq_id, const int32_t* tokens, size_t n_tokens,
                                    uint64_t key, uint32_t priority, uint32_t* out) noexcept {
    return guarded(__func__, [&] {
        kvc::prefix_cache_i& c = prefix_of(need(mem, "mem"));
        uint32_t& n = need(out, "out");
        n = c.prefix_attach(seq_id, tokens_of(tokens, n_tokens), key, priority_of(priority), UINT32_MAX);
    });
}

kvc_status kvc_memory_prefix_pin(kvc_memory* mem, const int32_t* tokens, size_t n_tokens, uint64_t key,
                                 uint32_t* out) noexcept {
    return guarded(__func__, [&] {
        kvc::prefix_cache_i& c = prefix_of(need(mem, "mem"));
        uint32_t& n = need(out, "out");
        n = c.prefix_pin(tokens_of(tokens, n_tokens), key);
    });
}

kvc_status kvc_memory_prefix_unpin(kvc_memory* mem, const int32_t* tokens, size_t n_tokens, uint64_t key,
                                   uint32_t* out) noexcept {
    return guarded(__func__, [&] {
        kvc::prefix_cache_i& c = prefix_of(need(mem, "mem"));
        uint32_t& n = need(out, "out");
        n = c.prefix_unpin(tokens_of(tokens, n_tokens), key);
    });
}

kvc_status kvc_memory_prefix_set_priority(kvc_memory* mem, const int32_t* tokens, size_t n_tokens,
                                          uint64_t key, uint32_t priority, uint32_t* out) noexcept {
    return guarded(__func__, [&] {
        kvc::prefix_cache_i& c = prefix_of(need(mem, "mem"));
        uint32_t& n = need(out, "out");
        n = c.prefix_set_priority(tokens_of(tokens, n_tokens), key, priority_of(priority));
    });
}

kvc_status kvc_memory_prefix_publish(kvc_memory* mem) noexcept {
    return guarded(__func__, [&] { prefix_of(need(mem, "mem")).prefix_publish(); });
}

kvc_status kvc_memory_get_prefix_stats(const kvc_memory* mem, kvc_prefix_stats* out) noexcept {
    return guarded(__func__, [&] {
        const kvc::prefix_stats s = prefix_of(need(mem, "mem")).get_prefix_stats();
        need(out, "out") = kvc_prefix_stats{.lookups = s.lookups,
                                            .tokens_looked_up = s.tokens_looked_up,
                                            .hit_tokens = s.hit_tokens,
                                            .published_blocks = s.published_blocks,
                                            .evicted_blocks = s.evicted_blocks,
                                            .unpublished_blocks = s.unpublished_blocks,
                                            .bytes_copied = s.bytes_copied,
                                            .event_errors = s.event_errors,
                                            .blocks = s.blocks,
                                            .cached_cells = s.cached_cells,
                                            .shared_cells = s.shared_cells,
                                            .pinned_cells = s.pinned_cells,
                                            .free_cells = s.free_cells,
                                            .index_bytes = s.index_bytes,
                                            .snapshots_saved = s.snapshots_saved,
                                            .snapshots_dropped = s.snapshots_dropped,
                                            .snapshots = s.snapshots,
                                            .swa_blocks = s.swa_blocks,
                                            .swa_published_blocks = s.swa_published_blocks,
                                            .swa_evicted_blocks = s.swa_evicted_blocks,
                                            .tier_fetched_blocks = s.tier_fetched_blocks,
                                            .tier_written_blocks = s.tier_written_blocks,
                                            .dropped_blocks = s.dropped_blocks};
    });
}
