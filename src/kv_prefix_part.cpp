// A kv_cache as a part of its prefix cache (detail/kv_prefix_part.h).
#include "detail/kv_prefix_part.h"

#include "detail/kv_cache_prefix.h"

namespace kvc::detail {

kv_prefix_part& kv_prefix_part::of(kv_cache& cache) {
    if (!cache.part_) throw error(errc::invalid_state, "kv_cache: made without a prefix cache");
    return *cache.part_;
}

prefix_part_i::kind kv_prefix_part::part_kind() const {
    return c_.prefix_->windowed() ? kind::window : kind::blocks;
}

void kv_prefix_part::listen(listener to) {
    c_.prefix_->on_event = std::move(to);
}

bool kv_prefix_part::masked(pos_t p_key, pos_t p_query) const {
    return is_masked_swa(c_.params_.n_swa, c_.params_.swa, p_key, p_query);
}

void kv_prefix_part::fetch(seq_id_t seq_id, std::span<const token_t> tokens, uint64_t key,
                           uint32_t max_tokens) {
    c_.prefix_publish();
    c_.tier_fetch(tokens, key, c_.seq_to_stream(seq_id), max_tokens);
}

bool kv_prefix_part::serves(const prefix_event& e) const {
    const kv_cache::prefix_state& ps = *c_.prefix_;
    if (!ps.windowed()) return false;
    const uint32_t d0 = ps.attach_from((e.depth + 1) * ps.bs()) / ps.bs();
    uint64_t h = e.hash;
    for (uint32_t d = e.depth + 1; d-- > d0;) {  // the chain's blocks by hash, from e's down
        const uint32_t id = ps.index.find_any(h);
        if (id == prefix_index::none || ps.index.at(id).depth != d) return false;
        h = ps.index.seed(id);
    }
    return true;
}

uint32_t kv_prefix_part::trim(const prefix_event& e, const keep_fn& keep) {
    kv_cache::prefix_state& ps = *c_.prefix_;
    uint32_t n = 0;
    for (uint32_t id = ps.index.find_hash(e.hash, e.parent_hash, e.tokens);
         id != prefix_index::none && ps.index.at(id).st == prefix_index::state::queued;) {
        const prefix_index::block& b = ps.index.at(id);
        if (keep && keep({.type = prefix_event::kind::stored,
                          .hash = b.hash,
                          .parent_hash = ps.index.seed(id),
                          .depth = b.depth,
                          .tokens = ps.index.tokens(id)}))
            break;
        const uint32_t parent = b.parent, stream = b.stream;
        c_.tier_evicting(id);  // it leaves memory as an eviction would
        ps.index.evicting(id);
        ps.emit(prefix_event::kind::removed, id);
        kv_cells& cells = c_.streams_[stream];
        for (uint32_t c : ps.index.cells(id)) {
            cells.unhold(c);  // no sequence holds it: empty now
            c_.lower_head(stream, c);
        }
        ps.index.remove(id);
        ++ps.stats.evicted_blocks;
        c_.fit_storage(stream);
        ++n;
        id = parent;  // queued now if this was its last child
    }
    if (n > 0) c_.tier_flush();
    return n;
}

void kv_prefix_part::share_duplicates() {
    c_.prefix_->share_duplicates = true;
}

}  // namespace kvc::detail
