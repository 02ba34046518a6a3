// The prefix cache ops of `kvcache replay` (docs/op-scripts.md): a memory line with prefix=BLOCK gives the
// KV cache (or a mamba or jamba model's memory) a prefix cache; these ops look prompts up, attach them, pin
// them (KV caches) and print the counters.
#include <algorithm>

#include <fmt/format.h>
#include <kvcache/prefix_cache.h>

#include "replay_ops.h"

namespace kvc::cli {
namespace {

prefix_cache_i& prefix_cache(replay_memory& m, std::string_view op) {
    prefix_cache_i* p = m.mem->prefix_cache();
    if (p == nullptr) fail(fmt::format("{}: the memory has no prefix cache (memory ... prefix=BLOCK)", op));
    return *p;
}

std::vector<token_t> tokens_of(std::string_view list, std::string_view op) {
    std::vector<token_t> t;
    for (std::string_view s : split(list, ',')) t.push_back(parse_i32(s, fmt::format("{} token", op)));
    return t;
}

uint64_t key_of(const keys& k) {
    const int64_t key = k.get_int("key", 0);
    if (key < 0) fail(fmt::format("key={} must not be negative", key));
    return static_cast<uint64_t>(key);
}

}  // namespace

void op_lookup(replay_memory& m, const words& w) {
    prefix_cache_i& c = prefix_cache(m, "lookup");
    const auto toks = tokens_of(w[1], "lookup");
    const keys k(w, 2, {"key"}, "lookup");
    guarded("lookup", [&] { fmt::print("lookup n={}\n", c.prefix_lookup(toks, key_of(k))); });
}

void op_attach(replay_memory& m, const words& w) {
    prefix_cache_i& c = prefix_cache(m, "attach");
    const seq_id_t s = parse_i32(w[1], "attach seq");
    const auto toks = tokens_of(w[2], "attach");
    const keys k(w, 3, {"key", "priority"}, "attach");
    const int64_t priority = k.get_int("priority", prefix_default_priority);
    if (priority < 0 || priority > 255) fail(fmt::format("attach: priority={} out of range", priority));
    guarded("attach", [&] {
        const uint32_t n = c.prefix_attach(s, toks, key_of(k), static_cast<uint8_t>(priority), UINT32_MAX);
        fmt::print("attach seq={} n={}\n", s, n);
    });
}

void op_pin(replay_memory& m, const words& w) {
    prefix_cache_i& c = prefix_cache(m, w[0]);
    if (!c.prefix_can_pin())
        fail(fmt::format("{}: pins are a plain KV cache's (not an iSWA pair's, nor recurrent snapshots')",
                         w[0]));
    const auto toks = tokens_of(w[1], w[0]);
    const keys k(w, 2, {"key"}, w[0] == "pin" ? "pin" : "unpin");
    guarded(w[0] == "pin" ? "pin" : "unpin", [&] {
        const uint32_t n = w[0] == "pin" ? c.prefix_pin(toks, key_of(k)) : c.prefix_unpin(toks, key_of(k));
        fmt::print("{} n={}\n", w[0], n);
    });
}

void op_publish(replay_memory& m, const words&) {
    prefix_cache(m, "publish").prefix_publish();
    fmt::print("publish ok\n");
}

void op_pstats(replay_memory& m, const words&) {
    const prefix_stats s = prefix_cache(m, "pstats").get_prefix_stats();
    fmt::print(
        "pstats blocks={} cached={} shared={} pinned={} free={} lookups={} looked_up={} hit={} published={} "
        "evicted={} unpublished={} copied={}\n",
        s.blocks, s.cached_cells, s.shared_cells, s.pinned_cells, s.free_cells, s.lookups, s.tokens_looked_up,
        s.hit_tokens, s.published_blocks, s.evicted_blocks, s.unpublished_blocks, s.bytes_copied);
    if (std::any_of(m.parts.begin(), m.parts.end(), [](const replay_part& p) { return p.name == "swa"; }))
        fmt::print("pstats swa_blocks={} swa_published={} swa_evicted={}\n", s.swa_blocks,
                   s.swa_published_blocks, s.swa_evicted_blocks);
    if (m.mem->recurrent() != nullptr)  // recurrent or hybrid: snapshots
        fmt::print("pstats snapshots={} saved={} dropped={}\n", s.snapshots, s.snapshots_saved,
                   s.snapshots_dropped);
}

}  // namespace kvc::cli
