// The prefix cache of kv_cache: bad input, eviction order, and a property test in which every K row is
// the fingerprint of the tokens that produced it, so any hit can be checked against what it must hold
// (prefix_cache_test_util.h). The tiers below it: test_prefix_tiers.cpp.
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <xxhash.h>
#include <kvcache/disk_store.h>
#include <kvcache/kv_cache.h>
#include <kvcache/state.h>

#include "prefix_cache_test_util.h"

namespace kvc {
namespace {

using namespace prefix_test;

TEST(prefix_cache, bad_configurations_and_calls_are_errors_that_change_nothing) {
    auto p = prefix_params(64, 2);
    p.n_pos = 4;
    EXPECT_THROW(kv_cache{p}, error);
    p = prefix_params(64, 2);
    p.prefix.block_size = 0;
    EXPECT_THROW(kv_cache{p}, error);
    p = prefix_params(64, 2);
    p.swa = swa_type::symmetric;  // a window both ways: no boundary has a past of its own
    p.n_swa = 4;
    EXPECT_THROW(kv_cache{p}, error);
    p.swa = swa_type::standard;
    p.n_swa = 0;
    EXPECT_THROW(kv_cache{p}, error);
    p.n_swa = 4;
    EXPECT_NO_THROW(kv_cache{p});
    p = prefix_params(64, 2);
    p.prefix.policy = static_cast<evict_policy>(3);
    try {
        kv_cache c(p);
        ADD_FAILURE() << "a policy past adaptive was accepted";
    } catch (const error& x) {
        EXPECT_NE(std::string(x.what()).find("prefix policy 3 unknown"), std::string::npos) << x.what();
    }

    engine e(64, 2);
    const auto prompt = seq_of({1, 2, 3, 4, 5, 6, 7, 8, 9});
    ASSERT_TRUE(e.decode(0, prompt));
    EXPECT_THROW(e.c.prefix_cache()->prefix_attach(2, prompt), error);  // no such sequence
    EXPECT_THROW(e.c.prefix_cache()->prefix_attach(0, prompt), error);  // not empty
    try {
        e.c.prefix_cache()->prefix_attach(0, prompt);
    } catch (const error& x) {
        EXPECT_NE(std::string(x.what()).find("seq 0 is not empty"), std::string::npos) << x.what();
    }
    EXPECT_EQ(e.c.seq_pos_max(0), 8);
    auto q = prefix_params(64, 1);
    q.prefix.enabled = false;
    kv_cache plain(q);
    EXPECT_EQ(plain.prefix_cache(), nullptr);  // a cache made without one has none
}

TEST(prefix_cache, blocks_publish_at_the_next_step_and_lookup_changes_nothing) {
    engine e(64, 2);
    const auto prompt = seq_of({1, 2, 3, 4, 5, 6, 7, 8, 9, 10});
    // the step's context, applied and written, but not moved past: the engine has not computed it yet
    memory_context_ptr ctx = e.start(0, prompt);
    ASSERT_NE(ctx, nullptr);
    prefix_cache_i& pc = *e.c.prefix_cache();
    EXPECT_EQ(pc.get_prefix_stats().blocks, 0u);  // not before the engine computed them
    const std::string before = e.c.cells(0).picture();
    EXPECT_EQ(pc.prefix_lookup(prompt), 0u);  // a lookup publishes nothing
    EXPECT_EQ(pc.get_prefix_stats().blocks, 0u);
    EXPECT_FALSE(ctx->next());  // the engine moves past the last ubatch: the two full blocks go in
    EXPECT_EQ(pc.get_prefix_stats().blocks, 2u);
    EXPECT_EQ(pc.prefix_lookup(prompt), 8u);
    EXPECT_EQ(e.c.cells(0).picture(), before);
    EXPECT_EQ(e.c.prefix_cache()->prefix_lookup(seq_of({1, 2, 3, 4, 5, 6, 7, 9})),
              4u);  // the second block differs
    EXPECT_EQ(e.c.prefix_cache()->prefix_lookup(seq_of({1, 2, 3, 4, 5, 6, 7, 8})),
              7u);  // whole: one token short
    EXPECT_EQ(e.c.prefix_cache()->prefix_lookup(seq_of({2, 2, 3, 4})), 0u);
    EXPECT_EQ(e.c.prefix_cache()->prefix_lookup({}), 0u);
    EXPECT_EQ(e.attach(1, seq_of({1, 2, 3, 4, 5, 6, 7, 8, 20})), 8u);
    e.check(1);
    EXPECT_EQ(e.c.prefix_cache()->get_prefix_stats().shared_cells, 8u);
}

// A step the engine moved past (next() after its last ubatch) is published as it ends, so a sequence
// removed right after it leaves its blocks cached (a prefill-only request). A step it did not finish (a
// failed compute: no next()) loses its blocks with the cells seq_rm takes: counted, logged once.
TEST(prefix_cache, a_finished_step_is_published_before_the_sequence_goes) {
    static std::vector<std::string> logged;
    logged.clear();
    set_log_callback([](log_level, const char* m, void*) { logged.emplace_back(m); });
    engine e(64, 2);
    const auto prompt = seq_of({1, 2, 3, 4, 5, 6, 7, 8, 9});
    auto ctx = e.c.init_ubatches({tokens_ub(0, 0, prompt)}, {});
    ASSERT_EQ(ctx->get_status(), memory_status::success);
    ctx->apply();
    EXPECT_FALSE(ctx->next());  // the engine computed the last ubatch
    EXPECT_EQ(e.c.prefix_cache()->get_prefix_stats().blocks, 2u);
    e.c.seq_rm(0, -1, -1);
    EXPECT_EQ(e.c.prefix_cache()->prefix_lookup(prompt), 8u);
    EXPECT_EQ(e.c.prefix_cache()->get_prefix_stats().dropped_blocks, 0u);
    EXPECT_TRUE(logged.empty());
    for (int round = 1; round <= 2; ++round) {  // steps that failed: applied, never finished
        const auto other = seq_of({20, 21, 22, 23, 24, 25, 26, 27, 28});
        ctx = e.c.init_ubatches({tokens_ub(1, 0, other)}, {});
        ASSERT_EQ(ctx->get_status(), memory_status::success);
        ctx->apply();
        e.c.seq_rm(1, -1, -1);
        EXPECT_EQ(e.c.prefix_cache()->prefix_lookup(other), 0u);
        EXPECT_EQ(e.c.prefix_cache()->get_prefix_stats().dropped_blocks, 2u * static_cast<uint64_t>(round));
    }
    ASSERT_EQ(logged.size(), 1u);
    EXPECT_NE(logged[0].find("seq_rm of seq 1 dropped 2 completed block(s)"), std::string::npos) << logged[0];
    set_log_callback(nullptr);
    e.check_cells();
}

TEST(prefix_cache, keys_separate_namespaces) {
    engine e(64, 3);
    const auto prompt = seq_of({1, 2, 3, 4, 5, 6, 7, 8, 9});
    ASSERT_EQ(e.c.prefix_cache()->prefix_attach(0, prompt, 7), 0u);
    ASSERT_TRUE(e.decode(0, prompt));
    e.c.prefix_cache()->prefix_publish();
    EXPECT_EQ(e.c.prefix_cache()->prefix_lookup(prompt, 7), 8u);
    EXPECT_EQ(e.c.prefix_cache()->prefix_lookup(prompt, 0), 0u);
    EXPECT_EQ(e.c.prefix_cache()->prefix_lookup(prompt, 8), 0u);
}

TEST(prefix_cache, eviction_takes_the_least_recently_released_deepest_first) {
    engine e(32, 2);  // 8 blocks of 4
    const auto a = seq_of({1, 1, 1, 1, 2, 2, 2, 2, 3});
    const auto b = seq_of({5, 5, 5, 5, 6, 6, 6, 6, 7});
    ASSERT_TRUE(e.decode(0, a));
    ASSERT_TRUE(e.decode(1, b));
    e.c.prefix_cache()->prefix_publish();
    e.c.seq_rm(0, -1, -1);  // a released first: its blocks go first, the deeper one before its root
    e.c.seq_rm(1, -1, -1);
    e.seqs[0].clear();
    e.seqs[1].clear();
    EXPECT_EQ(e.c.prefix_cache()->get_prefix_stats().cached_cells, 16u);
    // 20 new tokens need 4 of the 16 cached cells: a's second block
    ASSERT_TRUE(e.decode(0, std::vector<token_t>(20, 9)));
    EXPECT_EQ(e.c.prefix_cache()->get_prefix_stats().evicted_blocks, 1u);
    EXPECT_EQ(e.c.prefix_cache()->prefix_lookup(a), 4u);
    EXPECT_EQ(e.c.prefix_cache()->prefix_lookup(b), 8u);
    // 8 more: a's root, then b's second block
    ASSERT_TRUE(e.decode(0, std::vector<token_t>(8, 9)));
    EXPECT_EQ(e.c.prefix_cache()->prefix_lookup(a), 0u);
    EXPECT_EQ(e.c.prefix_cache()->prefix_lookup(b), 4u);
    e.check_cells();
    // more than free + evictable: refused, nothing evicted
    const prefix_stats before = e.c.prefix_cache()->get_prefix_stats();
    EXPECT_FALSE(e.decode(1, std::vector<token_t>(8, 4)));
    EXPECT_EQ(e.c.prefix_cache()->get_prefix_stats().evicted_blocks, before.evicted_blocks);
    EXPECT_EQ(e.c.prefix_cache()->prefix_lookup(b), 4u);
}

TEST(prefix_cache, a_whole_state_saves_the_sequences_not_the_cached_cells) {
    engine e(64, 2);
    ASSERT_TRUE(e.decode(0, seq_of({1, 2, 3, 4, 5, 6, 7, 8, 9})));
    ASSERT_TRUE(e.decode(1, seq_of({1, 2, 3, 4, 7})));
    e.c.prefix_cache()->prefix_publish();
    e.c.seq_rm(0, -1, -1);
    e.seqs[0].clear();
    ASSERT_GT(e.c.prefix_cache()->get_prefix_stats().cached_cells, 0u);
    const auto saved = state_seq_get_data(e.c, seq_all);
    state_seq_set_data(e.c, saved, seq_all);
    e.check(1);
    e.check_cells();  // no cell without a sequence came back
    EXPECT_EQ(e.c.cells(0).get_used(), 5u);
    EXPECT_EQ(e.c.prefix_cache()->get_prefix_stats().blocks, 0u);  // a whole restore empties the index
    EXPECT_EQ(e.c.prefix_cache()->prefix_lookup(seq_of({1, 2, 3, 4, 5})), 0u);
}

TEST(prefix_cache, a_hit_refreshes_a_block) {
    engine e(24, 2);  // 6 blocks
    const auto a = seq_of({1, 1, 1, 1, 0});
    const auto b = seq_of({2, 2, 2, 2, 0});
    ASSERT_TRUE(e.decode(0, a));
    ASSERT_TRUE(e.decode(1, b));
    e.c.seq_rm(0, -1, -1);
    e.c.seq_rm(1, -1, -1);
    e.seqs[0].clear();
    e.seqs[1].clear();
    // a is attached and let go again: now b is older
    ASSERT_EQ(e.attach(0, a), 4u);
    e.c.seq_rm(0, -1, -1);
    e.seqs[0].clear();
    ASSERT_TRUE(e.decode(0, std::vector<token_t>(20, 9)));  // needs one block
    EXPECT_EQ(e.c.prefix_cache()->prefix_lookup(a), 4u);
    EXPECT_EQ(e.c.prefix_cache()->prefix_lookup(b), 0u);
}

TEST(prefix_cache, tokens_outside_the_vocabulary_and_bad_sizes_are_errors) {
    auto p = prefix_params(64, 2);
    p.prefix.block_size = 5;  // does not divide 64
    try {
        kv_cache c{p};
        FAIL() << "block_size 5 accepted";
    } catch (const error& x) {
        EXPECT_NE(std::string(x.what()).find("block_size 5 must divide kv_size 64"), std::string::npos)
            << x.what();
    }
    p = prefix_params(64, 2);
    p.prefix.max_pinned_fraction = 1.5f;
    EXPECT_THROW(kv_cache{p}, error);
    p = prefix_params(64, 2);
    p.prefix.n_vocab = 10;
    kv_cache c(p);
    const auto bad = seq_of({1, 2, 10, 4});
    try {
        c.prefix_cache()->prefix_attach(0, bad);
        FAIL() << "token 10 accepted";
    } catch (const error& x) {
        EXPECT_NE(std::string(x.what()).find("token[2] = 10 not in [0, 10)"), std::string::npos) << x.what();
    }
    EXPECT_THROW(c.prefix_cache()->prefix_lookup(seq_of({-1})), error);
    EXPECT_THROW(c.prefix_cache()->prefix_pin(bad), error);
    EXPECT_THROW(c.prefix_cache()->prefix_attach(0, seq_of({1}), 0, 101), error);
    EXPECT_EQ(c.prefix_cache()->get_prefix_stats().lookups, 0u);  // nothing was counted
}

// Fills a cache with new tokens in one sequence until it has used `n` cells, then ends it.
void churn(engine& e, seq_id_t s, uint32_t n) {
    ASSERT_TRUE(e.decode(s, std::vector<token_t>(n, 9)));
    e.c.seq_rm(s, -1, -1);
    e.seqs[static_cast<size_t>(s)].clear();
}

// Blocks through a store (docs/tiers.md): fetched blocks hold the rows that were stored (every K row a
// fingerprint of its tokens), make room by evicting cached blocks of lower standing, and never evict the
// block they extend, even when it is the first to go by priority.
TEST(prefix_cache, fetched_blocks_make_room_but_keep_their_chain) {
    const auto dir = std::filesystem::temp_directory_path() / fmt::format("kvc-prefix-tier-{}", ::getpid());
    std::filesystem::remove_all(dir);
    disk_store_params dp;
    dp.dir = dir.string();
    disk_block_store store(dp);
    engine e(32, 2);  // 8 blocks of 4
    const auto a = seq_of({1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3});
    ASSERT_TRUE(e.decode(0, a));
    EXPECT_EQ(e.c.prefix_cache()->prefix_store_blocks(store, 1, a), 3u);
    e.c.seq_rm(0, -1, -1);
    e.seqs[0].clear();
    e.c.clear(false);
    // a's first block, cached (priority 50); then 24 cells of b at priority 90: 4 cells free
    ASSERT_TRUE(e.decode(1, std::span(a).first(4)));
    e.c.prefix_cache()->prefix_publish();
    e.c.seq_rm(1, -1, -1);
    e.seqs[1].clear();
    const auto b = seq_of({7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7});
    ASSERT_EQ(e.c.prefix_cache()->prefix_attach(0, b, 0, 90), 0u);
    ASSERT_TRUE(e.decode(0, b));
    e.c.prefix_cache()->prefix_publish();
    e.c.seq_rm(0, -1, -1);
    e.seqs[0].clear();
    ASSERT_EQ(e.c.prefix_cache()->get_prefix_stats().free_cells, 4u);
    // the second block fits; the third needs room: the second (priority 50, the lowest) is what it extends,
    // so b's deepest block goes instead
    auto q = a;
    q.push_back(4);
    EXPECT_EQ(e.c.prefix_cache()->prefix_fetch_blocks(store, 1, q), 12u);
    const prefix_stats st = e.c.prefix_cache()->get_prefix_stats();
    EXPECT_EQ(st.evicted_blocks, 1u);
    EXPECT_EQ(e.c.prefix_cache()->prefix_lookup(b, 0), 20u);
    EXPECT_EQ(e.attach(1, q), 12u);
    ASSERT_NO_FATAL_FAILURE(e.check(1));  // the rows that a's decode wrote
    ASSERT_NO_FATAL_FAILURE(e.check_cells());
    // another model id is another layout: nothing
    e.c.seq_rm(1, -1, -1);
    e.seqs[1].clear();
    e.c.clear(false);
    EXPECT_EQ(e.c.prefix_cache()->prefix_fetch_blocks(store, 2, q), 0u);
    EXPECT_EQ(e.c.prefix_cache()->prefix_fetch_blocks(store, 1, q), 12u);
    std::filesystem::remove_all(dir);
}

TEST(prefix_cache, pinned_prefixes_survive_and_pins_are_bounded) {
    engine e(32, 2);  // 8 blocks of 4; pins may hold 16 cells
    const auto a = seq_of({1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4});
    ASSERT_TRUE(e.decode(0, a));
    e.c.prefix_cache()->prefix_publish();
    e.c.seq_rm(0, -1, -1);
    e.seqs[0].clear();
    EXPECT_EQ(e.c.prefix_cache()->prefix_pin(a), 12u);  // three whole blocks
    EXPECT_EQ(e.c.prefix_cache()->get_prefix_stats().pinned_cells, 12u);
    ASSERT_NO_FATAL_FAILURE(churn(e, 1, 20));  // every other cell: the pinned blocks stay
    EXPECT_EQ(e.c.prefix_cache()->prefix_lookup(a), 12u);
    EXPECT_FALSE(e.decode(1, std::vector<token_t>(21, 9)));  // 20 free, the pinned 12 are not evictable
    // a second pin of 8 more cells would pin 20 > 16: refused, nothing pinned
    const auto b = seq_of({5, 5, 5, 5, 6, 6, 6, 6, 7});
    ASSERT_TRUE(e.decode(0, b));
    e.c.prefix_cache()->prefix_publish();
    try {
        e.c.prefix_cache()->prefix_pin(b);
        FAIL() << "pin beyond the limit accepted";
    } catch (const error& x) {
        EXPECT_NE(std::string(x.what()).find("would pin 20 of 32 cells; the limit is 16"), std::string::npos)
            << x.what();
    }
    EXPECT_EQ(e.c.prefix_cache()->get_prefix_stats().pinned_cells, 12u);
    e.c.seq_rm(0, -1, -1);
    e.seqs[0].clear();
    // pins nest; the last unpin makes the blocks evictable again
    EXPECT_EQ(e.c.prefix_cache()->prefix_pin(a), 12u);
    EXPECT_EQ(e.c.prefix_cache()->prefix_unpin(a), 12u);
    ASSERT_NO_FATAL_FAILURE(churn(e, 1, 20));  // still pinned once: b's cached blocks go
    EXPECT_EQ(e.c.prefix_cache()->prefix_lookup(a), 12u);
    EXPECT_EQ(e.c.prefix_cache()->prefix_unpin(a), 12u);
    EXPECT_EQ(e.c.prefix_cache()->prefix_unpin(a), 0u);
    ASSERT_NO_FATAL_FAILURE(churn(e, 1, 32));
    EXPECT_EQ(e.c.prefix_cache()->prefix_lookup(a), 0u);
    e.check_cells();
}

TEST(prefix_cache, a_holder_that_shifts_copies_the_cells_of_a_pinned_block) {
    engine e(32, 2);
    const auto a = seq_of({1, 1, 1, 1, 2});
    ASSERT_TRUE(e.decode(0, a));
    e.c.prefix_cache()->prefix_publish();
    ASSERT_EQ(e.c.prefix_cache()->prefix_pin(a), 4u);
    e.c.seq_add(0, 0, -1, 3);  // the only holder moves: the pinned block keeps its cells
    EXPECT_EQ(e.c.prefix_cache()->get_prefix_stats().unpublished_blocks, 0u);
    EXPECT_GT(e.c.prefix_cache()->get_prefix_stats().bytes_copied, 0u);
    e.c.seq_rm(0, -1, -1);
    e.seqs[0].clear();
    ASSERT_EQ(e.attach(1, a), 4u);
    e.check(1);
}

TEST(prefix_cache, lower_priorities_are_evicted_first) {
    engine e(32, 3);
    const auto low = seq_of({1, 1, 1, 1, 0});
    const auto high = seq_of({2, 2, 2, 2, 0});
    ASSERT_EQ(e.c.prefix_cache()->prefix_attach(0, high, 0, 90), 0u);
    ASSERT_TRUE(e.decode(0, high));
    e.c.prefix_cache()->prefix_publish();
    e.c.seq_rm(0, -1, -1);  // released first, but worth more
    e.seqs[0].clear();
    ASSERT_EQ(e.c.prefix_cache()->prefix_attach(1, low, 0, 10), 0u);
    ASSERT_TRUE(e.decode(1, low));
    e.c.prefix_cache()->prefix_publish();
    e.c.seq_rm(1, -1, -1);
    e.seqs[1].clear();
    ASSERT_NO_FATAL_FAILURE(churn(e, 2, 28));  // needs one of the two blocks
    EXPECT_EQ(e.c.prefix_cache()->prefix_lookup(high), 4u);
    EXPECT_EQ(e.c.prefix_cache()->prefix_lookup(low), 0u);
    // set_priority lowers it: now it goes first
    EXPECT_EQ(e.c.prefix_cache()->prefix_set_priority(high, 0, 0), 4u);
    ASSERT_TRUE(e.decode(1, std::vector<token_t>(4, 8)));  // a new block of priority 50 is published
    e.c.prefix_cache()->prefix_publish();
    e.c.seq_rm(1, -1, -1);
    e.seqs[1].clear();
    ASSERT_NO_FATAL_FAILURE(churn(e, 2, 32));
    EXPECT_EQ(e.c.prefix_cache()->prefix_lookup(high), 0u);
}

TEST(prefix_cache, slru_keeps_a_shared_prompt_through_a_burst_of_one_off_prompts) {
    for (evict_policy policy : {evict_policy::lru, evict_policy::slru}) {
        auto p = prefix_params(32, 2);
        p.prefix.policy = policy;
        engine e(p);
        const auto sys = seq_of({1, 1, 1, 1, 2, 2, 2, 2, 0});
        ASSERT_TRUE(e.decode(0, sys));
        e.c.prefix_cache()->prefix_publish();
        e.c.seq_rm(0, -1, -1);
        e.seqs[0].clear();
        ASSERT_EQ(e.attach(0, sys), 8u);  // a hit
        e.c.seq_rm(0, -1, -1);
        e.seqs[0].clear();
        for (token_t t = 3; t < 13; ++t) {  // one-off prompts of one block each: 12 blocks for 8
            ASSERT_TRUE(e.decode(1, std::vector<token_t>(4, t)));
            e.c.prefix_cache()->prefix_publish();
            e.c.seq_rm(1, -1, -1);
            e.seqs[1].clear();
        }
        const uint32_t want = policy == evict_policy::slru ? 8 : 0;
        EXPECT_EQ(e.c.prefix_cache()->prefix_lookup(sys), want) << "policy " << static_cast<int>(policy);
    }
}

TEST(prefix_cache, adaptive_protects_a_prompt_published_again_after_its_eviction) {
    // a prompt evicted by a burst and then sent again (a miss: recomputed and published) is protected under
    // the adaptive policy, whose ghosts remember it, and survives the next burst; SLRU and LRU lose it
    for (evict_policy policy : {evict_policy::lru, evict_policy::slru, evict_policy::adaptive}) {
        auto p = prefix_params(32, 2);
        p.prefix.policy = policy;
        engine e(p);
        const auto conv = seq_of({1, 1, 1, 1, 2, 2, 2, 2, 0});
        const auto burst = [&](token_t from) {  // one-off prompts of one block each: 10 blocks for 8
            for (token_t t = from; t < from + 10; ++t) {
                ASSERT_TRUE(e.decode(1, std::vector<token_t>(4, t)));
                e.c.prefix_cache()->prefix_publish();
                e.c.seq_rm(1, -1, -1);
                e.seqs[1].clear();
            }
        };
        for (int round = 0; round < 2; ++round) {
            ASSERT_TRUE(e.decode(0, conv));
            e.c.prefix_cache()->prefix_publish();
            e.c.seq_rm(0, -1, -1);
            e.seqs[0].clear();
            ASSERT_NO_FATAL_FAILURE(burst(static_cast<token_t>(3 + 10 * round)));
            if (round == 0) {
                ASSERT_EQ(e.c.prefix_cache()->prefix_lookup(conv), 0u) << "the burst must evict it";
            }
        }
        const uint32_t want = policy == evict_policy::adaptive ? 8 : 0;
        EXPECT_EQ(e.c.prefix_cache()->prefix_lookup(conv), want) << "policy " << static_cast<int>(policy);
    }
}

TEST(prefix_cache, embeddings_are_published_only_under_a_key_naming_their_content) {
    // a prompt of 4 text tokens and 8 image positions (placeholder ids 7), the image fed as embeddings
    const auto prompt = seq_of({1, 2, 3, 4, 7, 7, 7, 7, 7, 7, 7, 7, 5});
    for (uint64_t key : {0ull, 0x1234ull}) {  // 0x1234: the engine's hash of the image
        engine e(64, 2);
        ASSERT_EQ(e.c.prefix_cache()->prefix_attach(0, prompt, key), 0u);
        ASSERT_TRUE(e.decode(0, std::span(prompt).first(4)));
        ASSERT_TRUE(e.decode(0, std::span(prompt).subspan(4, 8), /*as_embd=*/true));
        ASSERT_TRUE(e.decode(0, std::span(prompt).subspan(12)));
        e.c.prefix_cache()->prefix_publish();
        e.c.seq_rm(0, -1, -1);
        e.seqs[0].clear();
        // without a key only the text block before the image is published
        EXPECT_EQ(e.c.prefix_cache()->get_prefix_stats().blocks, key ? 3u : 1u);
        EXPECT_EQ(e.c.prefix_cache()->prefix_lookup(prompt, key), key ? 12u : 4u);
        if (key) {
            EXPECT_EQ(e.c.prefix_cache()->prefix_lookup(prompt, 0), 0u);  // another image: another key
            ASSERT_EQ(e.attach(1, prompt), 0u);
            e.c.seq_rm(1, -1, -1);
            e.seqs[1].clear();
            ASSERT_EQ(e.c.prefix_cache()->prefix_attach(1, prompt, key), 12u);
            e.seqs[1].assign(prompt.begin(), prompt.begin() + 12);
            e.check(1);
        }
    }
}

TEST(prefix_cache, events_let_a_router_mirror_the_index) {
    std::map<uint64_t, std::pair<uint64_t, std::vector<token_t>>> mirror;  // hash -> (parent hash, tokens)
    uint32_t cleared = 0;
    auto p = prefix_params(32, 2);
    p.prefix.on_event = [&](const prefix_event& ev) {
        switch (ev.type) {
            case prefix_event::kind::stored:
                ASSERT_TRUE(mirror
                                .emplace(ev.hash, std::pair(ev.parent_hash,
                                                            std::vector(ev.tokens.begin(), ev.tokens.end())))
                                .second);
                break;
            case prefix_event::kind::removed:
                ASSERT_EQ(mirror.erase(ev.hash), 1u);
                break;
            case prefix_event::kind::cleared:
                mirror.clear();
                ++cleared;
                break;
        }
    };
    engine e(p);
    const auto a = seq_of({1, 1, 1, 1, 2, 2, 2, 2, 0});
    ASSERT_EQ(e.c.prefix_cache()->prefix_attach(0, a, 42), 0u);
    ASSERT_TRUE(e.decode(0, a));
    e.c.prefix_cache()->prefix_publish();
    ASSERT_EQ(mirror.size(), 2u);
    // a router computes the chain of a prompt itself: XXH3-64 of each block seeded by the previous hash
    const uint64_t h0 = XXH3_64bits_withSeed(a.data(), 4 * sizeof(token_t), 42);
    const uint64_t h1 = XXH3_64bits_withSeed(a.data() + 4, 4 * sizeof(token_t), h0);
    ASSERT_TRUE(mirror.count(h0) && mirror.count(h1));
    EXPECT_EQ(mirror[h0].first, 42u);
    EXPECT_EQ(mirror[h1].first, h0);
    EXPECT_EQ(mirror[h1].second, seq_of({2, 2, 2, 2}));
    e.c.seq_rm(0, -1, -1);
    e.seqs[0].clear();
    ASSERT_NO_FATAL_FAILURE(churn(e, 1, 28));  // evicts the deeper block
    EXPECT_FALSE(mirror.count(h1));
    EXPECT_TRUE(mirror.count(h0));
    EXPECT_EQ(mirror.size(), e.c.prefix_cache()->get_prefix_stats().blocks);
    e.c.clear(false);
    EXPECT_EQ(cleared, 1u);
    EXPECT_TRUE(mirror.empty());
    // a listener that throws is counted, and the cache goes on
    e.c.seq_rm(-1, -1, -1);
    auto q = prefix_params(32, 1);
    q.prefix.on_event = [](const prefix_event&) { throw std::runtime_error("listener"); };
    engine f(q);
    ASSERT_TRUE(f.decode(0, a));
    f.c.prefix_cache()->prefix_publish();
    EXPECT_EQ(f.c.prefix_cache()->get_prefix_stats().event_errors, 2u);
    EXPECT_EQ(f.c.prefix_cache()->get_prefix_stats().blocks, 2u);
}

bool shares_plain_cells(const kv_cache& c, seq_id_t s) {
    const kv_cells& cells = c.cells(c.params().unified ? 0 : static_cast<uint32_t>(s));
    for (const auto& [pos, cell] : cells.seq_entries(s, -1, -1))
        if (cells.seq_count(cell) > 1 && !cells.is_held(cell)) return true;
    return false;
}

// Random attaches (at random priorities), decodes, removals, rollbacks, shifts, copies, pins and clears
// against the fingerprints: never a wrong hit, never a leaked cell, every hit a prefix some sequence
// decoded (the "may hit" oracle), every pinned prefix still whole.
// With a window (n_swa 6), cells out of every window may go, each hit must bring the whole window
// before it, and pins are refused.
void random_ops(evict_policy policy, uint32_t seed, bool unified = true, swa_type swa = swa_type::none) {
    const char* env = std::getenv("KVC_LONG_TESTS");
    const int n_ops = env && *env ? 1000000 : 30000;
    std::mt19937 rng(seed);
    auto params = prefix_params(unified ? 96 : 48, 4);  // 4 streams of 48 cells, or one of 96
    params.prefix.policy = policy;
    params.unified = unified;
    params.swa = swa;
    params.n_swa = swa == swa_type::none ? 0 : 6;
    engine e(params);
    // what a query at n can see (the window's first position), and the last position at least
    const auto window_from = [&](uint32_t n) -> uint32_t {
        const uint32_t w = params.n_swa;
        const uint32_t first = swa == swa_type::standard  ? (n >= w ? n - w + 1 : 0)
                               : swa == swa_type::chunked ? n / w * w
                                                          : 0;
        return std::min(first, n - 1);
    };
    std::set<std::vector<token_t>> may_hit;  // block-aligned prefixes decoded since the index last emptied
    const auto decoded = [&](seq_id_t s) {
        const auto& h = e.seqs[static_cast<size_t>(s)];
        for (size_t n = bs; n <= h.size(); n += bs)
            may_hit.emplace(h.begin(), h.begin() + static_cast<ptrdiff_t>(n));
    };
    std::vector<std::vector<uint32_t>> pins(4);  // per system prompt: the tokens each of its pins covered
    uint64_t n_pinned = 0;
    std::vector<std::vector<token_t>> systems;
    for (int k = 0; k < 4; ++k) {
        std::vector<token_t> s(4 + rng() % 12);
        for (auto& t : s) t = static_cast<token_t>(rng() % 3);
        systems.push_back(s);
    }
    uint64_t hits = 0;
    for (int op = 0; op < n_ops; ++op) {
        const auto s = static_cast<seq_id_t>(rng() % 4);
        auto& h = e.seqs[static_cast<size_t>(s)];
        const int what = static_cast<int>(rng() % 100);
        if (h.empty() && what < 60) {  // a new request: a system prompt and a question
            std::vector<token_t> prompt = systems[rng() % systems.size()];
            for (uint32_t i = rng() % 8; i > 0; --i) prompt.push_back(static_cast<token_t>(rng() % 3));
            const uint32_t n =
                e.c.prefix_cache()->prefix_attach(s, prompt, 0, static_cast<uint8_t>(rng() % 101));
            h.assign(prompt.begin(), prompt.begin() + n);
            const size_t covered = (n + bs - 1) / bs * bs;  // the whole blocks the hit came from
            ASSERT_TRUE(n == 0 ||
                        may_hit.count({prompt.begin(), prompt.begin() + static_cast<ptrdiff_t>(covered)}))
                << "a hit of " << n << " tokens no sequence decoded";
            hits += n;
            ASSERT_NO_FATAL_FAILURE(e.check(s));
            if (n > 0) {  // every position a query at n can see is there
                const kv_cells& cells = e.c.cells(e.stream(s));
                const uint32_t from = window_from(n);
                ASSERT_EQ(cells.seq_entries(s, static_cast<pos_t>(from), static_cast<pos_t>(n)).size(),
                          n - from)
                    << "a hit of " << n << " tokens without its window";
            }
            if (!e.decode(s, std::span(prompt).subspan(n))) {
                e.c.seq_rm(s, -1, -1);
                h.clear();
            }
            decoded(s);
        } else if (what < 75 && !h.empty()) {  // a step
            const token_t t = static_cast<token_t>(rng() % 3);
            e.decode(s, std::span(&t, 1));
            decoded(s);
        } else if (what < 83) {  // the request ends
            e.c.seq_rm(s, -1, -1);
            h.clear();
        } else if (what < 88 && h.size() > 2) {  // rollback of a suffix
            const size_t keep = 1 + rng() % (h.size() - 1);
            e.c.seq_rm(s, static_cast<pos_t>(keep), -1);
            h.resize(keep);
            if (e.c.seq_pos_max(s) != static_cast<pos_t>(keep) - 1) {  // the window slid past it: start over
                ASSERT_NE(swa, swa_type::none);
                e.c.seq_rm(s, -1, -1);
                h.clear();
            }
        } else if (what < 91 && h.size() > 6 && !shares_plain_cells(e.c, s)) {
            // a context shift: cells it shares through the prefix cache are copied for it, so the others
            // keep theirs (cells shared by seq_cp move for all, as in llama.cpp: not this test's model)
            try {
                e.c.seq_rm(s, 1, 3);
                e.c.seq_add(s, 3, -1, -2);
            } catch (const error&) {}
            e.c.seq_rm(s, -1, -1);  // the fingerprint model cannot follow a shift: end the request
            h.clear();
        } else if (what < 95) {  // a copy into an empty sequence (parallel sampling)
            const auto d = static_cast<seq_id_t>(rng() % 4);
            if (d != s && e.seqs[static_cast<size_t>(d)].empty() && !h.empty()) {
                try {
                    e.c.seq_cp(s, d, -1, -1);
                    e.seqs[static_cast<size_t>(d)] = h;
                } catch (const error&) {  // across streams: no room in d's (pins), nothing changed
                    ASSERT_FALSE(unified);
                    ASSERT_EQ(e.c.seq_pos_max(d), -1);
                }
            }
        } else if (what < 96) {
            if (rng() % 2) {
                e.c.clear(/*data=*/false);
                for (auto& q : e.seqs) q.clear();
            } else {  // the whole memory through a state buffer: sequences stay, the index empties
                state_seq_set_data(e.c, state_seq_get_data(e.c, seq_all), seq_all);
            }
            may_hit.clear();
            for (auto& p : pins) p.clear();
        } else if (what < 97) {  // one sequence through a state buffer into an empty one
            const auto d = static_cast<seq_id_t>(rng() % 4);
            if (d != s && e.seqs[static_cast<size_t>(d)].empty() && !h.empty()) {
                try {
                    state_seq_set_data(e.c, state_seq_get_data(e.c, s), d);
                    e.seqs[static_cast<size_t>(d)] = h;
                } catch (const error&) {  // no room: nothing changed
                }
            }
        } else if (what < 99 && rng() % 3 != 0) {  // pin or unpin a system prompt
            const size_t k = rng() % systems.size();
            if (swa != swa_type::none) {
                EXPECT_THROW(e.c.prefix_cache()->prefix_pin(systems[k]), error);
                continue;
            }
            if (rng() % 2) {
                try {
                    const uint32_t n = e.c.prefix_cache()->prefix_pin(systems[k]);
                    if (n > 0) pins[k].push_back(n);
                    n_pinned += n > 0;
                } catch (const error&) {  // over the limit: nothing pinned
                }
            } else if (!pins[k].empty()) {
                const auto top = std::max_element(pins[k].begin(), pins[k].end());
                ASSERT_EQ(e.c.prefix_cache()->prefix_unpin(systems[k]), *top);
                pins[k].erase(top);
            }
        } else {  // only a lookup, verified by attaching to a free sequence
            std::vector<token_t> prompt = systems[rng() % systems.size()];
            const uint32_t n = e.c.prefix_cache()->prefix_lookup(prompt);
            for (seq_id_t f = 0; f < 4; ++f)
                if (e.seqs[static_cast<size_t>(f)].empty()) {
                    // with a stream per sequence, pins may leave too little room for the copies
                    const uint32_t got = e.attach(f, prompt);
                    if (unified) {
                        ASSERT_EQ(got, n);
                    } else {
                        ASSERT_LE(got, n);
                    }
                    ASSERT_NO_FATAL_FAILURE(e.check(f));
                    break;
                }
        }
        for (seq_id_t q = 0; q < 4; ++q)
            ASSERT_NO_FATAL_FAILURE(e.check(q)) << "op " << op << " kind " << what << " seq " << s
                                                << " cells " << e.c.cells(e.stream(q)).picture();
        ASSERT_NO_FATAL_FAILURE(e.check_cells()) << "op " << op;
        for (size_t k = 0; k < systems.size(); ++k) {
            if (pins[k].empty()) continue;
            const uint32_t want = std::min<uint32_t>(*std::max_element(pins[k].begin(), pins[k].end()),
                                                     static_cast<uint32_t>(systems[k].size() - 1));
            ASSERT_GE(e.c.prefix_cache()->prefix_lookup(systems[k]), want)
                << "op " << op << ": pinned prefix " << k << " lost";
        }
    }
    EXPECT_GT(hits, uint64_t(n_ops) / 10) << "the test must exercise hits";
    const prefix_stats st = e.c.prefix_cache()->get_prefix_stats();
    EXPECT_GT(st.evicted_blocks, 0u);
    if (swa == swa_type::none) {
        EXPECT_GT(n_pinned, uint64_t(n_ops) / 500) << "the test must pin";
    }
    ::testing::Test::RecordProperty("hit_tokens", static_cast<int>(hits));
}

TEST(prefix_cache_property, lru_hits_always_hold_the_tokens_they_claim) {
    random_ops(evict_policy::lru, 2024);
}

TEST(prefix_cache_property, slru_hits_always_hold_the_tokens_they_claim) {
    random_ops(evict_policy::slru, 2025);
}

TEST(prefix_cache_property, adaptive_hits_always_hold_the_tokens_they_claim) {
    random_ops(evict_policy::adaptive, 2030);
    random_ops(evict_policy::adaptive, 2031, /*unified=*/false, swa_type::chunked);
}

TEST(prefix_cache_property, streams_per_sequence_hits_always_hold_the_tokens_they_claim) {
    random_ops(evict_policy::lru, 2026, /*unified=*/false);
}

TEST(prefix_cache_property, window_hits_hold_their_tokens_and_their_whole_window) {
    random_ops(evict_policy::lru, 2027, /*unified=*/true, swa_type::standard);
    random_ops(evict_policy::slru, 2028, /*unified=*/true, swa_type::chunked);
    random_ops(evict_policy::lru, 2029, /*unified=*/false, swa_type::standard);
}

}  // namespace
}  // namespace kvc
