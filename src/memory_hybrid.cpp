// memory_hybrid: an attention cache (kv_cache or kv_cache_iswa) and a recurrent memory as one memory
// (design/recurrent.md §5).
#include <algorithm>
#include <cassert>

#include <fmt/format.h>
#include <kvcache/batch.h>
#include <kvcache/memory_budget.h>
#include <kvcache/memory_hybrid.h>

#include "prefix/prefix_index.h"

namespace kvc {

memory_hybrid::memory_hybrid(memory_hybrid_params params)
    : memory_pair("hybrid", "attn", "recr"), params_(std::move(params)) {
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
        // the user hears both parts' blocks (prefix_event::part: the attention part's kv and, with iswa,
        // swa; the recurrent part's snapshot); both parts' removals reach the other (sync_parts)
        // the attention part's cache with a window: the SWA cache of an iSWA pair, or a windowed kv_cache
        const bool iswa = params_.iswa.has_value(),
                   plain_window = !iswa && params_.attn.swa != swa_type::none;
        const auto queue = [this, iswa, plain_window](bool attn, const prefix_event& e) {
            const bool window = attn && (iswa ? e.part == prefix_part::swa : plain_window);
            if (window) track_window(e);
            if (e.type == prefix_event::kind::removed)
                removed_.push_back(
                    {attn, window, e.hash, e.parent_hash, e.depth, {e.tokens.begin(), e.tokens.end()}});
        };
        params_.attn.prefix.on_event = [queue, user = params_.prefix.on_event](const prefix_event& e) {
            queue(true, e);
            if (user) user(e);
        };
        params_.recr.prefix.on_event = [queue, user = params_.prefix.on_event](const prefix_event& e) {
            queue(false, e);
            if (user) user(e);
        };
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
    if (params_.prefix.enabled) {
        attn_prefix_ = dynamic_cast<prefix_cache_i*>(attn_.get());
        kv_ = dynamic_cast<kv_cache*>(attn_.get());
        iswa_ = dynamic_cast<kv_cache_iswa*>(attn_.get());
        windowed_ = iswa_ != nullptr || params_.attn.swa != swa_type::none;
        // what it recomputes after an earlier snapshot (an iSWA pair does it in its base cache itself)
        if (kv_) kv_->prefix_share_duplicates(true);
    }
}

// -- prefix cache --

namespace {

// The prompt a part looks up to resume at most at n: a boundary n' < tokens.size() is at most n.
std::span<const token_t> upto(std::span<const token_t> tokens, uint32_t n) {
    return tokens.first(std::min<size_t>(tokens.size(), uint64_t{n} + 1));
}

}  // namespace

uint32_t memory_hybrid::lookup_both(std::span<const token_t> tokens, uint64_t key) {
    uint32_t n_attn = attn_prefix_->prefix_lookup(tokens, key);  // checks the tokens
    while (true) {
        const uint32_t n = recr_->prefix_lookup(upto(tokens, n_attn), key);
        // a kv_cache that has [0, n_attn) has every shallower chain; with a window (an iSWA pair, or a
        // kv_cache with one) the window before a shallower snapshot may be gone, so it is asked again there
        if (n == n_attn || !windowed_) return n;
        n_attn = attn_prefix_->prefix_lookup(upto(tokens, n), key);  // at most n
        if (n_attn == n) return n;
    }
}

uint32_t memory_hybrid::prefix_lookup(std::span<const token_t> tokens, uint64_t key) {
    if (!attn_prefix_) throw error(errc::unsupported, "prefix_lookup: the memory has no prefix cache");
    const uint32_t n = lookup_both(tokens, key);
    ++stats_.lookups;
    stats_.tokens_looked_up += tokens.size();
    return n;
}

uint32_t memory_hybrid::prefix_attach(seq_id_t seq_id, std::span<const token_t> tokens, uint64_t key,
                                      uint8_t priority, uint32_t max_tokens) {
    if (!attn_prefix_) throw error(errc::unsupported, "prefix_attach: the memory has no prefix cache");
    if (recr_->seq_pos_max(seq_id) >= 0 || attn_->seq_pos_min(seq_id) >= 0)  // checks the id
        throw error(errc::invalid_argument, fmt::format("prefix_attach: seq {} is not empty", seq_id));
    // checked before the tiers change anything
    detail::check_prompt_tokens(tokens, params_.prefix.n_vocab, "prefix_attach");
    check_prefix_priority(priority, "prefix_attach");
    if (kv_) {  // the tiers first (none with iswa): a deeper snapshot, then the K/V up to it
        recr_->prefix_fetch(tokens, key, max_tokens);
        kv_->prefix_fetch(seq_id, tokens, key, recr_->prefix_lookup(upto(tokens, max_tokens), key));
        sync_parts();  // what the fetches evicted
    }
    // the deepest boundary with both halves; the attention part attaches up to it (fewer when copies
    // across streams find no room), the recurrent part its snapshot at or before where that stopped
    const uint32_t n_both = std::min(prefix_lookup(upto(tokens, max_tokens), key), max_tokens);
    uint32_t n_attn = attn_prefix_->prefix_attach(seq_id, tokens, key, priority, n_both);
    sync_parts();  // what copies across streams evicted
    // An attention part with a window cannot be cut back to a shallower snapshot (the window before it
    // may be older than the cells attached), so it is attached again, shallower, until a snapshot meets
    // it; each round asks for less, so this ends (at 0 at worst).
    while (windowed_) {
        const uint32_t n_snap = recr_->prefix_lookup(upto(tokens, n_attn), key);
        if (n_snap == n_attn) break;
        attn_->seq_rm(seq_id, -1, -1);
        n_attn = attn_prefix_->prefix_attach(seq_id, tokens, key, priority, n_snap);
        sync_parts();
    }
    const uint32_t n = recr_->prefix_attach(seq_id, tokens, key, priority, n_attn);
    assert(!windowed_ || n == n_attn);                                 // the loop found a snapshot there
    if (n < n_attn) attn_->seq_rm(seq_id, static_cast<pos_t>(n), -1);  // a chain without a window: cut back
    stats_.hit_tokens += n;
    return n;
}

void memory_hybrid::prefix_publish() {
    if (!attn_prefix_) return;
    attn_prefix_->prefix_publish();
    recr_->prefix_publish();
    sync_parts();
}

void memory_hybrid::track_window(const prefix_event& e) {
    switch (e.type) {
        case prefix_event::kind::stored:
            window_children_.emplace(e.parent_hash,
                                     window_block{e.hash, e.depth, {e.tokens.begin(), e.tokens.end()}});
            break;
        case prefix_event::kind::removed: {
            auto [it, end] = window_children_.equal_range(e.parent_hash);
            for (; it != end; ++it)
                if (it->second.hash == e.hash && it->second.depth == e.depth) {
                    window_children_.erase(it);
                    break;
                }
            break;
        }
        case prefix_event::kind::cleared:
            window_children_.clear();
            break;
    }
}

void memory_hybrid::drop_window_followers(const removed_block& r) {
    const uint32_t bs = params_.prefix.block_size;
    const auto last = static_cast<pos_t>((uint64_t{r.depth} + 1) * bs - 1);  // r's last position
    std::vector<uint64_t> level{r.hash}, next;
    while (!level.empty()) {
        next.clear();
        for (const uint64_t parent : level) {
            auto [it, end] = window_children_.equal_range(parent);
            for (; it != end; ++it) {
                const window_block& c = it->second;
                // the boundary after c: does the next token's window reach back to r?
                const auto n = static_cast<pos_t>((uint64_t{c.depth} + 1) * bs);
                if (is_masked_swa(params_.attn.n_swa, params_.attn.swa, last, n)) continue;
                recr_->prefix_drop(
                    {.hash = c.hash, .parent_hash = parent, .depth = c.depth, .tokens = c.tokens});
                next.push_back(c.hash);
            }
        }
        level.swap(next);
    }
}

void memory_hybrid::sync_parts() {
    const auto leads_to_a_snapshot = [this](const prefix_event& b) { return recr_->prefix_has(b); };
    while (!removed_.empty()) {
        std::vector<removed_block> now;
        now.swap(removed_);  // what these calls remove is queued again
        for (const removed_block& r : now) {
            const prefix_event e{.hash = r.hash, .parent_hash = r.parent_hash, .tokens = r.tokens};
            if (r.attn) {
                recr_->prefix_drop(e);  // its K/V (base blocks, or the window before it) is incomplete now
                if (r.window) drop_window_followers(r);
            } else if (kv_) {
                kv_->prefix_trim(e, leads_to_a_snapshot);
            } else {
                iswa_->prefix_trim(e, leads_to_a_snapshot);
            }
        }
    }
}

prefix_stats memory_hybrid::get_prefix_stats() const {
    if (!attn_prefix_) return {};
    prefix_stats s = attn_prefix_->get_prefix_stats();
    const prefix_stats r = recr_->get_prefix_stats();
    s.lookups = stats_.lookups;
    s.tokens_looked_up = stats_.tokens_looked_up;
    s.hit_tokens = stats_.hit_tokens;
    s.snapshots_saved = r.snapshots_saved;
    s.snapshots_dropped = r.snapshots_dropped;
    s.snapshots = r.snapshots;
    s.event_errors += r.event_errors;
    s.index_bytes += r.index_bytes;
    for (const auto& entry : window_children_)  // the window blocks' followers (drop_window_followers)
        s.index_bytes += sizeof(entry) + entry.second.tokens.capacity() * sizeof(token_t);
    s.tier_fetched_blocks += r.tier_fetched_blocks;
    s.tier_written_blocks += r.tier_written_blocks;
    return s;
}

void memory_hybrid::prefix_tier_drain() {
    if (!kv_) return;
    kv_->prefix_tier_drain();
    recr_->prefix_tier_drain();
}

std::vector<prefix_tier_stats> memory_hybrid::get_tier_stats() const {
    if (!kv_) return {};
    std::vector<prefix_tier_stats> a = kv_->get_tier_stats();
    const std::vector<prefix_tier_stats> r = recr_->get_tier_stats();
    for (size_t i = 0; i < a.size() && i < r.size(); ++i) {  // one store, the two parts' use of it
        a[i].fetches += r[i].fetches;
        a[i].fetched_blocks += r[i].fetched_blocks;
        a[i].declined += r[i].declined;
        a[i].refused_blocks += r[i].refused_blocks;
        a[i].written_blocks += r[i].written_blocks;
        a[i].dropped_blocks += r[i].dropped_blocks;
        a[i].errors += r[i].errors;
    }
    return a;
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
    if (attn_prefix_) sync_parts();  // what the attention part evicted to make room
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
    prefix_publish();  // the last step's blocks, which a sequence that ends leaves behind
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
