// Fixed-offset fields of the file headers and records kvcache writes (session files, block records):
// values in host order, which both formats require to be little-endian.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

namespace kvc::detail {

// The T at byte `at` of b (the caller checked that it fits).
template <class T>
T load_at(std::span<const uint8_t> b, size_t at) {
    T v;
    std::memcpy(&v, b.data() + at, sizeof v);
    return v;
}

// Writes v at byte `at` of b (the caller checked that it fits).
template <class T>
void store_at(std::span<uint8_t> b, size_t at, T v) {
    std::memcpy(b.data() + at, &v, sizeof v);
}

}  // namespace kvc::detail
