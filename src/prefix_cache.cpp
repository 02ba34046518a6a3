// What prefix_cache_i offers that only some memories do: pins and priorities are a plain KV cache's.
#include <kvcache/prefix_cache.h>

namespace kvc {

namespace {

[[noreturn]] void no_pins(const char* what) {
    throw error(errc::unsupported,
                std::string(what) +
                    ": pins and priorities are a plain KV cache's (not an iSWA pair's, nor "
                    "recurrent snapshots')");
}

}  // namespace

void check_prefix_priority(uint32_t priority, const char* what) {
    if (priority > prefix_max_priority)
        throw error(errc::invalid_argument, std::string(what) + ": priority " + std::to_string(priority) +
                                                " above " + std::to_string(prefix_max_priority));
}

uint32_t prefix_cache_i::prefix_pin(std::span<const token_t> /*tokens*/, uint64_t /*key*/) {
    no_pins("prefix_pin");
}

uint32_t prefix_cache_i::prefix_unpin(std::span<const token_t> /*tokens*/, uint64_t /*key*/) {
    no_pins("prefix_unpin");
}

uint32_t prefix_cache_i::prefix_set_priority(std::span<const token_t> /*tokens*/, uint64_t /*key*/,
                                             uint8_t /*priority*/) {
    no_pins("prefix_set_priority");
}

}  // namespace kvc
