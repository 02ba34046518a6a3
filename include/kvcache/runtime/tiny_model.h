/// @file
/// A tiny model with deterministic pseudo-random weights, written as GGUF: for tests, the demo's built-in
/// default, and comparisons with other engines. With the default options the file is byte for byte the
/// workplace's llama-peer `tiny_llama.gguf` (make_tiny_llama.py: splitmix64 seeded 0x5EED1234, all f32),
/// so logits can be compared with llama.cpp on the same weights; tiny_model_options::mamba() and
/// tiny_model_options::jamba() give its `tiny_mamba.gguf` and `tiny_jamba.gguf` (make_tiny_mamba.py,
/// make_tiny_jamba.py).
#pragma once

// Layer guard: this header belongs to the runtime library (kvcache_runtime). The core library and the C
// API are built with KVC_LAYER_CORE / KVC_LAYER_CAPI and must not depend on the runtime.
#if defined(KVC_LAYER_CORE) || defined(KVC_LAYER_CAPI)
#error "kvcache layers: a runtime header (<kvcache/runtime/...>) included from the core library or the C API"
#endif

#include <cstdint>
#include <string>
#include <vector>

#include <kvcache/dtype.h>

namespace kvc {

/// The architectures the generator writes.
enum class tiny_arch : uint8_t {
    llama,  ///< attention layers with RoPE
    mamba,  ///< Mamba-1 layers (no feed-forward)
    jamba,  ///< Mamba layers with dt/B/C norms and attention layers without RoPE, each with a feed-forward
};

/// The shape, weights seed and weight type of the tiny model.
struct tiny_model_options {
    tiny_arch arch = tiny_arch::llama;  ///< what to write
    uint32_t n_vocab = 256;             ///< vocabulary size
    uint32_t n_embd = 64;               ///< embedding width
    uint32_t n_head = 4;                ///< attention heads
    uint32_t n_head_kv = 2;             ///< KV heads
    uint32_t n_layer = 2;               ///< layers
    uint32_t n_ff = 128;                ///< feed-forward width
    uint32_t n_ctx_train = 512;         ///< training context
    float rope_freq_base = 10000.0f;    ///< RoPE base
    float rms_eps = 1e-5f;              ///< RMSNorm epsilon
    uint64_t seed = 0x5EED1234u;        ///< splitmix64 seed of the weights
    /// of the 2-D weight matrices (f32, f16, bf16, q8_0, q4_0); norms stay f32
    dtype weight_type = dtype::f32;
    uint32_t d_inner = 0;      ///< Mamba: inner width (0: 2 * n_embd, the only expansion llama.cpp runs)
    uint32_t d_state = 8;      ///< Mamba: SSM state per channel
    uint32_t d_conv = 4;       ///< Mamba: conv kernel width
    uint32_t dt_rank = 4;      ///< Mamba: time-step rank
    uint32_t attn_period = 2;  ///< Jamba: layer il is attention when il % attn_period == attn_period - 1

    /// The peer's tiny_mamba.gguf: n_embd 32, 2 layers, d_inner 64, d_state 8, d_conv 4, dt_rank 4.
    static tiny_model_options mamba();
    /// The peer's tiny_jamba.gguf: n_embd 32, 4 layers (Mamba, attention, Mamba, attention), 4 heads,
    /// 2 KV heads, n_ff 64, d_inner 64, d_state 8, d_conv 4, dt_rank 4.
    static tiny_model_options jamba();
};

/// The GGUF bytes of the model; throws kvc::error(invalid_argument) on inconsistent options.
std::vector<uint8_t> tiny_model_bytes(const tiny_model_options& options = {});
/// Writes them to path atomically; returns the file size.
uint64_t write_tiny_model(const std::string& path, const tiny_model_options& options = {});

}  // namespace kvc
