// The tiers below a kv_cache's prefix cache (prefix_cache_params::tiers, docs/tiers.md): evicted blocks
// written to stores and fetched back at attach, the write policies, slow, failing and damaged stores,
// asynchronous writes.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <kvcache/disk_store.h>
#include <kvcache/kv_cache.h>

#include "prefix_cache_test_util.h"

namespace kvc {
namespace {

using namespace prefix_test;

// -- tiers (prefix_cache_params::tiers, docs/tiers.md) --

// A store in memory that can be slow, throw, or return damaged values.
class test_store final : public block_store_i {
public:
    std::map<std::string, std::vector<uint8_t>> values;
    int delay_us = 0;
    bool fail = false;     // every call throws
    bool garbage = false;  // every key reads as a damaged value
    block_store_stats st;

    size_t read_many(std::span<const std::string> keys, const block_value_fn& on_value) override {
        block_store_call_timer timer(st);
        if (delay_us) ::usleep(static_cast<useconds_t>(delay_us));
        if (fail) throw error(errc::io, "test store: down");
        size_t n = 0;
        st.lookups += keys.size();
        for (size_t i = 0; i < keys.size(); ++i) {
            auto it = values.find(keys[i]);
            if (garbage) {
                std::vector<uint8_t> v(it == values.end() ? 200 : it->second.size(), 0x5a);
                on_value(i, v);
                ++n;
            } else if (it != values.end()) {
                on_value(i, it->second);
                ++n;
            }
        }
        st.hits += n;
        return n;
    }
    void put_many(std::span<const block_put> items) override {
        block_store_call_timer timer(st);
        if (fail) throw error(errc::io, "test store: down");
        for (const block_put& b : items) {
            values[std::string(b.key)].assign(b.value.begin(), b.value.end());
            ++st.puts;
        }
    }
    std::vector<uint8_t> contains_many(std::span<const std::string> keys) override {
        std::vector<uint8_t> out;
        for (const auto& k : keys) out.push_back(values.count(k) ? 1 : 0);
        return out;
    }
    block_store_stats stats() const override { return st; }
    std::string describe() const override { return "test"; }
};

kv_cache_params tier_params(std::vector<std::shared_ptr<block_store_i>> stores,
                            tier_write write = tier_write::on_evict) {
    kv_cache_params p = prefix_params(32, 2);  // 8 blocks of 4
    p.prefix.tiers = {.stores = std::move(stores), .model_id = 3, .write = write};
    return p;
}

// Decodes `toks` in s and ends it: its whole blocks stay cached.
void decode_and_end(engine& e, seq_id_t s, std::span<const token_t> toks) {
    ASSERT_TRUE(e.decode(s, toks));
    e.c.prefix_cache()->prefix_publish();
    e.c.seq_rm(s, -1, -1);
    e.seqs[static_cast<size_t>(s)].clear();
}

// 32 tokens of 8 blocks, all different: they take every cell of a 32-cell cache.
std::vector<token_t> filler() {
    std::vector<token_t> t(32);
    for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<token_t>(100 + i);
    return t;
}

// Decodes `a` in seq 0, ends it, and fills the cache with other tokens so that a's blocks are evicted.
void decode_then_evict(engine& e, std::span<const token_t> a) {
    ASSERT_NO_FATAL_FAILURE(decode_and_end(e, 0, a));
    ASSERT_NO_FATAL_FAILURE(decode_and_end(e, 1, filler()));
    ASSERT_EQ(e.c.prefix_cache()->prefix_lookup(a), 0u);
}

// Evicted blocks go to every tier; an attach brings them back from the first that has them and writes
// them, when they leave memory again, only to the tiers that did not return them.
TEST(prefix_tiers, evictions_write_each_tier_once_and_attaches_fetch_in_order) {
    auto t0 = std::make_shared<test_store>(), t1 = std::make_shared<test_store>();
    const auto a = seq_of({1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4});
    {
        engine e(tier_params({t1}));
        ASSERT_NO_FATAL_FAILURE(decode_then_evict(e, a));
        EXPECT_EQ(t1->values.size(), 3u);  // a's blocks, evicted by the filler's
        EXPECT_EQ(e.c.prefix_cache()->get_prefix_stats().tier_written_blocks, 3u);
    }
    engine e(tier_params({t0, t1}));
    EXPECT_EQ(e.attach(0, a), 12u);  // t0 misses, t1 has the chain
    ASSERT_NO_FATAL_FAILURE(e.check(0));
    std::vector<prefix_tier_stats> ts = e.c.prefix_cache()->get_tier_stats();
    EXPECT_EQ(ts[0].fetches, 1u);
    EXPECT_EQ(ts[0].fetched_blocks, 0u);
    EXPECT_EQ(ts[1].fetched_blocks, 3u);
    EXPECT_EQ(e.c.prefix_cache()->get_prefix_stats().tier_fetched_blocks, 3u);
    e.c.seq_rm(0, -1, -1);
    e.seqs[0].clear();
    ASSERT_NO_FATAL_FAILURE(decode_and_end(e, 1, filler()));
    ts = e.c.prefix_cache()->get_tier_stats();
    EXPECT_EQ(ts[0].written_blocks, 3u);  // a's blocks left memory again: to t0 only, they came from t1
    EXPECT_EQ(ts[1].written_blocks, 0u);
    // a third cache finds a in t0 and does not ask t1
    engine f(tier_params({t0, t1}));
    EXPECT_EQ(f.attach(0, a), 12u);
    ASSERT_NO_FATAL_FAILURE(f.check(0));
    ts = f.c.prefix_cache()->get_tier_stats();
    EXPECT_EQ(ts[0].fetched_blocks, 3u);
    EXPECT_EQ(ts[1].fetches, 0u);
    ASSERT_NO_FATAL_FAILURE(f.check_cells());
}

TEST(prefix_tiers, write_policies) {
    const auto a = seq_of({1, 1, 1, 1, 2, 2, 2, 2, 3});
    for (const tier_write w : {tier_write::through, tier_write::never}) {
        auto t = std::make_shared<test_store>();
        engine e(tier_params({t}, w));
        ASSERT_TRUE(e.decode(0, a));
        e.c.prefix_cache()->prefix_publish();
        EXPECT_EQ(t->values.size(), w == tier_write::through ? 2u : 0u);  // written when published
        e.c.seq_rm(0, -1, -1);
        e.seqs[0].clear();
        ASSERT_NO_FATAL_FAILURE(decode_and_end(e, 1, filler()));
        // through: the churn's blocks too, each once; never: nothing
        EXPECT_EQ(t->values.size(), w == tier_write::through ? 2u + 8u : 0u);
        EXPECT_EQ(e.c.prefix_cache()->get_tier_stats()[0].written_blocks,
                  w == tier_write::through ? 10u : 0u);
    }
    // fetch off: the tier is never asked
    auto t = std::make_shared<test_store>();
    kv_cache_params p = tier_params({t});
    p.prefix.tiers.fetch = false;
    engine e(p);
    ASSERT_NO_FATAL_FAILURE(decode_then_evict(e, a));
    EXPECT_EQ(e.attach(0, a), 0u);
    EXPECT_EQ(t->st.calls, 1u);  // the eviction's put only
}

// The cost model: a store slower than computing the tokens it would return is not asked, except for one
// probe every probe_every attaches; a store faster than computing them is always asked.
TEST(prefix_tiers, a_store_slower_than_prefill_is_not_asked) {
    const auto a = seq_of({1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4});
    auto slow = std::make_shared<test_store>();
    slow->delay_us = 3000;  // 3 ms a call; the 12 tokens cost 12 x 100 ns to compute
    kv_cache_params p = tier_params({slow});
    p.prefix.tiers.prefill_ns_per_token = 100;
    p.prefix.tiers.probe_every = 3;
    engine e(p);
    ASSERT_NO_FATAL_FAILURE(decode_then_evict(e, a));
    for (int i = 0; i < 7; ++i) {  // asked at the first (no estimate yet), then every third
        EXPECT_EQ(e.c.prefix_cache()->prefix_attach(0, a), i == 0 || i == 3 || i == 6 ? 12u : 0u) << i;
        e.c.seq_rm(0, -1, -1);
        e.c.clear(false);
    }
    prefix_tier_stats s = e.c.prefix_cache()->get_tier_stats()[0];
    EXPECT_EQ(s.fetches, 3u);
    EXPECT_EQ(s.declined, 4u);
    EXPECT_GT(s.est_latency_ns + s.est_ns_per_byte * 1000, 1e6);
    // computing is slow (1 ms a token): the same store is worth asking every time
    auto t = std::make_shared<test_store>(*slow);
    p = tier_params({t});
    p.prefix.tiers.prefill_ns_per_token = 1e6;
    engine f(p);
    for (int i = 0; i < 4; ++i) {
        EXPECT_EQ(f.c.prefix_cache()->prefix_attach(0, a), 12u) << i;
        f.c.seq_rm(0, -1, -1);
        f.c.clear(false);
    }
    EXPECT_EQ(f.c.prefix_cache()->get_tier_stats()[0].declined, 0u);
}

// A store that throws, or returns damaged values, is a miss: attaches and evictions go on, the cache
// stays consistent, and the failures are counted.
TEST(prefix_tiers, failing_and_damaged_stores_are_misses) {
    const auto a = seq_of({1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4});
    auto t = std::make_shared<test_store>();
    engine e(tier_params({t}));
    t->fail = true;
    ASSERT_NO_FATAL_FAILURE(decode_then_evict(e, a));  // the writes failed
    EXPECT_EQ(e.attach(0, a), 0u);
    ASSERT_TRUE(e.decode(0, a));  // the engine computes it
    ASSERT_NO_FATAL_FAILURE(e.check(0));
    prefix_tier_stats s = e.c.prefix_cache()->get_tier_stats()[0];
    EXPECT_EQ(s.errors, 3u);  // writes when the filler evicted a and a evicted the filler; the attach's read
    EXPECT_EQ(s.written_blocks, 0u);
    ASSERT_NO_FATAL_FAILURE(e.check_cells());
    // now it answers, with damaged values: refused, the chain ends, nothing attached
    t->fail = false;
    e.c.prefix_cache()->prefix_publish();
    e.c.seq_rm(0, -1, -1);
    e.seqs[0].clear();
    ASSERT_NO_FATAL_FAILURE(decode_and_end(e, 1, filler()));  // a's blocks are written now
    t->garbage = true;
    EXPECT_EQ(e.attach(0, a), 0u);
    EXPECT_EQ(e.c.prefix_cache()->get_tier_stats()[0].refused_blocks, 1u);
    ASSERT_NO_FATAL_FAILURE(e.check_cells());
    // and whole again: a hit
    t->garbage = false;
    EXPECT_EQ(e.attach(0, a), 12u);
    ASSERT_NO_FATAL_FAILURE(e.check(0));
    ASSERT_NO_FATAL_FAILURE(e.check_cells());
}

// A store whose writes wait until the test opens it (at most 10 s: then it says it timed out).
class gated_store final : public block_store_i {
public:
    size_t read_many(std::span<const std::string> keys, const block_value_fn& on_value) override {
        const std::lock_guard lock(m_);
        size_t n = 0;
        for (size_t i = 0; i < keys.size(); ++i)
            if (auto it = values_.find(keys[i]); it != values_.end()) {
                on_value(i, it->second);
                ++n;
            }
        return n;
    }
    void put_many(std::span<const block_put> items) override {
        std::unique_lock lock(m_);
        if (!cv_.wait_for(lock, std::chrono::seconds(10), [this] { return open_; })) timed_out_ = true;
        for (const block_put& b : items) values_[std::string(b.key)].assign(b.value.begin(), b.value.end());
    }
    std::vector<uint8_t> contains_many(std::span<const std::string> keys) override {
        return std::vector<uint8_t>(keys.size(), 0);
    }
    block_store_stats stats() const override { return {}; }
    std::string describe() const override { return "gated"; }
    void open() {
        {
            const std::lock_guard lock(m_);
            open_ = true;
        }
        cv_.notify_all();
    }
    size_t size() const {
        const std::lock_guard lock(m_);
        return values_.size();
    }
    bool timed_out() const {
        const std::lock_guard lock(m_);
        return timed_out_;
    }

private:
    mutable std::mutex m_;
    std::condition_variable cv_;
    bool open_ = false, timed_out_ = false;
    std::map<std::string, std::vector<uint8_t>> values_;
};

// async_writes: a step that evicts returns while its writes wait in the store; they land later, and a
// queue too small for a record drops it (counted, and the block is not marked stored).
TEST(prefix_tiers, async_writes_never_hold_up_a_step) {
    const auto a = seq_of({1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4});
    auto gate = std::make_shared<gated_store>();
    kv_cache_params p = tier_params({gate});
    p.prefix.tiers.async_writes = true;
    {
        engine e(p);
        ASSERT_NO_FATAL_FAILURE(decode_then_evict(e, a));  // returns with the write still held at the gate
        EXPECT_EQ(gate->size(), 0u);
        EXPECT_EQ(e.c.prefix_cache()->get_tier_stats()[0].written_blocks, 0u);
        gate->open();
        e.c.prefix_cache()->prefix_tier_drain();
        EXPECT_EQ(gate->size(), 3u);
        EXPECT_EQ(e.c.prefix_cache()->get_tier_stats()[0].written_blocks, 3u);
        EXPECT_EQ(e.c.prefix_cache()->get_prefix_stats().tier_written_blocks, 3u);
        EXPECT_FALSE(gate->timed_out()) << "the step waited for the store";
        engine f(p);
        EXPECT_EQ(f.attach(0, a), 12u);
        ASSERT_NO_FATAL_FAILURE(f.check(0));
    }
    auto t = std::make_shared<test_store>();
    p = tier_params({t});
    p.prefix.tiers.async_writes = true;
    p.prefix.tiers.max_queued_bytes = 100;  // less than one record
    engine e(p);
    ASSERT_NO_FATAL_FAILURE(decode_then_evict(e, a));
    e.c.prefix_cache()->prefix_tier_drain();
    EXPECT_TRUE(t->values.empty());
    EXPECT_EQ(e.c.prefix_cache()->get_tier_stats()[0].dropped_blocks, 3u);
    EXPECT_EQ(e.c.prefix_cache()->get_tier_stats()[0].written_blocks, 0u);
}

TEST(prefix_tiers, parameters_are_checked) {
    const auto refused = [](const kv_cache_params& p, const std::string& what) {
        try {
            kv_cache c(p);
            ADD_FAILURE() << "accepted: " << what;
        } catch (const error& x) {
            EXPECT_NE(std::string(x.what()).find(what), std::string::npos) << x.what();
        }
    };
    auto t = std::make_shared<test_store>();
    refused(tier_params({t, t, t, t}), "at most 3 tiers, not 4");
    refused(tier_params({t, nullptr}), "no store (null)");
    kv_cache_params p = tier_params({t});
    p.prefix.tiers.write = static_cast<tier_write>(9);
    refused(p, "write policy 9 unknown");
    p = tier_params({t});
    p.prefix.tiers.prefill_ns_per_token = -1;
    refused(p, "prefill_ns_per_token -1 must be in [0, 1e12]");
    p = tier_params({t});
    p.prefix.tiers.async_writes = true;
    p.prefix.tiers.max_queued_bytes = 0;
    refused(p, "async_writes needs max_queued_bytes > 0");
    p = tier_params({t});
    p.n_swa = 8;
    p.swa = swa_type::standard;
    refused(p, "not supported with a sliding window");
}

}  // namespace
}  // namespace kvc
