/// @file
/// The memory interfaces (llama.cpp's llama_memory_i and llama_memory_context_i).
///
/// A memory is where an engine keeps what its layers remember about each sequence: attention K/V rows
/// (kv_cache), recurrent state rows (memory_recurrent), or both (kv_cache_iswa, memory_hybrid).
///
/// A memory_context_i is the plan for one batch (init_batch), for a worst-case reservation (init_full)
/// or for pending maintenance such as K-shifts (init_update). Creating it checks the batch (a ubatch the
/// memory can never place is a kvc::error) and changes nothing; failed_prepare means only "no room now".
/// apply() is the only method that mutates the memory: it commits the current ubatch (or runs the
/// update); next() moves to the following ubatch. If get_status() is a failure, the memory is exactly as
/// it was before the context was created, and apply() must not be called. An engine reaches the
/// per-layer inputs through get_attn(il) and get_recr(), whatever the memory kind.
///
/// Driver loop of one decode step (design/kv-cache.md §1.5):
/// @verbatim
///   if (auto up = mem.init_update(/*optimize=*/false); up->get_status() == memory_status::success)
///   up->apply(); auto ctx = mem.init_batch(balloc, n_ubatch, /*embd_all=*/false); if
///   (is_fail(ctx->get_status())) -> the batch does not fit; nothing changed do {
///       ctx->apply();
///       for each layer il: ctx->get_attn(il) (K/V, mask, views) or ctx->get_recr() (state rows)
///   } while (ctx->next());
/// @endverbatim
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <kvcache/dtype.h>
#include <kvcache/io.h>
#include <kvcache/memory_budget.h>
#include <kvcache/types.h>

namespace kvc {

struct ubatch;                   // batch.h
class batch_allocr;              // batch.h
class kv_cache;                  // kv_cache.h
class kv_cache_context;          // kv_cache.h
class memory_recurrent;          // memory_recurrent.h
class memory_recurrent_context;  // memory_recurrent.h
class prefix_cache_i;            // prefix_cache.h

/// Flags of state_write / state_read.
using state_seq_flags = uint32_t;
/// Composite memories (iSWA, hybrid) save and restore only their partial part (SWA cache, recurrent
/// state); plain memories ignore the flag.
inline constexpr state_seq_flags state_seq_flag_partial_only = 1;
/// Throws kvc::error(invalid_argument) naming the bits of `flags` that are no state_seq_flag_* (every
/// state read and write checks its flags with it).
void check_state_seq_flags(state_seq_flags flags);

/// A state parsed and checked by memory_i::state_stage, waiting for memory_i::state_commit. It may point
/// into the reader's source, which must outlive it.
class state_stage_i {
public:
    virtual ~state_stage_i() = default;
};

using state_stage_ptr = std::unique_ptr<state_stage_i>;  ///< a stage owned by the caller

/// The plan for one batch, a worst-case reservation or pending maintenance (llama_memory_context_i);
/// created by memory_i::init_batch, init_full and init_update.
class memory_context_i {
public:
    virtual ~memory_context_i() = default;

    // -- iteration --
    /// Moves to the next ubatch once the engine computed this one; false when every ubatch has been
    /// consumed. Past the last ubatch the step counts as computed: a prefix cache publishes its blocks.
    virtual bool next() = 0;
    /// Commits the current ubatch (or runs the update). Throws kvc::error(invalid_state) on a failed
    /// context or a ubatch applied twice; cannot fail otherwise.
    virtual void apply() = 0;

    // -- inspection --
    virtual memory_status get_status() const = 0;  ///< a failure means: nothing changed, do not apply()
    virtual const ubatch& get_ubatch() const = 0;  ///< the current ubatch (batch contexts only)
    /// Batch indices of the output tokens, in the order the ubatches produce their output rows; an engine
    /// uses it to put rows back into batch order.
    virtual std::span<const int32_t> out_ids() const = 0;

    // -- parts: an engine's way to the per-layer inputs, whatever the memory kind --
    /// The context of the attention cache that holds model layer il's K/V (the kv_cache itself, the base
    /// or SWA cache of an iSWA memory, the attention part of a hybrid); null when no attention cache holds
    /// layer il (recurrent memories, recurrent layers of a hybrid) and on a failed context.
    virtual kv_cache_context* get_attn(uint32_t il) = 0;
    /// The recurrent part's context; null when the memory has none (attention caches) and on a failed
    /// context.
    virtual memory_recurrent_context* get_recr() = 0;
};

using memory_context_ptr = std::unique_ptr<memory_context_i>;  ///< contexts are owned by the caller

/// A memory: what an engine's layers remember about each sequence (llama_memory_i).
class memory_i {
public:
    virtual ~memory_i() = default;

    // -- batches --
    /// Splits the batch the allocator holds into ubatches of at most n_ubatch tokens and finds room for
    /// all of them. embd_all: every token produces an output (embeddings), which constrains the split.
    virtual memory_context_ptr init_batch(batch_allocr& balloc, uint32_t n_ubatch, bool embd_all) = 0;
    /// What init_batch does once the batch is split: finds room for ubatches the caller split (a composite
    /// memory splits once for all its parts). out_ids: the batch's output ids in ubatch order. A failed
    /// context when they do not fit; throws kvc::error for a ubatch this memory cannot take (sequence
    /// ids out of range, a shape it cannot place). Changes nothing.
    virtual memory_context_ptr init_ubatches(std::vector<ubatch> ubatches, std::vector<int32_t> out_ids) = 0;
    /// A context shaped like the largest possible ubatch, to reserve compute buffers.
    virtual memory_context_ptr init_full() = 0;
    /// Pending maintenance (K-shift, stream copies; compaction when optimize). no_update when none.
    virtual memory_context_ptr init_update(bool optimize) = 0;
    virtual bool get_can_shift() const = 0;  ///< whether seq_add / seq_div are allowed

    // -- sequences --
    /// @name Sequences
    /// Positions are [p0, p1): p0 < 0 means 0, p1 < 0 means no upper bound; seq_id -1 means every
    /// sequence where noted. Invalid ids throw kvc::error and change nothing.
    /// @{
    virtual void clear(bool data) = 0;  ///< data: also zero the stored rows
    /// Removes [p0, p1) of seq_id (-1: of every sequence). false only where the memory cannot remove part
    /// of a sequence (recurrent state without rollback); nothing changed then.
    virtual bool seq_rm(seq_id_t seq_id, pos_t p0, pos_t p1) = 0;
    /// dst also holds src's [p0, p1)
    virtual void seq_cp(seq_id_t src, seq_id_t dst, pos_t p0, pos_t p1) = 0;
    virtual void seq_keep(seq_id_t seq_id) = 0;  ///< drop every other sequence
    virtual void seq_add(seq_id_t seq_id, pos_t p0, pos_t p1, pos_t shift) = 0;  ///< positions += shift
    virtual void seq_div(seq_id_t seq_id, pos_t p0, pos_t p1, int d) = 0;        ///< positions /= d
    virtual pos_t seq_pos_min(seq_id_t seq_id) const = 0;  ///< -1 when the sequence is empty
    virtual pos_t seq_pos_max(seq_id_t seq_id) const = 0;  ///< -1 when the sequence is empty
    /// @}

    // -- state --
    /// @name State
    /// The whole memory (seq_id -1) or one sequence, in llama.cpp's layout. A failed read leaves the
    /// memory exactly as it was.
    /// @{

    /// Writes the state to io.
    virtual void state_write(io_write_i& io, seq_id_t seq_id = seq_all, state_seq_flags flags = 0) const = 0;
    /// Reads a state from io into the memory (seq_id: the destination): state_stage, io.end_of_state(),
    /// state_commit.
    void state_read(io_read_i& io, seq_id_t seq_id = seq_all, state_seq_flags flags = 0);
    /// Parses and checks a state exactly as state_read would, changing nothing; throws on any problem.
    void state_check(io_read_i& io, seq_id_t seq_id = seq_all, state_seq_flags flags = 0) const;
    /// First half of state_read: parses and checks everything, changing nothing; throws kvc::error naming
    /// the problem and its byte offset.
    virtual state_stage_ptr state_stage(io_read_i& io, seq_id_t seq_id, state_seq_flags flags) const = 0;
    /// Second half: replaces the memory (or the stage's destination sequence) with a stage this memory
    /// made, that nothing changed since. Throws kvc::error(invalid_state) only when the memory's contents
    /// leave no room for the cells of one sequence (state_fits false), and then changes nothing; throws
    /// kvc::error(invalid_argument) for a stage another memory made.
    virtual void state_commit(state_stage_i& stage) = 0;
    /// Whether state_commit of this stage would find room now (composite memories ask every part before
    /// committing any). Changes nothing.
    virtual bool state_fits(const state_stage_i& stage) = 0;
    /// What a state must match to load here, as one canonical line (kind, streams, V layout, positions
    /// per token, rotation, layers with K/V types and widths; not capacity). Session files store it.
    virtual std::string state_layout() const = 0;
    /// The most bytes a state this memory can read may hold: a whole-memory state with every cell used and
    /// listing as many sequence ids as a cell can (a sequence's state, or a partial one, is smaller).
    /// Loads refuse a payload declaring more before reading it (a forged size never decides what is
    /// allocated). Computed from the shape, O(layers); saturates at UINT64_MAX.
    virtual uint64_t state_max_bytes() const = 0;
    /// @}

    /// Where its bytes are (memory_breakdown). Counts every cell: for reports, not for every step.
    virtual memory_breakdown get_memory_breakdown() const = 0;

    // -- capabilities --
    /// @name Capabilities
    /// What the memory holds and offers, whatever its kind: code that serves any memory (the C API, the
    /// Python package, the tools) asks these instead of casting to the memory's class.
    /// @{

    /// Sequence ids a batch may use: [0, n_seq_max()).
    uint32_t n_seq_max() const { return shape_.n_seq_max; }
    /// Positions per token a batch gives (M-RoPE: 4; 1 for a memory without attention).
    uint32_t n_pos() const { return shape_.n_pos; }
    /// Model layers the memory was made for (those it keeps nothing for included).
    uint32_t n_layer() const { return shape_.n_layer; }
    /// The attention cache that keeps model layer il's K/V: the kv_cache itself, the base or SWA cache of
    /// a kv_cache_iswa, a memory_hybrid's attention part; null when no cache keeps it.
    virtual kv_cache* layer_cache(uint32_t il) = 0;
    /// The attention cache that keeps model layer il's K/V, or null (see the non-const overload).
    const kv_cache* layer_cache(uint32_t il) const { return const_cast<memory_i*>(this)->layer_cache(il); }
    /// The recurrent state: a memory_recurrent itself, a memory_hybrid's recurrent part; null otherwise.
    virtual memory_recurrent* recurrent() = 0;
    /// The prefix cache (lookups, attaches, pins, priorities, statistics, tiers), or null when the memory
    /// was made without one.
    prefix_cache_i* prefix_cache() { return prefix_; }
    /// The prefix cache, or null (see the non-const overload).
    const prefix_cache_i* prefix_cache() const { return prefix_; }
    /// @}

protected:
    /// What n_seq_max(), n_pos() and n_layer() report.
    struct memory_shape {
        uint32_t n_seq_max = 0;  ///< sequence ids [0, n_seq_max)
        uint32_t n_pos = 1;      ///< positions per token
        uint32_t n_layer = 0;    ///< model layers
    };
    /// The memory's constructor says what it was made for.
    void set_shape(const memory_shape& s) { shape_ = s; }
    /// The memory's prefix cache (it owns it), once made.
    void set_prefix_cache(prefix_cache_i* p) { prefix_ = p; }

private:
    memory_shape shape_;
    prefix_cache_i* prefix_ = nullptr;
};

using memory_ptr = std::unique_ptr<memory_i>;  ///< an owned memory

}  // namespace kvc
