// Small pieces shared by the state writers and readers (kv_cache, memory_recurrent, state_summary).
#pragma once

#include <functional>
#include <string>
#include <string_view>

#include <fmt/format.h>
#include <kvcache/state.h>

namespace kvc::detail {

template <class T>
void put(io_write_i& io, T v) {
    io.write(&v, sizeof v);
}

template <class T>
T get(io_read_i& io) {
    T v{};
    io.read(&v, sizeof v);
    return v;
}

// A malformed state: kvc::error(corrupt_data) naming the byte reached.
[[noreturn]] inline void bad(const io_read_i& io, const std::string& what) {
    throw error(errc::corrupt_data, fmt::format("state: at byte {}: {}", io.n_bytes(), what));
}

// Refuses a payload of `bytes` that no state of mem can be, before any of it is read: a declared size
// (a session header's, a zstd frame's) is the writer's word only, and a forged one must not decide what
// a load reads or inflates. kvc::error(corrupt_data) "WHO: the payload is N bytes, more than ...".
inline void check_payload_size(const memory_i& mem, uint64_t bytes, std::string_view who) {
    const uint64_t max = mem.state_max_bytes();
    if (bytes > max)
        throw error(
            errc::corrupt_data,
            fmt::format("{}: the payload is {} bytes, more than the {} bytes of the largest state this "
                        "memory can hold (state_max_bytes)",
                        who, bytes, max));
}

// The layers of a state_layout() line: runs of consecutive model layers with one shape, e.g.
// "0-31:k=f16x1024,v=f16x1024;32:k=...". il(i) is the model index of own layer i, shape(i) its text.
inline std::string layer_runs(size_t n_layers, const std::function<uint32_t(size_t)>& il,
                              const std::function<std::string(size_t)>& shape) {
    std::string out;
    for (size_t i = 0; i < n_layers;) {
        size_t n = 1;
        const std::string s = shape(i);
        while (i + n < n_layers && il(i + n) == il(i) + n && shape(i + n) == s) ++n;
        if (i) out += ';';
        out += n == 1 ? fmt::format("{}:{}", il(i), s) : fmt::format("{}-{}:{}", il(i), il(i + n - 1), s);
        i += n;
    }
    return n_layers ? out : "none";
}

}  // namespace kvc::detail
