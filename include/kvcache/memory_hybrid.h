/// @file
/// memory_hybrid: an attention KV cache and a recurrent memory driven as one memory (llama.cpp's
/// llama_memory_hybrid and llama_memory_hybrid_iswa, design/recurrent.md §5) for models that mix
/// attention layers with Mamba / RWKV / short-conv layers (Jamba, Falcon-H1, Granite 4, LFM2, Qwen3-Next,
/// Nemotron-H, ...). Implements memory_i.
///
/// Which layers each part keeps comes from the parameters: the attention part keeps the layers with
/// layer_desc::has_kv (and its filter), the recurrent part those with an r or s row (and its filter); a
/// layer may be in both (Falcon-H1) or in neither (Nemotron-H's MLP layers). With `iswa` the attention
/// part is a kv_cache_iswa.
///
/// Batches are split once, in equal-length ubatches (the recurrent memory needs them), and placed in the
/// recurrent part first, then the attention part; if either has no room, neither changes. Removing
/// tokens is all-or-nothing: the recurrent part decides first (it cannot remove a suffix without
/// rollback), and when it refuses the attention part is left untouched. Positions combine as the
/// tokens both parts hold: seq_pos_min is the larger minimum, seq_pos_max the smaller maximum.
/// State: the attention part's then the recurrent part's; state_seq_flag_partial_only saves and restores
/// the recurrent part alone. A failed restore changes neither part (upstream clears the destination).
///
/// Prefix cache (params.prefix; docs/prefix-cache.md, "Hybrid memories"): the attention part keeps the
/// K/V of published blocks, the recurrent part snapshots of states at block boundaries. A hit resumes at
/// the deepest boundary that has both: the K/V of every block before it and a snapshot at it. With an
/// iSWA attention part the K/V is the base cache's blocks before the boundary and the SWA cache's window
/// before it (design D30).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include <kvcache/kv_cache.h>
#include <kvcache/kv_cache_iswa.h>
#include <kvcache/memory.h>
#include <kvcache/memory_pair.h>
#include <kvcache/memory_recurrent.h>

namespace kvc {

/// Everything a memory_hybrid is made from.
struct memory_hybrid_params {
    kv_cache_params attn;   ///< the attention part (its layers: those with has_kv that its filter keeps)
    recurrent_params recr;  ///< the recurrent part (same n_seq_max as attn)
    /// set: the attention part is a kv_cache_iswa sized so (its SWA rule: attn.n_swa, attn.swa)
    std::optional<iswa_sizing> iswa;
    /// The most bytes both parts together may take (memory_budget.h; each part also checks its own).
    /// 0: the machine's physical memory.
    uint64_t memory_budget = 0;
    /// Keep prompt prefixes for reuse (see the file comment): given to both parts (set it here, not in
    /// attn.prefix or recr.prefix). With iswa: no tiers.
    prefix_cache_params prefix;
};

/// An attention cache and a recurrent memory as one memory. See the file comment.
class memory_hybrid final : public memory_pair, public prefix_cache_i {
public:
    /// Throws kvc::error(invalid_argument) on an invalid configuration: what either part refuses, or
    /// different n_seq_max.
    explicit memory_hybrid(memory_hybrid_params params);
    ~memory_hybrid() override;
    memory_hybrid(const memory_hybrid&) = delete;
    memory_hybrid& operator=(const memory_hybrid&) = delete;

    // -- memory_i --
    /// split_equal (sequential unless the attention part has one stream; keeping the last n_rs_seq + 1
    /// tokens of each sequence together), or split_seq when embd_all; then the recurrent part and the
    /// attention part. failed_prepare when tokens are left over or either part has no room.
    memory_context_ptr init_batch(batch_allocr& balloc, uint32_t n_ubatch, bool embd_all) override;
    /// The caller's ubatches in the recurrent part then the attention part.
    memory_context_ptr init_ubatches(std::vector<ubatch> ubatches, std::vector<int32_t> out_ids) override;
    memory_context_ptr init_full() override;
    /// The attention part's pending work (a recurrent memory has none).
    memory_context_ptr init_update(bool optimize) override;
    bool get_can_shift() const override;  ///< the attention part's answer

    // clear, seq_keep, seq_add, seq_div (memory_pair): both parts; seq_cp: the attention part then the
    // recurrent part (which shares the whole state, whatever the range).
    /// The recurrent part first: if it refuses, false and nothing changed; else the attention part's
    /// result. A range before the last position leaves the recurrent state as it is (true) and comes out
    /// of the attention part, as upstream.
    bool seq_rm(seq_id_t seq_id, pos_t p0, pos_t p1) override;
    pos_t seq_pos_min(seq_id_t seq_id) const override;  ///< max of the parts' minimums
    pos_t seq_pos_max(seq_id_t seq_id) const override;  ///< min of the parts' maximums (-1 if one is empty)

    // State (memory_pair): the attention part's (unless state_seq_flag_partial_only) then the recurrent
    // part's, both or neither (the attention part is the only one that can lack room, and then changes
    // nothing); layout "hybrid attn={attention layout} recr={recurrent layout}".

    uint32_t n_seq_max() const override { return params_.attn.n_seq_max; }
    uint32_t n_pos() const override { return params_.attn.n_pos; }
    uint32_t n_layer() const override { return static_cast<uint32_t>(params_.attn.layers.size()); }
    kv_cache* layer_cache(uint32_t il) override { return attn_->layer_cache(il); }
    using memory_i::layer_cache;
    memory_recurrent* recurrent() override { return recr_.get(); }
    prefix_cache_i* prefix_cache() override { return prefix_enabled() ? this : nullptr; }
    using memory_i::prefix_cache;

    // -- prefix cache (params().prefix.enabled; see the file comment) --
    bool prefix_enabled() const override { return attn_prefix_ != nullptr; }
    /// Tokens prefix_attach would resume now: the deepest block boundary n < tokens.size() with the
    /// attention part's K/V for [0, n) (iswa: the base cache's, and the SWA cache's window before n) and
    /// a recurrent snapshot at n. Throws what the parts throw.
    uint32_t prefix_lookup(std::span<const token_t> tokens, uint64_t key = 0) override;
    /// Gives the empty sequence seq_id the K/V of [0, n) (shared) and the snapshot at n (copied), and
    /// returns n (what prefix_lookup returns, or less when one stream per sequence lacks room for the
    /// K/V copies; at most max_tokens). Throws, nothing changed, for a sequence that is not empty, a bad
    /// token or priority.
    uint32_t prefix_attach(seq_id_t seq_id, std::span<const token_t> tokens, uint64_t key = 0,
                           uint8_t priority = prefix_default_priority,
                           uint32_t max_tokens = UINT32_MAX) override;
    /// Publishes the last step's blocks and snapshots in both parts.
    void prefix_publish() override;
    /// The attention part's counters and cells (iswa: its base cache's, and the SWA cache's in swa_*),
    /// the recurrent part's snapshot counters; lookups and hits are the hybrid's own.
    prefix_stats get_prefix_stats() const override;
    /// What the prefix cache did with each of its tiers (prefix.tiers.stores, in order; empty without): the
    /// attention part's blocks and the recurrent part's snapshots through the same stores, counted together
    /// (est_* and store: the attention part's).
    std::vector<prefix_tier_stats> get_tier_stats() const override;
    /// With prefix.tiers.async_writes: returns when every write queued so far is done (before reading
    /// the stores from elsewhere, or counters that must include them). Nothing otherwise.
    void prefix_tier_drain() override;

    // -- parts --
    memory_i& get_attn() { return *attn_; }              ///< the attention part (kv_cache or kv_cache_iswa)
    const memory_i& get_attn() const { return *attn_; }  ///< the attention part
    memory_recurrent& get_recr() { return *recr_; }      ///< the recurrent part
    const memory_recurrent& get_recr() const { return *recr_; }     ///< the recurrent part
    const memory_hybrid_params& params() const { return params_; }  ///< the configuration
    size_t size_bytes() const;                                      ///< K/V and state rows of both parts

private:
    void before_sequence_op() override { prefix_publish(); }  // the last step's blocks and snapshots
    // A block one part's index let go, which the other part's may no longer need (sync_parts).
    struct removed_block {
        bool attn = false;    // from the attention part
        bool window = false;  // from its cache with a window (the SWA cache, or a kv_cache with a window)
        uint64_t hash = 0;
        uint64_t parent_hash = 0;
        uint32_t depth = 0;
        std::vector<token_t> tokens;
    };
    // A block of the attention part's cache with a window, filed under its parent's hash (window_children_)
    struct window_block {
        uint64_t hash = 0;
        uint32_t depth = 0;
        std::vector<token_t> tokens;
    };
    // Keeps the parts' caches from holding halves of hits: a snapshot whose blocks' K/V went (a base
    // block, or any block of its window) is dropped, and cached K/V blocks that lead to no snapshot any
    // more are evicted. Run between the parts' operations (never inside one: the removals are queued by
    // their events).
    void sync_parts();
    // Follows the attention part's events of its cache with a window (window_children_).
    void track_window(const prefix_event& e);
    // Drops the snapshots after window block r whose windows held it (those at the ends of the blocks
    // that follow it, as far as the window reaches back).
    void drop_window_followers(const removed_block& r);
    // The deepest boundary n < tokens.size() both parts can resume at (prefix_lookup without counting).
    uint32_t lookup_both(std::span<const token_t> tokens, uint64_t key);

    memory_hybrid_params params_;
    std::unique_ptr<memory_i> attn_;  // kv_cache or kv_cache_iswa
    std::unique_ptr<memory_recurrent> recr_;
    prefix_cache_i* attn_prefix_ = nullptr;  // attn_ when the memory has a prefix cache (borrowed from attn_)
    kv_cache* kv_ = nullptr;                 // attn_ when it is a kv_cache with a prefix cache
    kv_cache_iswa* iswa_ = nullptr;          // attn_ when it is a kv_cache_iswa with a prefix cache
    bool windowed_ = false;  // the attention part has a sliding window: a hit there implies no shallower one
    prefix_stats stats_;     // lookups and hits
    std::vector<removed_block> removed_;
    // The blocks of the attention part's cache with a window, by parent hash: a window block that goes
    // finds the blocks after it, whose snapshots' windows it was part of (one entry per such block)
    std::unordered_multimap<uint64_t, window_block> window_children_;
};

/// The context memory_hybrid returns: an attention child and a recurrent child over the same ubatches.
/// Engines build attention layers with get_attn(il) and recurrent layers with get_recr().
class memory_hybrid_context final : public memory_pair_context {
public:
    /// A failed context (no children).
    explicit memory_hybrid_context(memory_status status) : memory_pair_context(status) {}
    /// A context over two children (a batch context with its ubatches and output ids, or full / update
    /// contexts with empty ones): the attention part's context and the recurrent part's.
    memory_hybrid_context(memory_context_ptr attn, memory_context_ptr recr, std::vector<ubatch> ubatches,
                          std::vector<int32_t> out_ids)
        : memory_pair_context(std::move(attn), std::move(recr), std::move(ubatches), std::move(out_ids)) {}
    /// The KV cache context of attention layer il (the iSWA child that holds it, with iswa); null for a
    /// layer no attention cache holds and on a failed context.
    kv_cache_context* get_attn(uint32_t il) override;
    memory_recurrent_context* get_recr() override;  ///< the recurrent child; null on a failed context
};

}  // namespace kvc
