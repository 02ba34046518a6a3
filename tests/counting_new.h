// Replaces the global operator new and delete of a test binary (include this header in exactly one source
// file of the binary): every allocation is counted with its bytes (live and peak), and, when armed, the
// Nth allocation throws std::bad_alloc (out-of-memory injection). One thread only.
#pragma once

#include <malloc.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>

namespace {

// Armed when g_fail_at > 0: allocation number g_fail_at (counted from arming) throws.
uint64_t g_count = 0;
uint64_t g_fail_at = 0;
bool g_failed = false;  // the armed allocation was reached

uint64_t g_live_bytes = 0;  // bytes allocated and not freed (usable sizes, as malloc rounds them)
uint64_t g_peak_bytes = 0;  // the most g_live_bytes has been since the last reset_peak_bytes()

[[maybe_unused]] void reset_peak_bytes() {
    g_peak_bytes = g_live_bytes;
}

void* counted_alloc(size_t size, size_t align) {
    if (g_fail_at != 0 && ++g_count == g_fail_at) {
        g_failed = true;
        throw std::bad_alloc();
    }
    if (size == 0) size = 1;
    void* p = align <= alignof(std::max_align_t)
                  ? std::malloc(size)
                  : std::aligned_alloc(align, (size + align - 1) / align * align);
    if (!p) throw std::bad_alloc();
    g_live_bytes += malloc_usable_size(p);
    if (g_live_bytes > g_peak_bytes) g_peak_bytes = g_live_bytes;
    return p;
}

void* counted_alloc_nothrow(size_t size, size_t align) noexcept {
    try {
        return counted_alloc(size, align);
    } catch (const std::bad_alloc&) {
        return nullptr;
    }
}

void counted_free(void* p) noexcept {
    if (!p) return;
    g_live_bytes -= malloc_usable_size(p);
    std::free(p);
}

}  // namespace

void* operator new(size_t size) {
    return counted_alloc(size, 0);
}
void* operator new[](size_t size) {
    return counted_alloc(size, 0);
}
void* operator new(size_t size, std::align_val_t a) {
    return counted_alloc(size, static_cast<size_t>(a));
}
void* operator new[](size_t size, std::align_val_t a) {
    return counted_alloc(size, static_cast<size_t>(a));
}
void* operator new(size_t size, const std::nothrow_t&) noexcept {
    return counted_alloc_nothrow(size, 0);
}
void* operator new[](size_t size, const std::nothrow_t&) noexcept {
    return counted_alloc_nothrow(size, 0);
}
void operator delete(void* p) noexcept {
    counted_free(p);
}
void operator delete[](void* p) noexcept {
    counted_free(p);
}
void operator delete(void* p, size_t) noexcept {
    counted_free(p);
}
void operator delete[](void* p, size_t) noexcept {
    counted_free(p);
}
void operator delete(void* p, std::align_val_t) noexcept {
    counted_free(p);
}
void operator delete[](void* p, std::align_val_t) noexcept {
    counted_free(p);
}
void operator delete(void* p, size_t, std::align_val_t) noexcept {
    counted_free(p);
}
void operator delete[](void* p, size_t, std::align_val_t) noexcept {
    counted_free(p);
}
