// The prefix coordinator: one prefix cache over a memory's parts (design D35; docs/architecture.md, "The
// prefix wing").
#include "prefix/prefix_coordinator.h"

#include <algorithm>
#include <cassert>
#include <string_view>

#include <fmt/format.h>

#include "prefix/prefix_index.h"

namespace kvc::detail {

namespace {

// The prompt a part looks up to resume at most at n: a boundary n' < tokens.size() is at most n.
std::span<const token_t> upto(std::span<const token_t> tokens, uint32_t n) {
    return tokens.first(std::min<size_t>(tokens.size(), uint64_t{n} + 1));
}

[[noreturn]] void plain_kv_only(const char* what) {
    const std::string_view w(what);
    const bool pins = w == "prefix_pin" || w == "prefix_unpin" || w == "prefix_set_priority";
    throw error(errc::unsupported,
                fmt::format("{}: {} are a plain KV cache's (not an iSWA pair's, nor recurrent "
                            "snapshots')",
                            what, pins ? "pins and priorities" : "block transfers"));
}

}  // namespace

prefix_coordinator::prefix_coordinator(const prefix_cache_params& p, uint32_t n_seq_max)
    : block_size_(p.block_size), n_vocab_(p.n_vocab), n_seq_max_(n_seq_max), user_(p.on_event) {}

void prefix_coordinator::adopt(prefix_part_i& part) {
    const kind k = part.part_kind();
    prefix_part_i*& slot = k == kind::blocks ? b_ : k == kind::window ? w_ : r_;
    assert(slot == nullptr);
    slot = &part;
    ++n_parts_;
    part.listen([this, k](const prefix_event& e) { hear(k, e); });
    // a sequence resumed short of the blocks' chain (at a shallower window or snapshot) recomputes cached
    // blocks: it moves onto them, so that no cached block waits for a child it duplicates
    if (b_ != nullptr && n_parts_ > 1) b_->share_duplicates();
}

void prefix_coordinator::hear(kind from, const prefix_event& e) {
    if (n_parts_ > 1) {
        if (from == kind::window && r_ != nullptr) track_window(e);
        if (e.type == prefix_event::kind::removed)
            removed_.push_back({from, e, {e.tokens.begin(), e.tokens.end()}});
    }
    if (!user_) return;
    // the part the block is in: the SWA cache of an iSWA pair, recurrent snapshots' chains
    const bool swa = from == kind::window && b_ != nullptr;
    if (!swa && from != kind::snapshots) return user_(e);
    prefix_event tagged = e;
    tagged.part = swa ? prefix_part::swa : prefix_part::snapshot;
    user_(tagged);
}

// -- the hit every part gives --

uint32_t prefix_coordinator::lookup_attention(std::span<const token_t> tokens, uint64_t key) {
    if (b_ == nullptr || w_ == nullptr) return attention()->lookup(tokens, key);
    // the deepest boundary with the base cache's blocks before it and the SWA cache's window
    return w_->lookup(upto(tokens, b_->lookup(tokens, key)), key);
}

uint32_t prefix_coordinator::prefix_lookup(std::span<const token_t> tokens, uint64_t key) {
    check_prompt_tokens(tokens, n_vocab_, "prefix_lookup");
    if (n_parts_ == 1) return (r_ != nullptr ? r_ : attention())->lookup(tokens, key);
    ++lookups_;
    tokens_looked_up_ += tokens.size();
    uint32_t n_attn = lookup_attention(tokens, key);
    if (r_ == nullptr) return n_attn;
    while (true) {
        const uint32_t n = r_->lookup(upto(tokens, n_attn), key);
        // blocks without a window give every shallower boundary too; with a window, the window before a
        // shallower snapshot may be gone, so the attention parts are asked again there
        if (n == n_attn || w_ == nullptr) return n;
        n_attn = lookup_attention(upto(tokens, n), key);  // at most n
        if (n_attn == n) return n;
    }
}

// -- attach --

void prefix_coordinator::check_attach(seq_id_t seq_id, std::span<const token_t> tokens,
                                      uint8_t priority) const {
    check_prompt_tokens(tokens, n_vocab_, "prefix_attach");
    if (seq_id < 0 || static_cast<uint32_t>(seq_id) >= n_seq_max_)
        throw error(errc::out_of_range,
                    fmt::format("prefix_attach: seq_id {} not in [0, {})", seq_id, n_seq_max_));
    check_prefix_priority(priority, "prefix_attach");
    for (const prefix_part_i* p : {b_, w_, r_})
        if (p != nullptr && p->seq_end(seq_id) >= 0)
            throw error(errc::invalid_argument,
                        fmt::format("prefix_attach: seq {} is not empty (it holds positions {} to {})",
                                    seq_id, p->seq_begin(seq_id), p->seq_end(seq_id)));
}

uint32_t prefix_coordinator::attach_attention(seq_id_t seq_id, std::span<const token_t> tokens, uint64_t key,
                                              uint8_t priority, uint32_t max_tokens) {
    if (b_ == nullptr || w_ == nullptr) return attention()->attach(seq_id, tokens, key, priority, max_tokens);
    // the base cache up to the hit (fewer when copies across streams find no room), the SWA cache the
    // deepest window at or before where that stopped
    const uint32_t n_base = b_->attach(seq_id, tokens, key, priority, max_tokens);
    const uint32_t n = w_->attach(seq_id, tokens, key, priority, n_base);
    if (n < n_base) b_->cut(seq_id, n);
    return n;
}

void prefix_coordinator::cut_attention(seq_id_t seq_id, uint32_t n) {
    for (prefix_part_i* p : {b_, w_})
        if (p != nullptr) p->cut(seq_id, n);
}

uint32_t prefix_coordinator::prefix_attach(seq_id_t seq_id, std::span<const token_t> tokens, uint64_t key,
                                           uint8_t priority, uint32_t max_tokens) {
    check_attach(seq_id, tokens, priority);
    if (n_parts_ == 1)
        return (r_ != nullptr ? r_ : attention())->attach(seq_id, tokens, key, priority, max_tokens);
    if (r_ != nullptr && (b_ == nullptr || w_ == nullptr)) {
        // the tiers first (none with an iSWA pair): a deeper snapshot, then the K/V up to it
        r_->fetch(seq_id, tokens, key, max_tokens);
        attention()->fetch(seq_id, tokens, key, r_->lookup(upto(tokens, max_tokens), key));
        sync();  // what the fetches evicted
    }
    const uint32_t n_all = std::min(prefix_lookup(upto(tokens, max_tokens), key), max_tokens);
    uint32_t n_attn = attach_attention(seq_id, tokens, key, priority, n_all);
    sync();  // what copies across streams evicted
    if (r_ == nullptr) {
        hit_tokens_ += n_attn;
        return n_attn;
    }
    // Attention with a window cannot be cut back to a shallower snapshot (the window before it may be
    // older than the cells attached), so it is attached again, shallower, until a snapshot meets it; each
    // round asks for less, so this ends (at 0 at worst).
    while (w_ != nullptr) {
        const uint32_t n_snap = r_->lookup(upto(tokens, n_attn), key);
        if (n_snap == n_attn) break;
        cut_attention(seq_id, 0);
        n_attn = attach_attention(seq_id, tokens, key, priority, n_snap);
        sync();
    }
    const uint32_t n = r_->attach(seq_id, tokens, key, priority, n_attn);
    assert(w_ == nullptr || n == n_attn);      // the loop found a snapshot there
    if (n < n_attn) cut_attention(seq_id, n);  // blocks without a window: cut back
    hit_tokens_ += n;
    return n;
}

// -- publishing and coupled evictions --

void prefix_coordinator::prefix_publish() {
    for (prefix_part_i* p : {b_, w_})
        if (p != nullptr) p->publish();
    if (b_ != nullptr && w_ != nullptr) sync();
    if (r_ != nullptr) r_->publish();
    sync();
}

void prefix_coordinator::sync() {
    const auto has_window = [this](const prefix_event& b) { return w_->serves(b); };
    const auto leads_to_a_snapshot = [this](const prefix_event& b) { return r_->serves(b); };
    while (!removed_.empty()) {
        std::vector<removed_block> now;
        now.swap(removed_);  // what these calls remove is queued again
        for (removed_block& r : now) {
            r.e.tokens = r.tokens;
            switch (r.from) {
                case kind::blocks:  // no hit reaches past it: the windows after it, its snapshot
                    if (w_ != nullptr) w_->trim(r.e, {});
                    if (r_ != nullptr) r_->drop(r.e);
                    break;
                case kind::window:  // the base blocks before it serve no window; the snapshots it served
                    if (b_ != nullptr) b_->trim(r.e, has_window);
                    if (r_ != nullptr) {
                        r_->drop(r.e);
                        drop_window_followers(r.e);
                    }
                    break;
                case kind::snapshots:  // the K/V that led only to it
                    attention()->trim(r.e, leads_to_a_snapshot);
                    break;
            }
        }
    }
}

void prefix_coordinator::track_window(const prefix_event& e) {
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

// Drops the snapshots after window block `removed` whose windows held it (those at the ends of the blocks
// that follow it, as far as the window reaches back).
void prefix_coordinator::drop_window_followers(const prefix_event& removed) {
    const auto last = static_cast<pos_t>((uint64_t{removed.depth} + 1) * block_size_ - 1);
    std::vector<uint64_t> level{removed.hash}, next;
    while (!level.empty()) {
        next.clear();
        for (const uint64_t parent : level) {
            auto [it, end] = window_children_.equal_range(parent);
            for (; it != end; ++it) {
                const window_block& c = it->second;
                // the boundary after c: does the next token's window reach back to `removed`?
                const auto n = static_cast<pos_t>((uint64_t{c.depth} + 1) * block_size_);
                if (w_->masked(last, n)) continue;
                r_->drop({.hash = c.hash, .parent_hash = parent, .depth = c.depth, .tokens = c.tokens});
                next.push_back(c.hash);
            }
        }
        level.swap(next);
    }
}

// -- what the parts hold --

prefix_stats prefix_coordinator::get_prefix_stats() const {
    if (n_parts_ == 1) return (r_ != nullptr ? r_ : attention())->stats();
    prefix_stats s = attention()->stats();
    if (b_ != nullptr && w_ != nullptr) {
        const prefix_stats w = w_->stats();
        s.swa_blocks = w.blocks;
        s.swa_published_blocks = w.published_blocks;
        s.swa_evicted_blocks = w.evicted_blocks;
        s.bytes_copied += w.bytes_copied;
        s.event_errors += w.event_errors;
        s.index_bytes += w.index_bytes;
    }
    if (r_ != nullptr) {
        const prefix_stats r = r_->stats();
        s.snapshots_saved = r.snapshots_saved;
        s.snapshots_dropped = r.snapshots_dropped;
        s.snapshots = r.snapshots;
        s.event_errors += r.event_errors;
        s.index_bytes += r.index_bytes;
        for (const auto& entry : window_children_)
            s.index_bytes += sizeof(entry) + entry.second.tokens.capacity() * sizeof(token_t);
        s.tier_fetched_blocks += r.tier_fetched_blocks;
        s.tier_written_blocks += r.tier_written_blocks;
    }
    s.lookups = lookups_;
    s.tokens_looked_up = tokens_looked_up_;
    s.hit_tokens = hit_tokens_;
    return s;
}

std::vector<prefix_tier_stats> prefix_coordinator::get_tier_stats() const {
    std::vector<prefix_tier_stats> a = attention() != nullptr ? attention()->tier_stats() : r_->tier_stats();
    if (attention() == nullptr || r_ == nullptr) return a;
    const std::vector<prefix_tier_stats> r = r_->tier_stats();
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

void prefix_coordinator::prefix_tier_drain() {
    for (prefix_part_i* p : {b_, w_, r_})
        if (p != nullptr) p->tier_drain();
}

// -- a plain KV cache's --

prefix_part_i& prefix_coordinator::single(const char* what, std::span<const token_t> tokens) const {
    if (!prefix_can_pin()) plain_kv_only(what);
    check_prompt_tokens(tokens, n_vocab_, what);
    return *attention();
}

bool prefix_coordinator::prefix_can_pin() const {
    return n_parts_ == 1 && r_ == nullptr;
}

uint32_t prefix_coordinator::prefix_pin(std::span<const token_t> tokens, uint64_t key) {
    return single("prefix_pin", tokens).pin(tokens, key);
}

uint32_t prefix_coordinator::prefix_unpin(std::span<const token_t> tokens, uint64_t key) {
    return single("prefix_unpin", tokens).unpin(tokens, key);
}

uint32_t prefix_coordinator::prefix_set_priority(std::span<const token_t> tokens, uint64_t key,
                                                 uint8_t priority) {
    prefix_part_i& p = single("prefix_set_priority", tokens);
    check_prefix_priority(priority, "prefix_set_priority");
    return p.set_priority(tokens, key, priority);
}

block_layout prefix_coordinator::prefix_block_layout(uint64_t model_id) const {
    return single("prefix_block_layout", {}).layout(model_id);
}

uint32_t prefix_coordinator::prefix_store_blocks(block_store_i& store, uint64_t model_id,
                                                 std::span<const token_t> tokens, uint64_t key) {
    return single("prefix_store_blocks", tokens).store_blocks(store, model_id, tokens, key);
}

uint32_t prefix_coordinator::prefix_fetch_blocks(block_store_i& store, uint64_t model_id,
                                                 std::span<const token_t> tokens, uint64_t key,
                                                 uint32_t stream) {
    return single("prefix_fetch_blocks", tokens).fetch_blocks(store, model_id, tokens, key, stream);
}

}  // namespace kvc::detail
