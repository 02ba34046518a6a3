// The prefix cache of kv_cache: bad input, eviction order, and a property test in which every K row is
// the fingerprint of the tokens that produced it, so any hit can be checked against what it must hold.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>
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

namespace kvc {
namespace {

constexpr uint32_t bs = 4;

kv_cache_params prefix_params(uint32_t kv_size, uint32_t n_seq_max) {
    kv_cache_params p;
    // no RoPE: a K-shift leaves rows as they are, so fingerprints survive it
    p.layers = {layer_desc{.n_head_kv = 1,
                           .n_embd_head_k = 4,
                           .n_embd_head_v = 4,
                           .rope = rope_params{.type = rope_type::none}}};
    p.type_k = p.type_v = dtype::f32;
    p.v_trans = false;
    p.kv_size = kv_size;
    p.n_seq_max = n_seq_max;
    p.n_kv_pad = 1;
    p.prefix = {.enabled = true, .block_size = bs};
    return p;
}

// 63 bits of the tokens [0, n) as three exact floats (21 bits each) and the position.
std::array<float, 4> fingerprint(const std::vector<token_t>& toks, size_t n) {
    const uint64_t h = XXH3_64bits(toks.data(), n * sizeof(token_t));
    return {static_cast<float>(n - 1), static_cast<float>(h & 0x1fffff),
            static_cast<float>((h >> 21) & 0x1fffff), static_cast<float>((h >> 42) & 0x1fffff)};
}

ubatch tokens_ub(seq_id_t s, pos_t p0, std::span<const token_t> toks) {
    ubatch u;
    u.n_tokens = static_cast<uint32_t>(toks.size());
    u.n_seq_tokens = 1;
    u.n_seqs = u.n_tokens;
    u.n_seqs_unq = 1;
    u.seq_id_unq = {s};
    u.seq_id_begin.push_back(0);
    for (size_t i = 0; i < toks.size(); ++i) {
        u.token.push_back(toks[i]);
        u.pos.push_back(p0 + static_cast<pos_t>(i));
        u.n_seq_id.push_back(1);
        u.seq_id_data.push_back(s);
        u.seq_id_begin.push_back(static_cast<uint32_t>(i + 1));
        u.output.push_back(0);
        u.batch_idx.push_back(static_cast<int32_t>(i));
    }
    return u;
}

// An engine whose "model" writes each token's fingerprint as its K and V rows.
struct engine {
    kv_cache c;
    std::vector<std::vector<token_t>> seqs;  // what each sequence has decoded (positions 0..)

    engine(uint32_t kv_size, uint32_t n_seq_max) : engine(prefix_params(kv_size, n_seq_max)) {}
    explicit engine(const kv_cache_params& p) : c(p), seqs(p.n_seq_max) {}

    // Decodes toks after what s holds; false (nothing changed) when they do not fit. With as_embd, the
    // ubatch carries embeddings (the engine's image or audio features) instead of the token ids.
    bool decode(seq_id_t s, std::span<const token_t> toks, bool as_embd = false) {
        auto& h = seqs[static_cast<size_t>(s)];
        const auto p0 = static_cast<pos_t>(h.size());
        ubatch ub = tokens_ub(s, p0, toks);
        if (as_embd) {
            ub.n_embd = 2;
            ub.embd.assign(size_t{ub.n_tokens} * 2, 0.5f);
            ub.token.clear();
        }
        auto ctx = c.init_ubatches({ub}, {});
        if (ctx->get_status() != memory_status::success) return false;
        ctx->apply();
        std::vector<float> rows;
        for (token_t t : toks) {
            h.push_back(t);
            const auto f = fingerprint(h, h.size());
            rows.insert(rows.end(), f.begin(), f.end());
        }
        const auto view = const_tensor_view::contiguous(
            dtype::f32, reinterpret_cast<const std::byte*>(rows.data()), 4, toks.size());
        ctx->get_attn(0)->cpy_k(0, view);
        ctx->get_attn(0)->cpy_v(0, view);
        return true;
    }
    uint32_t attach(seq_id_t s, const std::vector<token_t>& prompt) {
        const uint32_t n = c.prefix_attach(s, prompt);
        seqs[static_cast<size_t>(s)].assign(prompt.begin(), prompt.begin() + n);
        return n;
    }
    uint32_t stream(seq_id_t s) const { return c.params().unified ? 0 : static_cast<uint32_t>(s); }
    // Every cell of s holds the fingerprint of s's tokens up to its position.
    void check(seq_id_t s) const {
        const auto& h = seqs[static_cast<size_t>(s)];
        const kv_cells& cells = c.cells(stream(s));
        ASSERT_EQ(cells.seq_pos_max(s), static_cast<pos_t>(h.size()) - 1) << "seq " << s;
        std::vector<float> k(4);
        for (const auto& [pos, cell] : cells.seq_entries(s, -1, -1)) {
            c.read_k_row(0, stream(s), cell, k);
            const auto f = fingerprint(h, static_cast<size_t>(pos) + 1);
            ASSERT_TRUE(std::equal(k.begin(), k.end(), f.begin()))
                << "seq " << s << " position " << pos << " cell " << cell << " holds position " << k[0];
        }
    }
    // Cells are free, held by sequences, or cached; a cell no sequence holds is cached or empty.
    void check_cells() const {
        uint32_t with_seqs = 0, cached = 0, total = 0;
        for (uint32_t s = 0; s < c.get_n_stream(); ++s) {
            const kv_cells& cells = c.cells(s);
            cells.validate();
            total += cells.size();
            for (uint32_t i = 0; i < cells.size(); ++i) {
                if (cells.is_empty(i)) continue;
                if (cells.seq_count(i) > 0)
                    ++with_seqs;
                else
                    ASSERT_TRUE(cells.is_held(i))
                        << "stream " << s << " cell " << i << " leaked: used, no sequence, not cached";
                cached += cells.seq_count(i) == 0;
            }
        }
        const prefix_stats st = c.get_prefix_stats();
        ASSERT_EQ(st.cached_cells, cached);
        ASSERT_EQ(st.free_cells + with_seqs + cached, total);
    }
};

std::vector<token_t> seq_of(std::initializer_list<token_t> t) {
    return t;
}

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
    EXPECT_THROW(e.c.prefix_attach(2, prompt), error);  // no such sequence
    EXPECT_THROW(e.c.prefix_attach(0, prompt), error);  // not empty
    try {
        e.c.prefix_attach(0, prompt);
    } catch (const error& x) {
        EXPECT_NE(std::string(x.what()).find("seq 0 is not empty"), std::string::npos) << x.what();
    }
    EXPECT_EQ(e.c.seq_pos_max(0), 8);
    auto q = prefix_params(64, 1);
    q.prefix.enabled = false;
    kv_cache plain(q);
    EXPECT_THROW(plain.prefix_lookup(prompt), error);
    EXPECT_EQ(plain.get_prefix_stats().blocks, 0u);
}

TEST(prefix_cache, blocks_publish_at_the_next_step_and_lookup_changes_nothing) {
    engine e(64, 2);
    const auto prompt = seq_of({1, 2, 3, 4, 5, 6, 7, 8, 9, 10});
    ASSERT_TRUE(e.decode(0, prompt));
    EXPECT_EQ(e.c.get_prefix_stats().blocks, 0u);  // not before the engine computed them
    const std::string before = e.c.cells(0).picture();
    EXPECT_EQ(e.c.prefix_lookup(prompt), 8u);  // publishes the two full blocks, then looks up
    EXPECT_EQ(e.c.get_prefix_stats().blocks, 2u);
    EXPECT_EQ(e.c.cells(0).picture(), before);
    EXPECT_EQ(e.c.prefix_lookup(seq_of({1, 2, 3, 4, 5, 6, 7, 9})), 4u);  // the second block differs
    EXPECT_EQ(e.c.prefix_lookup(seq_of({1, 2, 3, 4, 5, 6, 7, 8})), 7u);  // whole: one token short
    EXPECT_EQ(e.c.prefix_lookup(seq_of({2, 2, 3, 4})), 0u);
    EXPECT_EQ(e.c.prefix_lookup({}), 0u);
    EXPECT_EQ(e.attach(1, seq_of({1, 2, 3, 4, 5, 6, 7, 8, 20})), 8u);
    e.check(1);
    EXPECT_EQ(e.c.get_prefix_stats().shared_cells, 8u);
}

TEST(prefix_cache, keys_separate_namespaces) {
    engine e(64, 3);
    const auto prompt = seq_of({1, 2, 3, 4, 5, 6, 7, 8, 9});
    ASSERT_EQ(e.c.prefix_attach(0, prompt, 7), 0u);
    ASSERT_TRUE(e.decode(0, prompt));
    e.c.prefix_publish();
    EXPECT_EQ(e.c.prefix_lookup(prompt, 7), 8u);
    EXPECT_EQ(e.c.prefix_lookup(prompt, 0), 0u);
    EXPECT_EQ(e.c.prefix_lookup(prompt, 8), 0u);
}

TEST(prefix_cache, eviction_takes_the_least_recently_released_deepest_first) {
    engine e(32, 2);  // 8 blocks of 4
    const auto a = seq_of({1, 1, 1, 1, 2, 2, 2, 2, 3});
    const auto b = seq_of({5, 5, 5, 5, 6, 6, 6, 6, 7});
    ASSERT_TRUE(e.decode(0, a));
    ASSERT_TRUE(e.decode(1, b));
    e.c.prefix_publish();
    e.c.seq_rm(0, -1, -1);  // a released first: its blocks go first, the deeper one before its root
    e.c.seq_rm(1, -1, -1);
    e.seqs[0].clear();
    e.seqs[1].clear();
    EXPECT_EQ(e.c.get_prefix_stats().cached_cells, 16u);
    // 20 new tokens need 4 of the 16 cached cells: a's second block
    ASSERT_TRUE(e.decode(0, std::vector<token_t>(20, 9)));
    EXPECT_EQ(e.c.get_prefix_stats().evicted_blocks, 1u);
    EXPECT_EQ(e.c.prefix_lookup(a), 4u);
    EXPECT_EQ(e.c.prefix_lookup(b), 8u);
    // 8 more: a's root, then b's second block
    ASSERT_TRUE(e.decode(0, std::vector<token_t>(8, 9)));
    EXPECT_EQ(e.c.prefix_lookup(a), 0u);
    EXPECT_EQ(e.c.prefix_lookup(b), 4u);
    e.check_cells();
    // more than free + evictable: refused, nothing evicted
    const prefix_stats before = e.c.get_prefix_stats();
    EXPECT_FALSE(e.decode(1, std::vector<token_t>(8, 4)));
    EXPECT_EQ(e.c.get_prefix_stats().evicted_blocks, before.evicted_blocks);
    EXPECT_EQ(e.c.prefix_lookup(b), 4u);
}

TEST(prefix_cache, a_whole_state_saves_the_sequences_not_the_cached_cells) {
    engine e(64, 2);
    ASSERT_TRUE(e.decode(0, seq_of({1, 2, 3, 4, 5, 6, 7, 8, 9})));
    ASSERT_TRUE(e.decode(1, seq_of({1, 2, 3, 4, 7})));
    e.c.prefix_publish();
    e.c.seq_rm(0, -1, -1);
    e.seqs[0].clear();
    ASSERT_GT(e.c.get_prefix_stats().cached_cells, 0u);
    const auto saved = state_seq_get_data(e.c, seq_all);
    state_seq_set_data(e.c, saved, seq_all);
    e.check(1);
    e.check_cells();  // no cell without a sequence came back
    EXPECT_EQ(e.c.cells(0).get_used(), 5u);
    EXPECT_EQ(e.c.get_prefix_stats().blocks, 0u);  // a whole restore empties the index
    EXPECT_EQ(e.c.prefix_lookup(seq_of({1, 2, 3, 4, 5})), 0u);
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
    EXPECT_EQ(e.c.prefix_lookup(a), 4u);
    EXPECT_EQ(e.c.prefix_lookup(b), 0u);
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
        c.prefix_attach(0, bad);
        FAIL() << "token 10 accepted";
    } catch (const error& x) {
        EXPECT_NE(std::string(x.what()).find("token[2] = 10 not in [0, 10)"), std::string::npos) << x.what();
    }
    EXPECT_THROW(c.prefix_lookup(seq_of({-1})), error);
    EXPECT_THROW(c.prefix_pin(bad), error);
    EXPECT_THROW(c.prefix_attach(0, seq_of({1}), 0, 101), error);
    EXPECT_EQ(c.get_prefix_stats().lookups, 0u);  // nothing was counted
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
    EXPECT_EQ(e.c.prefix_store_blocks(store, 1, a), 3u);
    e.c.seq_rm(0, -1, -1);
    e.seqs[0].clear();
    e.c.clear(false);
    // a's first block, cached (priority 50); then 24 cells of b at priority 90: 4 cells free
    ASSERT_TRUE(e.decode(1, std::span(a).first(4)));
    e.c.prefix_publish();
    e.c.seq_rm(1, -1, -1);
    e.seqs[1].clear();
    const auto b = seq_of({7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7});
    ASSERT_EQ(e.c.prefix_attach(0, b, 0, 90), 0u);
    ASSERT_TRUE(e.decode(0, b));
    e.c.prefix_publish();
    e.c.seq_rm(0, -1, -1);
    e.seqs[0].clear();
    ASSERT_EQ(e.c.get_prefix_stats().free_cells, 4u);
    // the second block fits; the third needs room: the second (priority 50, the lowest) is what it extends,
    // so b's deepest block goes instead
    auto q = a;
    q.push_back(4);
    EXPECT_EQ(e.c.prefix_fetch_blocks(store, 1, q), 12u);
    const prefix_stats st = e.c.get_prefix_stats();
    EXPECT_EQ(st.evicted_blocks, 1u);
    EXPECT_EQ(e.c.prefix_lookup(b, 0), 20u);
    EXPECT_EQ(e.attach(1, q), 12u);
    ASSERT_NO_FATAL_FAILURE(e.check(1));  // the rows that a's decode wrote
    ASSERT_NO_FATAL_FAILURE(e.check_cells());
    // another model id is another layout: nothing
    e.c.seq_rm(1, -1, -1);
    e.seqs[1].clear();
    e.c.clear(false);
    EXPECT_EQ(e.c.prefix_fetch_blocks(store, 2, q), 0u);
    EXPECT_EQ(e.c.prefix_fetch_blocks(store, 1, q), 12u);
    std::filesystem::remove_all(dir);
}

TEST(prefix_cache, pinned_prefixes_survive_and_pins_are_bounded) {
    engine e(32, 2);  // 8 blocks of 4; pins may hold 16 cells
    const auto a = seq_of({1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4});
    ASSERT_TRUE(e.decode(0, a));
    e.c.prefix_publish();
    e.c.seq_rm(0, -1, -1);
    e.seqs[0].clear();
    EXPECT_EQ(e.c.prefix_pin(a), 12u);  // three whole blocks
    EXPECT_EQ(e.c.get_prefix_stats().pinned_cells, 12u);
    ASSERT_NO_FATAL_FAILURE(churn(e, 1, 20));  // every other cell: the pinned blocks stay
    EXPECT_EQ(e.c.prefix_lookup(a), 12u);
    EXPECT_FALSE(e.decode(1, std::vector<token_t>(21, 9)));  // 20 free, the pinned 12 are not evictable
    // a second pin of 8 more cells would pin 20 > 16: refused, nothing pinned
    const auto b = seq_of({5, 5, 5, 5, 6, 6, 6, 6, 7});
    ASSERT_TRUE(e.decode(0, b));
    e.c.prefix_publish();
    try {
        e.c.prefix_pin(b);
        FAIL() << "pin beyond the limit accepted";
    } catch (const error& x) {
        EXPECT_NE(std::string(x.what()).find("would pin 20 of 32 cells; the limit is 16"), std::string::npos)
            << x.what();
    }
    EXPECT_EQ(e.c.get_prefix_stats().pinned_cells, 12u);
    e.c.seq_rm(0, -1, -1);
    e.seqs[0].clear();
    // pins nest; the last unpin makes the blocks evictable again
    EXPECT_EQ(e.c.prefix_pin(a), 12u);
    EXPECT_EQ(e.c.prefix_unpin(a), 12u);
    ASSERT_NO_FATAL_FAILURE(churn(e, 1, 20));  // still pinned once: b's cached blocks go
    EXPECT_EQ(e.c.prefix_lookup(a), 12u);
    EXPECT_EQ(e.c.prefix_unpin(a), 12u);
    EXPECT_EQ(e.c.prefix_unpin(a), 0u);
    ASSERT_NO_FATAL_FAILURE(churn(e, 1, 32));
    EXPECT_EQ(e.c.prefix_lookup(a), 0u);
    e.check_cells();
}

TEST(prefix_cache, a_holder_that_shifts_copies_the_cells_of_a_pinned_block) {
    engine e(32, 2);
    const auto a = seq_of({1, 1, 1, 1, 2});
    ASSERT_TRUE(e.decode(0, a));
    e.c.prefix_publish();
    ASSERT_EQ(e.c.prefix_pin(a), 4u);
    e.c.seq_add(0, 0, -1, 3);  // the only holder moves: the pinned block keeps its cells
    EXPECT_EQ(e.c.get_prefix_stats().unpublished_blocks, 0u);
    EXPECT_GT(e.c.get_prefix_stats().bytes_copied, 0u);
    e.c.seq_rm(0, -1, -1);
    e.seqs[0].clear();
    ASSERT_EQ(e.attach(1, a), 4u);
    e.check(1);
}

TEST(prefix_cache, lower_priorities_are_evicted_first) {
    engine e(32, 3);
    const auto low = seq_of({1, 1, 1, 1, 0});
    const auto high = seq_of({2, 2, 2, 2, 0});
    ASSERT_EQ(e.c.prefix_attach(0, high, 0, 90), 0u);
    ASSERT_TRUE(e.decode(0, high));
    e.c.prefix_publish();
    e.c.seq_rm(0, -1, -1);  // released first, but worth more
    e.seqs[0].clear();
    ASSERT_EQ(e.c.prefix_attach(1, low, 0, 10), 0u);
    ASSERT_TRUE(e.decode(1, low));
    e.c.prefix_publish();
    e.c.seq_rm(1, -1, -1);
    e.seqs[1].clear();
    ASSERT_NO_FATAL_FAILURE(churn(e, 2, 28));  // needs one of the two blocks
    EXPECT_EQ(e.c.prefix_lookup(high), 4u);
    EXPECT_EQ(e.c.prefix_lookup(low), 0u);
    // set_priority lowers it: now it goes first
    EXPECT_EQ(e.c.prefix_set_priority(high, 0, 0), 4u);
    ASSERT_TRUE(e.decode(1, std::vector<token_t>(4, 8)));  // a new block of priority 50 is published
    e.c.prefix_publish();
    e.c.seq_rm(1, -1, -1);
    e.seqs[1].clear();
    ASSERT_NO_FATAL_FAILURE(churn(e, 2, 32));
    EXPECT_EQ(e.c.prefix_lookup(high), 0u);
}

TEST(prefix_cache, slru_keeps_a_shared_prompt_through_a_burst_of_one_off_prompts) {
    for (evict_policy policy : {evict_policy::lru, evict_policy::slru}) {
        auto p = prefix_params(32, 2);
        p.prefix.policy = policy;
        engine e(p);
        const auto sys = seq_of({1, 1, 1, 1, 2, 2, 2, 2, 0});
        ASSERT_TRUE(e.decode(0, sys));
        e.c.prefix_publish();
        e.c.seq_rm(0, -1, -1);
        e.seqs[0].clear();
        ASSERT_EQ(e.attach(0, sys), 8u);  // a hit
        e.c.seq_rm(0, -1, -1);
        e.seqs[0].clear();
        for (token_t t = 3; t < 13; ++t) {  // one-off prompts of one block each: 12 blocks for 8
            ASSERT_TRUE(e.decode(1, std::vector<token_t>(4, t)));
            e.c.prefix_publish();
            e.c.seq_rm(1, -1, -1);
            e.seqs[1].clear();
        }
        const uint32_t want = policy == evict_policy::slru ? 8 : 0;
        EXPECT_EQ(e.c.prefix_lookup(sys), want) << "policy " << static_cast<int>(policy);
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
                e.c.prefix_publish();
                e.c.seq_rm(1, -1, -1);
                e.seqs[1].clear();
            }
        };
        for (int round = 0; round < 2; ++round) {
            ASSERT_TRUE(e.decode(0, conv));
            e.c.prefix_publish();
            e.c.seq_rm(0, -1, -1);
            e.seqs[0].clear();
            ASSERT_NO_FATAL_FAILURE(burst(static_cast<token_t>(3 + 10 * round)));
            if (round == 0) {
                ASSERT_EQ(e.c.prefix_lookup(conv), 0u) << "the burst must evict it";
            }
        }
        const uint32_t want = policy == evict_policy::adaptive ? 8 : 0;
        EXPECT_EQ(e.c.prefix_lookup(conv), want) << "policy " << static_cast<int>(policy);
    }
}

TEST(prefix_cache, embeddings_are_published_only_under_a_key_naming_their_content) {
    // a prompt of 4 text tokens and 8 image positions (placeholder ids 7), the image fed as embeddings
    const auto prompt = seq_of({1, 2, 3, 4, 7, 7, 7, 7, 7, 7, 7, 7, 5});
    for (uint64_t key : {0ull, 0x1234ull}) {  // 0x1234: the engine's hash of the image
        engine e(64, 2);
        ASSERT_EQ(e.c.prefix_attach(0, prompt, key), 0u);
        ASSERT_TRUE(e.decode(0, std::span(prompt).first(4)));
        ASSERT_TRUE(e.decode(0, std::span(prompt).subspan(4, 8), /*as_embd=*/true));
        ASSERT_TRUE(e.decode(0, std::span(prompt).subspan(12)));
        e.c.prefix_publish();
        e.c.seq_rm(0, -1, -1);
        e.seqs[0].clear();
        // without a key only the text block before the image is published
        EXPECT_EQ(e.c.get_prefix_stats().blocks, key ? 3u : 1u);
        EXPECT_EQ(e.c.prefix_lookup(prompt, key), key ? 12u : 4u);
        if (key) {
            EXPECT_EQ(e.c.prefix_lookup(prompt, 0), 0u);  // another image: another key
            ASSERT_EQ(e.attach(1, prompt), 0u);
            e.c.seq_rm(1, -1, -1);
            e.seqs[1].clear();
            ASSERT_EQ(e.c.prefix_attach(1, prompt, key), 12u);
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
    ASSERT_EQ(e.c.prefix_attach(0, a, 42), 0u);
    ASSERT_TRUE(e.decode(0, a));
    e.c.prefix_publish();
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
    EXPECT_EQ(mirror.size(), 1u);
    EXPECT_TRUE(mirror.count(h0));
    EXPECT_EQ(mirror.size(), e.c.get_prefix_stats().blocks);
    e.c.clear(false);
    EXPECT_EQ(cleared, 1u);
    EXPECT_TRUE(mirror.empty());
    // a listener that throws is counted, and the cache goes on
    e.c.seq_rm(-1, -1, -1);
    auto q = prefix_params(32, 1);
    q.prefix.on_event = [](const prefix_event&) { throw std::runtime_error("listener"); };
    engine f(q);
    ASSERT_TRUE(f.decode(0, a));
    f.c.prefix_publish();
    EXPECT_EQ(f.c.get_prefix_stats().event_errors, 2u);
    EXPECT_EQ(f.c.get_prefix_stats().blocks, 2u);
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
            const uint32_t n = e.c.prefix_attach(s, prompt, 0, static_cast<uint8_t>(rng() % 101));
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
                EXPECT_THROW(e.c.prefix_pin(systems[k]), error);
                continue;
            }
            if (rng() % 2) {
                try {
                    const uint32_t n = e.c.prefix_pin(systems[k]);
                    if (n > 0) pins[k].push_back(n);
                    n_pinned += n > 0;
                } catch (const error&) {  // over the limit: nothing pinned
                }
            } else if (!pins[k].empty()) {
                const auto top = std::max_element(pins[k].begin(), pins[k].end());
                ASSERT_EQ(e.c.prefix_unpin(systems[k]), *top);
                pins[k].erase(top);
            }
        } else {  // only a lookup, verified by attaching to a free sequence
            std::vector<token_t> prompt = systems[rng() % systems.size()];
            const uint32_t n = e.c.prefix_lookup(prompt);
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
            ASSERT_GE(e.c.prefix_lookup(systems[k]), want)
                << "op " << op << ": pinned prefix " << k << " lost";
        }
    }
    EXPECT_GT(hits, uint64_t(n_ops) / 10) << "the test must exercise hits";
    const prefix_stats st = e.c.get_prefix_stats();
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
    e.c.prefix_publish();
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
    ASSERT_EQ(e.c.prefix_lookup(a), 0u);
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
        EXPECT_EQ(e.c.get_prefix_stats().tier_written_blocks, 3u);
    }
    engine e(tier_params({t0, t1}));
    EXPECT_EQ(e.attach(0, a), 12u);  // t0 misses, t1 has the chain
    ASSERT_NO_FATAL_FAILURE(e.check(0));
    std::vector<prefix_tier_stats> ts = e.c.get_tier_stats();
    EXPECT_EQ(ts[0].fetches, 1u);
    EXPECT_EQ(ts[0].fetched_blocks, 0u);
    EXPECT_EQ(ts[1].fetched_blocks, 3u);
    EXPECT_EQ(e.c.get_prefix_stats().tier_fetched_blocks, 3u);
    e.c.seq_rm(0, -1, -1);
    e.seqs[0].clear();
    ASSERT_NO_FATAL_FAILURE(decode_and_end(e, 1, filler()));
    ts = e.c.get_tier_stats();
    EXPECT_EQ(ts[0].written_blocks, 3u);  // a's blocks left memory again: to t0 only, they came from t1
    EXPECT_EQ(ts[1].written_blocks, 0u);
    // a third cache finds a in t0 and does not ask t1
    engine f(tier_params({t0, t1}));
    EXPECT_EQ(f.attach(0, a), 12u);
    ASSERT_NO_FATAL_FAILURE(f.check(0));
    ts = f.c.get_tier_stats();
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
        e.c.prefix_publish();
        EXPECT_EQ(t->values.size(), w == tier_write::through ? 2u : 0u);  // written when published
        e.c.seq_rm(0, -1, -1);
        e.seqs[0].clear();
        ASSERT_NO_FATAL_FAILURE(decode_and_end(e, 1, filler()));
        // through: the churn's blocks too, each once; never: nothing
        EXPECT_EQ(t->values.size(), w == tier_write::through ? 2u + 8u : 0u);
        EXPECT_EQ(e.c.get_tier_stats()[0].written_blocks, w == tier_write::through ? 10u : 0u);
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
        EXPECT_EQ(e.c.prefix_attach(0, a), i == 0 || i == 3 || i == 6 ? 12u : 0u) << i;
        e.c.seq_rm(0, -1, -1);
        e.c.clear(false);
    }
    prefix_tier_stats s = e.c.get_tier_stats()[0];
    EXPECT_EQ(s.fetches, 3u);
    EXPECT_EQ(s.declined, 4u);
    EXPECT_GT(s.est_latency_ns + s.est_ns_per_byte * 1000, 1e6);
    // computing is slow (1 ms a token): the same store is worth asking every time
    auto t = std::make_shared<test_store>(*slow);
    p = tier_params({t});
    p.prefix.tiers.prefill_ns_per_token = 1e6;
    engine f(p);
    for (int i = 0; i < 4; ++i) {
        EXPECT_EQ(f.c.prefix_attach(0, a), 12u) << i;
        f.c.seq_rm(0, -1, -1);
        f.c.clear(false);
    }
    EXPECT_EQ(f.c.get_tier_stats()[0].declined, 0u);
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
    prefix_tier_stats s = e.c.get_tier_stats()[0];
    EXPECT_EQ(s.errors, 3u);  // writes when the filler evicted a and a evicted the filler; the attach's read
    EXPECT_EQ(s.written_blocks, 0u);
    ASSERT_NO_FATAL_FAILURE(e.check_cells());
    // now it answers, with damaged values: refused, the chain ends, nothing attached
    t->fail = false;
    e.c.prefix_publish();
    e.c.seq_rm(0, -1, -1);
    e.seqs[0].clear();
    ASSERT_NO_FATAL_FAILURE(decode_and_end(e, 1, filler()));  // a's blocks are written now
    t->garbage = true;
    EXPECT_EQ(e.attach(0, a), 0u);
    EXPECT_EQ(e.c.get_tier_stats()[0].refused_blocks, 1u);
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
        EXPECT_EQ(e.c.get_tier_stats()[0].written_blocks, 0u);
        gate->open();
        e.c.prefix_tier_drain();
        EXPECT_EQ(gate->size(), 3u);
        EXPECT_EQ(e.c.get_tier_stats()[0].written_blocks, 3u);
        EXPECT_EQ(e.c.get_prefix_stats().tier_written_blocks, 3u);
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
    e.c.prefix_tier_drain();
    EXPECT_TRUE(t->values.empty());
    EXPECT_EQ(e.c.get_tier_stats()[0].dropped_blocks, 3u);
    EXPECT_EQ(e.c.get_tier_stats()[0].written_blocks, 0u);
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
