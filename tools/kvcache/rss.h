// The process's resident memory (/proc/self/status): what the system actually gave it, next to what the
// memories say they hold.
#pragma once

#include <cstdint>

namespace kvc::cli {

struct rss {
    uint64_t now = 0;   ///< VmRSS in bytes (0 where /proc is missing)
    uint64_t peak = 0;  ///< VmHWM in bytes: the peak since the process started
};

rss read_rss();

}  // namespace kvc::cli
