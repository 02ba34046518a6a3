#include <atomic>

#include <fmt/format.h>
#include <kvcache/limits.h>
#include <kvcache/memory_budget.h>
#include <kvcache/types.h>

namespace kvc {

namespace {

// One atomic per field: a reader sees each limit whole (set_limits is not atomic as a whole).
struct stored_limits {
    std::atomic<uint64_t> file_bytes{limits{}.file_bytes};
    std::atomic<uint64_t> metadata_bytes{limits{}.metadata_bytes};
    std::atomic<uint32_t> batch_tokens{limits{}.batch_tokens};
    std::atomic<uint32_t> sequences{limits{}.sequences};
    std::atomic<uint64_t> memory_bytes{limits{}.memory_bytes};
};

stored_limits& stored() {
    static stored_limits s;
    return s;
}

}  // namespace

limits get_limits() {
    const stored_limits& s = stored();
    return {s.file_bytes.load(), s.metadata_bytes.load(), s.batch_tokens.load(), s.sequences.load(),
            s.memory_bytes.load()};
}

limits set_limits(const limits& l) {
    if (l.batch_tokens == 0 || l.sequences == 0)
        throw error(errc::invalid_argument,
                    fmt::format("set_limits: batch_tokens ({}) and sequences ({}) must be at least 1",
                                l.batch_tokens, l.sequences));
    const limits old = get_limits();
    stored_limits& s = stored();
    s.file_bytes = l.file_bytes;
    s.metadata_bytes = l.metadata_bytes;
    s.batch_tokens = l.batch_tokens;
    s.sequences = l.sequences;
    s.memory_bytes = l.memory_bytes;
    return old;
}

void check_limit(std::string_view what, std::string_view name, uint64_t value, uint64_t max) {
    if (value > max)
        throw error(errc::out_of_range,
                    fmt::format("{}: {}, over the limit {} of {} (kvc::limits)", what, value, name, max));
}

uint64_t file_bytes_limit() {
    const uint64_t l = stored().file_bytes.load();
    return l == 0 ? physical_memory_bytes() : l;
}

}  // namespace kvc
