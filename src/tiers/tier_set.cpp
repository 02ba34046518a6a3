// The tiers of a prefix cache: writes queued and flushed, the cost model's decisions, counters.
#include "tiers/tier_set.h"

#include <algorithm>
#include <exception>

#include <fmt/format.h>

namespace kvc::detail {

void tier_set::check(const prefix_tier_params& t, const char* who) {
    const auto bad = [who](const std::string& msg) {
        throw error(errc::invalid_argument, fmt::format("{}: {}", who, msg));
    };
    if (t.stores.size() > prefix_max_tiers)
        bad(fmt::format("the prefix cache takes at most {} tiers, not {}", prefix_max_tiers,
                        t.stores.size()));
    if (std::any_of(t.stores.begin(), t.stores.end(), [](const auto& st) { return st == nullptr; }))
        bad("a prefix tier has no store (null)");
    if (t.write != tier_write::on_evict && t.write != tier_write::through && t.write != tier_write::never)
        bad(fmt::format("prefix tiers: write policy {} unknown", static_cast<int>(t.write)));
    if (t.async_writes && t.max_queued_bytes == 0)
        bad("prefix tiers: async_writes needs max_queued_bytes > 0");
    if (!(t.prefill_ns_per_token >= 0 && t.prefill_ns_per_token <= 1e12))
        bad(fmt::format("prefix tiers: prefill_ns_per_token {} must be in [0, 1e12]",
                        t.prefill_ns_per_token));
}

void tier_set::init(const prefix_tier_params& p, block_layout layout) {
    p_ = p;
    for (const auto& store : p_.stores) {
        tier& t = tiers_.emplace_back();
        t.store = store;
        t.stats.where = store->describe();
    }
    p_.stores.clear();  // held by tiers_
    layout_ = std::move(layout);
    if (tiers_.empty()) return;
    fp_ = layout_.fingerprint();
    if (p_.async_writes) writer_ = std::make_unique<tier_writer>(size(), p_.max_queued_bytes);
}

void tier_set::queue(uint64_t key, uint64_t hash, uint8_t need, uint32_t id, uint32_t gen,
                     const std::function<std::vector<uint8_t>()>& make) {
    need &= all();
    if (need == 0) return;
    try {
        writes_.push_back({.key = block_key(fp_, key, hash),
                           .value = std::make_shared<const std::vector<uint8_t>>(make()),
                           .need = need,
                           .id = id,
                           .gen = gen});
    } catch (const std::exception&) {  // the record could not be made: lost, as without tiers
        for (uint32_t t = 0; t < tiers_.size(); ++t)
            if (need & (1u << t)) ++tiers_[t].stats.errors;
    }
}

void tier_set::flush(const std::function<void(uint32_t id, uint32_t gen, uint8_t bit)>& stored) {
    if (fetching || writes_.empty()) return;
    if (writer_) {  // one job per store for the writer's thread
        for (uint32_t t = 0; t < tiers_.size(); ++t) {
            std::vector<std::string> keys;
            std::vector<std::shared_ptr<const std::vector<uint8_t>>> values;
            uint64_t bytes = 0;
            for (const item& w : writes_)
                if (w.need & (1u << t)) {
                    keys.push_back(w.key);
                    values.push_back(w.value);
                    bytes += w.value->size();
                }
            if (keys.empty() || !writer_->push({.tier = t,
                                                .store = tiers_[t].store,
                                                .keys = std::move(keys),
                                                .values = std::move(values),
                                                .bytes = bytes}))
                continue;
            for (const item& w : writes_)
                if (w.need & (1u << t)) stored(w.id, w.gen, static_cast<uint8_t>(1u << t));
        }
        writes_.clear();
        return;
    }
    std::vector<block_put> puts;
    for (uint32_t t = 0; t < tiers_.size(); ++t) {
        tier& tr = tiers_[t];
        puts.clear();
        for (const item& w : writes_)
            if (w.need & (1u << t)) puts.push_back({w.key, *w.value});
        if (puts.empty()) continue;
        try {
            tr.store->put_many(puts);
        } catch (const std::exception&) {  // a tier is a cache: counted, never the engine's problem
            ++tr.stats.errors;
            continue;
        }
        tr.stats.written_blocks += puts.size();
        written_ += puts.size();
        for (const item& w : writes_)
            if (w.need & (1u << t)) stored(w.id, w.gen, static_cast<uint8_t>(1u << t));
    }
    writes_.clear();
}

void tier_set::evicting(const prefix_index& index, uint32_t id, const encode_fn& encode) {
    if (!write_on_evict()) return;
    const prefix_index::block& b = index.at(id);
    queue(index.key_of(id), b.hash, static_cast<uint8_t>(~b.stored), prefix_index::none, 0,
          [&] { return encode(id); });
}

void tier_set::write(prefix_index& index, const encode_fn& encode, const std::function<bool(uint32_t)>& has) {
    if (empty() || fetching) return;
    for (const auto& [bid, bgen] : published) {
        const uint32_t id = bid;  // captured below
        if (!index.alive(id, bgen) || (has && !has(id))) continue;
        const prefix_index::block& b = index.at(id);
        queue(index.key_of(id), b.hash, static_cast<uint8_t>(~b.stored), id, bgen,
              [&] { return encode(id); });
    }
    published.clear();
    flush([&](uint32_t id, uint32_t gen, uint8_t bit) {
        if (id != prefix_index::none && index.alive(id, gen)) index.set_stored(id, index.at(id).stored | bit);
    });
}

bool tier_set::worth_asking(uint32_t t, double bytes, double tokens) {
    tier& tr = tiers_[t];
    const double p = p_.prefill_ns_per_token;
    if (p > 0 && tr.cost.known() && tr.cost.predict(bytes) >= tokens * p &&
        (p_.probe_every == 0 || ++tr.declined_run < p_.probe_every)) {
        ++tr.stats.declined;
        return false;
    }
    tr.declined_run = 0;
    return true;
}

void tier_set::fetched(uint32_t t, double ns, uint64_t bytes, uint32_t accepted, uint32_t refused) {
    tier& tr = tiers_[t];
    tr.cost.add(static_cast<double>(bytes), ns);
    ++tr.stats.fetches;
    tr.stats.fetched_blocks += accepted;
    tr.stats.refused_blocks += refused;
    fetched_ += accepted;
}

uint64_t tier_set::written_total() const {
    uint64_t n = written_;
    if (writer_)
        for (uint32_t t = 0; t < tiers_.size(); ++t) n += writer_->of(t).written;
    return n;
}

std::vector<prefix_tier_stats> tier_set::stats() const {
    std::vector<prefix_tier_stats> out;
    for (uint32_t i = 0; i < tiers_.size(); ++i) {
        const tier& t = tiers_[i];
        prefix_tier_stats s = t.stats;
        if (writer_) {
            const tier_writer::counts c = writer_->of(i);
            s.written_blocks += c.written;
            s.errors += c.errors;
            s.dropped_blocks += c.dropped;
        }
        s.est_latency_ns = t.cost.latency_ns();
        s.est_ns_per_byte = t.cost.ns_per_byte();
        s.store = t.store->stats();
        out.push_back(std::move(s));
    }
    return out;
}

}  // namespace kvc::detail
