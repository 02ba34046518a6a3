// kvcache sim: the policy `llama-server`, a model of how llama.cpp's server reuses prompts (its
// get_available_slot, prompt_save / prompt_load and try_clear_idle_slots), as bookkeeping over the
// trace's block ids: no cache underneath, it is a yardstick. docs/sim.md lists what is modelled.
//
// C slots share one KV cache of `budget` cells (a unified cache). A slot keeps the tokens of its last
// request (prompt and answer) when idle. A new request takes the idle slot whose tokens have the longest
// common prefix with its prompt, if that prefix is more than `slot_similarity` of the prompt, else the
// least recently used idle slot; it reuses that slot's common prefix only (at most all but the last
// prompt token). Taking a slot by LRU, or keeping less than half of its tokens, first saves the slot's
// tokens in the RAM prompt cache (`cache_ram` tokens, oldest entries dropped first, nothing shared between
// entries) and then loads the entry with the longest common prefix, if any, into the slot. When the cells
// run short, idle slots are purged one by one.
//
// Recurrent, hybrid and iSWA models (--memory; iSWA with a window-sized SWA cache, whose keys slide out
// just as a recurrent state moves on): a slot's state cannot go back, so a prompt that diverges from
// the slot's tokens before their end resumes from the newest context checkpoint at or before the
// divergence (llama.cpp's server since 2025-10): checkpoints are taken while a prompt is processed, every
// checkpoint_every tokens and at the prompt's end, at most max_checkpoints per slot (the oldest dropped);
// RAM cache entries keep theirs. Recurrent only: no K/V, so the budget limits nothing here.
#include <algorithm>
#include <list>

#include <fmt/format.h>

#include "sim_backend.h"

namespace kvc::cli {
namespace {

// What a slot (or a RAM cache entry) holds: the first n tokens of request req's prompt and then its
// answer (output tokens are unique to the request, so they never match another prompt).
struct content {
    int64_t req = -1;
    uint64_t n = 0;
    std::vector<uint64_t> ckpts;  // recurrent, hybrid: states kept after tokens [0, c), ascending
};

class llama_server final : public sim_backend {
public:
    llama_server(const sim_options& o, const std::vector<sim_request>& reqs)
        : o_(o),
          reqs_(reqs),
          slots_(o.concurrency),
          seq_slot_(o.concurrency, -1),
          state_(o.memory != sim_memory::kv),
          budget_(o.memory == sim_memory::recurrent ? UINT64_MAX / 4 : o.budget) {}

    bool needs_tokens() const override { return false; }

    std::optional<uint32_t> start(seq_id_t seq, uint64_t req, std::span<const token_t> /*prompt*/,
                                  uint32_t n_out, uint64_t reserved) override {
        const uint64_t len = reqs_[req].input_length;
        // get_available_slot: by LCP similarity, else LRU
        int best = -1;
        double sim_best = 0;
        for (size_t i = 0; i < slots_.size(); ++i) {
            const slot& s = slots_[i];
            if (s.live || s.c.n == 0) continue;
            const double sim = static_cast<double>(lcp(s.c, req)) / static_cast<double>(len);
            if (sim > sim_best && sim > o_.slot_similarity) {
                sim_best = sim;
                best = static_cast<int>(i);
            }
        }
        bool update_cache = false;
        if (best >= 0) {
            update_cache =
                static_cast<double>(lcp(slots_[best].c, req)) / static_cast<double>(slots_[best].c.n) < 0.5;
        } else {
            int64_t t_last = -1;
            for (size_t i = 0; i < slots_.size(); ++i)
                if (!slots_[i].live && (best < 0 || slots_[i].t_last <= t_last)) {
                    t_last = slots_[i].t_last;
                    best = static_cast<int>(i);
                }
            update_cache = true;
        }
        slot& s = slots_[best];
        update_cache = update_cache && o_.cache_ram > 0 && s.c.n > 0;
        // what the slot would hold after prompt_save + prompt_load (decided before anything changes)
        content after = s.c;
        auto from_ram = ram_.end();
        bool keep_own = true;  // the slot's own tokens beat every entry: saving then loading them cancels out
        if (update_cache) {
            uint64_t best_lcp = 0;
            for (auto it = ram_.begin(); it != ram_.end(); ++it)
                if (const uint64_t l = lcp(*it, req); l > best_lcp) best_lcp = l, from_ram = it;
            keep_own = lcp(s.c, req) > 0 && lcp(s.c, req) >= best_lcp;
            if (!keep_own) after = from_ram != ram_.end() ? *from_ram : content{};
        }
        const uint64_t reuse = reusable(after, req, len - 1);
        // cells: live slots, what they will still add, this request's new tokens; idle slots may be purged
        uint64_t live_cells = 0;
        for (const slot& x : slots_) live_cells += x.live ? x.c.n : 0;
        if (live_cells + reserved + reuse + (len - reuse) + n_out > budget_) return std::nullopt;

        // commit
        if (!keep_own) {  // prompt_load of the best entry (it leaves the RAM cache), prompt_save of the slot
            content loaded{};
            if (from_ram != ram_.end()) {
                loaded = *from_ram;
                copied_ += loaded.n;
                ram_used_ -= loaded.n;
                ram_.erase(from_ram);
            }
            save(s.c);
            used_ -= s.c.n;
            s.c = loaded;
            used_ += s.c.n;
        }
        evicted_ += s.c.n - reuse;  // the tokens after the common prefix are dropped
        used_ -= s.c.n - reuse;
        std::erase_if(s.c.ckpts, [reuse](uint64_t c) { return c > reuse; });  // beyond what is kept
        s.c = {static_cast<int64_t>(req), reuse, std::move(s.c.ckpts)};
        s.live = true;
        seq_slot_[seq] = best;
        // try_clear_idle_slots: purge idle slots, in slot order, until the request fits
        for (size_t i = 0; i < slots_.size() && used_ + reserved + (len - reuse) + n_out > budget_; ++i) {
            if (slots_[i].live || slots_[i].c.n == 0) continue;
            evicted_ += slots_[i].c.n;
            used_ -= slots_[i].c.n;
            slots_[i].c = {};
        }
        return static_cast<uint32_t>(reuse);
    }

    void step(std::span<const sim_work> work) override {
        for (const sim_work& w : work) {
            content& c = slots_[seq_slot_[w.seq]].c;
            const uint64_t len = reqs_[static_cast<size_t>(c.req)].input_length;
            if (state_ &&
                c.n < len) {  // the prompt: a checkpoint every checkpoint_every tokens, and at its end
                const uint64_t last = c.ckpts.empty() ? 0 : c.ckpts.back();
                for (uint64_t p = std::max(last, c.n) + o_.checkpoint_every; p < len;
                     p += o_.checkpoint_every)
                    c.ckpts.push_back(p);
                c.ckpts.push_back(len);
                if (c.ckpts.size() > o_.max_checkpoints)
                    c.ckpts.erase(c.ckpts.begin(), c.ckpts.end() - o_.max_checkpoints);
                uint64_t held = 0;
                for (const slot& x : slots_) held += x.c.ckpts.size();
                for (const content& e : ram_) held += e.ckpts.size();
                peak_ckpts_ = std::max(peak_ckpts_, held);
            }
            c.n += w.n;
            used_ += w.n;
        }
        if (used_ > budget_)
            throw error(errc::invalid_state, fmt::format("sim: llama-server model holds {} cells of {}: the "
                                                         "simulator's accounting is wrong",
                                                         used_, o_.budget));
        peak_ = std::max(peak_, used_);
    }

    void finish(seq_id_t seq) override {
        slot& s = slots_[seq_slot_[seq]];
        s.live = false;
        s.t_last = ++clock_;
        seq_slot_[seq] = -1;
    }

    uint64_t used_cells() const override { return used_; }
    uint64_t live_cells() const override {
        uint64_t n = 0;
        for (const slot& s : slots_) n += s.live ? s.c.n : 0;
        return n;
    }
    void report(sim_result& r) const override {
        r.evicted_tokens = evicted_;
        r.copied_tokens = copied_;
        r.peak_cells = peak_;
        r.peak_snapshots = peak_ckpts_;
    }

private:
    struct slot {
        content c;
        bool live = false;
        int64_t t_last = -1;
    };

    // Common prefix of what `c` holds and the prompt of request b, in tokens.
    uint64_t lcp(const content& c, uint64_t b) const {
        if (c.req < 0 || c.n == 0) return 0;
        const sim_request& x = reqs_[static_cast<size_t>(c.req)];
        const sim_request& y = reqs_[b];
        const uint64_t lx = std::min<uint64_t>(c.n, x.input_length);  // the answer matches nothing
        size_t k = 0;
        const size_t m = std::min(x.hash_ids.size(), y.hash_ids.size());
        while (k < m && x.hash_ids[k] == y.hash_ids[k]) ++k;
        const uint64_t same = k == m ? UINT64_MAX : static_cast<uint64_t>(k) * o_.trace_block;
        return std::min({same, lx, static_cast<uint64_t>(y.input_length)});
    }

    // What request b may reuse of what `c` holds, at most `cap` tokens: the common prefix (K/V), or with
    // recurrent state the whole content when the prompt continues it, else the newest checkpoint in it.
    uint64_t reusable(const content& c, uint64_t b, uint64_t cap) const {
        const uint64_t l = std::min(lcp(c, b), cap);
        if (!state_ || l == c.n) return l;
        uint64_t best = 0;
        for (uint64_t p : c.ckpts)
            if (p <= l) best = p;
        return best;
    }

    // prompt_save: a copy of the slot's tokens into the RAM cache (not twice), oldest entries dropped.
    void save(const content& c) {
        if (c.n > o_.cache_ram) return;
        for (const content& e : ram_)
            if (e.req == c.req && e.n == c.n) return;
        ram_.push_back(c);
        ram_used_ += c.n;
        copied_ += c.n;
        while (ram_used_ > o_.cache_ram) {
            ram_used_ -= ram_.front().n;
            ram_.pop_front();
        }
    }

    const sim_options& o_;
    const std::vector<sim_request>& reqs_;
    std::vector<slot> slots_;
    std::vector<int> seq_slot_;  // [concurrency] slot of each live sequence id
    std::list<content> ram_;     // oldest first
    uint64_t ram_used_ = 0, used_ = 0, peak_ = 0, evicted_ = 0, copied_ = 0;
    int64_t clock_ = 0;
    bool state_;       // recurrent or hybrid: reuse goes through checkpoints
    uint64_t budget_;  // cells (none for a recurrent model)
    uint64_t peak_ckpts_ = 0;
};

}  // namespace

std::unique_ptr<sim_backend> make_llama_server_backend(const sim_options& o,
                                                       const std::vector<sim_request>& reqs) {
    return std::make_unique<llama_server>(o, reqs);
}

}  // namespace kvc::cli
