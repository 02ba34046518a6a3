// kvcache sim: the policies `kvcache` and `none`, the library's own kv_cache with rows of one f32 value
// (no model: the bookkeeping, placement, index, eviction and publishing are the real code).
#include <fmt/format.h>
#include <kvcache/batch.h>
#include <kvcache/kv_cache.h>

#include "sim_backend.h"

namespace kvc::cli {
namespace {

class kv_backend final : public sim_backend {
public:
    kv_backend(const sim_options& o, bool prefix)
        : prefix_(prefix), cache_(params(o, prefix)), n_ubatch_(o.n_ubatch) {}

    std::optional<uint32_t> start(seq_id_t seq, uint64_t /*req*/, std::span<const token_t> prompt,
                                  uint32_t n_out, uint64_t reserved) override {
        const uint64_t len = prompt.size(), size = cache_.get_size();
        // room = free cells + cached cells no live request holds (evictable) = size - held_
        const auto room = [&] { return static_cast<int64_t>(size - held_ - reserved); };
        if (!prefix_)
            return room() >= static_cast<int64_t>(len + n_out) ? std::optional<uint32_t>(0) : std::nullopt;
        const uint32_t n = cache_.prefix_attach(seq, prompt);
        const uint64_t took = alone(seq);  // attached cells that were cached only: no longer evictable
        held_ += took;
        if (room() < static_cast<int64_t>(len - n + n_out)) {
            cache_.seq_rm(seq, -1, -1);  // does not fit now: undo (the blocks go back to the cache)
            held_ -= took;
            probe_hits_ += n;
            return std::nullopt;
        }
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
        a.init(b.view(), positions_of(cache_), {.n_seq_max = cache_.params().n_seq_max});
        auto ctx = cache_.init_batch(a, n_ubatch_, /*embd_all=*/false);
        if (ctx->get_status() != memory_status::success)
            throw error(errc::invalid_state,
                        fmt::format("sim: a step of {} tokens found no room in {} cells ({} held by live "
                                    "requests): the simulator's accounting is wrong",
                                    n, cache_.get_size(), held_));
        do ctx->apply();
        while (ctx->next());
        held_ += n;  // new cells belong to their sequence only
        peak_ = std::max<uint64_t>(peak_, cache_.cells(0).get_used());
        peak_committed_ = std::max(peak_committed_, cache_.committed_bytes());
    }

    void finish(seq_id_t seq) override {
        if (prefix_) cache_.prefix_publish();  // the last step's blocks (no later step publishes them)
        held_ -= alone(seq);
        cache_.seq_rm(seq, -1, -1);
    }

    uint64_t used_cells() const override { return cache_.cells(0).get_used(); }
    uint64_t live_cells() const override { return held_; }

    void report(sim_result& r) const override {
        const prefix_stats st = cache_.get_prefix_stats();
        r.evicted_tokens = st.evicted_blocks * cache_.params().prefix.block_size;
        r.bytes_copied = st.bytes_copied;
        r.probe_hit_tokens = probe_hits_;
        r.peak_cells = peak_;
        const uint64_t cell = cache_.size_bytes() / cache_.get_size();
        r.peak_committed_cells = peak_committed_ / cell;
        r.final_committed_cells = cache_.committed_bytes() / cell;
        r.cache_hit_tokens = st.hit_tokens;
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
        return p;
    }

    // Cells of seq that no other sequence holds (what leaves the live set when seq goes).
    uint64_t alone(seq_id_t seq) const {
        uint64_t n = 0;
        const kv_cells& c = cache_.cells(0);
        for (const auto& [pos, cell] : c.seq_entries(seq, -1, -1)) n += c.seq_count(cell) == 1;
        return n;
    }

    bool prefix_;
    kv_cache cache_;
    uint32_t n_ubatch_;
    uint64_t held_ = 0;  // cells held by at least one live sequence
    uint64_t peak_ = 0;
    uint64_t peak_committed_ = 0;  // bytes
    uint64_t probe_hits_ = 0;
};

}  // namespace

std::unique_ptr<sim_backend> make_kv_backend(const sim_options& o, bool prefix) {
    return std::make_unique<kv_backend>(o, prefix);
}

}  // namespace kvc::cli
