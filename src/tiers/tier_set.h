// The tiers of a prefix cache (prefix_cache_params::tiers, docs/tiers.md): the stores, the layout of the
// memory's records, the records waiting to be written, and for each store its counters and cost model.
// kv_cache (blocks) and memory_recurrent (snapshots) keep one each; what a record holds is theirs.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <kvcache/block_record.h>
#include <kvcache/prefix_tiers.h>

#include "prefix/prefix_index.h"
#include "tiers/tier_cost.h"
#include "tiers/tier_writer.h"

namespace kvc::detail {

class tier_set {
public:
    // Checks p (invalid_argument naming `who` and the limit).
    static void check(const prefix_tier_params& p, const char* who);
    void init(const prefix_tier_params& p, block_layout layout);

    bool empty() const { return tiers_.empty(); }
    uint32_t size() const { return static_cast<uint32_t>(tiers_.size()); }
    const prefix_tier_params& params() const { return p_; }
    const block_layout& layout() const { return layout_; }
    uint64_t fingerprint() const { return fp_; }
    uint8_t all() const { return static_cast<uint8_t>((1u << tiers_.size()) - 1); }
    bool write_on_evict() const { return !empty() && p_.write == tier_write::on_evict; }
    bool write_through() const { return !empty() && p_.write == tier_write::through; }
    bool fetches() const { return !empty() && p_.fetch; }
    block_store_i& store(uint32_t t) { return *tiers_[t].store; }

    // A record for the tiers of `need` (bit t: tier t) at the next flush; id/gen: the block to mark stored
    // (none: it left memory). make() encodes it; a failure (storage that cannot save) is counted.
    void queue(uint64_t key, uint64_t hash, uint8_t need, uint32_t id, uint32_t gen,
               const std::function<std::vector<uint8_t>()>& make);
    // Writes what is queued: one put_many per store. stored(id, gen, bit) marks a block still alive.
    // Nothing while `fetching` (a store is inside a read).
    void flush(const std::function<void(uint32_t id, uint32_t gen, uint8_t bit)>& stored);

    // The records a memory writes: encode(id) makes block id's (its rows are intact), has(id) says
    // whether a published block has one now (empty: always).
    using encode_fn = std::function<std::vector<uint8_t>(uint32_t id)>;
    // on_evict: block id leaves memory; its record joins the next flush for the tiers that lack it.
    void evicting(const prefix_index& index, uint32_t id, const encode_fn& encode);
    // The records of the blocks published since the last call (write-through) and what evictions
    // queued, written; the blocks still alive marked stored in the tiers that took them.
    void write(prefix_index& index, const encode_fn& encode, const std::function<bool(uint32_t)>& has = {});

    // Whether reading `bytes` from tier t may cost less than computing `tokens` (the cost model; a
    // declined tier is still asked every probe_every times).
    bool worth_asking(uint32_t t, double bytes, double tokens);
    // A read of tier t: its time, the bytes it returned, the records accepted and refused.
    void fetched(uint32_t t, double ns, uint64_t bytes, uint32_t accepted, uint32_t refused);
    void failed(uint32_t t) { ++tiers_[t].stats.errors; }

    std::vector<prefix_tier_stats> stats() const;
    uint64_t fetched_total() const { return fetched_; }
    uint64_t written_total() const;
    // async_writes: returns when every write queued so far is done
    void drain() {
        if (writer_) writer_->drain();
    }

    bool fetching = false;  // inside a store's read_many: writes wait (a store is not reentrant)
    std::vector<std::pair<uint32_t, uint32_t>> published;  // write-through: (id, gen) since the last flush

private:
    struct tier {
        std::shared_ptr<block_store_i> store;
        prefix_tier_stats stats;
        tier_cost cost;
        uint32_t declined_run = 0;  // attaches declined in a row (a probe every probe_every)
    };
    struct item {
        std::string key;
        std::shared_ptr<const std::vector<uint8_t>> value;  // shared by the stores' writes
        uint8_t need = 0;
        uint32_t id = 0;
        uint32_t gen = 0;
    };
    prefix_tier_params p_;
    block_layout layout_;
    uint64_t fp_ = 0;
    std::vector<tier> tiers_;
    std::vector<item> writes_;
    uint64_t fetched_ = 0, written_ = 0;
    std::unique_ptr<tier_writer> writer_;  // async_writes
};

// While alive: the set's writes wait (a store calls back into the memory during read_many).
class tier_fetch_guard {
public:
    explicit tier_fetch_guard(tier_set& t) : t_(t) { t_.fetching = true; }
    ~tier_fetch_guard() { t_.fetching = false; }
    tier_fetch_guard(const tier_fetch_guard&) = delete;
    tier_fetch_guard& operator=(const tier_fetch_guard&) = delete;

private:
    tier_set& t_;
};

}  // namespace kvc::detail
