#include "rss.h"

#include <fstream>
#include <string>

namespace kvc::cli {

rss read_rss() {
    rss r;
    std::ifstream in("/proc/self/status");
    std::string key;
    uint64_t kib = 0;
    while (in >> key) {
        if (key == "VmRSS:" && in >> kib) r.now = kib * 1024;
        if (key == "VmHWM:" && in >> kib) r.peak = kib * 1024;
    }
    return r;
}

}  // namespace kvc::cli
