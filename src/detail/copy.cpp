// copy_streaming: non-temporal stores, four pages interleaved line by line with the sources prefetched
// (the shape of glibc's large-copy loop), so that the stores stream at full memory bandwidth.
#include "copy.h"

#include <algorithm>
#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>  // SSE2: part of x86-64, no dispatch needed
#endif

namespace kvc::detail {

void copy_streaming(void* dst, const void* src, size_t n) {
#if defined(__x86_64__) || defined(_M_X64)
    auto* d = static_cast<char*>(dst);
    const auto* s = static_cast<const char*>(src);
    const size_t head = std::min(n, (64 - (reinterpret_cast<uintptr_t>(d) & 63)) & 63);  // align d to a line
    std::memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    constexpr size_t page = 4096, block = 4 * page, line = 64;
    for (; n >= block; n -= block, d += block, s += block)
        for (size_t off = 0; off < page; off += line)
            for (size_t p = 0; p < 4; ++p) {
                const char* sp = s + p * page + off;
                char* dp = d + p * page + off;
                _mm_prefetch(sp + 4 * line, _MM_HINT_T0);
                const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sp));
                const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + 16));
                const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + 32));
                const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + 48));
                _mm_stream_si128(reinterpret_cast<__m128i*>(dp), a);
                _mm_stream_si128(reinterpret_cast<__m128i*>(dp + 16), b);
                _mm_stream_si128(reinterpret_cast<__m128i*>(dp + 32), c);
                _mm_stream_si128(reinterpret_cast<__m128i*>(dp + 48), e);
            }
    _mm_sfence();  // the streamed lines are visible before anything written after the copy
    std::memcpy(d, s, n);
#else
    std::memcpy(dst, src, n);
#endif
}

}  // namespace kvc::detail
