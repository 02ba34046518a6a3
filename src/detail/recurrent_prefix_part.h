// A memory_recurrent as a part of a prefix cache (prefix/prefix_part.h): the snapshots of its states at
// block boundaries, over the chains that lead to them. The memory owns one when it has a prefix cache; a
// memory_hybrid drives it through its own coordinator.
#pragma once

#include <kvcache/memory_recurrent.h>

#include "prefix/prefix_part.h"

namespace kvc::detail {

class recurrent_prefix_part final : public prefix_part_i {
public:
    explicit recurrent_prefix_part(memory_recurrent& mem) : m_(mem) {}
    // The part of a memory made with a prefix cache (throws kvc::error(invalid_state) without one).
    static recurrent_prefix_part& of(memory_recurrent& mem);

    kind part_kind() const override { return kind::snapshots; }
    void listen(listener to) override;
    pos_t seq_begin(seq_id_t seq_id) const override { return m_.seq_pos_min(seq_id); }
    pos_t seq_end(seq_id_t seq_id) const override { return m_.seq_pos_max(seq_id); }
    bool masked(pos_t /*p_key*/, pos_t /*p_query*/) const override { return false; }
    uint32_t lookup(std::span<const token_t> tokens, uint64_t key) override {
        return m_.prefix_lookup(tokens, key);
    }
    uint32_t attach(seq_id_t seq_id, std::span<const token_t> tokens, uint64_t key, uint8_t priority,
                    uint32_t max_tokens) override {
        return m_.prefix_attach(seq_id, tokens, key, priority, max_tokens);
    }
    void cut(seq_id_t seq_id, uint32_t n) override { m_.seq_rm(seq_id, static_cast<pos_t>(n), -1); }
    void fetch(seq_id_t seq_id, std::span<const token_t> tokens, uint64_t key, uint32_t max_tokens) override;
    void publish() override { m_.prefix_publish(); }
    uint32_t trim(const prefix_event& /*e*/, const keep_fn& /*keep*/) override { return 0; }
    bool drop(const prefix_event& e) override;
    // Whether the index has block e: it leads to a snapshot, or a sequence is decoding past it.
    bool serves(const prefix_event& e) const override;
    prefix_stats stats() const override { return m_.get_prefix_stats(); }
    std::vector<prefix_tier_stats> tier_stats() const override { return m_.get_tier_stats(); }
    void tier_drain() override { m_.prefix_tier_drain(); }
    // A plain KV cache's (the coordinator never asks a recurrent part).
    uint32_t pin(std::span<const token_t> tokens, uint64_t key) override;
    uint32_t unpin(std::span<const token_t> tokens, uint64_t key) override { return pin(tokens, key); }
    uint32_t set_priority(std::span<const token_t> tokens, uint64_t key, uint8_t /*priority*/) override {
        return pin(tokens, key);
    }
    block_layout layout(uint64_t model_id) const override { return m_.prefix_block_layout(model_id); }
    uint32_t store_blocks(block_store_i& /*store*/, uint64_t /*model_id*/, std::span<const token_t> tokens,
                          uint64_t key) override {
        return pin(tokens, key);
    }
    uint32_t fetch_blocks(block_store_i& /*store*/, uint64_t /*model_id*/, std::span<const token_t> tokens,
                          uint64_t key, uint32_t /*stream*/) override {
        return pin(tokens, key);
    }
    void share_duplicates() override {}

private:
    memory_recurrent& m_;
};

}  // namespace kvc::detail
