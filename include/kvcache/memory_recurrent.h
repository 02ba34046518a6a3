/// @file
/// memory_recurrent: the state memory of recurrent models (llama.cpp's llama_memory_recurrent: Mamba,
/// RWKV, LFM2 short-conv, Gated-DeltaNet, ...). Implements memory_i.
///
/// Cells. There are `size = n_seq_max` cells; cell c is row c of every layer's `r` (conv / token-shift)
/// and `s` (SSM / WKV) tensor. A sequence owns at most one cell, its *tail*; a cell may be shared
/// copy-on-write by several sequences (after seq_cp): the next batch that processes one of them gives it
/// a cell of its own whose source row is the shared one. A cell's position is that of the last token
/// folded into its state, so seq_pos_min(s) == seq_pos_max(s) == the tail's position.
///
/// Placing a ubatch (find_slot, design/recurrent.md §4.5) gives every block one cell, gathers them into
/// the contiguous range [head, head + n) and stages, per cell of the range, the row its state comes from
/// (s_copy). The engine then follows the contract below. init_batch dry-runs every ubatch (prepare) and
/// restores the cells, so a batch that cannot be placed changes nothing.
///
/// Engine contract for one applied ubatch (B = n_seqs blocks of T = n_seq_tokens tokens; rows are those of
/// the [n_embd, size, 1 + n_rs_seq] views, row index = plane * size + cell):
///   1. if rs_z >= 0, zero row rs_z (plane 0) of every r and s tensor, before reading anything;
///   2. gather, from the storage as it is before this ubatch writes anything, row s_copy(i) for every
///      i in [0, n) and the src row of every history copy (hist_copies());
///   3. i in [B, n) ("extra" cells): write gathered row s_copy(i) to plane 0 of cell head + i;
///   4. i in [0, B) ("main" cells): the gathered row is block i's initial state; run its T tokens and
///      write the final state to plane 0 of cell head + i; with n_rs_seq = k > 0 also write, for
///      r = 1 .. min(k, T - 1), the state after token T - 1 - r of the block (position P - r, P = the
///      block's last position) to plane r of cell head + i; with a prefix cache, also write every
///      snapshot of snaps() whose block is i: the state after its token t to its row dst;
///   5. write every gathered history copy to its dst row.
/// After it, plane 0 of cell c holds the state after position pos(c) and plane r (1 <= r <= depth) the
/// state after position pos(c) - r: the memory lists in hist_copies() the planes a short ubatch (T <= k)
/// cannot compute (plane T is the block's initial state, planes above it come from the source's own
/// history). Batches of k + 1 tokens or more per sequence need no copy (init_batch keeps the last k + 1
/// tokens of each sequence in one ubatch). A host engine need not write this itself: recurrent_step
/// (recurrent_engine.h) does steps 1-3 and 5 and stores what the engine's step 4 computes.
///
/// Rollback (n_rs_seq = k > 0): seq_rm(s, p0, -1) with 0 < p0 <= P (P = tail position) removes the last
/// r = P - p0 + 1 tokens when the tail cell belongs to s alone and holds at least r history planes:
/// the cell's position becomes p0 - 1 and its logical state the plane r it was (recorded as a pending
/// plane offset, consumed by the next ubatch that covers the cell: s_copy(i) then points into that
/// plane). Rollbacks compose: a second seq_rm before the next decode goes further back, as long as the
/// history lasts (pending + r <= k). The history counts the states a cell really has: after a state
/// restore it is empty, after a rollback of r it is r shorter, each token adds one (up to k).
///
/// Prefix cache (params.prefix.enabled; docs/prefix-cache.md, "Recurrent memories"): a state is one row
/// per sequence, overwritten by every token, so a prefix can be resumed only where a copy was kept. The
/// memory keeps snapshots of states at block boundaries of what sequences decode from position 0 in
/// order (the end of every prompt, every snapshot_interval blocks, and the newest boundary of every
/// sequence, which stays when the sequence ends) in a pool of max_snapshots rows placed after the planes
/// of every tensor (row (1 + n_rs_seq) * size + slot). The engine writes them (step 4); they are
/// published when the engine moves past the step's last ubatch (the context's next()). The memory's
/// prefix_cache()->prefix_attach resumes a new sequence from the deepest snapshot its prompt matches (the
/// rows are copied into its cell), so the engine decodes only the rest.
///
/// Sequence operations take [p0, p1) with p1 < 0 unbounded, and p0 < 0 unbounded below (a tail moved below
/// 0 by seq_add is still "from the start"). Sequence ids outside [0, n_seq_max) throw kvc::error
/// (out_of_range) and change nothing, in every operation (upstream: seq_rm false, others no-ops).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <kvcache/batch.h>
#include <kvcache/block_record.h>
#include <kvcache/dtype.h>
#include <kvcache/memory.h>
#include <kvcache/prefix_cache.h>
#include <kvcache/tensor.h>
#include <kvcache/types.h>

namespace kvc {

/// One model layer as the recurrent memory sees it: the widths of its two state rows.
struct recurrent_layer_desc {
    uint32_t n_embd_r = 0;  ///< values per r row (conv / token-shift state); 0: no r tensor
    uint32_t n_embd_s = 0;  ///< values per s row (SSM / WKV state); 0: no s tensor
};

/// Everything a recurrent memory is built from. Fields not named keep working defaults.
struct recurrent_params {
    std::vector<recurrent_layer_desc> layers;  ///< every model layer, by model index
    std::function<bool(uint32_t)> filter;      ///< keep model layer il? (null: every layer with a row)
    dtype type_r = dtype::f32;                 ///< element type of r rows (f32, f16 or bf16)
    dtype type_s = dtype::f32;                 ///< element type of s rows (f32, f16 or bf16)
    uint32_t n_seq_max = 1;                    ///< sequence ids [0, n_seq_max); also the number of cells
    uint32_t n_rs_seq = 0;                     ///< rollback depth k in tokens (0: no rollback)
    buffer_allocator* allocator = nullptr;     ///< where buffers live (null: host memory)
    /// The most bytes every state row may take (memory_budget.h): creation refuses more, before
    /// allocating anything. 0: the machine's physical memory.
    uint64_t memory_budget = 0;
    /// Keep snapshots of states at block boundaries for prefix_attach (see the file comment): block_size
    /// (1 to 65536), snapshot_interval, max_snapshots, policy, protected_fraction, n_vocab and on_event
    /// apply; pins do not. Events report blocks (chains of tokens) as kv_cache's do.
    prefix_cache_params prefix;
};

/// A row move the engine performs for one ubatch (rows of the [n_embd, size * (1 + n_rs_seq)] layout).
struct rs_copy {
    int64_t src = 0;  ///< row read before the ubatch writes anything
    int64_t dst = 0;  ///< row written after
};

/// A snapshot the engine writes for one ubatch (step 4 of the contract): block `block`'s state after its
/// token `token` goes to row `dst`, a snapshot row ((1 + n_rs_seq) * size + slot).
struct rs_snap {
    uint32_t block = 0;  ///< block of the ubatch, in [0, n_seqs)
    uint32_t token = 0;  ///< token of the block, in [0, n_seq_tokens)
    int64_t dst = 0;     ///< snapshot row
};

/// Where one ubatch's states come from and go (what find_slot staged; see the engine contract).
struct rs_slot {
    uint32_t head = 0;               ///< first cell of the range
    uint32_t n = 0;                  ///< cells in the range (n_rs); the first n_seqs are the blocks'
    uint32_t n_seqs = 0;             ///< blocks of the ubatch ("main" cells)
    int32_t rs_z = -1;               ///< row to zero before reading (fresh states read it), -1: none
    std::vector<int64_t> s_copy;     ///< [n] source row of range cell i (plane * size + cell)
    std::vector<rs_copy> hist_copy;  ///< history planes to carry over (empty when n_rs_seq == 0)
    std::vector<rs_snap> snaps;      ///< snapshots to write (empty without a prefix cache)
};

class memory_recurrent_context;
struct memory_recurrent_test_access;  // tests/memory_recurrent_test_access.h
namespace detail {
class recurrent_prefix_part;  // internal: the memory as a part of its prefix cache
class prefix_coordinator;     // internal: the prefix cache (src/prefix/prefix_coordinator.h)
}  // namespace detail

/// The recurrent state memory. See the file comment for cells, the engine contract and rollback.
class memory_recurrent final : public memory_i {
public:
    /// Throws kvc::error(invalid_argument) on an invalid configuration (no layer kept, n_seq_max 0,
    /// a type other than f32, f16 or bf16, buffers whose size overflows).
    explicit memory_recurrent(recurrent_params params);
    ~memory_recurrent() override;
    memory_recurrent(const memory_recurrent&) = delete;
    memory_recurrent& operator=(const memory_recurrent&) = delete;

    // -- memory_i --
    /// Splits with split_equal (sequential, n_keep_tail = n_rs_seq ? n_rs_seq + 1 : 0), or split_seq when
    /// embd_all, then dry-runs find_slot on every ubatch. failed_prepare when tokens are left over (tokens
    /// shared by several sequences cannot be split sequentially); throws kvc::error for a sequence id
    /// outside [0, n_seq_max) (like kv_cache; upstream reports failed_prepare). Changes nothing.
    memory_context_ptr init_batch(batch_allocr& balloc, uint32_t n_ubatch, bool embd_all) override;
    /// Dry-runs find_slot on ubatches split by the caller; throws what prepare throws (a ubatch that is
    /// not equal_seqs, blocks sharing a sequence), memory unchanged.
    memory_context_ptr init_ubatches(std::vector<ubatch> ubatches, std::vector<int32_t> out_ids) override;
    /// Worst-case context: n_rs = size, head = 0, rs_z = 0, s_copy(i) = i.
    memory_context_ptr init_full() override;
    /// Always no_update: a recurrent memory has no pending maintenance.
    memory_context_ptr init_update(bool optimize) override;
    /// True: shifting positions only edits the tail positions.
    bool get_can_shift() const override { return true; }

    /// Empties every cell, forgets pending rollbacks and history; data: also zeroes every plane.
    void clear(bool data) override;
    /// design/recurrent.md §4.7 table. seq_id >= 0: true when the tail position P is outside [p0, p1)
    /// (nothing to do), or when p0 <= 0 (the sequence leaves its cell); for 0 < p0 <= P < p1 a rollback (see
    /// the file comment) or false, nothing changed. seq_id -1: the full range empties everything (tails too,
    /// design D13), an empty range does nothing, anything else is false.
    bool seq_rm(seq_id_t seq_id, pos_t p0, pos_t p1) override;
    /// dst shares src's whole state (the range is ignored); dst's own state is dropped first.
    void seq_cp(seq_id_t src, seq_id_t dst, pos_t p0, pos_t p1) override;
    /// Every other sequence leaves; the cell of seq_id keeps only seq_id.
    void seq_keep(seq_id_t seq_id) override;
    /// Adds shift to the tail position when it is in [p0, p1) (for every sequence sharing the cell). A
    /// position may become negative: the state stays (unlike a KV cache, nothing is freed). Throws
    /// kvc::error(out_of_range) when the position would overflow int32.
    void seq_add(seq_id_t seq_id, pos_t p0, pos_t p1, pos_t shift) override;
    /// Divides the tail position by d when it is in [p0, p1). d < 1 throws kvc::error (upstream divides
    /// by zero); d == 1 does nothing.
    void seq_div(seq_id_t seq_id, pos_t p0, pos_t p1, int d) override;
    /// The tail position, -1 when the sequence has no state.
    pos_t seq_pos_min(seq_id_t seq_id) const override;
    /// The tail position, -1 when the sequence has no state.
    pos_t seq_pos_max(seq_id_t seq_id) const override;

    /// design/recurrent.md §4.9 layout: u32 cell_count, per cell i32 pos, u32 n_seq_id (0 for one sequence)
    /// and the ids ascending, u32 s_trans = 0, u32 n_layer (all model layers), then per layer with r its
    /// type, row size and rows, then the same for s. A cell with a pending rollback writes that plane (its
    /// logical state). Flags are ignored (the memory is already "partial").
    void state_write(io_write_i& io, seq_id_t seq_id, state_seq_flags flags) const override;
    /// Parses and checks a state (state_read = stage + commit, transactional: design D6). A sequence's
    /// state holds at most one cell; more is an error.
    state_stage_ptr state_stage(io_read_i& io, seq_id_t seq_id, state_seq_flags flags) const override;
    /// Replaces the whole memory (cells compacted to 0..n-1) or the destination sequence; never runs out
    /// of room. Restored cells have no pending rollback and no history.
    void state_commit(state_stage_i& stage) override;
    /// True: a sequence always finds a cell (it owns at most one, and there are n_seq_max).
    bool state_fits(const state_stage_i& /*stage*/) override { return true; }
    /// "recurrent n_layer=4 layers=0-3:r=f32x1536,s=f32x4096": what a state must match (not the number of
    /// cells, nor the rollback depth, which the format does not hold).
    std::string state_layout() const override;
    uint64_t state_max_bytes() const override;
    /// Host rows are committed up to the last used cell (their pages arrive when written, and go back
    /// when the cells above empty); an allocator's rows are all committed. A cell's bytes count its
    /// history planes.
    memory_breakdown get_memory_breakdown() const override;

    kv_cache* layer_cache(uint32_t /*il*/) override { return nullptr; }
    using memory_i::layer_cache;
    memory_recurrent* recurrent() override { return this; }

    /// State bytes a memory made from p would hold (every row of every plane), saturating at UINT64_MAX;
    /// p need not be valid. What creation checks against p.memory_budget.
    static uint64_t reserve_bytes(const recurrent_params& p);

    // -- prefix cache snapshots (params().prefix.enabled; see the file comment) --
    /// Snapshot rows in every tensor (prefix.max_snapshots resolved; 0 without a prefix cache).
    uint32_t get_n_snapshots() const { return n_snap_; }
    /// Snapshot rows in use now (published or being written); O(1).
    uint32_t get_snapshots_used() const;
    /// Bytes of one snapshot: one row of every tensor.
    size_t snapshot_bytes() const;

    // -- shape --
    /// The parameters the memory was built with.
    const recurrent_params& params() const { return params_; }
    /// Cells (= n_seq_max).
    uint32_t get_size() const { return size_; }
    /// Rollback depth k; each tensor holds 1 + k planes.
    uint32_t get_n_rs_seq() const { return params_.n_rs_seq; }
    /// Model index of every own layer (a layer with an r or s row that the filter keeps), ascending.
    std::span<const uint32_t> layer_ids() const { return layer_ids_; }
    /// Whether model layer il has an r tensor here.
    bool has_r(uint32_t il) const;
    /// Whether model layer il has an s tensor here.
    bool has_s(uint32_t il) const;

    // -- sizes (every plane and the snapshot rows counted) --
    /// Bytes of every r tensor.
    size_t size_r_bytes() const;
    /// Bytes of every s tensor.
    size_t size_s_bytes() const;
    /// size_r_bytes() + size_s_bytes().
    size_t size_bytes() const { return size_r_bytes() + size_s_bytes(); }

    // -- data --
    /// Layer il's r tensor, [n_embd_r, size, 1 + n_rs_seq] (row of cell c in plane p at (c, p)); throws
    /// kvc::error when the layer has none. With a prefix cache, get_n_snapshots() snapshot rows follow
    /// the last plane in the same buffer (contiguous rows: flat row (1 + n_rs_seq) * size + slot).
    tensor_view get_r(uint32_t il);
    /// Read-only r tensor.
    const_tensor_view get_r(uint32_t il) const;
    /// Layer il's s tensor, [n_embd_s, size, 1 + n_rs_seq].
    tensor_view get_s(uint32_t il);
    /// Read-only s tensor.
    const_tensor_view get_s(uint32_t il) const;

    // -- inspection --
    /// What a cell holds.
    struct cell_info {
        pos_t pos = -1;                ///< position of the last token folded into the state
        int32_t src = -1;              ///< row holding its data (its own index between ubatches; -1 fresh)
        uint32_t rs_idx = 0;           ///< pending rollback plane (0: none)
        uint32_t depth = 0;            ///< history planes beyond the logical state
        std::vector<seq_id_t> seqs{};  ///< sequences sharing it, ascending; empty = free cell
    };
    /// Cell i (throws kvc::error when i >= size).
    cell_info cell(uint32_t i) const;
    /// The cell holding seq_id's state, -1 if none.
    int32_t seq_tail(seq_id_t seq_id) const;
    /// Cells in use.
    uint32_t get_used() const { return used_; }
    /// Where the next search for a free cell starts (the start of the last range).
    uint32_t get_head() const { return head_; }
    /// One character per cell: '.' free, the owner (0-9, a-z, then '*') or 'M' for a shared cell.
    std::string picture() const;
    /// Rechecks every invariant (I1-I4 of design/recurrent.md §4.2, history bounds); throws kvc::error naming
    /// the first broken one. For tests.
    void validate() const;

private:
    friend class memory_recurrent_context;
    friend class detail::recurrent_prefix_part;
    friend struct memory_recurrent_test_access;
    struct cell_rec;
    struct layer;

    // placement: what the context does (init_batch prepares, apply places)
    /// Places an equal-seqs ubatch for real (design/recurrent.md §4.5) and returns what the engine needs. It
    /// cannot run out of cells (a sequence needing a new cell shares one or has none, so a cell is free).
    /// Throws kvc::error, nothing changed, for a sequence id outside [0, n_seq_max) or a ubatch this memory
    /// cannot take: not equal_seqs, a block whose tokens differ in sequences, blocks sharing a sequence.
    rs_slot find_slot(const ubatch& ub);
    /// Dry run of find_slot on every ubatch in order (later ones see earlier ones); the cells are
    /// restored afterwards. Throws what find_slot throws, memory unchanged.
    void prepare(std::span<const ubatch> ubatches);

    void check_seq(seq_id_t s, const char* what) const;
    const layer& own_layer(uint32_t il) const;
    void check_ubatch(const ubatch& ub) const;
    rs_slot place(const ubatch& ub, bool dry_run);
    // membership (sequences of a cell are a list through next_)
    void link(uint32_t c, seq_id_t s);
    void unlink(uint32_t c, seq_id_t s);
    bool free_if_empty(uint32_t c);  // resets a cell without members; true if it did
    // after sequence operations: the rows of the free cells above the last used one go back to the system
    void fit_rows();
    void clear_cells(bool data);  // clear() but the prefix cache's index and snapshots stay
    void swap_cells(uint32_t a, uint32_t b);
    int32_t next_free(uint32_t from) const;  // first free cell from `from`, ring-wise; -1 if none
    std::vector<seq_id_t> members(uint32_t c) const;
    struct staged_state;

    // -- the prefix cache's operations (src/memory_recurrent_prefix.cpp; the part recurrent_prefix_part
    // drives) --
    struct prefix_state;
    uint32_t prefix_lookup(std::span<const token_t> tokens, uint64_t key);
    uint32_t prefix_attach(seq_id_t seq_id, std::span<const token_t> tokens, uint64_t key, uint8_t priority,
                           uint32_t max_tokens);
    void prefix_publish();
    prefix_stats get_prefix_stats() const;  // the cell counts are 0 (it caches snapshots, not cells)
    block_layout prefix_block_layout(uint64_t model_id) const;  // of the snapshot records in a tier
    std::vector<prefix_tier_stats> get_tier_stats() const;
    void prefix_tier_drain();
    // -- prefix cache hooks (no-ops without one) --
    void prefix_init();
    // Before placing ub (the context's apply): which snapshots the ubatch's sequences get, making room
    // in the pool. `prompts`: the sequences with several tokens in the batch, each with its tokens in the
    // batch's later ubatches (the newest boundary a prompt reaches is kept).
    void prefix_plan(const ubatch& ub, std::span<const std::pair<seq_id_t, uint64_t>> prompts);
    // After placing it: the tokens each sequence decoded in order, and the snapshot rows (no allocation).
    void prefix_record(const ubatch& ub, rs_slot& slot);
    void prefix_forget(seq_id_t seq_id);         // its tracker stops (seq_all: every tracker)
    void prefix_cut(seq_id_t seq_id, pos_t p0);  // a rollback keeps positions [0, p0)
    void prefix_copy(seq_id_t src, seq_id_t dst);
    void prefix_reset();   // the memory was emptied or replaced
    void fit_snapshots();  // rows of free slots above the last used one go back
    // -- tiers (src/memory_recurrent_tier.cpp) --
    std::vector<uint8_t> tier_encode(uint32_t id) const;  // the record of block id's snapshot
    void tier_evicting(uint32_t id);                      // on_evict: its snapshot is queued for writing
    void tier_flush();                                    // writes what is queued
    // prefix_attach: brings back from the tiers a snapshot deeper than memory's, for `tokens`
    void tier_fetch(std::span<const token_t> tokens, uint64_t key);
    // A verified snapshot at the end of block d of `tokens` into a pool slot, its chain into the index;
    // false when the pool has no slot to give (tier_bit: the tier it came from)
    bool install_snapshot(std::span<const token_t> tokens, uint64_t key, uint32_t d, const block_view& v,
                          uint8_t tier_bit);

    recurrent_params params_;
    uint32_t size_ = 0;
    std::vector<layer> layers_;       // own layers, ascending model index
    std::vector<int32_t> layer_map_;  // [model layers] index into layers_, or -1
    std::vector<uint32_t> layer_ids_;
    std::vector<cell_rec> cells_;  // [size] as storage cells (index = physical row)
    std::vector<int32_t> tail_;    // [size] per sequence: its cell, -1 = no state
    std::vector<seq_id_t> next_;   // [size] per sequence: next member of the same cell, -1 = last
    uint32_t head_ = 0;
    uint32_t used_ = 0;
    uint32_t mark_ = 0;    // rows of cells [0, mark_) may hold memory: those above went back (fit_rows)
    uint32_t n_snap_ = 0;  // snapshot rows after the planes
    std::unique_ptr<prefix_state> prefix_;
    std::unique_ptr<detail::recurrent_prefix_part> part_;  // the memory as its prefix cache sees it
    std::unique_ptr<detail::prefix_coordinator> coord_;    // its prefix cache (prefix_cache())
    std::vector<uint32_t> refs_;                           // scratch: sources referencing each row
    std::vector<cell_rec> saved_cells_;                    // scratch of prepare: the cells before the dry run
    std::vector<int32_t> saved_tail_;
    std::vector<seq_id_t> saved_next_;
};

/// The context memory_recurrent returns from init_batch, init_full and init_update: an engine's way to
/// the per-ubatch state rows (memory_context_i::get_recr() returns it). They refer to the current
/// ubatch and are valid after apply() until next().
class memory_recurrent_context final : public memory_context_i {
public:
    /// What the context plans.
    enum class kind : uint8_t { batch, full, update };

    /// A failed, full or update context.
    memory_recurrent_context(memory_recurrent& mem, memory_status status, kind k);
    /// A batch context over ubatches that prepare() accepted.
    memory_recurrent_context(memory_recurrent& mem, std::vector<ubatch> ubatches,
                             std::vector<int32_t> out_ids);

    // -- memory_context_i --
    /// Moves to the next ubatch; false after the last.
    bool next() override;
    /// Places the current ubatch (batch contexts; once each). Full and update contexts: no-op.
    /// Throws kvc::error on a failed context.
    void apply() override;
    /// success, no_update (update contexts) or failed_prepare.
    memory_status get_status() const override { return status_; }
    /// The current ubatch (batch contexts).
    const ubatch& get_ubatch() const override;
    /// Batch indices of the output tokens in processing order.
    std::span<const int32_t> out_ids() const override { return out_ids_; }
    kv_cache_context* get_attn(uint32_t) override { return nullptr; }  ///< none: no attention layers
    memory_recurrent_context* get_recr() override;                     ///< this, unless failed

    // -- per ubatch (after apply) --
    /// The memory this context belongs to.
    const memory_recurrent& memory() const { return *mem_; }
    /// Number of ubatches.
    size_t n_ubatches() const { return ubatches_.size(); }
    // Each accessor below throws kvc::error(invalid_state) when there is nothing to describe: before
    // apply(), after the last ubatch, and on update contexts.
    /// Cells in the range (size in full mode).
    uint32_t get_n_rs() const { return slot().n; }
    /// Blocks of the ubatch: the first get_n_seqs() cells of the range are theirs ("main" cells; every
    /// cell in full mode).
    uint32_t get_n_seqs() const { return slot().n_seqs; }
    /// First cell of the range (0 in full mode).
    uint32_t get_head() const { return slot().head; }
    /// Row to zero before reading, -1 if none (0 in full mode).
    int32_t get_rs_z() const { return slot().rs_z; }
    /// Cells of the memory.
    uint32_t get_size() const { return mem_->get_size(); }
    /// Rollback depth k (planes are 1 + k).
    uint32_t get_n_rs_seq() const { return mem_->get_n_rs_seq(); }
    /// Source row of range cell i in [0, n_rs): plane * size + cell.
    int64_t s_copy(uint32_t i) const;
    /// Every source row, [n_rs]: s_copies()[i] == s_copy(i). Valid until next() (or the context's end).
    std::span<const int64_t> s_copies() const { return slot().s_copy; }
    /// History planes the engine carries over (step 5 of the contract). Valid until next().
    std::span<const rs_copy> hist_copies() const { return slot().hist_copy; }
    /// Snapshots the engine writes (step 4 of the contract). Valid until next().
    std::span<const rs_snap> snaps() const { return slot().snaps; }
    /// Layer il's r tensor, [n_embd_r, size, 1 + n_rs_seq].
    tensor_view get_r(uint32_t il) { return mem_->get_r(il); }
    /// Layer il's s tensor, [n_embd_s, size, 1 + n_rs_seq].
    tensor_view get_s(uint32_t il) { return mem_->get_s(il); }

private:
    const rs_slot& slot() const;

    memory_recurrent* mem_;  // borrowed: the memory outlives its contexts
    memory_status status_;
    kind kind_;
    std::vector<ubatch> ubatches_;
    std::vector<int32_t> out_ids_;
    size_t i_cur_ = 0;
    size_t n_applied_ = 0;
    std::optional<rs_slot> slot_;  // of the applied ubatch, or the full range
    // with a prefix cache: (ubatch, seq, its tokens in later ubatches) for sequences with several tokens
    // in the batch
    std::vector<std::tuple<uint32_t, seq_id_t, uint64_t>> prompts_;
};

}  // namespace kvc
