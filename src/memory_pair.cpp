#include <fmt/format.h>
#include <kvcache/memory_budget.h>
#include <kvcache/memory_pair.h>

#include "prefix/prefix_coordinator.h"

namespace kvc {

memory_pair::memory_pair(const char* kind, const char* first, const char* second)
    : kind_(kind), first_name_(first), second_name_(second) {}

memory_pair::~memory_pair() = default;

// -- prefix cache --

detail::prefix_coordinator& memory_pair::make_prefix(const prefix_cache_params& p, uint32_t n_seq_max) {
    prefix_ = std::make_unique<detail::prefix_coordinator>(p, n_seq_max);
    set_prefix_cache(prefix_.get());
    return *prefix_;
}

void memory_pair::before_sequence_op() {
    if (prefix_) prefix_->prefix_publish();
}

void memory_pair::sync_prefix() {
    if (prefix_) prefix_->sync();
}

// -- sequences --

void memory_pair::clear(bool data) {
    first_->clear(data);
    second_->clear(data);
}

void memory_pair::seq_cp(seq_id_t src, seq_id_t dst, pos_t p0, pos_t p1) {
    before_sequence_op();
    first_->seq_cp(src, dst, p0, p1);
    second_->seq_cp(src, dst, p0, p1);
    sync_prefix();  // a copy across streams may evict
}

void memory_pair::seq_keep(seq_id_t seq_id) {
    before_sequence_op();
    first_->seq_keep(seq_id);
    second_->seq_keep(seq_id);
}

void memory_pair::seq_add(seq_id_t seq_id, pos_t p0, pos_t p1, pos_t shift) {
    before_sequence_op();
    first_->seq_add(seq_id, p0, p1, shift);
    second_->seq_add(seq_id, p0, p1, shift);
}

void memory_pair::seq_div(seq_id_t seq_id, pos_t p0, pos_t p1, int d) {
    before_sequence_op();
    first_->seq_div(seq_id, p0, p1, d);
    second_->seq_div(seq_id, p0, p1, d);
}

// -- state --

struct memory_pair::staged final : state_stage_i {
    const memory_pair* owner = nullptr;
    state_stage_ptr first;  // null with state_seq_flag_partial_only
    state_stage_ptr second;
};

void memory_pair::state_write(io_write_i& io, seq_id_t seq_id, state_seq_flags flags) const {
    if (!(flags & state_seq_flag_partial_only)) first_->state_write(io, seq_id, flags);
    second_->state_write(io, seq_id, flags);
}

state_stage_ptr memory_pair::state_stage(io_read_i& io, seq_id_t seq_id, state_seq_flags flags) const {
    auto st = std::make_unique<staged>();
    st->owner = this;
    if (!(flags & state_seq_flag_partial_only)) st->first = first_->state_stage(io, seq_id, flags);
    st->second = second_->state_stage(io, seq_id, flags);
    return st;
}

const memory_pair::staged& memory_pair::stage_of(const state_stage_i& stage, const char* what) const {
    const auto* st = dynamic_cast<const staged*>(&stage);
    if (st == nullptr || st->owner != this)
        throw error(errc::invalid_argument, fmt::format("{}: the stage was made by another memory", what));
    return *st;
}

bool memory_pair::state_fits(const state_stage_i& stage) {
    const staged& st = stage_of(stage, "state_fits");
    return (!st.first || first_->state_fits(*st.first)) && second_->state_fits(*st.second);
}

void memory_pair::state_commit(state_stage_i& stage) {
    const staged& st = stage_of(stage, "state_commit");
    if (!state_fits(stage))  // both or neither
        throw error(errc::invalid_state,
                    fmt::format("state_read: no room for the state's cells in the {} or {} part", first_name_,
                                second_name_));
    commit_parts(st.first.get(), *st.second);
}

void memory_pair::commit_parts(state_stage_i* first, state_stage_i& second) {
    if (first != nullptr) first_->state_commit(*first);
    second_->state_commit(second);
}

std::string memory_pair::state_layout() const {
    return fmt::format("{} {}={} {}={}", kind_, first_name_, first_->state_layout(), second_name_,
                       second_->state_layout());
}

uint64_t memory_pair::state_max_bytes() const {
    return add_sat(first_->state_max_bytes(), second_->state_max_bytes());
}

memory_breakdown memory_pair::get_memory_breakdown() const {
    memory_breakdown b = first_->get_memory_breakdown();
    b += second_->get_memory_breakdown();
    return b;
}

// -- context --

memory_pair_context::memory_pair_context(memory_context_ptr first, memory_context_ptr second,
                                         std::vector<ubatch> ubatches, std::vector<int32_t> out_ids)
    : status_(combine(first->get_status(), second->get_status())),
      first_(std::move(first)),
      second_(std::move(second)),
      ubatches_(std::move(ubatches)),
      out_ids_(std::move(out_ids)) {}

bool memory_pair_context::next() {
    if (!first_) return false;
    first_->next();
    second_->next();
    if (i_cur_ >= ubatches_.size()) return false;
    return ++i_cur_ < ubatches_.size();
}

void memory_pair_context::apply() {
    if (is_fail(status_) || !first_)
        throw error(errc::invalid_state, "memory context: apply() on a failed context");
    for (memory_context_i* c : {first_.get(), second_.get()})
        if (c->get_status() == memory_status::success) c->apply();
}

const ubatch& memory_pair_context::get_ubatch() const {
    if (i_cur_ >= ubatches_.size()) throw error(errc::invalid_state, "memory context: no current ubatch");
    return ubatches_[i_cur_];
}

}  // namespace kvc
