// Conversion kernels behind the row functions of dtype.h, one table per SIMD level.
// Every table computes exactly the bytes of the scalar one; tests compare them bit for bit.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include <kvcache/dtype.h>

namespace kvc::detail {

struct dtype_kernels {
    // n: values (a multiple of 32 for the block types, checked by the caller)
    // Typed rows are raw bytes: a caller's row pointer need not be aligned for uint16_t or the blocks.
    void (*f32_to_f16)(const float* x, uint8_t* y, int64_t n);
    void (*f16_to_f32)(const uint8_t* x, float* y, int64_t n);
    void (*f32_to_bf16)(const float* x, uint8_t* y, int64_t n);
    void (*bf16_to_f32)(const uint8_t* x, float* y, int64_t n);
    void (*f32_to_q8_0)(const float* x, uint8_t* y, int64_t n);
    void (*q8_0_to_f32)(const uint8_t* x, float* y, int64_t n);
    void (*f32_to_q4_0)(const float* x, uint8_t* y, int64_t n);
    void (*q4_0_to_f32)(const uint8_t* x, float* y, int64_t n);
};

const dtype_kernels& scalar_kernels();

// nullptr when the build has no kernels for that level (non-x86 targets).
const dtype_kernels* x86_kernels(simd_level level);

// Per-block scale rules shared by the scalar and vector paths, so that both divide the same way.
inline float q8_0_scale(float amax) {
    return amax / 127.0f;
}
inline float q4_0_scale(float max) {
    return max / -8.0f;
}
inline float inverse_scale(float d) {
    return d != 0.0f ? 1.0f / d : 0.0f;
}

// The fp16 scale opens each block; the row pointer may have any alignment, so go through memcpy.
inline float load_scale(const uint8_t* d) {
    uint16_t h;
    std::memcpy(&h, d, sizeof h);
    return fp16_to_fp32(h);
}
inline void store_scale(uint8_t* d, float f) {
    const uint16_t h = fp32_to_fp16(f);
    std::memcpy(d, &h, sizeof h);
}

}  // namespace kvc::detail
