// Words, numbers and keys of op script lines (replay_script.h).
#include "replay_script.h"

#include <charconv>

#include <fmt/format.h>

namespace kvc::cli {

void fail(const std::string& what) {
    throw script_error{what};
}

int64_t parse_int(std::string_view s, const std::string& what) {
    int64_t v = 0;
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec != std::errc() || end != s.data() + s.size() || s.empty())
        fail(fmt::format("{}: '{}' is not an integer", what, s));
    return v;
}

int32_t parse_i32(std::string_view s, const std::string& what) {
    const int64_t v = parse_int(s, what);
    if (v < INT32_MIN || v > INT32_MAX) fail(fmt::format("{}: {} does not fit int32", what, v));
    return static_cast<int32_t>(v);
}

std::vector<std::string_view> split(std::string_view s, char sep) {
    std::vector<std::string_view> out;
    size_t start = 0;
    while (true) {
        const size_t at = s.find(sep, start);
        out.push_back(s.substr(start, at == std::string_view::npos ? std::string_view::npos : at - start));
        if (at == std::string_view::npos) return out;
        start = at + 1;
    }
}

keys::keys(const words& w, size_t first, std::span<const char* const> allowed, const char* op) {
    for (size_t i = first; i < w.size(); ++i) {
        const size_t eq = w[i].find('=');
        if (eq == std::string_view::npos) fail(fmt::format("{}: expected key=value, got '{}'", op, w[i]));
        const std::string name(w[i].substr(0, eq));
        bool known = false;
        for (const char* a : allowed) known |= name == a;
        if (!known) fail(fmt::format("{}: unknown key '{}'", op, name));
        if (!values_.emplace(name, std::string(w[i].substr(eq + 1))).second)
            fail(fmt::format("{}: key '{}' given twice", op, name));
    }
}

std::optional<std::string> keys::get(std::string_view name) const {
    const auto it = values_.find(name);
    if (it == values_.end()) return std::nullopt;
    return it->second;
}

int64_t keys::get_int(std::string_view name, int64_t def) const {
    const auto v = get(name);
    return v ? parse_int(*v, std::string(name)) : def;
}

bool keys::get_bool(std::string_view name, bool def) const {
    const int64_t v = get_int(name, def ? 1 : 0);
    if (v != 0 && v != 1) fail(fmt::format("{} must be 0 or 1", name));
    return v == 1;
}

}  // namespace kvc::cli
