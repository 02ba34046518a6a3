// kv_cache: the prefix cache (docs/prefix-cache.md). The index (prefix/prefix_index) knows blocks and
// their cells; this file keeps it true to the cells: what each sequence has decoded in order (its
// tracker), which cells the index holds (kv_cells records each held cell's block), and what happens to
// held cells when sequences leave them, edit them or restore a state.
#include <algorithm>
#include <cassert>
#include <limits>
#include <utility>

#include <fmt/format.h>
#include <kvcache/kv_cache.h>

#include "detail/kv_cache_prefix.h"
#include "detail/kv_prefix_part.h"
#include "prefix/prefix_coordinator.h"

namespace kvc {

namespace {
using detail::none;
}  // namespace

void kv_cache::check_prefix_params(const kv_cache_params& p, uint32_t n_stream) {
    const auto bad = [](const std::string& msg) { throw error(errc::invalid_argument, "kv_cache: " + msg); };
    const prefix_cache_params& q = p.prefix;
    if (n_stream > 65536) bad(fmt::format("the prefix cache allows at most 65536 streams, not {}", n_stream));
    if (p.swa == swa_type::symmetric)
        bad("the prefix cache needs a causal window (standard or chunked), not symmetric");
    if (p.swa != swa_type::none && p.n_swa == 0) bad("the prefix cache needs n_swa > 0 with a window");
    if (p.n_pos != 1)
        bad(fmt::format("the prefix cache needs one position per token, not n_pos {}", p.n_pos));
    if (q.block_size == 0 || q.block_size > p.kv_size || p.kv_size % q.block_size != 0)
        bad(fmt::format("prefix block_size {} must divide kv_size {}", q.block_size, p.kv_size));
    if (q.policy > evict_policy::adaptive)
        bad(fmt::format("prefix policy {} unknown", static_cast<int>(q.policy)));
    if (!(q.protected_fraction >= 0.0f && q.protected_fraction <= 1.0f))
        bad(fmt::format("prefix protected_fraction {} must be in [0, 1]", q.protected_fraction));
    if (!(q.max_pinned_fraction >= 0.0f && q.max_pinned_fraction <= 1.0f))
        bad(fmt::format("prefix max_pinned_fraction {} must be in [0, 1]", q.max_pinned_fraction));
    if (q.n_vocab < 0) bad(fmt::format("prefix n_vocab {} must not be negative", q.n_vocab));
    detail::tier_set::check(q.tiers, "kv_cache");
    if (!q.tiers.stores.empty() && p.swa != swa_type::none)
        bad("prefix tiers are not supported with a sliding window (n_swa > 0) yet");
}

void kv_cache::prefix_init() {
    prefix_ = std::make_unique<prefix_state>(params_.prefix, params_.kv_size,
                                             static_cast<uint32_t>(streams_.size()), params_.n_seq_max,
                                             params_.swa, params_.n_swa);
    const prefix_tier_params& t = params_.prefix.tiers;
    if (!t.stores.empty()) prefix_->tiers.init(t, prefix_block_layout(t.model_id));
    part_ = std::make_unique<detail::kv_prefix_part>(*this);
    coord_ = std::make_unique<detail::prefix_coordinator>(params_.prefix, params_.n_seq_max);
    coord_->adopt(*part_);  // its events go to the user through the coordinator
    set_prefix_cache(coord_.get());
}

namespace {

// What the index holds of a prompt's whole blocks: blocks[d] is block d's record (none: absent).
// Without a window they are the chain of the longest cached prefix; with one, every block is looked up
// on its own (design D30) and hashes[d] is its chain hash.
struct found_blocks {
    std::vector<uint32_t> blocks;
    std::vector<uint64_t> hashes;  // with a window
    std::vector<uint32_t> run;     // with a window: blocks found in a row ending at d

    found_blocks(const kv_cache::prefix_state& ps, std::span<const token_t> tokens, uint64_t key) {
        if (!ps.windowed()) {
            ps.index.match(key, tokens, blocks);
            return;
        }
        const uint32_t bs = ps.bs();
        const size_t n = tokens.size() / bs;
        blocks.resize(n);
        hashes.resize(n);
        run.resize(n);
        uint64_t seed = key;
        for (size_t d = 0; d < n; ++d) {
            const auto toks = tokens.subspan(d * bs, bs);
            hashes[d] = detail::prefix_index::chain_hash(seed, toks);
            blocks[d] = ps.index.find_hash(hashes[d], seed, toks);
            run[d] = blocks[d] == none ? 0 : (d > 0 ? run[d - 1] : 0) + 1;
            seed = hashes[d];
        }
    }

    // A sequence resumed at n has every cell it needs: blocks [attach_from(n) / bs, ceil(n / bs)).
    bool usable(const kv_cache::prefix_state& ps, uint32_t n) const {
        if (n == 0) return true;
        const uint32_t bs = ps.bs(), end = (n + bs - 1) / bs;
        if (end > blocks.size()) return false;
        if (!ps.windowed()) return true;
        return run[end - 1] >= end - ps.attach_from(n) / bs;
    }

    // The deepest usable n <= cap (tokens.size() - 1 at most: the engine computes the last token).
    uint32_t deepest(const kv_cache::prefix_state& ps, size_t n_tokens, uint32_t cap) const {
        if (n_tokens == 0) return 0;
        const uint32_t bs = ps.bs();
        uint32_t n = std::min<uint32_t>(
            {static_cast<uint32_t>(blocks.size()) * bs, static_cast<uint32_t>(n_tokens - 1), cap});
        while (n > 0 && !usable(ps, n)) n = (n - 1) / bs * bs;
        return n;
    }
};

}  // namespace

// -- the API --

uint32_t kv_cache::prefix_lookup(std::span<const token_t> tokens, uint64_t key) {
    prefix_state& ps = *prefix_;
    ++ps.stats.lookups;
    ps.stats.tokens_looked_up += tokens.size();
    return found_blocks(ps, tokens, key).deepest(ps, tokens.size(), UINT32_MAX);
}

uint32_t kv_cache::prefix_attach(seq_id_t seq_id, std::span<const token_t> tokens, uint64_t key,
                                 uint8_t priority, uint32_t max_tokens) {
    const uint32_t st = seq_to_stream(seq_id);
    kv_cells& cells = streams_[st];
    prefix_publish();
    tier_fetch(tokens, key, st, max_tokens);  // what memory lacks, from the tiers
    prefix_state& ps = *prefix_;
    ++ps.stats.lookups;
    ps.stats.tokens_looked_up += tokens.size();
    const uint32_t bs = ps.bs();
    const found_blocks found(ps, tokens, key);
    const std::vector<uint32_t>& chain = found.blocks;
    uint32_t n = found.deepest(ps, tokens.size(), max_tokens);
    // Blocks of other streams are copied into free cells of the sequence's stream (evicting cached blocks
    // other than those it attaches): as much of the prefix as fits.
    const auto copies_needed = [&](uint32_t m) {
        uint32_t k = 0;
        for (uint32_t d = ps.attach_from(m) / bs; d * bs < m; ++d)
            if (ps.index.at(chain[d]).stream != st) k += std::min(bs, m - d * bs);
        return k;
    };
    while (n > 0) {
        const uint32_t k = copies_needed(n);
        if (k == 0) break;
        std::vector<uint32_t> keep;  // the blocks it shares in its own stream
        for (uint32_t d = ps.attach_from(n) / bs; d * bs < n; ++d)
            if (ps.index.at(chain[d]).stream == st) keep.push_back(chain[d]);
        std::sort(keep.begin(), keep.end());
        std::vector<uint32_t> plan;
        const uint32_t free = cells.size() - cells.get_used();
        if (k <= free || ps.index.plan_eviction(st, k - free, plan, keep)) break;
        do n = (n - 1) / bs * bs;  // one block less
        while (n > 0 && !found.usable(ps, n));
    }
    const uint32_t lo = n == 0 ? 0 : ps.attach_from(n), n_blocks = (n + bs - 1) / bs;
    // the blocks it reuses count a hit and are worth at least its priority
    for (uint32_t d = lo / bs; d < n_blocks; ++d) {
        ps.index.hit(chain[d]);
        if (ps.index.at(chain[d]).priority < priority) ps.index.set_priority(chain[d], priority);
    }
    // the sequence joins the cells of its own stream's blocks at positions [lo, n): block p / bs, cell
    // p % bs (with a window, what a query at n cannot see stays behind)
    std::vector<uint32_t> at(n, none);  // its cell of each position
    for (uint32_t p = lo; p < n; ++p) {
        const uint32_t id = chain[p / bs];
        if (ps.index.at(id).stream != st) continue;
        const uint32_t c = ps.index.cells(id)[p % bs];
        assert(cells.pos_get(c) == static_cast<pos_t>(p) && cells.holder(c) == id);
        if (cells.seq_count(c) == 0) ps.index.acquire(id);
        cells.seq_add(c, seq_id);
        at[p] = c;
    }
    // and copies of the others' rows
    if (const uint32_t k = copies_needed(n); k > 0) {
        [[maybe_unused]] const bool room = prefix_make_room(st, k);
        assert(room);
        std::vector<uint32_t> fresh;
        cells.find_free(k, heads_[st], fresh);
        std::vector<row_copy> copies;
        copies.reserve(k);
        for (uint32_t p = lo, j = 0; p < n; ++p) {
            const uint32_t id = chain[p / bs];
            const uint32_t from = ps.index.at(id).stream;
            if (from == st) continue;
            const uint32_t c = fresh[j++];
            cells.pos_set(c, static_cast<pos_t>(p));
            cells.seq_add(c, seq_id);
            copies.push_back({row(from, ps.index.cells(id)[p % bs]), row(st, c)});
            at[p] = c;
        }
        fit_storage(st);
        storage_->copy_rows(copies);
        heads_[st] = fresh.back() + 1;
        ps.stats.bytes_copied += k * cell_bytes();
    }
    prefix_tracker& t = ps.seqs[static_cast<size_t>(seq_id)];
    t = prefix_tracker{};
    t.key = key;
    t.priority = priority;
    if (key != 0) t.prompt.assign(tokens.begin(), tokens.end());  // what embeddings at [n, size) stand for
    t.n_full = n / bs;
    if (ps.windowed())
        t.hashes.assign(found.hashes.begin(), found.hashes.begin() + t.n_full);
    else
        ps.set_tail(t, t.n_full == 0 ? none : chain[t.n_full - 1]);
    for (uint32_t p = t.n_full * bs; p < n; ++p) {
        t.toks.push_back(tokens[p]);
        t.cells.push_back(at[p]);
    }
    ps.stats.hit_tokens += n;
    return n;
}

size_t kv_cache::cell_bytes() const {
    size_t b = 0;
    for (uint32_t li = 0; li < layer_ids_.size(); ++li)
        b += storage_->k_row_bytes(li) + storage_->v_row_bytes(li);
    return b;
}

// The blocks of the longest cached prefix of tokens in whole blocks (the last token included); with a
// window, those a sequence resumed there needs.
static std::vector<uint32_t> whole_blocks(const kv_cache::prefix_state& ps, std::span<const token_t> tokens,
                                          uint64_t key) {
    found_blocks found(ps, tokens, key);
    if (!ps.windowed()) return std::move(found.blocks);
    const uint32_t bs = ps.bs();
    auto n = static_cast<uint32_t>(found.blocks.size()) * bs;
    while (n > 0 && !found.usable(ps, n)) n -= bs;
    return {found.blocks.begin() + (n == 0 ? 0 : ps.attach_from(n) / bs), found.blocks.begin() + n / bs};
}

uint32_t kv_cache::prefix_pin(std::span<const token_t> tokens, uint64_t key) {
    if (prefix_->windowed())  // which blocks a pin holds would move with every window
        throw error(errc::unsupported, "prefix_pin: a cache with a sliding window does not pin prefixes");
    prefix_publish();
    prefix_state& ps = *prefix_;
    const std::vector<uint32_t> chain = whole_blocks(ps, tokens, key);
    uint64_t more = 0;
    for (uint32_t id : chain) {
        more += ps.index.at(id).pins == 0;
        if (ps.index.at(id).pins == UINT16_MAX)
            throw error(errc::invalid_argument,
                        fmt::format("prefix_pin: the prefix is pinned {} times already", UINT16_MAX));
    }
    const uint64_t bs = ps.bs(), pinned = ps.index.pinned_blocks(0) * bs;
    const auto limit = static_cast<uint64_t>(static_cast<double>(params_.prefix.max_pinned_fraction) *
                                             static_cast<double>(params_.kv_size));
    if (pinned + more * bs > limit)
        throw error(errc::invalid_argument,
                    fmt::format("prefix_pin: pinning {} more cells would pin {} of {} cells; the limit is {} "
                                "(prefix.max_pinned_fraction {})",
                                more * bs, pinned + more * bs, params_.kv_size, limit,
                                params_.prefix.max_pinned_fraction));
    for (uint32_t id : chain) ps.index.pin(id);
    return static_cast<uint32_t>(chain.size() * bs);
}

uint32_t kv_cache::prefix_unpin(std::span<const token_t> tokens, uint64_t key) {
    if (prefix_->windowed())
        throw error(errc::unsupported, "prefix_unpin: a cache with a sliding window does not pin prefixes");
    prefix_publish();
    prefix_state& ps = *prefix_;
    uint32_t n = 0;
    for (uint32_t id : whole_blocks(ps, tokens, key)) {
        if (ps.index.at(id).pins == 0) break;  // pins cover a chain from its root
        ps.index.unpin(id);
        n += ps.bs();
    }
    return n;
}

uint32_t kv_cache::prefix_set_priority(std::span<const token_t> tokens, uint64_t key, uint8_t priority) {
    prefix_publish();
    prefix_state& ps = *prefix_;
    const std::vector<uint32_t> chain = whole_blocks(ps, tokens, key);
    for (uint32_t id : chain) ps.index.set_priority(id, priority);
    return static_cast<uint32_t>(chain.size()) * ps.bs();
}

void kv_cache::prefix_publish() {
    if (!prefix_) return;
    prefix_state& ps = *prefix_;
    const uint32_t bs = ps.bs();
    for (seq_id_t s : ps.pending) {
        prefix_tracker& t = ps.seqs[static_cast<size_t>(s)];
        if (!t.active) continue;
        const uint32_t st = seq_to_stream(s);
        kv_cells& cells = streams_[st];
        size_t done = 0;
        if (ps.windowed()) {
            done = publish_windowed(s, t);
            t.toks.erase(t.toks.begin(), t.toks.begin() + static_cast<ptrdiff_t>(done));
            t.cells.erase(t.cells.begin(), t.cells.begin() + static_cast<ptrdiff_t>(done));
            continue;
        }
        while (t.toks.size() - done >= bs) {
            if (!ps.tail_alive(t)) {  // its chain was evicted or edited away
                ps.stop(t);
                break;
            }
            const std::span<const token_t> toks(t.toks.data() + done, bs);
            const std::span<const uint32_t> cs(t.cells.data() + done, bs);
            // the cells must still be what the sequence decoded there, unshifted
            const pos_t p0 = static_cast<pos_t>(t.n_full * bs);
            bool intact = true;
            for (uint32_t j = 0; j < bs && intact; ++j)
                intact = cells.pos_get(cs[j]) == p0 + static_cast<pos_t>(j) && cells.seq_has(cs[j], s) &&
                         cells.get_shift(cs[j]) == 0;
            if (!intact) {
                ps.stop(t);
                break;
            }
            uint32_t id = ps.index.find(t.tail, t.key, toks);
            if (id != none && ps.share_duplicates) share_block(s, id, cs);
            if (id == none) {
                if (std::any_of(cs.begin(), cs.end(), [&](uint32_t c) { return cells.is_held(c); })) {
                    ps.stop(t);  // its cells belong to another block (a partial attach that diverged)
                    break;
                }
                id = ps.index.add(t.tail, t.key, toks, cs, st, t.priority, static_cast<uint16_t>(bs));
                for (uint32_t c : cs) cells.hold(c, id);
                ++ps.stats.published_blocks;
                ps.emit(prefix_event::kind::stored, id);
                if (ps.tiers.write_through()) ps.tiers.published.emplace_back(id, ps.index.at(id).gen);
            }
            ps.set_tail(t, id);
            ++t.n_full;
            done += bs;
        }
        if (t.active && done > 0) {
            t.toks.erase(t.toks.begin(), t.toks.begin() + static_cast<ptrdiff_t>(done));
            t.cells.erase(t.cells.begin(), t.cells.begin() + static_cast<ptrdiff_t>(done));
        }
    }
    ps.pending.clear();
    tier_flush();  // write-through
}

// With a window a block is published on its own when its cells are still what the sequence decoded, and
// skipped otherwise (the window slid over them, or they belong to another block): the sequence goes on.
size_t kv_cache::publish_windowed(seq_id_t s, prefix_tracker& t) {
    prefix_state& ps = *prefix_;
    const uint32_t bs = ps.bs(), st = seq_to_stream(s);
    kv_cells& cells = streams_[st];
    size_t done = 0;
    for (; t.toks.size() - done >= bs; done += bs, ++t.n_full) {
        const std::span<const token_t> toks(t.toks.data() + done, bs);
        const std::span<const uint32_t> cs(t.cells.data() + done, bs);
        const uint64_t seed = t.hashes.empty() ? t.key : t.hashes.back();
        t.hashes.push_back(detail::prefix_index::chain_hash(seed, toks));
        const pos_t p0 = static_cast<pos_t>(t.n_full * bs);
        bool intact = true;
        for (uint32_t j = 0; j < bs && intact; ++j)
            intact = cs[j] != none && !cells.is_held(cs[j]) &&
                     cells.pos_get(cs[j]) == p0 + static_cast<pos_t>(j) && cells.seq_has(cs[j], s) &&
                     cells.get_shift(cs[j]) == 0;
        if (!intact || ps.index.find_hash(t.hashes.back(), seed, toks) != none) continue;
        const uint32_t id =
            ps.index.add(none, seed, toks, cs, st, t.priority, static_cast<uint16_t>(bs), t.n_full);
        for (uint32_t c : cs) cells.hold(c, id);
        ++ps.stats.published_blocks;
        ps.emit(prefix_event::kind::stored, id);
    }
    return done;
}

// seq computed the tokens of cached block id again in its own cells `mine`: it holds the block's cells
// instead (the same K/V), and its own go free, so that no cached block waits for a child it duplicates.
void kv_cache::share_block(seq_id_t seq, uint32_t id, std::span<const uint32_t> mine) {
    prefix_state& ps = *prefix_;
    const uint32_t st = seq_to_stream(seq);
    if (ps.index.at(id).stream != st) return;  // another stream's cells: attention cannot read them
    kv_cells& cells = streams_[st];
    const auto theirs = ps.index.cells(id);
    for (uint32_t j = 0; j < mine.size(); ++j) {
        if (mine[j] == theirs[j] || cells.seq_has(theirs[j], seq) || cells.is_held(mine[j])) continue;
        const bool first = cells.seq_count(theirs[j]) == 0;
        if (cells.seq_move(mine[j], theirs[j], seq)) lower_head(st, mine[j]);
        if (first) ps.index.acquire(id);
    }
}

prefix_stats kv_cache::get_prefix_stats() const {
    if (!prefix_) return {};
    prefix_stats st = prefix_->stats;
    st.blocks = prefix_->index.size();
    st.tier_fetched_blocks = prefix_->tiers.fetched_total();
    st.tier_written_blocks = prefix_->tiers.written_total();
    st.cached_cells = st.shared_cells = st.free_cells = st.pinned_cells = 0;
    for (uint32_t s = 0; s < streams_.size(); ++s) {
        const kv_cells& cells = streams_[s];
        for (uint32_t c = 0; c < cells.size(); ++c) {
            if (!cells.is_held(c)) continue;
            (cells.seq_count(c) == 0 ? st.cached_cells : st.shared_cells) += 1;
        }
        st.free_cells += cells.size() - cells.get_used();
        st.pinned_cells += prefix_->index.pinned_blocks(s) * prefix_->bs();
    }
    const prefix_state& ps = *prefix_;
    st.index_bytes = ps.index.bytes() + ps.pending.capacity() * sizeof(seq_id_t);
    for (const prefix_tracker& t : ps.seqs)
        st.index_bytes += sizeof(t) + (t.toks.capacity() + t.prompt.capacity()) * sizeof(token_t) +
                          t.cells.capacity() * sizeof(uint32_t);
    return st;
}

// -- hooks --

void kv_cache::prefix_record(const slot_info& sinfo, const ubatch& ub) {
    if (!prefix_) return;
    prefix_state& ps = *prefix_;
    const bool tokens = !ub.token.empty();
    // room first, so that nothing below allocates: a failed allocation then changes nothing (issue 21)
    const auto room = [](auto& v, size_t n) {
        if (v.capacity() - v.size() < n) v.reserve(std::max(v.size() + n, 2 * v.capacity()));
    };
    for (seq_id_t s : ub.seq_id_unq) {
        prefix_tracker& t = ps.seqs[static_cast<size_t>(s)];
        if (!t.active) continue;
        room(t.toks, ub.n_tokens);
        room(t.cells, ub.n_tokens);
    }
    room(ps.pending, ub.seq_id_unq.size());
    uint32_t i = 0;
    for (size_t k = 0; k < sinfo.n_stream(); ++k)
        for (uint32_t c : sinfo.idxs[k]) {
            for (seq_id_t s : ub.seq_ids(i)) {
                prefix_tracker& t = ps.seqs[static_cast<size_t>(s)];
                if (!t.active) continue;
                const pos_t p = ub.pos[i];
                // embeddings count as the attached prompt's tokens at their positions when the engine
                // named their content with a key (e.g. an image's hash); else they end publishing
                const bool known = tokens || (t.key != 0 && static_cast<size_t>(p) < t.prompt.size());
                if (!known || p != ps.next(t)) {  // unknown content, or not in order from 0
                    ps.stop(t);
                    continue;
                }
                t.toks.push_back(tokens ? ub.token[i] : t.prompt[static_cast<size_t>(p)]);
                t.cells.push_back(c);
                if (t.toks.size() == ps.bs()) ps.pending.push_back(s);  // at most once per block run
            }
            ++i;
        }
    if (ps.windowed())
        for (seq_id_t s : ub.seq_id_unq)
            if (!ps.is_placed[static_cast<size_t>(s)]) {
                ps.is_placed[static_cast<size_t>(s)] = 1;
                ps.placed.push_back(s);
            }
}

bool kv_cache::prefix_room_possible(uint32_t stream, uint32_t n) const {
    const kv_cells& cells = streams_[stream];
    const uint32_t free = cells.size() - cells.get_used();
    if (free >= n) return true;
    if (!prefix_) return false;
    std::vector<uint32_t> plan;
    return prefix_->index.plan_eviction(stream, n - free, plan);
}

bool kv_cache::prefix_make_room(uint32_t stream, uint32_t n, std::span<const uint32_t> keep) {
    kv_cells& cells = streams_[stream];
    const uint32_t free = cells.size() - cells.get_used();
    if (free >= n) return true;
    if (!prefix_) return false;
    prefix_state& ps = *prefix_;
    std::vector<uint32_t> plan;
    if (!ps.index.plan_eviction(stream, n - free, plan, keep)) return false;
    for (uint32_t id : plan) {
        tier_evicting(id);  // its rows, while its cells still hold them
        ps.index.evicting(id);
        ps.emit(prefix_event::kind::removed, id);
        for (uint32_t c : ps.index.cells(id)) {
            cells.unhold(c);  // no sequence holds it: empty now
            lower_head(stream, c);
        }
        ps.index.remove(id);
        ++ps.stats.evicted_blocks;
    }
    fit_storage(stream);  // evicted cells at the top give their memory back
    tier_flush();
    return true;
}

bool kv_cache::prefix_make_room_for(std::span<const ubatch> ubatches) {
    prefix_publish();
    if (prefix_->windowed()) return window_make_room_for(ubatches);
    if (streams_.size() == 1) {
        uint64_t need = 0;
        for (const ubatch& ub : ubatches) need += ub.n_tokens;
        return need <= params_.kv_size && prefix_make_room(0, static_cast<uint32_t>(need));
    }
    // one stream per sequence: a token goes to the stream of each of its sequences
    std::vector<std::pair<uint32_t, uint64_t>> need;  // (stream, cells), few streams per batch
    for (const ubatch& ub : ubatches)
        for (uint32_t i = 0; i < ub.n_tokens; ++i)
            for (seq_id_t s : ub.seq_ids(i)) {
                const uint32_t st = seq_to_stream(s);
                auto it =
                    std::find_if(need.begin(), need.end(), [st](const auto& e) { return e.first == st; });
                if (it == need.end()) it = need.insert(need.end(), {st, 0});
                ++it->second;
            }
    for (const auto& [st, n] : need)  // check every stream before evicting in any
        if (n > params_.kv_size || !prefix_room_possible(st, static_cast<uint32_t>(n))) return false;
    for (const auto& [st, n] : need) prefix_make_room(st, static_cast<uint32_t>(n));
    return true;
}

// With a window, room is counted as without one, except that a sequence of T tokens in the batch needs
// at most min(T, n_swa) cells at once besides the ubatch being placed: its own cells that slide out of
// the window during the batch are reused. When empty and cached cells are too few, the cells that every
// later query of the sequences placed so far is masked from leave them (held ones stay cached, the others
// go free: design D30), so that no cell of the index is ever overwritten. Until then they stay, as in
// llama.cpp, for a rollback that needs them again.
bool kv_cache::window_make_room_for(std::span<const ubatch> ubatches) {
    prefix_state& ps = *prefix_;
    struct need_of {
        uint32_t stream;
        uint64_t tokens = 0, window = 0, ubatch = 0;
        uint32_t cells() const { return static_cast<uint32_t>(std::min(tokens, window + ubatch)); }
    };
    std::vector<need_of> need;  // few streams per batch
    const auto of = [&](uint32_t st) -> need_of& {
        auto it = std::find_if(need.begin(), need.end(), [st](const need_of& e) { return e.stream == st; });
        return it == need.end() ? need.emplace_back(need_of{.stream = st}) : *it;
    };
    std::vector<seq_id_t> seqs;  // the sequence of every token, once per sequence it has
    for (const ubatch& ub : ubatches) {
        std::vector<std::pair<uint32_t, uint64_t>> in_ub;  // tokens of each stream in this ubatch
        for (uint32_t i = 0; i < ub.n_tokens; ++i) {
            const auto ids = ub.seq_ids(i);
            seqs.insert(seqs.end(), ids.begin(), ids.end());
            for (size_t k = 0; k < (streams_.size() == 1 ? 1 : ids.size()); ++k) {  // a cell per stream
                const uint32_t st = streams_.size() == 1 ? 0 : seq_to_stream(ids[k]);
                ++of(st).tokens;
                auto it =
                    std::find_if(in_ub.begin(), in_ub.end(), [st](const auto& e) { return e.first == st; });
                if (it == in_ub.end()) it = in_ub.insert(in_ub.end(), {st, 0});
                ++it->second;
            }
        }
        for (const auto& [st, n] : in_ub) of(st).ubatch = std::max(of(st).ubatch, n);
    }
    std::sort(seqs.begin(), seqs.end());
    for (size_t a = 0, b = 0; a < seqs.size(); a = b) {  // each sequence's tokens: a run
        while (b < seqs.size() && seqs[b] == seqs[a]) ++b;
        of(seq_to_stream(seqs[a])).window += std::min<uint64_t>(b - a, params_.n_swa);
    }
    const auto possible = [&] {  // every stream before evicting in any
        return std::all_of(need.begin(), need.end(), [&](const need_of& e) {
            return e.cells() <= params_.kv_size && prefix_room_possible(e.stream, e.cells());
        });
    };
    if (!possible()) {
        for (seq_id_t s : ps.placed) {
            ps.is_placed[static_cast<size_t>(s)] = 0;
            const uint32_t st = seq_to_stream(s);
            kv_cells& cells = streams_[st];
            const pos_t max = cells.seq_pos_max(s);
            if (max < 0) continue;
            // the newest cell stays: the sequence's positions go on from it
            const auto cut = std::min(max, static_cast<pos_t>(ps.first(static_cast<uint32_t>(max) + 1)));
            if (cells.seq_pos_min(s) >= cut) continue;
            lower_head(st, cells.seq_rm_range(s, 0, cut));
            prefix_sync(s, /*slid=*/true);
        }
        ps.placed.clear();
        if (!possible()) return false;
    }
    for (const need_of& e : need) prefix_make_room(e.stream, e.cells());
    return true;
}

void kv_cache::prefix_sync(seq_id_t seq_id, bool slid) {
    if (!prefix_) return;
    prefix_state& ps = *prefix_;
    // Blocks whose last cell with a sequence was let go: evictable now, the deepest of a chain first
    // (a chain is let go from its end when a sequence leaves it).
    std::vector<uint32_t> let_go;
    const auto sync_stream = [&](uint32_t s) {
        kv_cells& cells = streams_[s];
        for (uint32_t c : cells.released()) {
            if (!cells.is_held(c) || cells.seq_count(c) != 0) continue;  // gone, or attached again
            const uint32_t id = cells.holder(c);
            ps.index.release(id);
            if (ps.index.at(id).held == 0) let_go.push_back(id);
        }
        cells.clear_released();
    };
    // A sequence that holds no cell starts over: what it decodes from position 0 is published again.
    const auto restart = [&](seq_id_t s) {
        prefix_tracker& t = ps.seqs[static_cast<size_t>(s)];
        if (seq_pos_min(s) < 0 && (!t.active || t.n_full > 0 || !t.toks.empty())) t = prefix_tracker{};
    };
    if (seq_id == seq_all) {
        for (uint32_t s = 0; s < streams_.size(); ++s) sync_stream(s);
        for (size_t s = 0; s < ps.seqs.size(); ++s) restart(static_cast<seq_id_t>(s));
    } else {
        sync_stream(seq_to_stream(seq_id));
        restart(seq_id);
    }
    std::sort(let_go.begin(), let_go.end(),
              [&](uint32_t a, uint32_t b) { return ps.index.at(a).depth > ps.index.at(b).depth; });
    if (!slid) {
        ps.index.requeue(let_go);
        return;
    }
    // Blocks a window slid over serve only boundaries just after them, which the sequence went past: they
    // go before the windows sequences left at their ends, unless a hit showed they are worth keeping.
    for (uint32_t id : let_go) {
        if (ps.index.at(id).hit)
            ps.index.requeue({&id, 1});
        else
            ps.index.to_front(id);
    }
}

void kv_cache::prefix_before_rm(seq_id_t seq_id, pos_t p0, pos_t p1) {
    if (!prefix_) return;
    prefix_state& ps = *prefix_;
    const int64_t lo = std::max<pos_t>(p0, 0), hi = p1 < 0 ? std::numeric_limits<int64_t>::max() : p1;
    if (hi <= lo) return;
    const auto cut = [&](seq_id_t s) {
        prefix_tracker& t = ps.seqs[static_cast<size_t>(s)];
        const int64_t next = ps.next(t);
        if (!t.active || lo >= next) return;
        if (hi < next) {  // a hole: what follows is no longer the tokens in order
            ps.stop(t);
            return;
        }
        // a suffix goes: keep [0, lo)
        const uint32_t bs = ps.bs();
        const auto keep = static_cast<uint64_t>(lo);
        if (keep >= uint64_t{t.n_full} * bs) {
            t.toks.resize(keep - uint64_t{t.n_full} * bs);
            t.cells.resize(t.toks.size());
            return;
        }
        if (ps.windowed()) {
            cut_windowed(s, t, static_cast<uint32_t>(keep));
            return;
        }
        if (!ps.tail_alive(t)) {
            ps.stop(t);
            return;
        }
        // back up the chain to block keep / bs; its first keep % bs tokens stay pending
        uint32_t cut_block = none, tail = t.tail;
        for (uint32_t d = t.n_full; d > keep / bs; --d) {
            cut_block = tail;
            tail = ps.index.at(tail).parent;
        }
        t.n_full = static_cast<uint32_t>(keep / bs);
        ps.set_tail(t, tail);
        const auto rem = static_cast<uint32_t>(keep % bs);
        const auto toks = ps.index.tokens(cut_block);
        t.toks.assign(toks.begin(), toks.begin() + rem);
        t.cells.clear();
        for (const auto& e : streams_[seq_to_stream(s)].seq_entries(s, static_cast<pos_t>(t.n_full * bs),
                                                                    static_cast<pos_t>(keep)))
            t.cells.push_back(e.second);
        if (t.cells.size() != t.toks.size()) ps.stop(t);  // a position held twice: not a plain prefix
    };
    // Whole blocks the last step completed and nobody published go with the cells: counted, logged once
    const auto cut_counting = [&](seq_id_t s) {
        const prefix_tracker& t = ps.seqs[static_cast<size_t>(s)];
        const size_t before = t.active ? t.toks.size() / ps.bs() : 0;
        cut(s);
        const size_t after = t.active ? t.toks.size() / ps.bs() : 0;
        if (after >= before) return;
        ps.stats.dropped_blocks += before - after;
        if (!std::exchange(ps.logged_drop, true))
            log(log_level::warn, fmt::format("prefix cache: seq_rm of seq {} dropped {} completed block(s) "
                                             "before they were published: the engine did not move past the "
                                             "step that computed them (the memory context's next() after "
                                             "its last ubatch, or prefix_publish()); further drops are only "
                                             "counted (prefix_stats::dropped_blocks)",
                                             s, before - after));
    };
    if (seq_id != seq_all) return cut_counting(seq_id);
    for (size_t s = 0; s < ps.seqs.size(); ++s) cut_counting(static_cast<seq_id_t>(s));
}

// A window's tracker backs up to block keep / bs by its hashes; the first keep % bs tokens of that block
// come from its record (the sequence stops publishing if it was evicted), their cells from the sequence.
void kv_cache::cut_windowed(seq_id_t s, prefix_tracker& t, uint32_t keep) {
    prefix_state& ps = *prefix_;
    const uint32_t bs = ps.bs(), k = keep / bs, rem = keep % bs;
    t.toks.clear();
    if (rem > 0) {
        const uint32_t id = ps.index.find_any(t.hashes[k]);
        const uint64_t seed = k == 0 ? t.key : t.hashes[k - 1];
        if (id == none || ps.index.seed(id) != seed) {
            ps.stop(t);
            return;
        }
        const auto toks = ps.index.tokens(id);
        t.toks.assign(toks.begin(), toks.begin() + rem);
    }
    t.hashes.resize(k);
    t.n_full = k;
    t.cells.assign(rem, none);
    for (const auto& [p, c] :
         streams_[seq_to_stream(s)].seq_entries(s, static_cast<pos_t>(k * bs), static_cast<pos_t>(keep))) {
        uint32_t& slot = t.cells[static_cast<size_t>(p) - size_t{k} * bs];
        if (slot != none) {
            ps.stop(t);  // a position held twice: not a plain prefix
            return;
        }
        slot = c;
    }
}

void kv_cache::prefix_before_cp(seq_id_t src, seq_id_t dst, pos_t p0, pos_t p1) {
    if (!prefix_) return;
    prefix_state& ps = *prefix_;
    if (seq_pos_min(src) < 0) return;  // nothing is copied
    prefix_tracker& d = ps.seqs[static_cast<size_t>(dst)];
    const prefix_tracker& s = ps.seqs[static_cast<size_t>(src)];
    // dst continues src's tokens only if it was empty and gets all of them
    const bool whole = p0 <= 0 && (p1 < 0 || p1 > seq_pos_max(src));
    if (seq_pos_min(dst) < 0 && whole && s.active) {
        d = s;  // across streams, prefix_copied points its cells at the copies
        if (d.toks.size() >= ps.bs()) ps.pending.push_back(dst);
    } else {
        ps.stop(d);
    }
}

void kv_cache::prefix_copied(seq_id_t dst, std::span<const std::pair<pos_t, uint32_t>> entries,
                             std::span<const uint32_t> cells) {
    if (!prefix_) return;
    prefix_tracker& d = prefix_->seqs[static_cast<size_t>(dst)];
    if (!d.active || d.cells.empty()) return;
    // the tracker's cells are src's at positions next() - size() .. (none: gone with the window);
    // entries are sorted by position
    const pos_t p0 = prefix_->next(d) - static_cast<pos_t>(d.cells.size());
    auto it = std::lower_bound(entries.begin(), entries.end(), std::pair<pos_t, uint32_t>{p0, 0});
    for (size_t j = 0; j < d.cells.size(); ++j) {
        if (d.cells[j] == none) continue;
        if (it == entries.end() || it->first != p0 + static_cast<pos_t>(j) || it->second != d.cells[j]) {
            prefix_->stop(d);  // not the plain prefix the tracker saw in src
            return;
        }
        d.cells[j] = cells[static_cast<size_t>(it - entries.begin())];
        ++it;
    }
}

void kv_cache::prefix_before_shift(seq_id_t seq_id, pos_t p0, pos_t p1) {
    if (!prefix_) return;
    prefix_state& ps = *prefix_;
    const uint32_t st = seq_to_stream(seq_id);
    kv_cells& cells = streams_[st];
    ps.stop(ps.seqs[static_cast<size_t>(seq_id)]);  // its positions no longer count its tokens
    std::vector<uint32_t> shared, alone;
    for (const auto& e : cells.seq_entries(seq_id, p0, p1)) {
        if (!cells.is_held(e.second)) continue;
        // a pinned block keeps its cells too
        const bool keep = cells.seq_count(e.second) > 1 || ps.index.at(cells.holder(e.second)).pins > 0;
        (keep ? shared : alone).push_back(e.second);
    }
    if (shared.empty() && alone.empty()) return;
    // Cells other sequences hold too keep their positions for them: the moving sequence gets copies.
    if (!shared.empty()) {
        if (!prefix_make_room(st, static_cast<uint32_t>(shared.size())))
            throw error(errc::invalid_state,
                        fmt::format("seq {} shares {} cells of cached prefixes with other sequences; moving "
                                    "them needs as many free cells, and only {} are free or evictable",
                                    seq_id, shared.size(), cells.size() - cells.get_used()));
        std::vector<uint32_t> fresh;
        cells.find_free(static_cast<uint32_t>(shared.size()), heads_[st], fresh);
        std::vector<row_copy> copies(shared.size());
        for (size_t k = 0; k < shared.size(); ++k) {
            const uint32_t from = shared[k], to = fresh[k];
            cells.pos_set(to, cells.pos_get(from));  // held cells have no pending shift
            cells.seq_add(to, seq_id);
            cells.seq_rm(from, seq_id);
            copies[k] = {row(st, from), row(st, to)};
        }
        fit_storage(st);
        storage_->copy_rows(copies);
        ps.stats.bytes_copied += shared.size() * cell_bytes();
    }
    // Cells only this sequence holds: their blocks leave the index (a block's meaning is its positions).
    for (uint32_t c : alone) {
        if (!cells.is_held(c)) continue;  // taken out with an earlier cell of the same block
        const uint32_t id = cells.holder(c);
        ps.emit(prefix_event::kind::removed, id);
        for (uint32_t bc : ps.index.cells(id)) {
            if (cells.unhold(bc)) lower_head(st, bc);
        }
        ps.index.remove(id);
        ++ps.stats.unpublished_blocks;
    }
    prefix_sync(seq_id);
}

void kv_cache::prefix_forget(seq_id_t seq_id) {
    if (!prefix_) return;
    if (seq_id == seq_all) {
        for (prefix_tracker& t : prefix_->seqs) prefix_->stop(t);
    } else {
        prefix_->stop(prefix_->seqs[static_cast<size_t>(seq_id)]);
    }
}

void kv_cache::prefix_reset() {
    if (!prefix_) return;
    prefix_state& ps = *prefix_;
    if (ps.index.size() > 0) ps.call(prefix_event{.type = prefix_event::kind::cleared});
    ps.index.clear();  // the caller empties the cells
    for (prefix_tracker& t : ps.seqs) t = prefix_tracker{};
    ps.pending.clear();
    for (seq_id_t s : ps.placed) ps.is_placed[static_cast<size_t>(s)] = 0;
    ps.placed.clear();
}

void kv_cache::prefix_moved(uint32_t stream, uint32_t from, uint32_t to) {
    if (!prefix_) return;
    prefix_state& ps = *prefix_;
    const kv_cells& cells = streams_[stream];
    if (cells.is_held(to)) {  // the cell took its holder along
        const uint32_t id = cells.holder(to);
        const auto cs = ps.index.cells(id);
        for (uint32_t j = 0; j < cs.size(); ++j)
            if (cs[j] == from) ps.index.set_cell(id, j, to);
    }
    // the trackers of the stream's sequences (every sequence in a unified cache)
    const auto fix = [&](prefix_tracker& t) { std::replace(t.cells.begin(), t.cells.end(), from, to); };
    if (streams_.size() == 1)
        for (prefix_tracker& t : ps.seqs) fix(t);
    else
        fix(ps.seqs[stream]);
}

}  // namespace kvc
