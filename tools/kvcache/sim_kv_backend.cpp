// kvcache sim: the policies `kvcache` and `none`, the library's own memories with rows of one f32 value
// (no model: the bookkeeping, placement, index, eviction, snapshots and publishing are the real code): a
// kv_cache, a memory_recurrent (--memory recurrent), a memory_hybrid (--memory hybrid) or a kv_cache_iswa
// (--memory iswa: one window layer and one full layer).
#include <fmt/format.h>
#include <kvcache/batch.h>
#include <kvcache/kv_cache.h>
#include <kvcache/kv_cache_iswa.h>
#include <kvcache/memory_hybrid.h>
#include <kvcache/memory_recurrent.h>

#include "sim_backend.h"

namespace kvc::cli {
namespace {

class kv_backend final : public sim_backend {
public:
    kv_backend(const sim_options& o, bool prefix)
        : prefix_(prefix), n_ubatch_(o.n_ubatch), block_(o.cache_block), memory_(o.memory) {
        const kv_cache_params kp = params(o, prefix && o.memory == sim_memory::kv);
        if (o.memory == sim_memory::kv) {
            auto c = std::make_unique<kv_cache>(kp);
            kv_ = c.get();
            mem_ = std::move(c);
        } else if (o.memory == sim_memory::iswa) {
            kv_cache_params ip = params(o, prefix);
            ip.layers.push_back(ip.layers[0]);
            ip.layers[0].is_swa = true;
            ip.n_swa = o.window;
            ip.swa = swa_type::standard;
            const uint32_t retain = o.swa_retain == 0 ? o.budget / 10 : o.swa_retain;
            auto c = std::make_unique<kv_cache_iswa>(kv_cache_iswa_params{
                .kv = ip, .sizing = {.swa_full = false, .n_ubatch = o.n_ubatch, .n_swa_retain = retain}});
            kv_ = &c->get_base();  // admission counts the base cache's cells; the SWA cache fits the windows
            swa_cells_ = c->get_swa().get_size();
            mem_ = std::move(c);
        } else {
            recurrent_params rp;
            rp.layers = {recurrent_layer_desc{.n_embd_s = 1}};  // one value: the bookkeeping is real
            rp.n_seq_max = o.concurrency;
            prefix_cache_params pc{.enabled = prefix,
                                   .block_size = o.cache_block,
                                   .policy = o.evict,
                                   .snapshot_interval = o.snapshot_interval,
                                   .max_snapshots = o.snapshots};
            // the pool's memory: a state costs state_tokens tokens of K/V; a recurrent model's cache is all
            // snapshots, a hybrid one's gives them a tenth of the budget
            if (pc.max_snapshots == 0) pc.max_snapshots = snapshot_pool(o);
            if (o.memory == sim_memory::recurrent) {
                rp.prefix = pc;
                auto r = std::make_unique<memory_recurrent>(rp);
                recr_ = r.get();
                mem_ = std::move(r);
            } else {
                kv_cache_params ka = kp;
                if (prefix) ka.kv_size = hybrid_kv_cells(o);  // the budget less the pool's memory
                auto h = std::make_unique<memory_hybrid>(memory_hybrid_params{
                    .attn = ka, .recr = rp, .iswa = std::nullopt, .memory_budget = 0, .prefix = pc});
                kv_ = h->layer_cache(0);
                recr_ = &h->get_recr();
                mem_ = std::move(h);
            }
        }
        pc_ = mem_->prefix_cache();
        tiers_ = prefix && o.memory == sim_memory::kv && !o.tiers.stores.empty();
    }

    std::optional<uint32_t> start(seq_id_t seq, uint64_t /*req*/, std::span<const token_t> prompt,
                                  uint32_t n_out, uint64_t reserved) override {
        if (kv_ == nullptr)  // recurrent: a state per sequence, always room
            return prefix_ ? pc_->prefix_attach(seq, prompt, 0, prefix_default_priority, UINT32_MAX) : 0;
        // a hybrid or iSWA memory's sequences move to cached copies of what they recompute (resumed short of
        // them: no snapshot or window there): count what they hold
        if (memory_ == sim_memory::hybrid || memory_ == sim_memory::iswa) held_ = count_held();
        const uint64_t len = prompt.size(), size = kv_->get_size();
        // room = free cells + cached cells no live request holds (evictable) = size - held_
        const auto room = [&] { return static_cast<int64_t>(size - held_ - reserved); };
        if (!prefix_)
            return room() >= static_cast<int64_t>(len + n_out) ? std::optional<uint32_t>(0) : std::nullopt;
        const uint64_t fetched0 = tiers_ ? tier_fetched() : 0;
        const uint32_t n = pc_->prefix_attach(seq, prompt, 0, prefix_default_priority, UINT32_MAX);
        // blocks a tier brought back are cached cells now, then attached: alone() counts them as the
        // sequence's like any other attached block
        const uint64_t took = alone(seq);  // attached cells that were cached only: no longer evictable
        held_ += took;
        if (room() < static_cast<int64_t>(len - n + n_out)) {
            mem_->seq_rm(seq, -1, -1);  // does not fit now: undo (the blocks go back to the cache)
            held_ -= took;
            probe_hits_ += n;
            return std::nullopt;
        }
        // the fetched blocks continue what memory held: they are the attach's last ones
        if (tiers_) tier_hits_ += std::min<uint64_t>(n, (tier_fetched() - fetched0) * block_);
        return n;
    }

    void step(std::span<const sim_work> work) override {
        size_t n = 0;
        for (const sim_work& w : work) n += w.tokens.size();
        batch_storage b = batch::init(static_cast<int32_t>(n), 0, 1);
        for (const sim_work& w : work) {
            const seq_id_t ids[1] = {w.seq};
            for (size_t i = 0; i < w.tokens.size(); ++i)
                b.add(w.tokens[i], w.p0 + static_cast<pos_t>(i), ids, i + 1 == w.tokens.size());
        }
        batch_allocr a;
        a.init(b.view(), positions_of(*mem_), {.n_seq_max = mem_->n_seq_max()});
        auto ctx = mem_->init_batch(a, n_ubatch_, /*embd_all=*/false);
        if (ctx->get_status() != memory_status::success) {
            const prefix_stats st = kv_ ? kv_->prefix_cache()->get_prefix_stats() : prefix_stats{};
            throw error(
                errc::invalid_state,
                fmt::format("sim: a step of {} tokens found no room ({} cells held by live requests; "
                            "cached {} shared {} free {} blocks {}): the simulator's accounting is wrong",
                            n, held_, st.cached_cells, st.shared_cells, st.free_cells, st.blocks));
        }
        do ctx->apply();
        while (ctx->next());
        if (recr_ != nullptr)
            peak_snapshots_ = std::max<uint64_t>(peak_snapshots_, recr_->get_snapshots_used());
        if (kv_ == nullptr) return;
        held_ += n;  // new cells belong to their sequence only
        peak_ = std::max<uint64_t>(peak_, kv_->cells(0).get_used());
        peak_committed_ = std::max(peak_committed_, kv_->committed_bytes());
    }

    void finish(seq_id_t seq) override {
        if (prefix_) pc_->prefix_publish();  // the last step's blocks (no later step publishes them)
        if (kv_ != nullptr) held_ -= alone(seq);
        mem_->seq_rm(seq, -1, -1);
    }

    uint32_t cached_prefix(std::span<const token_t> prompt) override {
        return prefix_ ? pc_->prefix_lookup(prompt, 0) : 0;
    }

    uint64_t used_cells() const override { return kv_ ? kv_->cells(0).get_used() : 0; }
    uint64_t live_cells() const override { return held_; }

    void report(sim_result& r) const override {
        const prefix_stats st = pc_ != nullptr ? pc_->get_prefix_stats() : prefix_stats{};
        r.evicted_tokens = st.evicted_blocks * block_;
        r.bytes_copied = st.bytes_copied;
        r.probe_hit_tokens = probe_hits_;
        r.peak_cells = peak_;
        r.cache_hit_tokens = st.hit_tokens;
        r.peak_snapshots = peak_snapshots_;
        r.swa_cells = swa_cells_;
        r.tier_hit_tokens = tier_hits_;
        if (tiers_)
            for (const prefix_tier_stats& t : kv_->prefix_cache()->get_tier_stats())
                r.tiers.push_back({.where = t.where,
                                   .fetches = t.fetches,
                                   .fetched_blocks = t.fetched_blocks,
                                   .refused_blocks = t.refused_blocks,
                                   .written_blocks = t.written_blocks,
                                   .errors = t.errors,
                                   .store = {}});
        if (kv_ == nullptr) return;
        const uint64_t cell = kv_->size_bytes() / kv_->get_size();
        r.peak_committed_cells = peak_committed_ / cell;
        r.final_committed_cells = kv_->committed_bytes() / cell;
    }

private:
    static kv_cache_params params(const sim_options& o, bool prefix) {
        kv_cache_params p;
        // one layer, one f32 value per row: the K/V bytes are negligible, everything else is real
        p.layers = {layer_desc{
            .n_head_kv = 1, .n_embd_head_k = 1, .n_embd_head_v = 1, .rope = {.type = rope_type::none}}};
        p.type_k = p.type_v = dtype::f32;
        p.v_trans = false;
        p.kv_size = o.budget;
        p.n_seq_max = o.concurrency;
        p.n_kv_pad = 1;
        p.prefix = {.enabled = prefix, .block_size = o.cache_block, .policy = o.evict};
        if (prefix) p.prefix.tiers = o.tiers;  // the same store objects in every instance
        return p;
    }

    // Cells of seq that no other sequence holds (what leaves the live set when seq goes).
    uint64_t alone(seq_id_t seq) const {
        uint64_t n = 0;
        const kv_cells& c = kv_->cells(0);
        for (const auto& [pos, cell] : c.seq_entries(seq, -1, -1)) n += c.seq_count(cell) == 1;
        return n;
    }
    uint64_t count_held() const {
        const kv_cells& c = kv_->cells(0);
        uint64_t n = 0;
        for (uint32_t i = 0; i < c.size(); ++i) n += c.seq_count(i) > 0;
        return n;
    }
    uint64_t tier_fetched() const {
        uint64_t n = 0;
        for (const prefix_tier_stats& t : kv_->prefix_cache()->get_tier_stats()) n += t.fetched_blocks;
        return n;
    }
    bool prefix_;
    uint32_t n_ubatch_;
    uint32_t block_;
    sim_memory memory_;
    std::unique_ptr<memory_i> mem_;
    kv_cache* kv_ = nullptr;                  // the K/V cells: the cache, or the hybrid's attention part
    const memory_recurrent* recr_ = nullptr;  // the recurrent memory or part
    prefix_cache_i* pc_ = nullptr;            // mem_'s prefix calls
    uint64_t peak_snapshots_ = 0;
    uint64_t swa_cells_ = 0;
    uint64_t held_ = 0;  // cells held by at least one live sequence
    uint64_t peak_ = 0;
    uint64_t peak_committed_ = 0;  // bytes
    uint64_t probe_hits_ = 0;
    bool tiers_ = false;      // a kv_cache with stores below its prefix cache
    uint64_t tier_hits_ = 0;  // hit tokens of admitted requests that a store brought back
};

}  // namespace

std::unique_ptr<sim_backend> make_kv_backend(const sim_options& o, bool prefix) {
    return std::make_unique<kv_backend>(o, prefix);
}

}  // namespace kvc::cli
