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
class memory_hybrid final : public memory_pair {
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

    kv_cache* layer_cache(uint32_t il) override { return attn_->layer_cache(il); }
    using memory_i::layer_cache;
    memory_recurrent* recurrent() override { return recr_.get(); }
    // prefix_cache() (memory_pair): over both parts (params().prefix.enabled; see the file comment)

    // -- parts --
    memory_i& get_attn() { return *attn_; }              ///< the attention part (kv_cache or kv_cache_iswa)
    const memory_i& get_attn() const { return *attn_; }  ///< the attention part
    memory_recurrent& get_recr() { return *recr_; }      ///< the recurrent part
    const memory_recurrent& get_recr() const { return *recr_; }     ///< the recurrent part
    const memory_hybrid_params& params() const { return params_; }  ///< the configuration
    size_t size_bytes() const;                                      ///< K/V and state rows of both parts

private:
    memory_hybrid_params params_;
    std::unique_ptr<memory_i> attn_;  // kv_cache or kv_cache_iswa
    std::unique_ptr<memory_recurrent> recr_;
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
