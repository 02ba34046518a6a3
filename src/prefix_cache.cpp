// The check every prefix cache call that takes a priority makes.
#include <kvcache/prefix_cache.h>

namespace kvc {

void check_prefix_priority(uint32_t priority, const char* what) {
    if (priority > prefix_max_priority)
        throw error(errc::invalid_argument, std::string(what) + ": priority " + std::to_string(priority) +
                                                " above " + std::to_string(prefix_max_priority));
}

}  // namespace kvc
