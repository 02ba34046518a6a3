// kv_cache_iswa: a base cache for the full-attention layers and a windowed cache for the SWA layers,
// driven as one memory (design/kv-cache.md §8).
#include <numeric>

#include <fmt/format.h>
#include <kvcache/batch.h>
#include <kvcache/kv_cache_iswa.h>
#include <kvcache/memory_budget.h>

#include "detail/kv_prefix_part.h"
#include "prefix/prefix_coordinator.h"

namespace kvc {

namespace {

std::unique_ptr<kv_cache_context> as_kv(memory_context_ptr ctx) {
    return std::unique_ptr<kv_cache_context>(&dynamic_cast<kv_cache_context&>(*ctx.release()));
}

kv_cache_params half(const kv_cache_iswa_params& p, bool swa) {
    kv_cache_params h = p.kv;
    h.auto_update = false;  // the pair applies both caches' shifts once both placed the batch
    const std::vector<layer_desc> layers = p.kv.layers;
    h.filter = [layers, user = p.kv.filter, swa](uint32_t il) {
        return layers[il].is_swa == swa && (!user || user(il));
    };
    if (!swa) {
        h.n_swa = 0;
        h.swa = swa_type::none;
    } else {
        h.kv_size = iswa_swa_size(p);
    }
    return h;
}

}  // namespace

uint32_t iswa_swa_size(const kv_cache_iswa_params& p) {
    const kv_cache_params& k = p.kv;
    if (p.sizing.swa_full) return k.kv_size;
    const uint64_t seqs = k.unified ? k.n_seq_max : 1;
    const uint64_t want = uint64_t{k.n_swa} * seqs + p.sizing.n_ubatch + p.sizing.n_swa_retain;
    const uint64_t pad = std::lcm(uint64_t{256}, uint64_t{std::max(1u, k.n_pad)});
    // never more than the base cache (kv_size is a multiple of n_pad; llama.cpp's is of 256 too)
    return static_cast<uint32_t>(std::min<uint64_t>(k.kv_size, (want + pad - 1) / pad * pad));
}

// -- construction --

kv_cache_iswa::kv_cache_iswa(kv_cache_iswa_params params)
    : memory_pair("iswa", "base", "swa"), params_(std::move(params)) {
    const kv_cache_params& k = params_.kv;
    set_shape(
        {.n_seq_max = k.n_seq_max, .n_pos = k.n_pos, .n_layer = static_cast<uint32_t>(k.layers.size())});
    const auto bad = [](const std::string& msg) {
        throw error(errc::invalid_argument, "kv_cache_iswa: " + msg);
    };
    if (k.swa == swa_type::none || k.n_swa == 0)
        bad("the SWA layers need a window: swa must not be none and n_swa must be positive");
    if (params_.sizing.n_ubatch == 0) bad("n_ubatch must be positive");
    if (!k.prefix.tiers.stores.empty()) bad("prefix tiers are supported by kv_cache only, not by iSWA yet");
    bool any_full = false, any_swa = false;
    for (uint32_t il = 0; il < k.layers.size(); ++il) {
        if (!k.layers[il].has_kv || (k.filter && !k.filter(il))) continue;
        (k.layers[il].is_swa ? any_swa : any_full) = true;
    }
    if (!any_full || !any_swa)
        bad(fmt::format("the layers kept hold no {} layer; use a plain kv_cache",
                        any_full ? "sliding-window" : "full-attention"));
    // both caches' bytes against the one budget, before either allocates
    kv_cache_params base = half(params_, false), swa = half(params_, true);
    check_memory_budget(
        "kv_cache_iswa", reserve_bytes(params_), k.memory_budget,
        fmt::format("a base cache of {} cells and an SWA cache of {} cells", base.kv_size, swa.kv_size));
    base_ = std::make_unique<kv_cache>(base);
    swa_ = std::make_unique<kv_cache>(swa);
    set_parts(*base_, *swa_);
    if (k.prefix.enabled) {  // one prefix cache over both caches' blocks
        detail::prefix_coordinator& prefix = make_prefix(k.prefix, k.n_seq_max);
        prefix.adopt(detail::kv_prefix_part::of(*base_));
        prefix.adopt(detail::kv_prefix_part::of(*swa_));
    }
}

uint64_t kv_cache_iswa::reserve_bytes(const kv_cache_iswa_params& p) {
    return add_sat(kv_cache::reserve_bytes(half(p, false)), kv_cache::reserve_bytes(half(p, true)));
}

kv_cache* kv_cache_iswa::layer_cache(uint32_t il) {
    if (base_->has_layer(il)) return base_.get();
    return swa_->has_layer(il) ? swa_.get() : nullptr;
}

kv_cache_iswa::~kv_cache_iswa() = default;

void kv_cache_iswa::check_seq(seq_id_t s, const char* what) const {
    if (s < 0 || static_cast<uint32_t>(s) >= params_.kv.n_seq_max)
        throw error(errc::out_of_range,
                    fmt::format("{}: seq_id {} not in [0, {})", what, s, params_.kv.n_seq_max));
}

// -- batches --

memory_context_ptr kv_cache_iswa::init_batch(batch_allocr& balloc, uint32_t n_ubatch, bool /*embd_all*/) {
    for (seq_id_t s : balloc.seq_id_unq()) check_seq(s, "init_batch");
    const auto split = [&](bool simple) {
        balloc.split_reset();
        std::vector<ubatch> ubatches;
        while (true) {
            ubatch ub =
                simple ? balloc.split_simple(n_ubatch) : balloc.split_equal(n_ubatch, !params_.kv.unified);
            if (ub.empty()) break;
            ubatches.push_back(std::move(ub));
        }
        return ubatches;
    };
    if (params_.kv.unified) {  // batch order first: the cheapest split, when both caches take it
        std::vector<ubatch> ubatches = split(true);
        if (balloc.get_n_used() == balloc.get_n_tokens()) {
            memory_context_ptr ctx =
                init_ubatches(std::move(ubatches), {balloc.out_ids().begin(), balloc.out_ids().end()});
            if (!is_fail(ctx->get_status())) return ctx;
        }
    }
    std::vector<ubatch> ubatches = split(false);
    if (balloc.get_n_used() < balloc.get_n_tokens())
        return std::make_unique<kv_cache_iswa_context>(memory_status::failed_prepare);
    return init_ubatches(std::move(ubatches), {balloc.out_ids().begin(), balloc.out_ids().end()});
}

memory_context_ptr kv_cache_iswa::init_ubatches(std::vector<ubatch> ubatches, std::vector<int32_t> out_ids) {
    // each cache's prepare rolls itself back: a failure of the second leaves both unchanged
    memory_context_ptr base = base_->init_ubatches(ubatches, out_ids);
    if (is_fail(base->get_status())) return std::make_unique<kv_cache_iswa_context>(base->get_status());
    memory_context_ptr swa = swa_->init_ubatches(ubatches, out_ids);
    sync_prefix();  // what the caches evicted to make room
    if (is_fail(swa->get_status())) return std::make_unique<kv_cache_iswa_context>(swa->get_status());
    if (params_.kv.auto_update) {
        base_->update();
        swa_->update();
    }
    return std::make_unique<kv_cache_iswa_context>(as_kv(std::move(base)), as_kv(std::move(swa)),
                                                   std::move(ubatches), std::move(out_ids));
}

memory_context_ptr kv_cache_iswa::init_full() {
    return std::make_unique<kv_cache_iswa_context>(as_kv(base_->init_full()), as_kv(swa_->init_full()),
                                                   std::vector<ubatch>{}, std::vector<int32_t>{});
}

memory_context_ptr kv_cache_iswa::init_update(bool optimize) {
    return std::make_unique<kv_cache_iswa_context>(as_kv(base_->init_update(optimize)),
                                                   as_kv(swa_->init_update(optimize)), std::vector<ubatch>{},
                                                   std::vector<int32_t>{});
}

bool kv_cache_iswa::get_can_shift() const {
    return base_->get_can_shift() && swa_->get_can_shift() && base_->get_size() == swa_->get_size();
}

// -- sequences: both caches have the same ids and streams, so a call the base accepts the SWA cache
// accepts too --

bool kv_cache_iswa::seq_rm(seq_id_t seq_id, pos_t p0, pos_t p1) {
    before_sequence_op();  // the last step's blocks, which a sequence that ends leaves behind
    const bool a = base_->seq_rm(seq_id, p0, p1);
    const bool b = swa_->seq_rm(seq_id, p0, p1);
    return a && b;
}

pos_t kv_cache_iswa::seq_pos_min(seq_id_t seq_id) const {
    return swa_->seq_pos_min(seq_id);
}

pos_t kv_cache_iswa::seq_pos_max(seq_id_t seq_id) const {
    return swa_->seq_pos_max(seq_id);
}

// -- state --

void kv_cache_iswa::commit_parts(state_stage_i* base, state_stage_i& swa) {
    if (base == nullptr) {
        swa_->state_commit(swa);
        sync_prefix();
        return;
    }
    // both or neither: the base's commit is taken back when the SWA cache's fails (an allocation, issue 21)
    const auto undo = base_->state_commit_undoable(*base);
    try {
        swa_->state_commit(swa);
    } catch (...) {
        base_->state_undo(*undo);
        throw;
    }
    base_->fit_storage_of(seq_all);  // an undoable commit gives no memory back until it stands
    sync_prefix();
}

// -- context --

kv_cache_iswa_context::kv_cache_iswa_context(std::unique_ptr<kv_cache_context> base,
                                             std::unique_ptr<kv_cache_context> swa,
                                             std::vector<ubatch> ubatches, std::vector<int32_t> out_ids)
    : memory_pair_context(std::move(base), std::move(swa), std::move(ubatches), std::move(out_ids)) {}

kv_cache_context& kv_cache_iswa_context::get_base() {
    if (first() == nullptr)
        throw error(errc::invalid_state, "memory context: a failed context has no children");
    return static_cast<kv_cache_context&>(*first());
}

kv_cache_context& kv_cache_iswa_context::get_swa() {
    if (second() == nullptr)
        throw error(errc::invalid_state, "memory context: a failed context has no children");
    return static_cast<kv_cache_context&>(*second());
}

kv_cache_context* kv_cache_iswa_context::get_attn(uint32_t il) {
    if (first() == nullptr) return nullptr;
    kv_cache_context* c = first()->get_attn(il);
    return c != nullptr ? c : second()->get_attn(il);
}

}  // namespace kvc
