// The prefix cache of a memory, over its parts (design D35; docs/architecture.md, "The prefix wing"): one
// coordinator serves lookup, attach, publish, stats, pins and tiers for a plain memory (one part) or a
// composite (a kv_cache_iswa's base and SWA caches, a memory_hybrid's attention and recurrent parts, or all
// three). It finds the hit every part can give, attaches it in each, and couples the parts' evictions: a
// block one part loses is let go by the others, as no hit can use their halves any more.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "prefix/prefix_part.h"

namespace kvc::detail {

class prefix_coordinator final : public prefix_cache_i {
public:
    // p: the memory's prefix parameters (n_vocab and on_event are used here); n_seq_max: its sequences.
    prefix_coordinator(const prefix_cache_params& p, uint32_t n_seq_max);
    // Drives `part` from now on: its events come here (and go on to the user's on_event). At most one
    // part of each kind; the caller keeps it alive.
    void adopt(prefix_part_i& part);
    // Lets the other parts go of what a part evicted since the last call (every call below does it).
    void sync();

    uint32_t prefix_lookup(std::span<const token_t> tokens, uint64_t key = 0) override;
    uint32_t prefix_attach(seq_id_t seq_id, std::span<const token_t> tokens, uint64_t key = 0,
                           uint8_t priority = prefix_default_priority,
                           uint32_t max_tokens = UINT32_MAX) override;
    void prefix_publish() override;
    prefix_stats get_prefix_stats() const override;
    bool prefix_can_pin() const override;
    uint32_t prefix_pin(std::span<const token_t> tokens, uint64_t key = 0) override;
    uint32_t prefix_unpin(std::span<const token_t> tokens, uint64_t key = 0) override;
    uint32_t prefix_set_priority(std::span<const token_t> tokens, uint64_t key, uint8_t priority) override;
    std::vector<prefix_tier_stats> get_tier_stats() const override;
    void prefix_tier_drain() override;
    block_layout prefix_block_layout(uint64_t model_id) const override;
    uint32_t prefix_store_blocks(block_store_i& store, uint64_t model_id, std::span<const token_t> tokens,
                                 uint64_t key = 0) override;
    uint32_t prefix_fetch_blocks(block_store_i& store, uint64_t model_id, std::span<const token_t> tokens,
                                 uint64_t key = 0, uint32_t stream = 0) override;

private:
    using kind = prefix_part_i::kind;
    // A block a part removed, kept until sync() (the event's tokens are only valid during the call).
    struct removed_block {
        kind from;
        prefix_event e;
        std::vector<token_t> tokens;
    };
    // A block of the window part, for the snapshots after it whose window reached back to it.
    struct window_block {
        uint64_t hash;
        uint32_t depth;
        std::vector<token_t> tokens;
    };

    void hear(kind from, const prefix_event& e);
    // the only part, if it is an attention part, once `tokens` are checked (throws kvc::error otherwise)
    prefix_part_i& single(const char* what, std::span<const token_t> tokens) const;
    prefix_part_i* attention() const { return b_ != nullptr ? b_ : w_; }
    uint32_t lookup_attention(std::span<const token_t> tokens, uint64_t key);
    uint32_t attach_attention(seq_id_t seq_id, std::span<const token_t> tokens, uint64_t key,
                              uint8_t priority, uint32_t max_tokens);
    void cut_attention(seq_id_t seq_id, uint32_t n);
    void check_attach(seq_id_t seq_id, std::span<const token_t> tokens, uint8_t priority) const;
    void track_window(const prefix_event& e);
    void drop_window_followers(const prefix_event& removed);

    prefix_part_i* b_ = nullptr;  // full-attention blocks
    prefix_part_i* w_ = nullptr;  // sliding-window blocks
    prefix_part_i* r_ = nullptr;  // recurrent snapshots
    uint32_t n_parts_ = 0;
    uint32_t block_size_;
    int32_t n_vocab_;
    uint32_t n_seq_max_;
    prefix_part_i::listener user_;
    std::vector<removed_block> removed_;
    // with a window part and a snapshot part: the window part's blocks by parent hash
    std::unordered_multimap<uint64_t, window_block> window_children_;
    uint64_t lookups_ = 0, tokens_looked_up_ = 0, hit_tokens_ = 0;  // of a composite
};

}  // namespace kvc::detail
