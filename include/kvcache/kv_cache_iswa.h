/// @file
/// kv_cache_iswa: interleaved sliding-window attention (llama_kv_cache_iswa, design/kv-cache.md §8)
/// for models that mix full-attention layers with sliding-window ones (Gemma 2/3, Cohere 2, Llama 4, ...).
/// Implements memory_i.
///
/// Two kv_caches split by layer: the base cache holds the layers with layer_desc::is_swa false (full
/// size, no window), the SWA cache those with is_swa true, with the window rule of the parameters and
/// only as many cells as the window needs:
/// @verbatim
///   size_swa = min(kv_size, roundup(n_swa * (unified ? n_seq_max : 1) + n_ubatch + n_swa_retain, 256))
///   size_swa = kv_size with swa_full
/// @endverbatim
/// The SWA cache reuses the cells of keys that slid out of every query's window, so it holds only the
/// recent past: positions are reported from it (seq_pos_min grows as the window slides), and positions
/// cannot be shifted unless both caches have the same size (swa_full). Every batch is placed in both
/// caches or in neither; the context gives each layer the child context of its cache (for_layer).
/// State: the base cache's then the SWA cache's (kv_cache layout each); state_seq_flag_partial_only
/// saves and restores the SWA part alone.
///
/// Prefix cache (kv.prefix; docs/prefix-cache.md, "Sliding-window models"): both caches publish the same
/// blocks; the SWA cache keeps a block only while it lies in the window of some boundary it may serve
/// (design D30). A hit at n needs the base cache's blocks for [0, n) and the SWA cache's for the window
/// before n; evictions of either part take the other's blocks that no longer serve a hit with them.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <kvcache/kv_cache.h>
#include <kvcache/memory.h>
#include <kvcache/memory_pair.h>

namespace kvc {

/// How the SWA cache of an iSWA pair is sized (the formula in the file comment); also the hybrid
/// memory's, when its attention part is such a pair.
struct iswa_sizing {
    /// size the SWA cache like the base one (shifts and any seq_rm then work)
    bool swa_full = true;
    /// the largest ubatch the engine places (sizes the SWA cache)
    uint32_t n_ubatch = 512;
    /// Without swa_full: more cells per stream for the windows of cached prefixes (the prefix cache's,
    /// docs/prefix-cache.md, "Sliding-window models"; 0: only what live sequences need).
    uint32_t n_swa_retain = 0;
};

/// Everything a kv_cache_iswa is made from.
struct kv_cache_iswa_params {
    /// Shared by both caches: the layers (is_swa decides the cache), filter, types, V layout, streams,
    /// padding, positions per token, allocator, engine (its operations name their model layers, so one
    /// engine serves both). kv_size sizes the base cache; n_swa and swa are the rule of the SWA layers (swa
    /// must not be none).
    kv_cache_params kv;
    iswa_sizing sizing;  ///< how the SWA cache is sized
};

/// The SWA cache's cells per stream for these parameters (the formula in the file comment).
uint32_t iswa_swa_size(const kv_cache_iswa_params& p);

/// Two KV caches, one for the full-attention layers and one for the sliding-window layers, driven as one
/// memory. See the file comment.
class kv_cache_iswa final : public memory_pair {
public:
    /// Throws kvc::error(invalid_argument) on an invalid configuration: what kv_cache refuses, no
    /// full-attention layer or no SWA layer kept (use a plain kv_cache), swa none or n_swa 0.
    explicit kv_cache_iswa(kv_cache_iswa_params params);
    ~kv_cache_iswa() override;
    kv_cache_iswa(const kv_cache_iswa&) = delete;
    kv_cache_iswa& operator=(const kv_cache_iswa&) = delete;

    // -- memory_i --
    /// Unified: ubatches in batch order (split_simple) if both caches take them, else (and with one stream
    /// per sequence) equal-length ubatches (split_equal, sequential unless unified) placed in both.
    memory_context_ptr init_batch(batch_allocr& balloc, uint32_t n_ubatch, bool embd_all) override;
    /// Places the caller's ubatches in the base cache then the SWA cache; failed_prepare if either has no
    /// room (neither changed).
    memory_context_ptr init_ubatches(std::vector<ubatch> ubatches, std::vector<int32_t> out_ids) override;
    memory_context_ptr init_full() override;
    /// Pending work of either cache (status combined: no_update only when neither has any).
    memory_context_ptr init_update(bool optimize) override;
    /// Both caches can shift and have the same size (swa_full).
    bool get_can_shift() const override;

    // clear, seq_cp, seq_keep, seq_add, seq_div (memory_pair): the base cache then the SWA cache.
    bool seq_rm(seq_id_t seq_id, pos_t p0, pos_t p1) override;  ///< both caches, the results ANDed
    pos_t seq_pos_min(seq_id_t seq_id) const override;          ///< of the SWA cache (the recent past)
    pos_t seq_pos_max(seq_id_t seq_id) const override;          ///< of the SWA cache

    // State (memory_pair): the base cache's (unless state_seq_flag_partial_only) then the SWA cache's;
    // layout "iswa base={base layout} swa={SWA layout}".

    kv_cache* layer_cache(uint32_t il) override;  ///< the base or the SWA cache
    using memory_i::layer_cache;
    memory_recurrent* recurrent() override { return nullptr; }
    // prefix_cache() (memory_pair): over both caches (kv.prefix.enabled; see the file comment)

    /// K/V bytes both caches made from p would reserve, saturating; p need not be valid.
    static uint64_t reserve_bytes(const kv_cache_iswa_params& p);

    // -- parts --
    kv_cache& get_base() { return *base_; }                         ///< the full-attention layers' cache
    const kv_cache& get_base() const { return *base_; }             ///< the full-attention layers' cache
    kv_cache& get_swa() { return *swa_; }                           ///< the sliding-window layers' cache
    const kv_cache& get_swa() const { return *swa_; }               ///< the sliding-window layers' cache
    const kv_cache_iswa_params& params() const { return params_; }  ///< the configuration
    size_t size_bytes() const { return base_->size_bytes() + swa_->size_bytes(); }  ///< K/V of both

private:
    // The base cache's commit is taken back when the SWA cache's fails (an allocation).
    void commit_parts(state_stage_i* base, state_stage_i& swa) override;
    void check_seq(seq_id_t s, const char* what) const;

    kv_cache_iswa_params params_;
    std::unique_ptr<kv_cache> base_;
    std::unique_ptr<kv_cache> swa_;
};

/// The context kv_cache_iswa returns: a child context per cache over the same ubatches. Engines build the
/// full-attention layers with get_base() (or for_layer) and the SWA layers with get_swa(): each has its
/// own slots, n_kv, mask (the SWA one masks keys outside the window) and views.
class kv_cache_iswa_context final : public memory_pair_context {
public:
    /// A failed context (no children).
    explicit kv_cache_iswa_context(memory_status status) : memory_pair_context(status) {}
    /// A context over two children (a batch context with its ubatches and output ids, or full / update
    /// contexts with empty ones): the base cache's then the SWA cache's.
    kv_cache_iswa_context(std::unique_ptr<kv_cache_context> base, std::unique_ptr<kv_cache_context> swa,
                          std::vector<ubatch> ubatches, std::vector<int32_t> out_ids);

    /// The child of the cache that holds model layer il; null when neither does or on a failed context.
    kv_cache_context* get_attn(uint32_t il) override;
    memory_recurrent_context* get_recr() override { return nullptr; }  ///< none

    // -- children --
    kv_cache_context& get_base();  ///< the base cache's context; throws on a failed context
    kv_cache_context& get_swa();   ///< the SWA cache's context; throws on a failed context
};

}  // namespace kvc
