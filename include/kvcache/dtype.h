/// @file
/// Element types of K/V storage, their block layouts (identical to ggml's) and row conversion to and
/// from f32.
///
/// A row of n values of a block type is n / block_size(type) consecutive blocks. Conversion follows
/// ggml's reference code bit for bit on finite input:
/// @verbatim
///   f16   IEEE binary16, round to nearest even, subnormals kept, overflow to inf
///   bf16  the upper half of binary32, round to nearest even, NaN made quiet
///   q8_0  d = amax / 127, q = round(x / d) (half away from zero)            value = q * d
///   q4_0  d = m / -8 (m: first value of largest magnitude), q = trunc(x / d + 8.5) clamped to 15,
///         two values per byte (value j low nibble, value j + 16 high nibble)  value = (q - 8) * d
/// @endverbatim
/// Non-finite input gives non-finite or saturated blocks, never undefined behaviour.
/// The vectorised paths (AVX2 + F16C, AVX-512) produce exactly the bytes of the scalar path.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include <kvcache/types.h>

namespace kvc {

/// The numeric values are ggml's type ids, which llama.cpp writes into state payloads.
enum class dtype : int32_t {
    f32 = 0,
    f16 = 1,
    q4_0 = 2,
    q8_0 = 8,
    bf16 = 30,
};

/// Every element type, in the order tools list them.
inline constexpr std::array<dtype, 5> all_dtypes = {dtype::f32, dtype::f16, dtype::bf16, dtype::q8_0,
                                                    dtype::q4_0};

inline constexpr int64_t qk8_0 = 32;  ///< values per q8_0 block
inline constexpr int64_t qk4_0 = 32;  ///< values per q4_0 block

/// ggml's block_q8_0: 34 bytes.
struct block_q8_0 {
    uint16_t d;        ///< scale, IEEE half
    int8_t qs[qk8_0];  ///< quants
};
static_assert(sizeof(block_q8_0) == 34);

/// ggml's block_q4_0: 18 bytes.
struct block_q4_0 {
    uint16_t d;             ///< scale, IEEE half
    uint8_t qs[qk4_0 / 2];  ///< nibbles: value j in the low half of byte j, value j + 16 in the high half
};
static_assert(sizeof(block_q4_0) == 18);

// -- sizes --

int64_t block_size(dtype type);  ///< values per block (1 for float types)
size_t type_size(dtype type);    ///< bytes per block
bool is_quantized(dtype type);   ///< q8_0 or q4_0 (block types)
bool is_valid(dtype type);       ///< one of all_dtypes (guards values cast from integers)

/// Bytes of a row of n values. Throws kvc::error if n < 0 or n is not a multiple of block_size(type).
size_t row_size(dtype type, int64_t n);

// -- names --

const char* to_string(dtype type);                            ///< "f32", "f16", "bf16", "q8_0", "q4_0"
std::optional<dtype> dtype_from_name(std::string_view name);  ///< case-sensitive, as to_string
dtype parse_dtype(std::string_view name);  ///< like dtype_from_name; throws kvc::error listing the choices
std::optional<dtype> dtype_from_ggml(int32_t ggml_type);  ///< nullopt for ggml types kvcache does not store

// -- scalar conversions (exactly what the row functions do per value) --

uint16_t fp32_to_fp16(float f);  ///< f32 -> IEEE binary16 bits
float fp16_to_fp32(uint16_t h);  ///< IEEE binary16 bits -> f32
uint16_t fp32_to_bf16(float f);  ///< f32 -> bfloat16 bits
float bf16_to_fp32(uint16_t h);  ///< bfloat16 bits -> f32

// -- rows --
/// @name Rows
/// n values; n must be a multiple of block_size(type). dst must hold row_size(type, n) bytes (from_f32)
/// or n floats (to_f32). Throws kvc::error on a bad n or an invalid type.
/// @{

void from_f32(dtype type, const float* src, void* dst, int64_t n);  ///< a row of f32 -> a row of `type`
void to_f32(dtype type, const void* src, float* dst, int64_t n);    ///< a row of `type` -> a row of f32
/// @}

/// Row of src_type -> row of dst_type through f32 (a plain copy when the types are equal).
void convert_row(dtype src_type, const void* src, dtype dst_type, void* dst, int64_t n);

// -- vectorised kernels --

/// Instruction set of the row conversion kernels.
enum class simd_level : uint8_t {
    scalar = 0,  ///< portable C++
    avx2 = 1,    ///< AVX2 + F16C
    avx512 = 2,  ///< AVX-512 F/BW/VL/DQ
};

const char* to_string(simd_level level);  ///< "scalar", "avx2", "avx512"
simd_level simd_supported();              ///< best level this CPU runs
simd_level simd_active();                 ///< level the row functions use (the supported one unless changed)

/// Selects the kernels used from now on, process-wide (for tests and benchmarks). Returns the level in
/// effect: `level` if the CPU runs it, else the supported one.
simd_level set_simd_level(simd_level level);

}  // namespace kvc
