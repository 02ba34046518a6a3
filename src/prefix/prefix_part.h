// One part of a memory as the prefix cache sees it (design D35; docs/architecture.md, "The prefix wing"): a
// kv_cache's K/V blocks, with or without a sliding window, or a memory_recurrent's snapshots. The prefix
// coordinator (prefix_coordinator.h) drives one to three of them as one prefix cache; each memory implements
// its part next to its cells (src/kv_cache_prefix.cpp, src/memory_recurrent_prefix.cpp). Arguments are
// checked by the coordinator, once: the parts take them as valid.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include <kvcache/block_record.h>
#include <kvcache/block_store.h>
#include <kvcache/prefix_cache.h>

namespace kvc::detail {

class prefix_part_i {
public:
    enum class kind : uint8_t {
        blocks,     // full attention: a hit at n needs the blocks of [0, n)
        window,     // sliding-window attention: a hit at n needs the blocks of n's window
        snapshots,  // recurrent: a hit at n needs a snapshot of the state after [0, n)
    };
    using listener = std::function<void(const prefix_event&)>;
    using keep_fn = std::function<bool(const prefix_event&)>;

    virtual ~prefix_part_i() = default;
    virtual kind part_kind() const = 0;
    // The part's events go to `to` from now on (the coordinator that drives it).
    virtual void listen(listener to) = 0;
    // The lowest and highest positions seq_id holds, -1 when it holds none.
    virtual pos_t seq_begin(seq_id_t seq_id) const = 0;
    virtual pos_t seq_end(seq_id_t seq_id) const = 0;
    // The part's rule for what is past the window: a key at p_key is hidden from a query at p_query.
    virtual bool masked(pos_t p_key, pos_t p_query) const = 0;

    // What attach would give now (no sequence and no cell changes: it counts a lookup).
    virtual uint32_t lookup(std::span<const token_t> tokens, uint64_t key) = 0;
    // Gives the empty seq_id the longest cached prefix, at most max_tokens; returns its length.
    virtual uint32_t attach(seq_id_t seq_id, std::span<const token_t> tokens, uint64_t key, uint8_t priority,
                            uint32_t max_tokens) = 0;
    // seq_id keeps only positions [0, n).
    virtual void cut(seq_id_t seq_id, uint32_t n) = 0;
    // Brings back from the tiers what memory lacks of the first max_tokens of `tokens`.
    virtual void fetch(seq_id_t seq_id, std::span<const token_t> tokens, uint64_t key,
                       uint32_t max_tokens) = 0;
    virtual void publish() = 0;  // what the last step computed

    // -- coupling: what another part lost --
    // Evicts block e and then its ancestors while each is evictable and keep(block) is false (attention).
    virtual uint32_t trim(const prefix_event& e, const keep_fn& keep) = 0;
    // Drops the snapshot of block e (snapshots); false if it had none.
    virtual bool drop(const prefix_event& e) = 0;
    // Whether a hit at the end of block e still finds what this part keeps for it: the block (snapshots),
    // the blocks of its window (window).
    virtual bool serves(const prefix_event& e) const = 0;

    virtual prefix_stats stats() const = 0;
    virtual std::vector<prefix_tier_stats> tier_stats() const = 0;
    virtual void tier_drain() = 0;

    // -- pins, priorities and explicit block transfers (attention parts; others throw unsupported) --
    virtual uint32_t pin(std::span<const token_t> tokens, uint64_t key) = 0;
    virtual uint32_t unpin(std::span<const token_t> tokens, uint64_t key) = 0;
    virtual uint32_t set_priority(std::span<const token_t> tokens, uint64_t key, uint8_t priority) = 0;
    virtual block_layout layout(uint64_t model_id) const = 0;
    virtual uint32_t store_blocks(block_store_i& store, uint64_t model_id, std::span<const token_t> tokens,
                                  uint64_t key) = 0;
    virtual uint32_t fetch_blocks(block_store_i& store, uint64_t model_id, std::span<const token_t> tokens,
                                  uint64_t key, uint32_t stream) = 0;
    // A sequence that decoded a cached block's tokens again moves onto the block's cells when it
    // publishes (blocks, in composites where a part may resume short of this one's chain).
    virtual void share_duplicates() = 0;
};

}  // namespace kvc::detail
