#include <unistd.h>

#include <limits>

#include <fmt/format.h>
#include <kvcache/limits.h>
#include <kvcache/memory_budget.h>
#include <kvcache/types.h>

namespace kvc {

memory_breakdown& memory_breakdown::operator+=(const memory_breakdown& o) {
    reserved += o.reserved;
    committed += o.committed;
    used += o.used;
    cached += o.cached;
    pinned += o.pinned;
    free += o.free;
    if (seq.size() < o.seq.size()) seq.resize(o.seq.size());
    for (size_t i = 0; i < o.seq.size(); ++i) seq[i] += o.seq[i];
    return *this;
}

uint64_t physical_memory_bytes() {
    // asked once: a system call each time would cost every batch::init one (it checks its bytes)
    static const uint64_t bytes = [] {
        const long pages = ::sysconf(_SC_PHYS_PAGES);
        const long page = ::sysconf(_SC_PAGESIZE);
        if (pages <= 0 || page <= 0)
            return std::numeric_limits<uint64_t>::max();  // unknown: no default limit
        return mul_sat(static_cast<uint64_t>(pages), static_cast<uint64_t>(page));
    }();
    return bytes;
}

uint64_t mul_sat(uint64_t a, uint64_t b) {
    uint64_t r = 0;
    return __builtin_mul_overflow(a, b, &r) ? std::numeric_limits<uint64_t>::max() : r;
}

uint64_t add_sat(uint64_t a, uint64_t b) {
    uint64_t r = 0;
    return __builtin_add_overflow(a, b, &r) ? std::numeric_limits<uint64_t>::max() : r;
}

namespace {

std::string human(uint64_t bytes) {
    if (bytes == std::numeric_limits<uint64_t>::max()) return "more than 16 EiB";
    const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
    double v = static_cast<double>(bytes);
    int u = 0;
    while (v >= 1024.0 && u < 6) {
        v /= 1024.0;
        ++u;
    }
    return u == 0 ? fmt::format("{} bytes", bytes) : fmt::format("{:.2f} {} ({} bytes)", v, units[u], bytes);
}

}  // namespace

void check_memory_budget(std::string_view what, uint64_t need, uint64_t budget, std::string_view detail) {
    std::string_view whence;
    if (budget == 0) {
        budget = get_limits().memory_bytes;
        whence = " (memory_budget 0: kvc::limits memory_bytes)";
    }
    if (budget == 0) {
        budget = physical_memory_bytes();
        whence = " (memory_budget 0: the machine's physical memory)";
    }
    if (need <= budget) return;
    throw error(errc::out_of_memory, fmt::format("{}: {} needs {}, over the memory budget of {}{}", what,
                                                 detail, human(need), human(budget), whence));
}

}  // namespace kvc
