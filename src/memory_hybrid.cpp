// memory_hybrid: an attention cache (kv_cache or kv_cache_iswa) and a recurrent memory as one memory
// (design/recurrent.md §5).
#include <algorithm>
#include <cassert>

#include <fmt/format.h>
#include <kvcache/batch.h>
#include <kvcache/memory_budget.h>
#include <kvcache/memory_hybrid.h>

#include "detail/kv_prefix_part.h"
#include "detail/recurrent_prefix_part.h"
#include "prefix/prefix_coordinator.h"

namespace kvc {

memory_hybrid::memory_hybrid(memory_hybrid_params params)
    : memory_pair("hybrid", "attn", "recr"), params_(std::move(params)) {
    const kv_cache_params& a = params_.attn;
    set_shape(
        {.n_seq_max = a.n_seq_max, .n_pos = a.n_pos, .n_layer = static_cast<uint32_t>(a.layers.size())});
    const auto bad = [](const std::string& msg) {
        throw error(errc::invalid_argument, "memory_hybrid: " + msg);
    };
    if (params_.attn.n_seq_max != params_.recr.n_seq_max)
        bad(fmt::format("the attention part has n_seq_max {}, the recurrent part {}", params_.attn.n_seq_max,
                        params_.recr.n_seq_max));
    if (params_.attn.prefix.enabled || params_.recr.prefix.enabled)
        bad("a prefix cache is set in memory_hybrid_params::prefix, for both parts (a part alone would "
            "resume "
            "one half of the state)");
    if (params_.prefix.enabled) {
        if (params_.iswa && !params_.prefix.tiers.stores.empty())
            bad(
                fmt::format("prefix tiers ({} stores) are not supported with an iSWA attention part (iswa): "
                            "use no stores, or a plain attention part",
                            params_.prefix.tiers.stores.size()));
        params_.attn.prefix = params_.recr.prefix = params_.prefix;
    }
    const std::optional<kv_cache_iswa_params> iswa =
        params_.iswa ? std::optional(kv_cache_iswa_params{.kv = params_.attn, .sizing = *params_.iswa})
                     : std::nullopt;
    const uint64_t attn = iswa ? kv_cache_iswa::reserve_bytes(*iswa) : kv_cache::reserve_bytes(params_.attn);
    check_memory_budget("memory_hybrid", add_sat(attn, memory_recurrent::reserve_bytes(params_.recr)),
                        params_.memory_budget, "an attention part and a recurrent part");
    if (iswa)
        attn_ = std::make_unique<kv_cache_iswa>(*iswa);
    else
        attn_ = std::make_unique<kv_cache>(params_.attn);
    recr_ = std::make_unique<memory_recurrent>(params_.recr);
    set_parts(*attn_, *recr_);
    if (!params_.prefix.enabled) return;
    // one prefix cache over the attention part's blocks (both caches of an iSWA pair) and the snapshots
    detail::prefix_coordinator& prefix = make_prefix(params_.prefix, params_.attn.n_seq_max);
    if (auto* kv = dynamic_cast<kv_cache*>(attn_.get())) {
        prefix.adopt(detail::kv_prefix_part::of(*kv));
    } else {
        auto& pair = dynamic_cast<kv_cache_iswa&>(*attn_);
        prefix.adopt(detail::kv_prefix_part::of(pair.get_base()));
        prefix.adopt(detail::kv_prefix_part::of(pair.get_swa()));
    }
    prefix.adopt(detail::recurrent_prefix_part::of(*recr_));
}

memory_hybrid::~memory_hybrid() = default;

// -- batches --

memory_context_ptr memory_hybrid::init_batch(batch_allocr& balloc, uint32_t n_ubatch, bool embd_all) {
    for (seq_id_t s : balloc.seq_id_unq())
        if (s < 0 || static_cast<uint32_t>(s) >= params_.attn.n_seq_max)
            throw error(errc::out_of_range,
                        fmt::format("init_batch: seq_id {} not in [0, {})", s, params_.attn.n_seq_max));
    const bool sequential = !params_.attn.unified;  // several streams: consecutive ids per ubatch
    const uint32_t keep_tail = params_.recr.n_rs_seq ? params_.recr.n_rs_seq + 1 : 0;
    balloc.split_reset();
    std::vector<ubatch> ubatches;
    while (true) {
        ubatch ub =
            embd_all ? balloc.split_seq(n_ubatch) : balloc.split_equal(n_ubatch, sequential, keep_tail);
        if (ub.empty()) break;
        ubatches.push_back(std::move(ub));
    }
    if (balloc.get_n_used() < balloc.get_n_tokens())
        return std::make_unique<memory_hybrid_context>(memory_status::failed_prepare);
    return init_ubatches(std::move(ubatches), {balloc.out_ids().begin(), balloc.out_ids().end()});
}

memory_context_ptr memory_hybrid::init_ubatches(std::vector<ubatch> ubatches, std::vector<int32_t> out_ids) {
    // both are dry runs that restore their part: a failure of either leaves both unchanged
    memory_context_ptr recr = recr_->init_ubatches(ubatches, out_ids);
    if (is_fail(recr->get_status())) return std::make_unique<memory_hybrid_context>(recr->get_status());
    memory_context_ptr attn = attn_->init_ubatches(ubatches, out_ids);
    if (is_fail(attn->get_status())) return std::make_unique<memory_hybrid_context>(attn->get_status());
    sync_prefix();  // what the attention part evicted to make room
    return std::make_unique<memory_hybrid_context>(std::move(attn), std::move(recr), std::move(ubatches),
                                                   std::move(out_ids));
}

memory_context_ptr memory_hybrid::init_full() {
    return std::make_unique<memory_hybrid_context>(attn_->init_full(), recr_->init_full(),
                                                   std::vector<ubatch>{}, std::vector<int32_t>{});
}

memory_context_ptr memory_hybrid::init_update(bool optimize) {
    return std::make_unique<memory_hybrid_context>(attn_->init_update(optimize), recr_->init_update(optimize),
                                                   std::vector<ubatch>{}, std::vector<int32_t>{});
}

bool memory_hybrid::get_can_shift() const {
    return attn_->get_can_shift();
}

// -- sequences --

bool memory_hybrid::seq_rm(seq_id_t seq_id, pos_t p0, pos_t p1) {
    before_sequence_op();  // the last step's blocks, which a sequence that ends leaves behind
    if (!recr_->seq_rm(seq_id, p0, p1)) return false;  // all or nothing: attention untouched
    return attn_->seq_rm(seq_id, p0, p1);
}

pos_t memory_hybrid::seq_pos_min(seq_id_t seq_id) const {
    return std::max(attn_->seq_pos_min(seq_id), recr_->seq_pos_min(seq_id));
}

pos_t memory_hybrid::seq_pos_max(seq_id_t seq_id) const {
    return std::min(attn_->seq_pos_max(seq_id), recr_->seq_pos_max(seq_id));
}

// -- state --

size_t memory_hybrid::size_bytes() const {
    const auto* kv = dynamic_cast<const kv_cache*>(attn_.get());
    const size_t attn = kv ? kv->size_bytes() : dynamic_cast<const kv_cache_iswa&>(*attn_).size_bytes();
    return attn + recr_->size_bytes();
}

// -- context --

kv_cache_context* memory_hybrid_context::get_attn(uint32_t il) {
    return first() == nullptr ? nullptr : first()->get_attn(il);
}

memory_recurrent_context* memory_hybrid_context::get_recr() {
    return second() == nullptr ? nullptr : second()->get_recr();
}

}  // namespace kvc
