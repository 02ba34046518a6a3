#include <cstdio>
#include <mutex>
#include <string>

#include <kvcache/types.h>
#include <kvcache/version.h>

namespace kvc {

const char* to_string(memory_status s) {
    switch (s) {
        case memory_status::success:
            return "success";
        case memory_status::no_update:
            return "no_update";
        case memory_status::failed_prepare:
            return "failed_prepare";
        case memory_status::failed_compute:
            return "failed_compute";
    }
    return "unknown";
}

const char* to_string(errc code) {
    switch (code) {
        case errc::invalid_argument:
            return "invalid_argument";
        case errc::out_of_range:
            return "out_of_range";
        case errc::invalid_state:
            return "invalid_state";
        case errc::corrupt_data:
            return "corrupt_data";
        case errc::unsupported:
            return "unsupported";
        case errc::io:
            return "io";
        case errc::out_of_memory:
            return "out_of_memory";
    }
    return "unknown";
}

namespace {

const char* level_name(log_level level) {
    switch (level) {
        case log_level::debug:
            return "debug";
        case log_level::info:
            return "info";
        case log_level::warn:
            return "warning";
        case log_level::error:
            return "error";
    }
    return "?";
}

void default_log(log_level level, const char* message, void* /*user_data*/) {
    if (level < log_level::warn) return;
    std::fprintf(stderr, "kvcache %s: %s\n", level_name(level), message);
}

// Logging is rare (never per token), so a mutex keeps callback and user data consistent cheaply.
struct log_sink {
    std::mutex mutex;
    log_callback callback = default_log;
    void* user_data = nullptr;
};

log_sink& sink() {
    static log_sink s;
    return s;
}

}  // namespace

void set_log_callback(log_callback callback, void* user_data) {
    log_sink& s = sink();
    std::lock_guard lock(s.mutex);
    s.callback = callback ? callback : default_log;
    s.user_data = callback ? user_data : nullptr;
}

void log(log_level level, std::string_view message) {
    log_sink& s = sink();
    std::lock_guard lock(s.mutex);
    const std::string text(message);
    s.callback(level, text.c_str(), s.user_data);
}

const char* version_string() {
    return KVC_VERSION_STRING;
}

}  // namespace kvc
