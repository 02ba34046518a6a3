/// @file
/// memory_pair: two memories driven as one, the frame of kv_cache_iswa (a base and a sliding-window
/// cache) and memory_hybrid (an attention and a recurrent part). What is the same for both is here once:
/// the state (the first part's, unless state_seq_flag_partial_only, then the second's; both parsed before
/// anything changes, committed both or neither), the sequence operations that go to both parts alike, the
/// memory breakdown, the prefix cache over both parts' caches (one coordinator: design D35;
/// docs/architecture.md), and the context over a child context of each part. What differs stays with the
/// owner: which part holds a layer, how a batch is split, what removing a range and positions mean across the
/// parts.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <kvcache/batch.h>
#include <kvcache/memory.h>
#include <kvcache/prefix_cache.h>

namespace kvc {

namespace detail {
class prefix_coordinator;  // internal: the prefix cache (src/prefix/prefix_coordinator.h)
}  // namespace detail

/// Two memories as one (see the file comment). The owner makes the parts and hands them over with
/// set_parts(); they live as long as it does.
class memory_pair : public memory_i {
public:
    ~memory_pair() override;
    void clear(bool data) override;  ///< both parts
    /// These publish the last step (before_sequence_op), then run the first part's operation, then the
    /// second's.
    void seq_cp(seq_id_t src, seq_id_t dst, pos_t p0, pos_t p1) override;  ///< then sync_prefix()
    void seq_keep(seq_id_t seq_id) override;
    void seq_add(seq_id_t seq_id, pos_t p0, pos_t p1, pos_t shift) override;
    void seq_div(seq_id_t seq_id, pos_t p0, pos_t p1, int d) override;

    /// The first part's state (unless state_seq_flag_partial_only) then the second's.
    void state_write(io_write_i& io, seq_id_t seq_id, state_seq_flags flags) const override;
    /// Parses both parts (the same flag rule) before anything changes.
    state_stage_ptr state_stage(io_read_i& io, seq_id_t seq_id, state_seq_flags flags) const override;
    bool state_fits(const state_stage_i& stage) override;  ///< both parts have room
    /// Both parts or neither (commit_parts); throws, nothing changed, when one has no room.
    void state_commit(state_stage_i& stage) override;
    /// "KIND FIRST={first part's layout} SECOND={second part's layout}", e.g. "iswa base=... swa=...".
    std::string state_layout() const override;
    uint64_t state_max_bytes() const override;               ///< the two payloads back to back
    memory_breakdown get_memory_breakdown() const override;  ///< both parts' bytes

protected:
    /// kind, first and second name the memory and its parts in state_layout() and in errors.
    memory_pair(const char* kind, const char* first, const char* second);
    /// The parts, once the owner made them.
    void set_parts(memory_i& first, memory_i& second) {
        first_ = &first;
        second_ = &second;
    }
    /// Commits the staged parts, both or neither, once both fit (first is null with
    /// state_seq_flag_partial_only). The default commits the first then the second, for a first part
    /// that changes nothing when it fails and a second that does not fail.
    virtual void commit_parts(state_stage_i* first, state_stage_i& second);
    /// Makes the pair's prefix cache (p: its parameters), into which the owner adopts the parts of its
    /// caches; each cache was made with a prefix cache of the same parameters.
    detail::prefix_coordinator& make_prefix(const prefix_cache_params& p, uint32_t n_seq_max);
    /// Before a sequence operation: the prefix cache publishes the last step first.
    void before_sequence_op();
    /// After what may have evicted in a part (a copy, a placement, a state commit): the prefix cache lets
    /// the other part go of it.
    void sync_prefix();

private:
    struct staged;
    const staged& stage_of(const state_stage_i& stage, const char* what) const;

    const char* kind_;
    const char* first_name_;
    const char* second_name_;
    memory_i* first_ = nullptr;
    memory_i* second_ = nullptr;
    std::unique_ptr<detail::prefix_coordinator> prefix_;  // null without a prefix cache
};

/// The context of a memory_pair: a child context of each part over the same ubatches. The owner's
/// context says which child holds a layer (get_attn, get_recr).
class memory_pair_context : public memory_context_i {
public:
    bool next() override;   ///< advances both children
    void apply() override;  ///< the first child then the second; an update only those with work
    memory_status get_status() const override { return status_; }
    const ubatch& get_ubatch() const override;
    std::span<const int32_t> out_ids() const override { return out_ids_; }

protected:
    /// A failed context (no children).
    explicit memory_pair_context(memory_status status) : status_(status) {}
    /// A context over two children: batch contexts with the ubatches and output ids, or full / update
    /// contexts with empty ones.
    memory_pair_context(memory_context_ptr first, memory_context_ptr second, std::vector<ubatch> ubatches,
                        std::vector<int32_t> out_ids);
    /// The first part's child; null on a failed context.
    memory_context_i* first() { return is_fail(status_) ? nullptr : first_.get(); }
    /// The second part's child; null on a failed context.
    memory_context_i* second() { return is_fail(status_) ? nullptr : second_.get(); }

private:
    memory_status status_;
    memory_context_ptr first_;
    memory_context_ptr second_;
    std::vector<ubatch> ubatches_;
    std::vector<int32_t> out_ids_;
    size_t i_cur_ = 0;
};

}  // namespace kvc
