// A memory_recurrent as a part of its prefix cache (detail/recurrent_prefix_part.h).
#include "detail/recurrent_prefix_part.h"

#include <algorithm>

#include "detail/recurrent_prefix.h"

namespace kvc::detail {

recurrent_prefix_part& recurrent_prefix_part::of(memory_recurrent& mem) {
    if (!mem.part_) throw error(errc::invalid_state, "memory_recurrent: made without a prefix cache");
    return *mem.part_;
}

void recurrent_prefix_part::listen(listener to) {
    m_.prefix_->on_event = std::move(to);
}

// a snapshot deeper than memory's for the first max_tokens + 1 of `tokens`
void recurrent_prefix_part::fetch(seq_id_t /*seq_id*/, std::span<const token_t> tokens, uint64_t key,
                                  uint32_t max_tokens) {
    m_.prefix_publish();
    m_.tier_fetch(tokens.first(std::min<size_t>(tokens.size(), uint64_t{max_tokens} + 1)), key);
}

bool recurrent_prefix_part::drop(const prefix_event& e) {
    memory_recurrent::prefix_state& ps = *m_.prefix_;
    const uint32_t id = ps.index.find_hash(e.hash, e.parent_hash, e.tokens);
    if (id == prefix_index::none || !ps.has_snapshot(id)) return false;
    m_.tier_evicting(id);  // it leaves memory as an eviction would
    ps.drop_snapshot(id);
    m_.fit_snapshots();
    m_.tier_flush();
    return true;
}

bool recurrent_prefix_part::serves(const prefix_event& e) const {
    return m_.prefix_->index.find_hash(e.hash, e.parent_hash, e.tokens) != prefix_index::none;
}

uint32_t recurrent_prefix_part::pin(std::span<const token_t> /*tokens*/, uint64_t /*key*/) {
    throw error(errc::unsupported,
                "memory_recurrent: pins, priorities and block transfers are a plain KV cache's");
}

}  // namespace kvc::detail
