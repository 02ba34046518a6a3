// The words of an op script line (docs/op-scripts.md) for `kvcache replay`: script errors, numbers and
// key=value pairs, shared by the op handlers and the memory factories.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvc::cli {

/// A script error: stops the run with `error line N: what` and exit status 2.
struct script_error {
    std::string what;
};

/// The words of one line, the op name first.
using words = std::vector<std::string_view>;

[[noreturn]] void fail(const std::string& what);

/// A decimal integer, or a script error naming `what`.
int64_t parse_int(std::string_view s, const std::string& what);
/// A decimal integer that fits int32, or a script error naming `what`.
int32_t parse_i32(std::string_view s, const std::string& what);
/// s cut at every sep (empty pieces kept).
std::vector<std::string_view> split(std::string_view s, char sep);

/// The keys of one line: name=value pairs from words[first], each allowed key at most once.
class keys {
public:
    keys(const words& w, size_t first, std::span<const char* const> allowed, const char* op);
    keys(const words& w, size_t first, std::initializer_list<const char*> allowed, const char* op)
        : keys(w, first, std::span<const char* const>(allowed.begin(), allowed.size()), op) {}

    /// The value of a key, if given.
    std::optional<std::string> get(std::string_view name) const;
    /// An integer key, def when absent.
    int64_t get_int(std::string_view name, int64_t def) const;
    /// A 0/1 key, def when absent.
    bool get_bool(std::string_view name, bool def) const;

private:
    std::map<std::string, std::string, std::less<>> values_;
};

}  // namespace kvc::cli
