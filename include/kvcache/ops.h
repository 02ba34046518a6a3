/// @file
/// RoPE (normal, NeoX; YaRN parameters), the one kernel the memories need themselves: the K-shift
/// re-rotates stored keys with it. Exact: it defines what the results must be (the runtime's attention
/// kernels live in the runtime layer).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include <kvcache/types.h>

namespace kvc {

/// How a layer rotates its queries and keys (rotary position embedding).
enum class rope_type : uint8_t {
    none = 0,    ///< no rotary embedding (ALiBi, learned positions): nothing to shift
    normal = 1,  ///< rotate pairs (x[2i], x[2i+1]) (llama, ggml mode 0)
    neox = 2,    ///< rotate pairs (x[i], x[i + n_rot/2]) (GPT-NeoX, Qwen, ggml mode 2)
};

const char* to_string(rope_type t);  ///< "none", "normal", "neox"

/// RoPE of one layer, with ggml's YaRN parameters.
struct rope_params {
    rope_type type = rope_type::normal;  ///< rotation kind
    int32_t n_rot = 0;                   ///< rotary dims of a head (even; 0 = the whole head)
    float freq_base = 10000.0f;          ///< theta_i = pos * freq_base^(-2i / n_rot)
    float freq_scale = 1.0f;             ///< linear / YaRN interpolation: positions scaled by freq_scale
    float ext_factor = 0.0f;             ///< YaRN extrapolation mix (0 = off)
    float attn_factor = 1.0f;            ///< magnitude scale applied to rotated values
    float beta_fast = 32.0f;             ///< YaRN ramp bounds
    float beta_slow = 1.0f;              ///< YaRN ramp bounds
    int32_t n_ctx_orig = 0;              ///< training context (YaRN)
};

/// RoPE rotation (exact; the vector path gives the scalar path's bits).
namespace ops {

/// Rotates the first n_rot dims of each of n_head heads of head_dim values in x (f32, contiguous) as
/// for position `pos`, in place. with_magnitude: multiply by attn_factor and YaRN's magnitude correction,
/// as when computing Q and K; false: a pure rotation, as a K-shift needs (design D5), so that rotating
/// by d after p equals rotating by p + d. Throws kvc::error on bad sizes.
void rope(std::span<float> x, uint32_t n_head, uint32_t head_dim, pos_t pos, const rope_params& p,
          bool with_magnitude = true);

/// The same in two steps, for many rows at one position (a K-shift moves whole runs of cells by the
/// same delta): the (cos, sin) of every rotated pair, then their application to rows.
/// Per rotated dim i of a head: x'[i] = x[i] * c[i] + x[partner(i)] * s[i], where partner(i) is the other
/// dim of i's pair (i ^ 1 for normal RoPE, i +- n_rot / 2 for NeoX), so that rows rotate as vectors.
struct rope_table {
    rope_type type = rope_type::normal;  ///< rotation kind
    uint32_t n_rot = 0;                  ///< rotated dims of a head
    std::vector<float> c;                ///< [n_rot] cos of the dim's pair
    std::vector<float> s;                ///< [n_rot] -sin for the pair's first dim, +sin for its second
};
/// The (cos, sin) table of position `pos` (arguments as for rope()).
rope_table make_rope_table(uint32_t head_dim, pos_t pos, const rope_params& p, bool with_magnitude = true);
/// Rotates the n_head heads of head_dim values in x by the table, in place (as rope() would).
void apply_rope(std::span<float> x, uint32_t n_head, uint32_t head_dim, const rope_table& t);

}  // namespace ops
}  // namespace kvc
