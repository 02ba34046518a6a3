// kv_cache: cached prefix blocks to and from a block store (docs/tiers.md). Rows leave and enter through
// kv_storage's state I/O (save_k / save_v / load), so host and engine-owned storage work alike, and a
// record's V bytes are what save_v writes: rows, or channel-major for transposed V.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <vector>

#include <fmt/format.h>
#include <kvcache/kv_cache.h>

#include "detail/kv_cache_prefix.h"

namespace kvc {

namespace {

using detail::none;
using detail::prefix_index;

// save_k / save_v into one piece of a record, which must come out exactly filled.
class span_writer final : public io_write_i {
public:
    explicit span_writer(std::span<uint8_t> dst) : dst_(dst) {}
    void write(const void* src, size_t size) override {
        if (size > dst_.size() - n_)
            throw error(
                errc::out_of_range,
                fmt::format("block record: {} bytes more than the {} of a layer's rows", size, dst_.size()));
        std::memcpy(dst_.data() + n_, src, size);
        n_ += size;
    }
    size_t n_bytes() const override { return n_; }

private:
    std::span<uint8_t> dst_;
    size_t n_ = 0;
};

}  // namespace

block_layout kv_cache::prefix_block_layout(uint64_t model_id) const {
    if (!prefix_) throw error(errc::unsupported, "prefix_block_layout: the cache has no prefix cache");
    block_layout l;
    l.model_id = model_id;
    l.type_k = params_.type_k;
    l.type_v = params_.type_v;
    l.v_trans = params_.v_trans;
    l.block_size = prefix_->bs();
    for (uint32_t li = 0; li < layer_ids_.size(); ++li)
        l.layers.push_back({.il = layer_ids_[li], .n_k = storage_->e_k(li), .n_v = storage_->e_v(li)});
    return l;
}

std::vector<uint8_t> kv_cache::tier_encode(uint32_t id, const block_layout& layout) const {
    const prefix_state& ps = *prefix_;
    const prefix_index::block& b = ps.index.at(id);
    const std::span<const uint32_t> cs = ps.index.cells(id);
    std::vector<uint64_t> rows(ps.bs());
    for (uint32_t j = 0; j < ps.bs(); ++j) rows[j] = row(b.stream, cs[j]);
    const block_id bid{
        .key = ps.index.key_of(id), .hash = b.hash, .parent_hash = ps.index.seed(id), .depth = b.depth};
    return encode_block(
        layout, bid, ps.index.tokens(id), [&](uint32_t li, bool is_v, std::span<uint8_t> dst) {
            span_writer w(dst);
            if (is_v)
                storage_->save_v(w, li, rows);
            else
                storage_->save_k(w, li, rows, {});  // cached cells: no shift
            if (w.n_bytes() != dst.size())
                throw error(errc::invalid_state, fmt::format("block record: layer {} wrote {} of {} bytes",
                                                             li, w.n_bytes(), dst.size()));
        });
}

uint32_t kv_cache::prefix_store_blocks(block_store_i& store, uint64_t model_id,
                                       std::span<const token_t> tokens, uint64_t key) {
    prefix_publish();
    const prefix_state& ps = *prefix_;
    const block_layout layout = prefix_block_layout(model_id);
    const uint64_t fp = layout.fingerprint();
    std::vector<uint32_t> chain;
    ps.index.match(key, tokens, chain);
    if (chain.empty()) return 0;
    std::vector<std::string> keys;
    keys.reserve(chain.size());
    for (const uint32_t id : chain) keys.push_back(block_key(fp, key, ps.index.at(id).hash));
    const std::vector<uint8_t> held = store.contains_many(keys);
    std::vector<std::vector<uint8_t>> values;
    std::vector<block_put> puts;
    values.reserve(chain.size());
    for (size_t d = 0; d < chain.size(); ++d) {
        if (held[d]) continue;
        values.push_back(tier_encode(chain[d], layout));
        puts.push_back({keys[d], values.back()});
    }
    if (!puts.empty()) store.put_many(puts);
    return static_cast<uint32_t>(puts.size());
}

uint32_t kv_cache::prefix_fetch_blocks(block_store_i& store, uint64_t model_id,
                                       std::span<const token_t> tokens, uint64_t key, uint32_t stream) {
    if (stream >= streams_.size())
        throw error(errc::out_of_range, fmt::format("prefix_fetch_blocks: stream {} of a cache with {}",
                                                    stream, streams_.size()));
    prefix_publish();
    const uint32_t bs = prefix_->bs();
    const block_layout layout = prefix_block_layout(model_id);
    const tier_fetch_result r = fetch_from(store, layout, tokens, key, stream, 0);
    tier_flush();  // what the fetch evicted
    return (r.n_mem + r.fetched) * bs;
}

kv_cache::tier_fetch_result kv_cache::fetch_from(block_store_i& store, const block_layout& layout,
                                                 std::span<const token_t> tokens, uint64_t key,
                                                 uint32_t stream, uint8_t tier_bit) {
    prefix_state& ps = *prefix_;
    const uint32_t bs = ps.bs();
    const uint64_t fp = tier_bit != 0 ? ps.tiers.fingerprint() : layout.fingerprint();
    tier_fetch_result r;
    std::vector<uint32_t> chain;
    ps.index.match(key, tokens, chain);
    r.n_mem = static_cast<uint32_t>(chain.size());
    const auto n_blocks = static_cast<uint32_t>(tokens.size() / bs);
    if (r.n_mem >= n_blocks) return r;
    // the chain of the rest, computed from the tokens: what each block's record must say
    std::vector<block_id> want;
    std::vector<std::string> keys;
    uint64_t parent = r.n_mem == 0 ? key : ps.index.at(chain.back()).hash;
    for (uint32_t d = r.n_mem; d < n_blocks; ++d) {
        const uint64_t h = block_chain_hash(parent, tokens.subspan(size_t{d} * bs, bs));
        want.push_back({.key = key, .hash = h, .parent_hash = parent, .depth = d});
        keys.push_back(block_key(fp, key, h));
        parent = h;
    }
    kv_cells& cells = streams_[stream];
    uint32_t parent_id = r.n_mem == 0 ? none : chain.back();
    bool open = true;  // a miss, a refusal or no room ends the chain
    std::vector<uint32_t> fresh;
    std::vector<uint64_t> rows(bs);
    const detail::tier_fetch_guard guard(ps.tiers);  // evictions for room queue their writes
    store.read_many(keys, [&](size_t i, std::span<const uint8_t> value) {
        r.bytes += value.size();
        if (!open || i != r.fetched) {
            open = false;
            return;
        }
        const block_id& w = want[i];
        const std::span<const token_t> toks = tokens.subspan(size_t{w.depth} * bs, bs);
        block_view v;
        try {
            v = decode_block(value, layout, &w);
        } catch (const error&) {
            open = false;  // a value the store's own check (if any) let through
            ++r.refused;
            return;
        }
        if (!std::equal(v.tokens.begin(), v.tokens.end(), toks.begin())) {  // a hash collision
            open = false;
            ++r.refused;
            return;
        }
        // the blocks it extends are kept; a block already indexed (another call published it) is reused
        uint32_t id = ps.index.find(parent_id, key, toks);
        if (id == none) {
            const uint32_t keep[1] = {parent_id};
            if (!prefix_make_room(stream, bs, parent_id == none ? std::span<const uint32_t>{} : keep)) {
                open = false;
                return;
            }
            fresh.clear();
            cells.find_free(bs, heads_[stream], fresh);
            for (uint32_t j = 0; j < bs; ++j) {
                cells.pos_set(fresh[j], static_cast<pos_t>(w.depth * bs + j));
                rows[j] = row(stream, fresh[j]);
            }
            try {
                fit_storage(stream, false);
                for (uint32_t li = 0; li < layout.layers.size(); ++li) {
                    storage_->load(kv_part::k, li, rows, reinterpret_cast<const std::byte*>(v.k(li).data()));
                    storage_->load(kv_part::v, li, rows, reinterpret_cast<const std::byte*>(v.v(li).data()));
                }
            } catch (...) {  // the cells go back empty: the blocks fetched before stay, nothing else changed
                for (const uint32_t c : fresh) {
                    cells.rm(c);
                    lower_head(stream, c);
                }
                throw;
            }
            id = ps.index.add(parent_id, key, toks, fresh, stream, prefix_default_priority, 0);
            for (const uint32_t c : fresh) cells.hold(c, id);
            heads_[stream] = fresh.back() + 1;
            ++ps.stats.published_blocks;
            ps.emit(prefix_event::kind::stored, id);
            if (tier_bit != 0 && ps.tiers.write_through())
                ps.tiers.published.emplace_back(id, ps.index.at(id).gen);  // for the other tiers
        }
        ps.index.set_stored(id, ps.index.at(id).stored | tier_bit);
        parent_id = id;
        ++r.fetched;
    });
    return r;
}

void kv_cache::tier_fetch(std::span<const token_t> tokens, uint64_t key, uint32_t stream,
                          uint32_t max_tokens) {
    prefix_state& ps = *prefix_;
    if (!ps.tiers.fetches() || tokens.empty()) return;
    const uint32_t bs = ps.bs();
    // what prefix_attach can give: the engine computes the last token
    const uint32_t cap = std::min<uint32_t>(static_cast<uint32_t>(tokens.size() - 1), max_tokens) / bs;
    if (cap == 0) return;
    tokens = tokens.first(size_t{cap} * bs);
    const auto record = static_cast<double>(ps.tiers.layout().record_bytes());
    std::vector<uint32_t> chain;
    for (uint32_t t = 0; t < ps.tiers.size(); ++t) {
        chain.clear();
        ps.index.match(key, tokens, chain);
        if (chain.size() >= cap) break;
        // ask only when bringing back the whole rest may cost less than computing it
        const auto k = static_cast<double>(cap - chain.size());
        if (!ps.tiers.worth_asking(t, k * record, k * bs)) continue;
        const auto t0 = std::chrono::steady_clock::now();
        tier_fetch_result r;
        try {
            r = fetch_from(ps.tiers.store(t), ps.tiers.layout(), tokens, key, stream,
                           static_cast<uint8_t>(1u << t));
        } catch (const std::exception&) {  // a tier is a cache: the engine recomputes
            ps.tiers.failed(t);
            continue;
        }
        ps.tiers.fetched(
            t, std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count(),
            r.bytes, r.fetched, r.refused);
    }
    tier_flush();
}

void kv_cache::tier_evicting(uint32_t id) {
    prefix_state& ps = *prefix_;
    if (!ps.tiers.write_on_evict()) return;
    ps.tiers.evicting(ps.index, id, [&](uint32_t b) { return tier_encode(b, ps.tiers.layout()); });
}

void kv_cache::tier_flush() {
    if (!prefix_ || prefix_->tiers.empty()) return;  // every publish and placement passes here
    prefix_state& ps = *prefix_;
    ps.tiers.write(ps.index, [&](uint32_t b) { return tier_encode(b, ps.tiers.layout()); });
}

void kv_cache::prefix_tier_drain() {
    if (prefix_) prefix_->tiers.drain();
}

std::vector<prefix_tier_stats> kv_cache::get_tier_stats() const {
    return prefix_ ? prefix_->tiers.stats() : std::vector<prefix_tier_stats>{};
}

}  // namespace kvc
