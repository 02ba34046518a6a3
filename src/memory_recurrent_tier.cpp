// memory_recurrent: snapshots to and from the prefix cache's tiers (docs/tiers.md). A snapshot's record is
// a block record of a per_block layout: the block's tokens and chain position, and each layer's r and s
// rows after its last token.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>

#include <fmt/format.h>
#include <kvcache/memory_recurrent.h>

#include "detail/memory_recurrent_impl.h"
#include "detail/recurrent_prefix.h"

namespace kvc {

namespace {
using detail::none;
}  // namespace

block_layout memory_recurrent::prefix_block_layout(uint64_t model_id) const {
    if (!prefix_) throw error(errc::unsupported, "prefix_block_layout: the memory has no prefix cache");
    block_layout l;
    l.model_id = model_id;
    l.type_k = params_.type_r;
    l.type_v = params_.type_s;
    l.block_size = prefix_->bs;
    l.per_block = true;
    for (const layer& y : layers_) l.layers.push_back({.il = y.il, .n_k = y.n_embd_r, .n_v = y.n_embd_s});
    return l;
}

void memory_recurrent::prefix_tier_drain() {
    if (prefix_) prefix_->tiers.drain();
}

std::vector<prefix_tier_stats> memory_recurrent::get_tier_stats() const {
    return prefix_ ? prefix_->tiers.stats() : std::vector<prefix_tier_stats>{};
}

std::vector<uint8_t> memory_recurrent::tier_encode(uint32_t id) const {
    const prefix_state& ps = *prefix_;
    const detail::prefix_index::block& b = ps.index.at(id);
    const uint64_t row = (uint64_t{params_.n_rs_seq} + 1) * size_ + ps.block_slot[id];
    const block_id bid{
        .key = ps.index.key_of(id), .hash = b.hash, .parent_hash = ps.index.seed(id), .depth = b.depth};
    return encode_block(
        ps.tiers.layout(), bid, ps.index.tokens(id), [&](uint32_t l, bool is_s, std::span<uint8_t> dst) {
            const layer& y = layers_[l];
            const size_t n = is_s ? y.row_s : y.row_r;
            if (dst.size() != n)
                throw error(errc::invalid_state,
                            fmt::format("snapshot record: layer {} has {} bytes of state, the record {}",
                                        y.il, n, dst.size()));
            if (n) std::memcpy(dst.data(), (is_s ? y.s.data() : y.r.data()) + row * n, n);
        });
}

void memory_recurrent::tier_evicting(uint32_t id) {
    prefix_state& ps = *prefix_;
    if (!ps.tiers.write_on_evict()) return;
    ps.tiers.evicting(ps.index, id, [&](uint32_t b) { return tier_encode(b); });
}

void memory_recurrent::tier_flush() {
    if (!prefix_ || prefix_->tiers.empty()) return;  // every publish and plan passes here
    prefix_state& ps = *prefix_;
    // write-through: the snapshots kept since the last flush, if they still are
    ps.tiers.write(
        ps.index, [&](uint32_t b) { return tier_encode(b); }, [&](uint32_t b) { return ps.has_snapshot(b); });
}

bool memory_recurrent::install_snapshot(std::span<const token_t> tokens, uint64_t key, uint32_t d,
                                        const block_view& v, uint8_t tier_bit) {
    prefix_state& ps = *prefix_;
    while (ps.free_slots.empty() && ps.evict_one(false)) {}  // their writes wait for the flush
    const uint32_t slot = ps.take_slot();
    if (slot == none) return false;  // every snapshot is in use
    const uint64_t row = (uint64_t{params_.n_rs_seq} + 1) * size_ + slot;
    for (uint32_t l = 0; l < layers_.size(); ++l) {
        layer& y = layers_[l];
        if (y.row_r) std::memcpy(y.r.data() + row * y.row_r, v.k(l).data(), y.row_r);
        if (y.row_s) std::memcpy(y.s.data() + row * y.row_s, v.v(l).data(), y.row_s);
    }
    // the chain down to the block: found, or added (no sequence holds them: the ancestors wait for their
    // child, the block is evictable with its snapshot)
    const uint32_t bs = ps.bs;
    uint32_t id = none;
    for (uint32_t j = 0; j <= d; ++j) {
        const auto toks = tokens.subspan(size_t{j} * bs, bs);
        const uint32_t parent = id;
        id = ps.index.find(parent, key, toks);
        if (id == none) {
            id = ps.index.add(parent, key, toks, ps.zeros, 0, prefix_default_priority, 0);
            ps.grow();
            ++ps.stats.published_blocks;
            ps.emit(prefix_event::kind::stored, id);
        }
    }
    ps.publish(slot, id, prefix_state::snap_kind::fetched);
    ps.index.set_stored(id, ps.index.at(id).stored | tier_bit);
    return true;
}

// The deepest snapshot a tier holds for the prompt, deeper than memory's: which boundaries have one
// (contains_many: presence costs no state bytes), then the deepest read and verified (a refused one: the
// next deepest). It goes into a pool slot (evicting as placement does), its blocks into the index.
void memory_recurrent::tier_fetch(std::span<const token_t> tokens, uint64_t key) {
    prefix_state& ps = *prefix_;
    if (!ps.tiers.fetches() || tokens.size() < 2) return;
    const uint32_t bs = ps.bs;
    // a snapshot at the end of block d resumes at (d + 1) * bs, before the last token
    const auto n_cand = static_cast<uint32_t>((tokens.size() - 1) / bs);
    std::vector<uint32_t> chain;
    const int64_t d_mem = ps.deepest(tokens, key, chain);
    const auto first = static_cast<uint32_t>(d_mem + 1);
    if (first >= n_cand) return;
    std::vector<uint64_t> hashes(n_cand);
    uint64_t seed = key;
    for (uint32_t d = 0; d < n_cand; ++d)
        seed = hashes[d] = block_chain_hash(seed, tokens.subspan(size_t{d} * bs, bs));
    std::vector<std::string> keys;
    for (uint32_t d = first; d < n_cand; ++d)
        keys.push_back(block_key(ps.tiers.fingerprint(), key, hashes[d]));
    const block_layout& layout = ps.tiers.layout();
    const auto record = static_cast<double>(layout.record_bytes());
    for (uint32_t t = 0; t < ps.tiers.size(); ++t) {
        if (!ps.tiers.worth_asking(t, record, static_cast<double>(n_cand - first) * bs)) continue;
        const auto t0 = std::chrono::steady_clock::now();
        uint64_t bytes = 0;
        uint32_t refused = 0;
        bool got = false;
        try {
            const std::vector<uint8_t> present = ps.tiers.store(t).contains_many(keys);
            for (auto i = static_cast<int64_t>(keys.size()) - 1; i >= 0 && !got; --i) {
                if (!present[static_cast<size_t>(i)]) continue;
                const uint32_t d = first + static_cast<uint32_t>(i);
                const block_id want{
                    .key = key, .hash = hashes[d], .parent_hash = d == 0 ? key : hashes[d - 1], .depth = d};
                const detail::tier_fetch_guard guard(ps.tiers);
                ps.tiers.store(t).read_many(
                    std::span(keys).subspan(static_cast<size_t>(i), 1),
                    [&](size_t, std::span<const uint8_t> value) {
                        bytes += value.size();
                        block_view v;
                        try {
                            v = decode_block(value, layout, &want);
                        } catch (const error&) {
                            ++refused;
                            return;
                        }
                        const auto toks = tokens.subspan(size_t{d} * bs, bs);
                        if (!std::equal(v.tokens.begin(), v.tokens.end(), toks.begin())) {
                            ++refused;  // a hash collision
                            return;
                        }
                        got = install_snapshot(tokens, key, d, v, static_cast<uint8_t>(1u << t));
                    });
            }
        } catch (const std::exception&) {  // a tier is a cache: the engine recomputes
            ps.tiers.failed(t);
            continue;
        }
        ps.tiers.fetched(
            t, std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count(), bytes,
            got ? 1 : 0, refused);
        if (got) break;
    }
    tier_flush();
}

}  // namespace kvc
