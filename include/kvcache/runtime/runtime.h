/// @file
/// The reference runtime: a llama-architecture forward pass that decodes through a kv_cache, the proof
/// that the cache is right (docs/runtime.md). Decoding through the cache must give the logits of a
/// reference that keeps every sequence's keys and values in plain f32 arrays and recomputes attention
/// from them (reference_memory), within the tolerance of the cache's element types.
///
/// Models are GGUF files of the llama architecture (general.architecture = llama) with weights in f32,
/// f16, bf16, q8_0 or q4_0: token embedding, per layer RMSNorm, Q/K/V projections, RoPE, grouped-query
/// attention, output projection, RMSNorm, SwiGLU feed-forward; final RMSNorm and output head (or the
/// tied embedding). Plain f32 arithmetic, multi-threaded with a thread_pool.
///
/// Recurrent models decode the same way through a memory_recurrent (`mamba`: Mamba-1 layers) or a
/// memory_hybrid (`jamba`: Mamba layers with dt/B/C norms, attention layers without RoPE, dense SwiGLU
/// feed-forward in every layer); their oracle is reference_recurrent (reference_recurrent.h).
#pragma once

// Layer guard: this header belongs to the runtime library (kvcache_runtime). The core library and the C
// API are built with KVC_LAYER_CORE / KVC_LAYER_CAPI and must not depend on the runtime.
#if defined(KVC_LAYER_CORE) || defined(KVC_LAYER_CAPI)
#error "kvcache layers: a runtime header (<kvcache/runtime/...>) included from the core library or the C API"
#endif

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <kvcache/batch.h>
#include <kvcache/dtype.h>
#include <kvcache/kv_cache.h>
#include <kvcache/kv_cache_iswa.h>
#include <kvcache/memory_hybrid.h>
#include <kvcache/memory_recurrent.h>
#include <kvcache/ops.h>
#include <kvcache/runtime/kv_tensors.h>
#include <kvcache/runtime/thread_pool.h>
#include <kvcache/types.h>

namespace kvc {

class gguf_file;

/// The GGUF architectures the runtime runs (general.architecture).
enum class model_arch : uint8_t {
    llama,  ///< attention layers with RoPE: a kv_cache or kv_cache_iswa
    mamba,  ///< Mamba-1 layers only: a memory_recurrent
    jamba,  ///< Mamba and attention layers (head_count_kv 0: Mamba): a memory_hybrid
};

/// The memory a model decodes through.
enum class model_memory : uint8_t { kv, recurrent, hybrid };

/// The hyper-parameters of a model, as its GGUF file states them.
struct model_hparams {
    model_arch arch = model_arch::llama;  ///< general.architecture
    std::string name;                     ///< general.name, if any
    uint32_t n_vocab = 0;                 ///< vocabulary size
    uint32_t n_ctx_train = 0;             ///< training context
    uint32_t n_embd = 0;                  ///< embedding width
    uint32_t n_layer = 0;                 ///< layers
    uint32_t n_ff = 0;                    ///< feed-forward width
    uint32_t n_head = 0;                  ///< attention heads
    uint32_t n_head_kv = 0;               ///< KV heads (of the attention layers)
    uint32_t n_embd_head = 0;             ///< n_embd / n_head
    float rms_eps = 1e-5f;                ///< RMSNorm epsilon
    rope_params rope{};                   ///< llama: normal rotation of n_rot dims
    dtype weight_type = dtype::f32;       ///< of the attention projections (what the file mostly holds)
    /// [n_layer] per layer: whether it is a Mamba layer (state rows, no K/V)
    std::vector<bool> recurrent;
    uint32_t ssm_d_conv = 0;   ///< Mamba: conv kernel width
    uint32_t ssm_d_inner = 0;  ///< Mamba: inner width (2 * n_embd)
    uint32_t ssm_d_state = 0;  ///< Mamba: SSM state per channel
    uint32_t ssm_dt_rank = 0;  ///< Mamba: rank of the time-step projection

    /// Values of a Mamba layer's r row (the conv window): (d_conv - 1) * d_inner.
    uint32_t n_embd_r() const { return ssm_d_conv == 0 ? 0 : (ssm_d_conv - 1) * ssm_d_inner; }
    /// Values of a Mamba layer's s row (the SSM state): d_state * d_inner.
    uint32_t n_embd_s() const { return ssm_d_state * ssm_d_inner; }
    /// Whether layer il is a Mamba layer.
    bool is_recurrent(uint32_t il) const { return il < recurrent.size() && recurrent[il]; }
};

/// A llama model, memory-mapped from a GGUF file.
class model {
public:
    /// Loads and checks a model: architecture, every hyper-parameter, every tensor's presence, type and
    /// shape. Throws kvc::error naming the key or tensor that is missing or wrong, or the option the
    /// runtime does not run (another architecture, Jamba's mixture-of-experts layers).
    static model load(const std::string& path);
    model(model&&) noexcept;             ///< takes the other's mapping
    model& operator=(model&&) noexcept;  ///< takes the other's mapping
    ~model();                            ///< unmaps the file

    const model_hparams& hparams() const;  ///< the hyper-parameters
    /// The layers as the cache sees them (kv_cache_params::layers).
    std::vector<layer_desc> layers() const;
    /// Cache parameters for this model; the caller adjusts types, streams, sizes.
    kv_cache_params cache_params(uint32_t kv_size, uint32_t n_seq_max) const;
    /// The memory the model needs: kv (llama), recurrent (mamba) or hybrid (jamba).
    model_memory memory_kind() const;
    /// The recurrent layers (f32 rows, no rollback); the caller adjusts types and n_rs_seq.
    recurrent_params recr_params(uint32_t n_seq_max) const;
    /// Hybrid parameters: the attention layers in a kv_cache of kv_size cells, the Mamba layers in
    /// the recurrent part.
    memory_hybrid_params hybrid_params(uint32_t kv_size, uint32_t n_seq_max) const;

    struct impl;
    const impl& get() const { return *p_; }  ///< the weights, for the runtime's own code

private:
    explicit model(std::unique_ptr<impl> p);
    std::unique_ptr<impl> p_;
};

/// What a decode produced.
struct decode_result {
    memory_status status = memory_status::success;  ///< failed_prepare: no room, nothing changed
    uint32_t n_ubatches = 0;                        ///< ubatches the batch was split into
    std::vector<int32_t> output_ids;                ///< batch index of each output row, in batch order
    std::vector<float> logits;                      ///< [output rows][n_vocab]

    /// The logits of output row i.
    std::span<const float> row(size_t i, uint32_t n_vocab) const {
        return std::span(logits).subspan(i * n_vocab, n_vocab);
    }
};

/// How a runtime decodes.
struct runtime_params {
    uint32_t n_threads = 0;   ///< 0: the hardware's
    uint32_t n_ubatch = 512;  ///< tokens per ubatch
    /// init_batch's embd_all: a recurrent or hybrid memory then splits by sequence (split_seq) instead of
    /// in equal blocks (split_equal), as llama.cpp does when every token is an output
    bool embd_all = false;
    /// Non-null: the runtime owns the K/V tensors (engine-owned storage): the memory's caches were made with
    /// kv_cache_params::engine = tensors; it writes each ubatch's rows at k_idxs / v_idxs and attends over
    /// them. Null: the caches own their storage. Borrowed.
    kv_tensors* tensors = nullptr;
};

/// Decodes batches through any memory, as an engine's llama_decode does: applies the memory's pending
/// work (K-shift, compaction), validates and splits the batch, places each ubatch, writes its K/V rows and
/// attends over the views of the cache holding each layer (memory_i::layer_cache: a kv_cache, the base
/// or SWA cache of an iSWA memory, whose SWA layers see only their window; a hybrid's attention part),
/// with that cache's KQ mask; a Mamba layer's state rows are gathered, run and written back through the
/// context's get_recr() (recurrent_engine.h), rollback planes included.
class runtime {
public:
    /// Decodes with model m through mem (both borrowed: they outlive the runtime). Throws kvc::error when
    /// the memory does not keep what a layer of the model needs (K/V, recurrent state) in its shape.
    runtime(const model& m, memory_i& mem, runtime_params params = {});
    ~runtime();  ///< stops the thread pool

    /// Throws kvc::error on an invalid batch (memory unchanged); returns failed_prepare when the batch
    /// does not fit (memory unchanged).
    decode_result decode(const batch& b);

    const model& get_model() const { return *model_; }  ///< the model
    memory_i& memory() { return *mem_; }                ///< the memory
    /// The KV cache (the base cache of an iSWA memory, the attention part of a hybrid one); throws
    /// kvc::error for a recurrent memory.
    kv_cache& cache();
    thread_pool& pool() { return pool_; }  ///< the worker threads

private:
    void check_layers();

    const model* model_;                  // borrowed
    memory_i* mem_;                       // borrowed
    kv_cache* base_ = nullptr;            // the cache of the full-attention layers (null: recurrent)
    memory_recurrent* recr_ = nullptr;    // the recurrent state (mamba, jamba)
    std::vector<kv_cache*> layer_cache_;  // [n_layer] the cache holding each layer (null: a Mamba layer)
    runtime_params params_;
    thread_pool pool_;
};

/// The oracle: every sequence's tokens with positions, pre-RoPE keys and values, in plain f32 arrays;
/// a decode attends over them (keys rotated to their current positions) one token at a time. Sequence
/// operations have the semantics of a cache whose cells are never shared (seq_cp copies).
class reference_memory {
public:
    /// An empty memory for up to n_seq_max sequences of model m (borrowed).
    reference_memory(const model& m, uint32_t n_seq_max, uint32_t n_threads = 0);
    ~reference_memory();  ///< frees the arrays

    /// A sliding window as a cache's (kv_cache_params n_swa, swa): keys outside it are not attended, in
    /// every layer or, when swa_layers is not empty, in the layers it marks (as an iSWA model's).
    void set_swa(uint32_t n_swa, swa_type type, std::vector<bool> swa_layers = {});

    /// The same batch rules as a cache (positions filled from the sequences when absent); logits of the
    /// output tokens in batch order.
    decode_result decode(const batch& b);

    void clear();                                                 ///< as memory_i::clear
    bool seq_rm(seq_id_t s, pos_t p0, pos_t p1);                  ///< as memory_i::seq_rm
    void seq_cp(seq_id_t src, seq_id_t dst, pos_t p0, pos_t p1);  ///< as memory_i::seq_cp (copies)
    void seq_keep(seq_id_t s);                                    ///< as memory_i::seq_keep
    void seq_add(seq_id_t s, pos_t p0, pos_t p1, pos_t shift);    ///< as memory_i::seq_add
    void seq_div(seq_id_t s, pos_t p0, pos_t p1, int d);          ///< as memory_i::seq_div
    pos_t seq_pos_min(seq_id_t s) const;                          ///< as memory_i::seq_pos_min
    pos_t seq_pos_max(seq_id_t s) const;                          ///< as memory_i::seq_pos_max
    size_t seq_size(seq_id_t s) const;                            ///< entries (tokens) it holds

    struct impl;

private:
    std::unique_ptr<impl> p_;
};

/// Largest |a - b| over two logit arrays of equal size (for reports and tests).
float max_abs_diff(std::span<const float> a, std::span<const float> b);
/// max |a - ref| / max |ref| (the denominator at least 1e-6): the difference logits_tolerance bounds.
double relative_diff(std::span<const float> a, std::span<const float> ref);

/// The documented bound on max |cache - reference| / max |reference| over the logits when K or V are
/// stored as `type` (docs/runtime.md: about 3x the worst seen on the tiny models): f32 1e-5, f16 2e-3,
/// bf16 1.5e-2, q8_0 3e-2, q4_0 3e-1.
double logits_tolerance(dtype type);

}  // namespace kvc
