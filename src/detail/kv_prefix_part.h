// A kv_cache as a part of a prefix cache (prefix/prefix_part.h): its blocks, with or without a sliding
// window. The cache owns one when it has a prefix cache; composites drive their caches' parts through
// their own coordinator.
#pragma once

#include <kvcache/kv_cache.h>

#include "prefix/prefix_part.h"

namespace kvc::detail {

class kv_prefix_part final : public prefix_part_i {
public:
    explicit kv_prefix_part(kv_cache& cache) : c_(cache) {}
    // The part of a cache made with a prefix cache (throws kvc::error(invalid_state) without one).
    static kv_prefix_part& of(kv_cache& cache);

    kind part_kind() const override;
    void listen(listener to) override;
    pos_t seq_begin(seq_id_t seq_id) const override { return c_.seq_pos_min(seq_id); }
    pos_t seq_end(seq_id_t seq_id) const override { return c_.seq_pos_max(seq_id); }
    bool masked(pos_t p_key, pos_t p_query) const override;
    uint32_t lookup(std::span<const token_t> tokens, uint64_t key) override {
        return c_.prefix_lookup(tokens, key);
    }
    uint32_t attach(seq_id_t seq_id, std::span<const token_t> tokens, uint64_t key, uint8_t priority,
                    uint32_t max_tokens) override {
        return c_.prefix_attach(seq_id, tokens, key, priority, max_tokens);
    }
    void cut(seq_id_t seq_id, uint32_t n) override { c_.seq_rm(seq_id, static_cast<pos_t>(n), -1); }
    void fetch(seq_id_t seq_id, std::span<const token_t> tokens, uint64_t key, uint32_t max_tokens) override;
    void publish() override { c_.prefix_publish(); }
    uint32_t trim(const prefix_event& e, const keep_fn& keep) override;
    bool drop(const prefix_event& /*e*/) override { return false; }
    // With a window: whether the blocks a sequence resumed at the end of block e needs are all cached.
    bool serves(const prefix_event& e) const override;
    prefix_stats stats() const override { return c_.get_prefix_stats(); }
    std::vector<prefix_tier_stats> tier_stats() const override { return c_.get_tier_stats(); }
    void tier_drain() override { c_.prefix_tier_drain(); }
    uint32_t pin(std::span<const token_t> tokens, uint64_t key) override {
        return c_.prefix_pin(tokens, key);
    }
    uint32_t unpin(std::span<const token_t> tokens, uint64_t key) override {
        return c_.prefix_unpin(tokens, key);
    }
    uint32_t set_priority(std::span<const token_t> tokens, uint64_t key, uint8_t priority) override {
        return c_.prefix_set_priority(tokens, key, priority);
    }
    block_layout layout(uint64_t model_id) const override { return c_.prefix_block_layout(model_id); }
    uint32_t store_blocks(block_store_i& store, uint64_t model_id, std::span<const token_t> tokens,
                          uint64_t key) override {
        return c_.prefix_store_blocks(store, model_id, tokens, key);
    }
    uint32_t fetch_blocks(block_store_i& store, uint64_t model_id, std::span<const token_t> tokens,
                          uint64_t key, uint32_t stream) override {
        return c_.prefix_fetch_blocks(store, model_id, tokens, key, stream);
    }
    void share_duplicates() override;

private:
    kv_cache& c_;
};

}  // namespace kvc::detail
