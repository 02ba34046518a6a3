#include <algorithm>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <kvcache/batch.h>
#include <kvcache/memory.h>

namespace kvc {
namespace {

// A memory that only answers position queries, from a table.
class fake_memory final : public memory_i {
public:
    fake_memory() { set_shape({.n_seq_max = 1, .n_pos = 1, .n_layer = 0}); }
    std::map<seq_id_t, std::pair<pos_t, pos_t>> ranges;  // seq -> [min, max]

    memory_context_ptr init_batch(batch_allocr&, uint32_t, bool) override { return nullptr; }
    memory_context_ptr init_ubatches(std::vector<ubatch>, std::vector<int32_t>) override { return nullptr; }
    memory_context_ptr init_full() override { return nullptr; }
    memory_context_ptr init_update(bool) override { return nullptr; }
    bool get_can_shift() const override { return true; }
    void clear(bool) override { ranges.clear(); }
    bool seq_rm(seq_id_t, pos_t, pos_t) override { return true; }
    void seq_cp(seq_id_t, seq_id_t, pos_t, pos_t) override {}
    void seq_keep(seq_id_t) override {}
    void seq_add(seq_id_t, pos_t, pos_t, pos_t) override {}
    void seq_div(seq_id_t, pos_t, pos_t, int) override {}
    pos_t seq_pos_min(seq_id_t s) const override {
        const auto it = ranges.find(s);
        return it == ranges.end() ? -1 : it->second.first;
    }
    pos_t seq_pos_max(seq_id_t s) const override {
        const auto it = ranges.find(s);
        return it == ranges.end() ? -1 : it->second.second;
    }
    void state_write(io_write_i&, seq_id_t, state_seq_flags) const override {}
    state_stage_ptr state_stage(io_read_i&, seq_id_t, state_seq_flags) const override { return nullptr; }
    void state_commit(state_stage_i&) override {}
    bool state_fits(const state_stage_i&) override { return true; }
    std::string state_layout() const override { return {}; }
    uint64_t state_max_bytes() const override { return 0; }  // state_write writes nothing
    memory_breakdown get_memory_breakdown() const override { return {}; }
    kv_cache* layer_cache(uint32_t) override { return nullptr; }
    memory_recurrent* recurrent() override { return nullptr; }
};

// A batch described by value; view() points a kvc::batch at it.
struct test_batch {
    std::vector<token_t> tokens{};
    std::vector<float> embd{};
    std::vector<pos_t> pos{};                   // empty = automatic
    std::vector<std::vector<seq_id_t>> seqs{};  // empty = automatic
    std::vector<int8_t> logits{};               // empty = automatic
    int32_t n_tokens = -1;                      // override

    std::vector<int32_t> n_seq_id{};
    std::vector<const seq_id_t*> seq_ptrs{};

    batch view() {
        batch b;
        b.n_tokens =
            n_tokens >= 0 ? n_tokens : static_cast<int32_t>(tokens.empty() ? embd.size() / 2 : tokens.size());
        b.token = tokens.empty() ? nullptr : tokens.data();
        b.embd = embd.empty() ? nullptr : embd.data();
        b.pos = pos.empty() ? nullptr : pos.data();
        if (!seqs.empty()) {
            n_seq_id.clear();
            seq_ptrs.clear();
            for (auto& s : seqs) {
                n_seq_id.push_back(static_cast<int32_t>(s.size()));
                seq_ptrs.push_back(s.data());
            }
            b.n_seq_id = n_seq_id.data();
            b.seq_id = seq_ptrs.data();
        }
        b.logits = logits.empty() ? nullptr : logits.data();
        return b;
    }
};

std::vector<pos_t> positions(const batch_allocr& a) {
    std::vector<pos_t> p;
    for (uint32_t i = 0; i < a.get_n_tokens(); ++i) p.push_back(a.pos(i));
    return p;
}

std::vector<int> outputs(const batch_allocr& a) {
    std::vector<int> o;
    for (uint32_t i = 0; i < a.get_n_tokens(); ++i) o.push_back(a.is_output(i));
    return o;
}

// -- design/batch.md §2.9 test vectors --

TEST(batch_allocr, empty_memory_fills_positions_sequence_and_last_output) {
    test_batch t{.tokens = {5, 6, 7}};
    batch_allocr a;
    fake_memory mem;
    a.init(t.view(), positions_of(mem), {});
    EXPECT_EQ(positions(a), (std::vector<pos_t>{0, 1, 2}));
    EXPECT_EQ(outputs(a), (std::vector<int>{0, 0, 1}));
    EXPECT_EQ(a.seq_ids(1)[0], 0);
    EXPECT_EQ(a.get_n_outputs(), 1u);
    a.init(t.view(), positions_of(mem), {.output_all = true});
    EXPECT_EQ(outputs(a), (std::vector<int>{1, 1, 1}));
}

TEST(batch_allocr, automatic_positions_continue_each_sequence_from_the_memory) {
    fake_memory mem;
    mem.ranges[0] = {0, 9};
    test_batch t{.tokens = {1, 2, 3, 4}, .seqs = {{0}, {1}, {0}, {1}}};
    batch_allocr a;
    a.init(t.view(), positions_of(mem), {.n_seq_max = 2});
    EXPECT_EQ(positions(a), (std::vector<pos_t>{10, 0, 11, 1}));
}

TEST(batch_allocr, shared_token_resynchronises_its_sequences) {
    fake_memory mem;
    test_batch t{.tokens = {1, 2, 3}, .seqs = {{0, 1}, {0}, {1}}};
    batch_allocr a;
    a.init(t.view(), positions_of(mem), {.n_seq_max = 2});
    EXPECT_EQ(positions(a), (std::vector<pos_t>{0, 1, 1}));
    EXPECT_TRUE(a.has_coupled());
}

TEST(batch_allocr, positions_against_the_memory) {
    fake_memory mem;
    mem.ranges[0] = {0, 9};
    batch_allocr a;
    const auto try_pos = [&](std::vector<pos_t> p) {
        test_batch t{.tokens = std::vector<token_t>(p.size(), 1), .pos = std::move(p)};
        a.init(t.view(), positions_of(mem), {});
    };
    EXPECT_NO_THROW(try_pos({10, 10, 11}));  // duplicates allowed
    try {
        try_pos({11, 12});
        FAIL();
    } catch (const error& e) {
        EXPECT_EQ(e.code(), errc::invalid_state);
        EXPECT_STREQ(
            e.what(),
            "batch: seq 0 starts at pos 11 but the memory ends at pos 9; the next position must be 10");
    }
    try {
        try_pos({10, 12});
        FAIL();
    } catch (const error& e) {
        EXPECT_STREQ(e.what(), "batch: positions of seq 0 have gaps: 2 distinct positions in [10, 12]");
    }
    try {
        try_pos({11, 10});  // upstream accepts this; kvcache rejects decreasing positions
        FAIL();
    } catch (const error& e) {
        EXPECT_STREQ(e.what(), "batch: positions of seq 0 decrease: token 1 has pos 10 after pos 11");
    }
    mem.ranges.clear();
    EXPECT_NO_THROW(try_pos({100, 101})) << "an empty sequence may start anywhere";
    EXPECT_EQ(a.seq_pos_min(0), 100);
    EXPECT_EQ(a.seq_pos_max(0), 101);
}

TEST(batch_allocr, mrope_positions_must_move_forward) {
    fake_memory mem;
    mem.ranges[0] = {0, 8};
    batch_allocr a;
    test_batch tok{.tokens = {1, 2}, .pos = {8, 9}};
    try {
        a.init(tok.view(), positions_of(mem), {.n_pos = 4});
        FAIL();
    } catch (const error& e) {
        EXPECT_STREQ(e.what(),
                     "batch: seq 0 starts at pos 8 but the memory ends at pos 8; M-RoPE tokens must start "
                     "after it");
    }
    tok.pos = {20, 21};  // jumps are fine for M-RoPE
    EXPECT_NO_THROW(a.init(tok.view(), positions_of(mem), {.n_pos = 4}));
    EXPECT_EQ(a.pos(1, 3), 21) << "token positions are broadcast to every section";

    // embeddings: 4 sections x 2 tokens, may start at the memory's last position (image chunks)
    test_batch emb{.embd = {0, 0, 0, 0}, .pos = {8, 8, 1, 2, 3, 4, 0, 0}};
    EXPECT_NO_THROW(a.init(emb.view(), positions_of(mem), {.n_embd = 2, .n_pos = 4}));
    EXPECT_EQ(a.pos(1, 2), 4);
    emb.pos = {7, 8, 1, 2, 3, 4, 0, 0};
    EXPECT_THROW(a.init(emb.view(), positions_of(mem), {.n_embd = 2, .n_pos = 4}), error);
    emb.pos.clear();
    try {
        a.init(emb.view(), positions_of(mem), {.n_embd = 2, .n_pos = 4});
        FAIL();
    } catch (const error& e) {
        EXPECT_STREQ(e.what(),
                     "batch: embeddings input for a model with 4 position sections needs explicit "
                     "positions (4 x n_tokens)");
    }
}

TEST(batch_allocr, coupled_sequences_must_not_have_diverged) {
    fake_memory mem;
    mem.ranges[0] = {0, 5};
    mem.ranges[1] = {0, 3};
    test_batch t{.tokens = {1}, .pos = {6}, .seqs = {{0, 1}}};
    batch_allocr a;
    try {
        a.init(t.view(), positions_of(mem), {.n_seq_max = 2});
        FAIL();
    } catch (const error& e) {
        EXPECT_STREQ(e.what(),
                     "batch: token 0 couples seq 1 to seq 0, but they have diverged in the memory (seq 1: "
                     "[0, 3], seq 0: [0, 5])");
    }
    mem.ranges[1] = {0, 5};
    EXPECT_NO_THROW(a.init(t.view(), positions_of(mem), {.n_seq_max = 2}));
}

TEST(batch_allocr, all_outputs_override_warns) {
    test_batch t{.tokens = {1, 2}, .logits = {0, 0}};
    batch_allocr a;
    testing::internal::CaptureStderr();
    a.init(t.view(), {}, {.output_all = true});
    const std::string err = testing::internal::GetCapturedStderr();
    EXPECT_NE(err.find("marking all as outputs"), std::string::npos);
    EXPECT_EQ(outputs(a), (std::vector<int>{1, 1}));
}

// -- every structural rule with its exact message --

struct rejection {
    const char* name;
    std::function<void(test_batch&, batch_options&)> make;
    const char* message;
};

TEST(batch_allocr, each_rejection_names_the_token_and_values) {
    const std::vector<rejection> cases = {
        {"no tokens", [](test_batch& t, batch_options&) { t.n_tokens = 0; },
         "batch: n_tokens = 0 must be positive"},
        {"token and embd", [](test_batch& t, batch_options&) { t.embd = {1, 2, 3, 4, 5, 6}; },
         "batch: both token and embd are set; give exactly one"},
        {"neither", [](test_batch& t, batch_options&) { t.tokens.clear(), t.n_tokens = 3; },
         "batch: neither token nor embd is set; give exactly one"},
        {"embd without width",
         [](test_batch& t, batch_options&) { t.tokens.clear(), t.embd = {1, 2, 3, 4, 5, 6}; },
         "batch: embeddings input needs n_embd > 0, got 0"},
        {"bad token", [](test_batch& t, batch_options& o) { o.n_vocab = 10, t.tokens[2] = 10; },
         "batch: token[2] = 10 not in [0, 10)"},
        {"negative token", [](test_batch& t, batch_options& o) { o.n_vocab = 10, t.tokens[1] = -1; },
         "batch: token[1] = -1 not in [0, 10)"},
        {"seq id too big",
         [](test_batch& t, batch_options&) {
             t.seqs = {{0}, {0}, {2}};
         },
         "batch: seq_id[2][0] = 2 not in [0, 2)"},
        {"negative seq id",
         [](test_batch& t, batch_options&) {
             t.seqs = {{0}, {1, -1}, {0}};
         },
         "batch: seq_id[1][1] = -1 not in [0, 2)"},
        {"duplicate ids",
         [](test_batch& t, batch_options&) {
             t.seqs = {{0}, {1, 1}, {0}};
         },
         "batch: token 1 lists seq_id 1 twice"},
        {"no ids",
         [](test_batch& t, batch_options&) {
             t.seqs = {{0}, {}, {0}};
         },
         "batch: n_seq_id[1] = 0 not in [1, 2]"},
        {"too many ids",
         [](test_batch& t, batch_options&) {
             t.seqs = {{0}, {0, 1, 0}, {0}};
         },
         "batch: n_seq_id[1] = 3 not in [1, 2]"},
        {"negative pos",
         [](test_batch& t, batch_options&) {
             t.pos = {0, -1, 1};
         },
         "batch: pos[1] = -1 is negative"},
        // regression (issue 20): accepted when no vocabulary was known
        {"negative token, no vocabulary",
         [](test_batch& t, batch_options& o) {
             t.tokens = {1, 2, -3};
             o.n_vocab = 0;
         },
         "batch: token[2] = -3 is negative"},
        {"zero n_seq_max", [](test_batch&, batch_options& o) { o.n_seq_max = 0; },
         "batch: n_seq_max must be at least 1"},
    };
    for (const rejection& r : cases) {
        test_batch t{.tokens = {1, 2, 3}};
        batch_options opt{.n_seq_max = 2};
        r.make(t, opt);
        batch_allocr a;
        try {
            a.init(t.view(), {}, opt);
            ADD_FAILURE() << r.name << ": accepted";
        } catch (const error& e) {
            EXPECT_STREQ(e.what(), r.message) << r.name;
        }
        EXPECT_EQ(a.get_n_tokens(), 0u) << r.name << ": a rejected batch leaves the allocator empty";
    }
}

TEST(batch_allocr, half_given_sequence_arrays_are_rejected) {
    std::vector<token_t> tokens = {1, 2};
    std::vector<int32_t> counts = {1, 1};
    batch b;
    b.n_tokens = 2;
    b.token = tokens.data();
    b.n_seq_id = counts.data();
    batch_allocr a;
    try {
        a.init(b, {}, {});
        FAIL();
    } catch (const error& e) {
        EXPECT_STREQ(e.what(), "batch: n_seq_id is set but seq_id is null; give both or neither");
    }
    const seq_id_t zero = 0;
    const seq_id_t* rows[] = {&zero, nullptr};
    b.seq_id = rows;
    try {
        a.init(b, {}, {});
        FAIL();
    } catch (const error& e) {
        EXPECT_STREQ(e.what(), "batch: seq_id[1] is null");
    }
}

// -- splits --

std::vector<int32_t> idx_of(const ubatch& u) {
    return u.batch_idx;
}

TEST(split, simple_cuts_consecutive_chunks) {
    test_batch t{.tokens = {1, 2, 3, 4, 5}, .seqs = {{0}, {1}, {0}, {1}, {0}}};
    batch_allocr a;
    a.init(t.view(), {}, {.n_seq_max = 2});
    const ubatch u1 = a.split_simple(2);
    EXPECT_EQ(idx_of(u1), (std::vector<int32_t>{0, 1}));
    EXPECT_FALSE(u1.equal_seqs);
    EXPECT_EQ(u1.n_seqs, 2u);
    EXPECT_EQ(u1.n_seq_tokens, 1u);
    EXPECT_EQ(u1.seq_id_unq, (std::vector<seq_id_t>{0, 1}));
    EXPECT_EQ(idx_of(a.split_simple(2)), (std::vector<int32_t>{2, 3}));
    EXPECT_EQ(idx_of(a.split_simple(2)), (std::vector<int32_t>{4}));
    EXPECT_TRUE(a.split_simple(2).empty());
    EXPECT_EQ(a.get_n_used(), 5u);
    EXPECT_THROW((void)a.split_simple(0), error);
}

TEST(split, equal_sequential_worked_example) {
    // design/batch.md §3.11: [A0 A1 A2 B0 B1 C0], n_ubatch = 4
    test_batch t{.tokens = {1, 2, 3, 4, 5, 6}, .seqs = {{0}, {0}, {0}, {1}, {1}, {2}}};
    batch_allocr a;
    a.init(t.view(), {}, {.n_seq_max = 3, .output_all = true});
    const ubatch u1 = a.split_equal(4, true);
    EXPECT_EQ(idx_of(u1), (std::vector<int32_t>{0, 3, 5}));
    EXPECT_EQ(u1.n_seqs, 3u);
    EXPECT_EQ(u1.n_seq_tokens, 1u);
    EXPECT_TRUE(u1.equal_seqs);
    EXPECT_EQ(idx_of(a.split_equal(4, true)), (std::vector<int32_t>{1, 4}));
    EXPECT_EQ(idx_of(a.split_equal(4, true)), (std::vector<int32_t>{2}));
    EXPECT_TRUE(a.split_equal(4, true).empty());
    EXPECT_EQ(std::vector<int32_t>(a.out_ids().begin(), a.out_ids().end()),
              (std::vector<int32_t>{0, 3, 5, 1, 4, 2}));
    // rows come back to batch order through the permutation
    EXPECT_EQ(a.output_permutation(), (std::vector<uint32_t>{0, 3, 5, 1, 4, 2}));
    EXPECT_EQ(a.output_row(4), 4);
}

TEST(split, equal_never_exceeds_n_ubatch) {
    // design D14: five single-token sequences, n_ubatch = 4 -> 4 + 1 (upstream could make 5)
    test_batch t{.tokens = {1, 2, 3, 4, 5}, .seqs = {{0}, {1}, {2}, {3}, {4}}};
    batch_allocr a;
    a.init(t.view(), {}, {.n_seq_max = 5});
    EXPECT_EQ(a.split_equal(4, false).n_tokens, 4u);
    EXPECT_EQ(a.split_equal(4, false).n_tokens, 1u);
}

TEST(split, equal_rounds_are_lock_step) {
    // two sequences of 3 tokens, n_ubatch 4 -> 2 rounds of 2 sequences, then the rest
    test_batch t{.tokens = {1, 2, 3, 4, 5, 6}, .seqs = {{0}, {1}, {0}, {1}, {0}, {1}}};
    batch_allocr a;
    a.init(t.view(), {}, {.n_seq_max = 2});
    const ubatch u = a.split_equal(4, true);
    EXPECT_EQ(idx_of(u), (std::vector<int32_t>{0, 2, 1, 3}));  // block of seq 0, then block of seq 1
    EXPECT_EQ(u.n_seq_tokens, 2u);
    EXPECT_EQ(idx_of(a.split_equal(4, true)), (std::vector<int32_t>{4, 5}));
}

TEST(split, sequential_equal_refuses_coupled_sequences) {
    test_batch t{.tokens = {1, 2}, .seqs = {{0, 1}, {0}}};
    batch_allocr a;
    a.init(t.view(), {}, {.n_seq_max = 2});
    testing::internal::CaptureStderr();
    EXPECT_TRUE(a.split_equal(8, true).empty());
    EXPECT_NE(testing::internal::GetCapturedStderr().find("sequential split"), std::string::npos);
    // the non-sequential split keeps each sequence's order: the shared token first
    EXPECT_EQ(idx_of(a.split_equal(8, false)), (std::vector<int32_t>{0}));
    EXPECT_EQ(idx_of(a.split_equal(8, false)), (std::vector<int32_t>{1}));
}

TEST(split, equal_keeps_sequence_order_when_sets_interleave) {
    // seq 0 sees {0,1}, {0}, {0,1}: taking both {0,1} tokens together would run token 2 before token 1
    test_batch t{.tokens = {1, 2, 3}, .pos = {0, 1, 1}, .seqs = {{0, 1}, {0}, {0, 1}}};
    batch_allocr a;
    a.init(t.view(), {}, {.n_seq_max = 2});
    EXPECT_EQ(idx_of(a.split_equal(8, false)), (std::vector<int32_t>{0}));
    EXPECT_EQ(idx_of(a.split_equal(8, false)), (std::vector<int32_t>{1}));
    EXPECT_EQ(idx_of(a.split_equal(8, false)), (std::vector<int32_t>{2}));
}

// n_keep_tail (design/batch.md §3.5 step 6): the last tokens of each sequence stay together in one ubatch
std::vector<uint32_t> equal_sizes(batch_allocr& a, uint32_t n_ubatch, bool sequential, uint32_t keep) {
    std::vector<uint32_t> sizes;
    for (ubatch u = a.split_equal(n_ubatch, sequential, keep); !u.empty();
         u = a.split_equal(n_ubatch, sequential, keep))
        sizes.push_back(u.n_tokens);
    return sizes;
}

TEST(split, equal_keep_tail_takes_fewer_rounds_before_the_tail) {
    test_batch t{.tokens = std::vector<token_t>(10, 1)};
    batch_allocr a;
    a.init(t.view(), {}, {});
    EXPECT_EQ(equal_sizes(a, 4, true, 0), (std::vector<uint32_t>{4, 4, 2}));  // today's split
    a.split_reset();
    EXPECT_EQ(equal_sizes(a, 4, true, 3), (std::vector<uint32_t>{4, 3, 3}));
    a.split_reset();
    EXPECT_EQ(equal_sizes(a, 4, true, 4), (std::vector<uint32_t>{4, 2, 4}));
}

TEST(split, equal_keep_tail_leaves_out_sets_that_would_split_a_tail) {
    // seq 0 has 3 tokens, seq 1 has 5: in lock step seq 1 would keep 2 < 3 back, and taking fewer
    // rounds would split seq 0's tail, so seq 0 goes alone
    test_batch t{.tokens = std::vector<token_t>(8, 1), .seqs = {{0}, {1}, {0}, {1}, {0}, {1}, {1}, {1}}};
    batch_allocr a;
    a.init(t.view(), {}, {.n_seq_max = 2});
    const ubatch u1 = a.split_equal(16, true, 3);
    EXPECT_EQ(idx_of(u1), (std::vector<int32_t>{0, 2, 4}));
    EXPECT_EQ(idx_of(a.split_equal(16, true, 3)), (std::vector<int32_t>{1, 3, 5, 6, 7}));
    EXPECT_TRUE(a.split_equal(16, true, 3).empty());
    a.split_reset();
    EXPECT_EQ(equal_sizes(a, 16, true, 0), (std::vector<uint32_t>{6, 2}));  // without: both sets, 3 rounds
}

TEST(split, equal_keep_tail_yields_to_n_ubatch) {
    test_batch t{.tokens = std::vector<token_t>(5, 1)};
    batch_allocr a;
    a.init(t.view(), {}, {});
    EXPECT_EQ(equal_sizes(a, 2, true, 5), (std::vector<uint32_t>{2, 2, 1}));  // design D14 wins
}

TEST(split, seq_takes_one_sequence_set_at_a_time) {
    test_batch t{.tokens = {1, 2, 3, 4, 5}, .pos = {0, 1, 1, 2, 3}, .seqs = {{0}, {1}, {0}, {0, 1}, {1}}};
    batch_allocr a;
    a.init(t.view(), {}, {.n_seq_max = 2});
    const ubatch u1 = a.split_seq(8);
    EXPECT_EQ(idx_of(u1), (std::vector<int32_t>{0, 2}));  // stops before the shared token 3
    EXPECT_EQ(u1.n_seqs, 1u);
    EXPECT_EQ(u1.n_seq_tokens, 2u);
    EXPECT_EQ(idx_of(a.split_seq(8)), (std::vector<int32_t>{1}));
    EXPECT_EQ(idx_of(a.split_seq(8)), (std::vector<int32_t>{3}));
    EXPECT_EQ(idx_of(a.split_seq(8)), (std::vector<int32_t>{4}));
    EXPECT_TRUE(a.split_seq(8).empty());
}

TEST(split, reserve_builds_placeholder_blocks) {
    const ubatch u = batch_allocr::ubatch_reserve(3, 2, 4);
    EXPECT_EQ(u.n_tokens, 6u);
    EXPECT_TRUE(u.equal_seqs);
    EXPECT_EQ(u.pos.size(), 24u);
    EXPECT_EQ(u.primary_seq(4), 1);
    EXPECT_EQ(u.seq_idx(1), 1);
    EXPECT_EQ(u.seq_idx(2), -1);
    EXPECT_THROW((void)batch_allocr::ubatch_reserve(0, 2), error);
}

// -- property: concatenating the ubatches gives the batch back --

struct random_case {
    test_batch t{};
    uint32_t n_seq_max = 1;
};

// Valid by construction: each token continues its sequences (or repeats the last position of a
// single sequence); a token is shared only by sequences that are at the same position.
random_case random_batch(std::mt19937& rng, bool coupled) {
    random_case rc;
    rc.n_seq_max = 1 + rng() % 6;
    std::vector<pos_t> next(rc.n_seq_max, 0);
    const uint32_t n = 1 + rng() % 40;
    for (uint32_t i = 0; i < n; ++i) {
        rc.t.tokens.push_back(static_cast<token_t>(rng() % 100));
        const auto a = static_cast<seq_id_t>(rng() % rc.n_seq_max);
        std::vector<seq_id_t> ids = {a};
        if (coupled && rng() % 3 == 0)
            for (seq_id_t b = 0; b < static_cast<seq_id_t>(rc.n_seq_max); ++b)
                if (b != a && next[b] == next[a] && rng() % 2 == 0) ids.push_back(b);
        pos_t p = next[a];
        if (ids.size() == 1 && p > 0 && rng() % 8 == 0) --p;  // a repeated position
        for (seq_id_t s : ids) next[s] = p + 1;
        rc.t.pos.push_back(p);
        rc.t.seqs.push_back(ids);
        rc.t.logits.push_back(rng() % 3 == 0);
    }
    return rc;
}

TEST(split_property, every_split_reassembles_the_batch_in_sequence_order) {
    std::mt19937 rng(14);
    for (int iter = 0; iter < 3000; ++iter) {
        random_case rc = random_batch(rng, iter % 2 == 0);
        batch_allocr a;
        a.init(rc.t.view(), {}, {.n_seq_max = rc.n_seq_max, .n_vocab = 100});
        const uint32_t n_ubatch = 1 + rng() % 12;
        for (int strategy = 0; strategy < 4; ++strategy) {
            a.split_reset();
            std::vector<int> seen(a.get_n_tokens(), 0);
            std::map<seq_id_t, int32_t> last;  // last batch index processed per sequence
            uint32_t outputs = 0;
            while (true) {
                ubatch u;
                switch (strategy) {
                    case 0:
                        u = a.split_simple(n_ubatch);
                        break;
                    case 1:
                        u = a.split_equal(n_ubatch, false);
                        break;
                    case 2:
                        u = a.split_equal(n_ubatch, true);
                        break;
                    default:
                        u = a.split_seq(n_ubatch);
                        break;
                }
                if (u.empty()) break;
                ASSERT_LE(u.n_tokens, n_ubatch);
                ASSERT_EQ(u.n_tokens, u.n_seq_tokens * u.n_seqs);
                ASSERT_TRUE(std::is_sorted(u.seq_id_unq.begin(), u.seq_id_unq.end()));
                for (uint32_t k = 0; k < u.n_tokens; ++k) {
                    const auto i = static_cast<uint32_t>(u.batch_idx[k]);
                    ++seen[i];
                    ASSERT_EQ(u.token[k], rc.t.tokens[i]);
                    ASSERT_EQ(u.pos[k], a.pos(i));
                    ASSERT_EQ(std::vector<seq_id_t>(u.seq_ids(k).begin(), u.seq_ids(k).end()), rc.t.seqs[i]);
                    ASSERT_EQ(u.output[k] != 0, a.is_output(i));
                    outputs += u.output[k] != 0;
                    for (seq_id_t s : u.seq_ids(k)) {
                        ASSERT_GE(u.seq_idx(s), 0);
                        const auto it = last.find(s);
                        ASSERT_TRUE(it == last.end() || it->second < u.batch_idx[k])
                            << "strategy " << strategy << ": seq " << s << " processed out of order";
                        last[s] = u.batch_idx[k];
                    }
                }
                if (u.equal_seqs && strategy != 0) {  // blocks: one exact sequence set each, disjoint
                    std::vector<std::set<seq_id_t>> blocks;
                    for (uint32_t b = 0; b < u.n_seqs; ++b) {
                        const auto ref = u.seq_ids(b * u.n_seq_tokens);
                        const std::set<seq_id_t> set(ref.begin(), ref.end());
                        for (uint32_t k = b * u.n_seq_tokens; k < (b + 1) * u.n_seq_tokens; ++k) {
                            const auto ids = u.seq_ids(k);
                            ASSERT_EQ(std::set<seq_id_t>(ids.begin(), ids.end()), set);
                        }
                        for (const auto& other : blocks)
                            for (seq_id_t s : set) ASSERT_FALSE(other.count(s));
                        blocks.push_back(set);
                        if (strategy == 2 && b > 0) {
                            ASSERT_EQ(u.primary_seq(b * u.n_seq_tokens),
                                      u.primary_seq((b - 1) * u.n_seq_tokens) + 1);
                        }
                    }
                }
            }
            if (strategy == 2 && a.has_coupled()) {
                ASSERT_EQ(a.get_n_used(), 0u);
                continue;
            }
            ASSERT_EQ(a.get_n_used(), a.get_n_tokens()) << "strategy " << strategy;
            for (int c : seen) ASSERT_EQ(c, 1);
            ASSERT_EQ(outputs, a.get_n_outputs());
            // out_ids is a permutation of the outputs; the permutation restores batch order
            std::vector<int32_t> ids(a.out_ids().begin(), a.out_ids().end());
            const auto perm = a.output_permutation();
            for (size_t j = 0; j < perm.size(); ++j) {
                ASSERT_EQ(a.output_row(static_cast<uint32_t>(ids[perm[j]])), static_cast<int32_t>(j));
                if (j > 0) {
                    ASSERT_LT(ids[perm[j - 1]], ids[perm[j]]);
                }
            }
        }
    }
}

TEST(split_property, equal_keep_tail_keeps_each_sequences_last_tokens_together) {
    std::mt19937 rng(3);
    for (int iter = 0; iter < 3000; ++iter) {
        random_case rc = random_batch(rng, false);
        batch_allocr a;
        a.init(rc.t.view(), {}, {.n_seq_max = rc.n_seq_max});
        const uint32_t n_ubatch = 1 + rng() % 12, keep = rng() % 6;
        const bool sequential = rng() % 2;
        std::vector<int> ubatch_of(a.get_n_tokens(), -1);
        int n = 0;
        for (ubatch u = a.split_equal(n_ubatch, sequential, keep); !u.empty();
             u = a.split_equal(n_ubatch, sequential, keep), ++n) {
            ASSERT_LE(u.n_tokens, n_ubatch);
            ASSERT_EQ(u.n_tokens, u.n_seq_tokens * u.n_seqs);
            for (int32_t i : u.batch_idx) ubatch_of[static_cast<size_t>(i)] = n;
        }
        ASSERT_EQ(a.get_n_used(), a.get_n_tokens());
        if (keep > n_ubatch) continue;
        std::map<seq_id_t, std::vector<int>> per_seq;  // ubatch of each token of a sequence, in order
        for (uint32_t i = 0; i < a.get_n_tokens(); ++i) per_seq[a.seq_ids(i)[0]].push_back(ubatch_of[i]);
        for (const auto& [s, ubs] : per_seq) {
            const size_t tail = std::min<size_t>(keep, ubs.size());
            for (size_t j = ubs.size() - tail; j < ubs.size(); ++j)
                ASSERT_EQ(ubs[j], ubs.back()) << "iter " << iter << " seq " << s << " keep " << keep;
        }
    }
}

// -- batch storage --

TEST(batch_storage, owns_arrays_and_checks_capacity) {
    batch_storage s = batch::init(2, 0, 3);
    const std::vector<seq_id_t> both = {0, 2};
    s.add(7, 0, both, false);
    s.add(8, 1, std::vector<seq_id_t>{1}, false);
    s.set_output(1, true);
    EXPECT_THROW(s.add(9, 2, both, true), error);                         // full
    EXPECT_THROW(s.add(std::vector<float>{1.0f}, 2, both, true), error);  // holds tokens
    const batch b = s.view();
    EXPECT_EQ(b.n_tokens, 2);
    EXPECT_EQ(b.seq_id[0][1], 2);
    batch_allocr a;
    a.init(b, {}, {.n_seq_max = 3});
    EXPECT_EQ(outputs(a), (std::vector<int>{0, 1}));
    s.clear();
    EXPECT_EQ(s.size(), 0);
    EXPECT_THROW(batch::init(0, 0, 1), error);
    EXPECT_THROW(s.add(1, 0, std::vector<seq_id_t>{}, true), error);
}

TEST(batch_storage, get_one_is_a_view) {
    const std::vector<token_t> tokens = {3, 4, 5};
    const batch b = batch::get_one(tokens);
    EXPECT_EQ(b.token, tokens.data());
    EXPECT_EQ(b.pos, nullptr);
    fake_memory mem;
    mem.ranges[0] = {0, 4};
    batch_allocr a;
    a.init(b, positions_of(mem), {});
    EXPECT_EQ(positions(a), (std::vector<pos_t>{5, 6, 7}));
}

}  // namespace
}  // namespace kvc
