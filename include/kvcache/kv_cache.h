/// @file
/// kv_cache: the attention KV cache (llama.cpp's llama_kv_cache), unified (one stream shared by every
/// sequence) or split (one stream per sequence). Implements memory_i.
///
/// Per own layer it holds a K buffer and a V buffer of kv_size rows ("cells") per stream; kv_cells keeps
/// the bookkeeping of each stream. Placing a ubatch = find_slot (free cells, or SWA-dead cells of a single
/// sequence, ring-wise from the stream's head hint) + apply_ubatch; init_batch dry-runs every ubatch of a
/// batch (prepare) and rolls back, so a batch that does not fit changes nothing.
///
/// Layout of one layer (E_k = n_head_kv * n_embd_head_k, rows of row_size(type_k, E_k) bytes):
/// @verbatim
///   K      [E_k, kv_size, n_stream]    row of cell c in stream s at (s * kv_size + c)
///   V      like K with E_v, or transposed (v_trans): per stream a matrix [E_vmax channels][kv_size cells],
///          element (channel e, cell c) at s * kv_size * E_vmax + e * kv_size + c (float types only)
/// @endverbatim
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <kvcache/batch.h>
#include <kvcache/block_record.h>
#include <kvcache/block_store.h>
#include <kvcache/dtype.h>
#include <kvcache/executor.h>
#include <kvcache/kv_cells.h>
#include <kvcache/kv_storage.h>
#include <kvcache/memory.h>
#include <kvcache/ops.h>
#include <kvcache/prefix_cache.h>
#include <kvcache/tensor.h>

namespace kvc {

struct kv_cache_test_access;
class kv_storage_engine;

/// Sliding-window attention rule: which past keys a query may see.
enum class swa_type : uint8_t {
    none = 0,       ///< every past key of the sequence is visible
    standard = 1,   ///< a query at p sees keys in (p - n_swa, p]
    chunked = 2,    ///< a query sees keys from the start of its chunk of n_swa positions (Llama 4)
    symmetric = 3,  ///< keys within n_swa / 2 on either side (bidirectional encoders)
};

const char* to_string(swa_type t);  ///< "none", "standard", "chunked", "symmetric"

/// Whether the key at p0 is outside the window of a query at p1 (causality is a separate rule).
bool is_masked_swa(uint32_t n_swa, swa_type type, pos_t p0, pos_t p1);

/// One model layer as the cache sees it.
struct layer_desc {
    uint32_t n_head_kv = 1;      ///< KV heads
    uint32_t n_embd_head_k = 0;  ///< values per key head (a multiple of the block size of type_k)
    uint32_t n_embd_head_v = 0;  ///< values per value head
    bool is_swa = false;         ///< a sliding-window layer (used by kv_cache_iswa to split layers)
    bool has_kv = true;          ///< false: the layer keeps no K/V (e.g. it reuses another layer's)
    rope_params rope{};          ///< how its keys were rotated (for K-shifts)
};

/// Everything a kv_cache is made from.
struct kv_cache_params {
    std::vector<layer_desc> layers;        ///< every model layer, by model index
    std::function<bool(uint32_t)> filter;  ///< keep model layer il? (null: every layer with K/V)
    dtype type_k = dtype::f16;             ///< element type of stored keys
    dtype type_v = dtype::f16;             ///< element type of stored values
    bool v_trans = true;            ///< transposed V (attention without flash attention); float type_v only
    uint32_t kv_size = 4096;        ///< cells per stream
    uint32_t n_seq_max = 1;         ///< sequence ids [0, n_seq_max)
    bool unified = true;            ///< one stream for all sequences, else one stream per sequence
    uint32_t n_pad = 1;             ///< kv_size must be a multiple of it
    uint32_t n_kv_pad = 256;        ///< attention reads a multiple of max(n_pad, n_kv_pad) cells
    uint32_t n_swa = 0;             ///< window of this cache's SWA rule
    swa_type swa = swa_type::none;  ///< this cache's SWA rule
    uint32_t n_pos = 1;             ///< positions per token (4 for M-RoPE: cells then keep (x, y))
    /// Compaction (design D12): init_update(false) also compacts once the empty cells below the last
    /// used one exceed this fraction of it (0: only when asked with init_update(true)).
    float compact_threshold = 0.0f;
    /// init_batch / init_ubatches apply pending K-shifts (what init_update's context runs) once the batch
    /// is placed, as llama.cpp's decode does; a batch that does not fit (failed_prepare) leaves them
    /// pending and the memory unchanged. false: the engine runs init_update itself (the runtime does),
    /// and a batch placed over pending shifts meets unrotated keys.
    bool auto_update = false;
    /// null: host memory, reserved for every cell and committed as cells are used (kv_storage.h); else
    /// the engine's allocator, every byte allocated at creation.
    buffer_allocator* allocator = nullptr;
    /// The most bytes the K/V of every cell may take (memory_budget.h): creation refuses more, before
    /// allocating anything. 0: the machine's physical memory.
    uint64_t memory_budget = 0;
    /// Non-null: the engine owns the K/V tensors and runs the row operations kvcache hands it
    /// (kv_storage_engine.h, docs/engine-owned-storage.md); no allocator then. Borrowed: outlives the cache.
    kv_storage_engine* engine = nullptr;
    /// Runs the K-shift's pieces in parallel (e.g. a thread_pool's parallel_for); empty: one thread.
    executor exec;
    /// Keep computed prompt prefixes for other sequences (kvcache/prefix_cache.h, docs/prefix-cache.md).
    /// Needs no sliding window and one position per token.
    prefix_cache_params prefix;
};

/// Where one ubatch goes (design/kv-cache.md §3.5): group k of size() tokens goes to stream strm[k], cells
/// idxs[k]. Token t of the ubatch is group t / size(), cell idxs[group][t % size()].
struct slot_info {
    uint32_t s0 = 0;                          ///< first stream touched
    uint32_t s1 = 0;                          ///< last stream touched
    std::vector<uint32_t> strm;               ///< [n_stream()] stream of each group
    std::vector<std::vector<uint32_t>> idxs;  ///< [n_stream()][size()] cells of each group

    size_t n_stream() const { return strm.size(); }                    ///< number of groups
    size_t size() const { return idxs.empty() ? 0 : idxs[0].size(); }  ///< tokens per group
    bool empty() const { return idxs.empty(); }                        ///< no room was found
    uint32_t head() const;       ///< first cell of the only group; throws kvc::error on an empty slot
    bool is_contiguous() const;  ///< one group of consecutive ascending cells
};

/// Which keys a query may see besides its sequence and window (kv_cache_context::set_input_kq_mask).
struct kq_mask_options {
    bool causal = true;  ///< keys after the query are masked (false: encoders)
    bool alibi = false;  ///< visible keys get -|p_key - p_query| instead of 0
};

struct prefix_tracker;  // internal: what a sequence decoded in order (src/detail/kv_cache_prefix.h)
namespace detail {
class kv_prefix_part;      // internal: the cache as a part of its prefix cache (src/detail/kv_prefix_part.h)
class prefix_coordinator;  // internal: the prefix cache (src/prefix/prefix_coordinator.h)
}  // namespace detail

/// The attention KV cache (llama_kv_cache): K/V rows of every own layer, placed in cells of one or
/// several streams. Implements memory_i. Engines reach the per-ubatch operations (K/V rows, views,
/// masks) only through the kv_cache_context that init_batch returns.
class kv_cache final : public memory_i {
public:
    explicit kv_cache(kv_cache_params params);  ///< throws kvc::error on an invalid configuration
    ~kv_cache() override;                       ///< frees the storage

    // -- memory_i --
    memory_context_ptr init_batch(batch_allocr& balloc, uint32_t n_ubatch, bool embd_all) override;
    memory_context_ptr init_ubatches(std::vector<ubatch> ubatches, std::vector<int32_t> out_ids) override;
    memory_context_ptr init_full() override;
    memory_context_ptr init_update(bool optimize) override;
    bool get_can_shift() const override;

    void clear(bool data) override;
    bool seq_rm(seq_id_t seq_id, pos_t p0, pos_t p1) override;
    void seq_cp(seq_id_t src, seq_id_t dst, pos_t p0, pos_t p1) override;
    void seq_keep(seq_id_t seq_id) override;
    void seq_add(seq_id_t seq_id, pos_t p0, pos_t p1, pos_t shift) override;
    void seq_div(seq_id_t seq_id, pos_t p0, pos_t p1, int d) override;
    pos_t seq_pos_min(seq_id_t seq_id) const override;
    pos_t seq_pos_max(seq_id_t seq_id) const override;

    void state_write(io_write_i& io, seq_id_t seq_id, state_seq_flags flags) const override;
    state_stage_ptr state_stage(io_read_i& io, seq_id_t seq_id, state_seq_flags flags) const override;
    void state_commit(state_stage_i& stage) override;
    bool state_fits(const state_stage_i& stage) override;
    /// "kv streams=1 v_trans=1 n_pos=1 hadamard=none layers=0-31:k=f16x1024,v=f16x1024"
    std::string state_layout() const override;
    uint64_t state_max_bytes() const override;
    memory_breakdown get_memory_breakdown() const override;

    kv_cache* layer_cache(uint32_t il) override { return has_layer(il) ? this : nullptr; }
    using memory_i::layer_cache;
    memory_recurrent* recurrent() override { return nullptr; }

    /// K/V bytes a cache made from p would reserve (every cell of every stream), saturating at UINT64_MAX;
    /// p need not be valid. What creation checks against p.memory_budget.
    static uint64_t reserve_bytes(const kv_cache_params& p);

    // -- shape --
    const kv_cache_params& params() const { return params_; }  ///< the configuration
    uint32_t get_size() const { return params_.kv_size; }      ///< cells per stream
    /// Number of streams (1 when unified, else n_seq_max).
    uint32_t get_n_stream() const { return static_cast<uint32_t>(streams_.size()); }
    uint32_t seq_to_stream(seq_id_t s) const;                           ///< throws on an invalid id
    std::span<const uint32_t> layer_ids() const { return layer_ids_; }  ///< model index of each own layer
    bool has_layer(uint32_t il) const;             ///< the cache keeps K/V for model layer il
    const kv_cells& cells(uint32_t stream) const;  ///< the bookkeeping of a stream; throws on a bad stream
    uint32_t head(uint32_t stream) const;          ///< where the stream's next free-cell search starts
    bool get_has_shift() const;                    ///< some cell of some stream has a pending shift
    const kv_storage& storage() const { return *storage_; }  ///< where the K/V bytes live

    // -- sizes --
    size_t size_bytes(kv_part part) const;  ///< K (or V) storage of every layer
    size_t size_bytes() const { return size_bytes(kv_part::k) + size_bytes(kv_part::v); }  ///< K and V
    /// K/V bytes backed by memory now (memory_breakdown::committed), in O(streams): cheap enough per step.
    uint64_t committed_bytes() const;
    size_t layer_bytes(kv_part part,
                       uint32_t il) const;  ///< K (or V) storage of model layer il (throws if not own)

    // -- inspection --
    /// A stored K (or V) row decoded to f32 (E values; transposed V gathered), for tests and inspection.
    void read_row(kv_part part, uint32_t il, uint32_t stream, uint32_t cell, std::span<float> out) const;

    /// Pending shift of every cell, [kv_size * n_stream] (0 for empty cells): the K-shift input of an engine
    /// that re-rotates keys itself.
    void set_input_k_shift(std::span<int32_t> dst) const;

    // -- maintenance (what init_update's context runs) --
    /// Re-rotates every pending shift into the stored keys (any K type), then forgets the shifts.
    /// Returns false when there was nothing to do.
    bool update();
    /// Moves used cells down, with their K/V rows, into the empty cells below them, so that every stream
    /// holds its cells in [0, used) and n_kv shrinks. No sequence sees any difference. Returns the
    /// number of cells moved.
    uint32_t compact();
    /// Empty cells below the last used one, as a fraction of it (0 when nothing can be compacted).
    float fragmentation() const;

    /// Internal: the prefix cache's state (src/detail/kv_cache_prefix.h).
    struct prefix_state;

private:
    friend class kv_cache_context;
    friend class detail::kv_prefix_part;
    // tests only: places ubatches at chosen cells, as the design notes' examples draw them
    friend struct kv_cache_test_access;
    friend class kv_cache_iswa;  // commits the states of its two caches all or nothing (state_undo)
    struct layer;
    struct journal;       // cell snapshots taken by a trial placement, for its rollback
    struct commit_undo;   // what a state commit changed (cells, heads, overwritten rows), to take it back
    struct staged_state;  // a parsed, checked state waiting to be applied

    // -- state commits that can be taken back (src/kv_cache_state.cpp) --
    void state_commit(state_stage_i& stage, commit_undo* undo);
    std::shared_ptr<commit_undo> state_commit_undoable(state_stage_i& stage);  // commits; the undo record
    void state_undo(commit_undo& undo);  // back to before that commit (allocates nothing)

    // -- placement: prepare validates each ubatch once; what follows relies on it --
    void check_ubatch(const ubatch& ub) const;                       // throws kvc::error: never placeable
    slot_info find_slot(const ubatch& ub, bool cont = false) const;  // empty: no room now
    void apply_ubatch(const slot_info& sinfo, const ubatch& ub, journal* j = nullptr);
    std::vector<slot_info> prepare(std::span<const ubatch> ubatches);  // empty if one does not fit
    uint32_t get_n_kv(const slot_info& sinfo) const;
    std::vector<uint64_t> rows_of(const slot_info& sinfo) const;  // stream * kv_size + cell, token order

    // -- attention inputs --
    void set_input_kq_mask(tensor_view dst, const ubatch& ub, uint32_t n_kv, kq_mask_options opt) const;
    void set_input_pos_bucket(std::span<int32_t> dst, const ubatch& ub, uint32_t n_kv,
                              uint32_t n_buckets) const;

    void write_cells(io_write_i& io, uint32_t stream, std::span<const uint32_t> cells, seq_id_t seq_id) const;
    uint32_t own_layer(uint32_t il) const;  // index into layers_ / the storage; throws if not own
    void check_seq(seq_id_t s, const char* what) const;
    void lower_head(uint32_t stream, uint32_t cell);
    bool find_slot_group(uint32_t stream, uint32_t n, bool cont, std::vector<uint32_t>& out) const;
    uint64_t row(uint32_t stream, uint32_t cell) const { return uint64_t{stream} * params_.kv_size + cell; }
    void k_shift();
    // commit mark of a stream = its used extent rounded up to the storage's granule: grows before rows are
    // written, gives memory back when the extent shrinks
    void fit_storage(uint32_t stream, bool release = true);  // release false: only grow
    void fit_storage_of(seq_id_t seq_id);                    // the streams seq_id (seq_all: any) lives in
    void remove(seq_id_t seq_id, pos_t p0, pos_t p1);        // seq_rm without giving memory back

    // -- the prefix cache's operations (src/kv_cache_prefix.cpp; the part kv_prefix_part drives) --
    uint32_t prefix_lookup(std::span<const token_t> tokens, uint64_t key);
    uint32_t prefix_attach(seq_id_t seq_id, std::span<const token_t> tokens, uint64_t key, uint8_t priority,
                           uint32_t max_tokens);
    uint32_t prefix_pin(std::span<const token_t> tokens, uint64_t key);
    uint32_t prefix_unpin(std::span<const token_t> tokens, uint64_t key);
    uint32_t prefix_set_priority(std::span<const token_t> tokens, uint64_t key, uint8_t priority);
    void prefix_publish();
    prefix_stats get_prefix_stats() const;
    block_layout prefix_block_layout(uint64_t model_id) const;
    uint32_t prefix_store_blocks(block_store_i& store, uint64_t model_id, std::span<const token_t> tokens,
                                 uint64_t key);
    uint32_t prefix_fetch_blocks(block_store_i& store, uint64_t model_id, std::span<const token_t> tokens,
                                 uint64_t key, uint32_t stream);
    std::vector<prefix_tier_stats> get_tier_stats() const;
    void prefix_tier_drain();

    // -- prefix cache hooks (no-ops without one) --
    static void check_prefix_params(const kv_cache_params& p, uint32_t n_stream);
    void prefix_init();         // params_.prefix checked
    size_t cell_bytes() const;  // K and V bytes of one cell over every layer
    void prefix_record(const slot_info& sinfo, const ubatch& ub);  // tokens a real apply placed
    // >= n empty cells, evicting cached blocks other than `keep` (sorted ids)
    bool prefix_make_room(uint32_t stream, uint32_t n, std::span<const uint32_t> keep = {});
    bool prefix_room_possible(uint32_t stream, uint32_t n) const;  // make_room would succeed
    bool prefix_make_room_for(std::span<const ubatch> ubatches);   // room for every token, per stream
    // after cells lost sequences: released blocks; seq_id (seq_all: any sequence) may have emptied;
    // slid: cells that slid out of a window (their blocks, unless hit, go first)
    void prefix_sync(seq_id_t seq_id, bool slid = false);
    void prefix_before_rm(seq_id_t seq_id, pos_t p0, pos_t p1);
    void prefix_before_cp(seq_id_t src, seq_id_t dst, pos_t p0, pos_t p1);
    // a copy across streams placed src's cells `entries` (pos, cell) at `cells` of dst's stream
    void prefix_copied(seq_id_t dst, std::span<const std::pair<pos_t, uint32_t>> entries,
                       std::span<const uint32_t> cells);
    void prefix_before_shift(seq_id_t seq_id, pos_t p0, pos_t p1);  // copies or unpublishes held cells
    void prefix_forget(seq_id_t seq_id);  // its tracker stops publishing (seq_all: every tracker)
    void share_block(seq_id_t seq, uint32_t id, std::span<const uint32_t> mine);
    void prefix_reset();                                             // everything the memory held is gone
    void prefix_moved(uint32_t stream, uint32_t from, uint32_t to);  // compaction moved a cell
    // with a sliding window (design D30)
    size_t publish_windowed(seq_id_t s, prefix_tracker& t);           // the tokens it went over
    void cut_windowed(seq_id_t s, prefix_tracker& t, uint32_t keep);  // a rollback to [0, keep)
    // -- tiers (src/kv_cache_tier.cpp) --
    struct tier_fetch_result {
        uint32_t n_mem = 0;    // blocks of the prompt in memory before
        uint32_t fetched = 0;  // blocks brought back
        uint32_t refused = 0;  // values that were not the block asked for
        uint64_t bytes = 0;    // value bytes the store returned
    };
    std::vector<uint8_t> tier_encode(uint32_t id, const block_layout& layout) const;  // a block's record
    void tier_evicting(uint32_t id);  // on_evict: its record joins the writes of the next flush
    void tier_flush();                // writes what evictions and publishing left to write
    // prefix_attach: brings back from the tiers what memory lacks of the prompt's first max_tokens
    void tier_fetch(std::span<const token_t> tokens, uint64_t key, uint32_t stream, uint32_t max_tokens);
    // The blocks of `tokens` after the cached chain, from one store (tier_bit: the tier's bit, 0: none)
    tier_fetch_result fetch_from(block_store_i& store, const block_layout& layout,
                                 std::span<const token_t> tokens, uint64_t key, uint32_t stream,
                                 uint8_t tier_bit);
    bool window_make_room_for(std::span<const ubatch> ubatches);

    kv_cache_params params_;
    std::vector<layer> layers_;       // own layers, ascending model index
    std::vector<int32_t> layer_map_;  // [model layers] index into layers_, or -1
    std::vector<uint32_t> layer_ids_;
    std::unique_ptr<kv_storage> storage_;                // every K/V byte
    std::vector<kv_cells> streams_;                      // [n_stream]
    std::vector<uint32_t> heads_;                        // [n_stream] where the next search starts
    std::vector<uint32_t> committed_;                    // [n_stream] cells below the commit mark
    uint32_t granule_ = 0;                               // the storage's commit granule (0: all committed)
    std::unique_ptr<prefix_state> prefix_;               // null without a prefix cache
    std::unique_ptr<detail::kv_prefix_part> part_;       // the cache as its prefix cache sees it
    std::unique_ptr<detail::prefix_coordinator> coord_;  // its prefix cache (prefix_cache())
};

/// The context kv_cache returns from init_batch, init_full and init_update: an engine's way to the
/// per-ubatch operations (memory_context_i::get_attn(il) returns it for a layer the cache holds).
/// Everything refers to the current ubatch and is valid after apply() until next().
class kv_cache_context final : public memory_context_i {
public:
    /// What the context is for: a batch, a worst-case reservation, pending maintenance, or maintenance
    /// with compaction.
    enum class kind : uint8_t { batch, full, update, compact_update };

    // -- memory_context_i --
    bool next() override;
    void apply() override;
    memory_status get_status() const override { return status_; }
    const ubatch& get_ubatch() const override;
    std::span<const int32_t> out_ids() const override { return out_ids_; }
    kv_cache_context* get_attn(uint32_t il) override;  ///< this, when the cache holds layer il
    memory_recurrent_context* get_recr() override { return nullptr; }

    // -- per ubatch --
    const kv_cache& cache() const { return *cache_; }  ///< the cache this context belongs to
    /// Cells attention reads: the used extent of the slot's streams, padded (0 until apply()).
    uint32_t get_n_kv() const { return n_kv_; }
    const slot_info& get_sinfo() const;                     ///< the current ubatch's slot
    size_t n_ubatches() const { return ubatches_.size(); }  ///< ubatches of the batch
    /// Views of the first n_kv cells of the slot's streams of layer il (model index):
    /// @verbatim
    ///   K, V:        [n_embd_head, n_head_kv, n_kv, ns]
    ///   V transposed: [n_kv, n_head_kv, n_embd_head_v, ns] (cells fastest)
    /// @endverbatim
    /// With engine-owned storage (kv_cache_params::engine) there is nothing to view: throws
    /// kvc::error(unsupported), as cpy_k and cpy_v do (the engine writes at k_idxs / v_idxs).
    tensor_view get_k(uint32_t il);
    tensor_view get_v(uint32_t il);  ///< the V view (see get_k)
    /// Writes the ubatch's K (or V) rows of layer il: src is [E, n_tokens] (or [head_dim, n_head,
    /// n_tokens]) of f32 or f16, contiguous rows; converted to type_k / type_v.
    void cpy_k(uint32_t il, const_tensor_view src);
    void cpy_v(uint32_t il, const_tensor_view src);  ///< the V rows (see cpy_k)
    /// Row indices for engines that scatter rows themselves (design/kv-cache.md §3.15): stream * kv_size +
    /// cell.
    std::vector<int64_t> k_idxs() const;
    /// The V indices: rows, or elements of transposed V (every channel of each token).
    std::vector<int64_t> v_idxs(uint32_t il) const;
    /// KQ mask [n_kv, n_tokens] (design/kv-cache.md §4.2-4.3) into dst (f32 or f16, contiguous, exactly
    /// kq_mask_elements() elements).
    void set_input_kq_mask(tensor_view dst, kq_mask_options opt = {}) const;
    /// Elements set_input_kq_mask writes: n_kv x n_tokens (after apply(), like the mask itself).
    size_t kq_mask_elements() const;
    /// Pending shift of every cell, [kv_size * n_stream] (0 for empty cells).
    void set_input_k_shift(std::span<int32_t> dst) const { cache_->set_input_k_shift(dst); }
    /// T5 relative position buckets [n_kv, n_tokens] (one stream only).
    void set_input_pos_bucket(std::span<int32_t> dst, uint32_t n_buckets) const;

private:
    friend class kv_cache;
    friend struct kv_cache_test_access;
    kv_cache_context(kv_cache& cache, memory_status status, kind k);  // failure, full or update
    // a batch context: the ubatches, the slots prepare() found for them and the batch's output ids
    kv_cache_context(kv_cache& cache, std::vector<ubatch> ubatches, std::vector<slot_info> sinfos,
                     std::vector<int32_t> out_ids);
    void check_applied(const char* what) const;  // a batch context whose current ubatch was applied

    kv_cache* cache_;  // borrowed: the cache outlives its contexts
    memory_status status_;
    kind kind_;
    std::vector<ubatch> ubatches_;
    std::vector<slot_info> sinfos_;
    std::vector<int32_t> out_ids_;
    std::vector<uint64_t> rows_;  // of the applied ubatch
    size_t i_cur_ = 0;
    size_t n_applied_ = 0;  // ubatches applied so far (apply() commits each once)
    uint32_t n_kv_ = 0;
};

}  // namespace kvc
