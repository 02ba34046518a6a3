// A memory_recurrent as a part of its prefix cache (detail/recurrent_prefix_part.h).
#include "detail/recurrent_prefix_part.h"

#include "detail/recurrent_prefix.h"

namespace kvc::detail {

recurrent_prefix_part& recurrent_prefix_part::of(memory_recurrent& mem) {
    if (!mem.part_) throw error(errc::invalid_state, "memory_recurrent: made without a prefix cache");
    return *mem.part_;
}

void recurrent_prefix_part::listen(listener to) {
    m_.prefix_->on_event = std::move(to);
}

uint32_t recurrent_prefix_part::pin(std::span<const token_t> /*tokens*/, uint64_t /*key*/) {
    throw error(errc::unsupported,
                "memory_recurrent: pins, priorities and block transfers are a plain KV cache's");
}

}  // namespace kvc::detail
