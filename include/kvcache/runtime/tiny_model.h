/// @file
/// A tiny llama-architecture model with deterministic pseudo-random weights, written as GGUF: for tests,
/// the demo's built-in default, and comparisons with other engines. With the default options the file
/// is byte for byte the workplace's llama-peer `tiny_llama.gguf` (make_tiny_llama.py: splitmix64 seeded
/// 0x5EED1234, all f32), so logits can be compared with llama.cpp on the same weights.
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

/// The shape, weights seed and weight type of the tiny model.
struct tiny_model_options {
    uint32_t n_vocab = 256;           ///< vocabulary size
    uint32_t n_embd = 64;             ///< embedding width
    uint32_t n_head = 4;              ///< attention heads
    uint32_t n_head_kv = 2;           ///< KV heads
    uint32_t n_layer = 2;             ///< layers
    uint32_t n_ff = 128;              ///< feed-forward width
    uint32_t n_ctx_train = 512;       ///< training context
    float rope_freq_base = 10000.0f;  ///< RoPE base
    float rms_eps = 1e-5f;            ///< RMSNorm epsilon
    uint64_t seed = 0x5EED1234u;      ///< splitmix64 seed of the weights
    /// of the 2-D weight matrices (f32, f16, bf16, q8_0, q4_0); norms stay f32
    dtype weight_type = dtype::f32;
};

/// The GGUF bytes of the model; throws kvc::error(invalid_argument) on inconsistent options.
std::vector<uint8_t> tiny_model_bytes(const tiny_model_options& options = {});
/// Writes them to path atomically; returns the file size.
uint64_t write_tiny_model(const std::string& path, const tiny_model_options& options = {});

}  // namespace kvc
