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

void kv_prefix_part::share_duplicates() {
    c_.prefix_->share_duplicates = true;
}

}  // namespace kvc::detail
