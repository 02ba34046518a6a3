// The synthetic engine of `kvcache replay`: what an engine writes into a memory for each applied ubatch,
// without a model. K/V rows and recurrent states are deterministic functions of (layer, sequence set,
// position, dim), so state bytes, sizes and digests are reproducible and depend on the whole history.
#pragma once

#include <cstdint>
#include <span>

#include <kvcache/memory.h>
#include <kvcache/types.h>

namespace kvc::cli {

/// The key of a sequence set (the sequences a token belongs to, in the order given): what the synthetic
/// values depend on besides layer, position and dim.
uint64_t seq_set_key(std::span<const seq_id_t> seqs);

/// The engine side of ctx's applied ubatch, whatever the memory kind: synthetic K/V rows for every
/// attention layer among the n_layer model layers (get_attn), and every recurrent state folded token by
/// token through the library's reference of the contract (get_recr). seq_key: per batch token, the key
/// of its sequence set (indexed by ubatch::batch_idx).
void run_synthetic_ubatch(memory_context_i& ctx, uint32_t n_layer, std::span<const uint64_t> seq_key);

}  // namespace kvc::cli
