// Byte copies for state save and load. A state is many row runs of up to a few megabytes each; above
// the last-level cache, glibc's memcpy streams past the cache only for single copies larger than its
// threshold (tens of MB), so runs of a big state would pay a read-for-ownership of every destination
// line. Runs of 1 MiB and more are therefore copied with non-temporal stores, four pages at a time.
#pragma once

#include <cstddef>
#include <cstring>

namespace kvc::detail {

/// Copies of at least this many bytes bypass the caches.
inline constexpr size_t streaming_copy_min = size_t{1} << 20;

/// memcpy with non-temporal stores (plain memcpy where the target has none); dst and src must not overlap.
void copy_streaming(void* dst, const void* src, size_t n);

/// memcpy, streaming for large copies.
inline void copy_bytes(void* dst, const void* src, size_t n) {
    if (n >= streaming_copy_min)
        copy_streaming(dst, src, n);
    else if (n > 0)
        std::memcpy(dst, src, n);
}

}  // namespace kvc::detail
