/// @file
/// The oracle of cache == recompute for recurrent and hybrid models (mamba, jamba): no memory at all.
/// Each sequence is the list of its tokens with their positions; its state is what running those tokens
/// from the first, one at a time, gives (Mamba states from zero, attention over the sequence's own
/// earlier tokens at positions not after the query's). The state after a sequence's list is kept until
/// the list changes other than by appending (seq_rm, seq_add, seq_div, clear): then it is recomputed
/// from the first token, so a rollback in the memory is checked against a full recomputation.
#pragma once

#if defined(KVC_LAYER_CORE) || defined(KVC_LAYER_CAPI)
#error "kvcache layers: a runtime header (<kvcache/runtime/...>) included from the core library or the C API"
#endif

#include <cstdint>
#include <memory>
#include <vector>

#include <kvcache/batch.h>
#include <kvcache/kv_cache.h>
#include <kvcache/runtime/runtime.h>
#include <kvcache/types.h>

namespace kvc {

/// Sequences as token lists, recomputed. Sequence operations have the semantics of a recurrent memory
/// whose every rollback succeeds: the caller applies to the oracle only what the memory accepted.
class reference_recurrent {
public:
    /// An empty oracle for up to n_seq_max sequences of model m (borrowed; any architecture).
    reference_recurrent(const model& m, uint32_t n_seq_max, uint32_t n_threads = 1);
    ~reference_recurrent();  ///< frees the lists

    /// The same batch rules as a memory (positions filled from the sequences when absent); logits of the
    /// output tokens in batch order. A token of several sequences continues its first sequence and is
    /// appended to every one.
    decode_result decode(const batch& b);
    /// A sliding window as a cache's (kv_cache_params n_swa, swa): keys outside it are not attended, in
    /// every attention layer or, when swa_layers is not empty, in the layers it marks (as the SWA layers
    /// of a hybrid whose attention part is an iSWA pair).
    void set_swa(uint32_t n_swa, swa_type type, std::vector<bool> swa_layers = {});

    void clear();                                                 ///< every sequence empty
    void seq_rm(seq_id_t s, pos_t p0, pos_t p1);                  ///< drops the tokens in [p0, p1)
    void seq_cp(seq_id_t src, seq_id_t dst, pos_t p0, pos_t p1);  ///< dst = src's whole list (range ignored)
    void seq_keep(seq_id_t s);                                    ///< every other sequence empty
    void seq_add(seq_id_t s, pos_t p0, pos_t p1, pos_t shift);    ///< shifts positions in [p0, p1)
    /// The position of the sequence's last token (-1: empty): a recurrent sequence's pos_min and pos_max.
    pos_t seq_pos_max(seq_id_t s) const;
    size_t seq_size(seq_id_t s) const;  ///< tokens in the list
    /// Single-token forwards run so far (recomputations included), for tests that need to know one ran.
    uint64_t n_forwards() const;

    struct impl;

private:
    std::unique_ptr<impl> p_;
};

}  // namespace kvc
