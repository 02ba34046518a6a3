// memory_recurrent property test: sequences own their states as an oracle of per-sequence states and
// history planes says, through random batches, sequence operations, rollbacks and restores.
#include <algorithm>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <kvcache/batch.h>
#include <kvcache/memory_recurrent.h>
#include <kvcache/state.h>

#include "memory_recurrent_test_util.h"
#include "recurrent_oracle.h"

namespace kvc {
namespace {

using namespace test;  // the oracle engine (recurrent_oracle.h) and the helpers

// -- property: the memory against an oracle of per-sequence states --

struct oracle_seq {
    bool has = false;
    pos_t pos = -1;
    uint64_t h = 0;
    std::vector<uint64_t> hist;  // hist[r - 1]: the state r tokens back
    int group = -1;              // cell identity: sequences sharing a state have the same group
};

TEST(memory_recurrent_property, sequences_own_their_states_like_the_oracle_says) {
    std::mt19937 rng(26);
    int rollbacks = 0, refused = 0, decodes = 0;
    for (int iter = 0; iter < 150; ++iter) {
        const uint32_t n_seq = 1 + rng() % 6;
        const uint32_t k = std::vector<uint32_t>{0, 1, 3}[rng() % 3];
        recurrent_params p;
        p.layers = {{.n_embd_r = static_cast<uint32_t>(2 + rng() % 3),
                     .n_embd_s = static_cast<uint32_t>(2 + rng() % 5)},
                    // every third memory: s rows of a page, so that emptied cells give memory back
                    {.n_embd_r = 0, .n_embd_s = iter % 3 == 0 ? 1024u : 3u}};
        p.n_seq_max = n_seq;
        p.n_rs_seq = k;
        memory_recurrent m(p);
        std::vector<oracle_seq> o(n_seq);
        int next_group = 0;
        const auto sharers = [&](seq_id_t s) {
            int n = 0;
            for (const oracle_seq& x : o) n += x.has && x.group == o[static_cast<size_t>(s)].group;
            return n;
        };
        const auto rand_seq = [&] { return static_cast<seq_id_t>(rng() % n_seq); };
        for (int op = 0; op < 60; ++op) {
            const uint32_t what = rng() % 20;
            std::string label;
            if (what < 9) {  // decode
                label = "decode";
                std::vector<std::pair<seq_id_t, pos_t>> tokens;
                std::vector<pos_t> next(n_seq);
                std::vector<int> count(n_seq, 0);
                for (seq_id_t s = 0; s < static_cast<seq_id_t>(n_seq); ++s) {
                    const oracle_seq& x = o[static_cast<size_t>(s)];
                    next[static_cast<size_t>(s)] =
                        x.has ? x.pos + 1 : static_cast<pos_t>(rng() % 3 == 0 ? 5 : 0);
                    if (rng() % 2) count[static_cast<size_t>(s)] = 1 + static_cast<int>(rng() % 5);
                }
                for (bool more = true; more;) {  // interleave the sequences' tokens randomly
                    more = false;
                    for (seq_id_t s = 0; s < static_cast<seq_id_t>(n_seq); ++s)
                        if (count[static_cast<size_t>(s)] > 0 && rng() % 2) {
                            tokens.emplace_back(s, next[static_cast<size_t>(s)]++);
                            --count[static_cast<size_t>(s)];
                        }
                    for (int c : count) more |= c > 0;
                }
                if (tokens.empty()) continue;
                const bool embd_all = rng() % 5 == 0;
                ASSERT_GT(decode(m, tokens, 1 + rng() % 8, embd_all), 0);
                ++decodes;
                for (const auto& [s, pos] : tokens) {
                    oracle_seq& x = o[static_cast<size_t>(s)];
                    if (!x.has || x.group >= 0) {  // first token of this batch: a cell of its own
                        if (!x.has) x.h = 0, x.hist.clear();
                        x.has = true;
                        x.group = -1;
                    }
                    x.hist.insert(x.hist.begin(), x.h);
                    if (x.hist.size() > k) x.hist.resize(k);
                    x.h = mix(x.h, s, pos);
                    x.pos = pos;
                }
                for (oracle_seq& x : o)
                    if (x.has && x.group < 0) x.group = next_group++;
            } else if (what < 12) {  // seq_rm: removal, rollback or nothing
                const seq_id_t s = rand_seq();
                oracle_seq& x = o[static_cast<size_t>(s)];
                const uint32_t kind = rng() % 3;
                pos_t p0 = kind == 0 ? -1 : x.pos - static_cast<pos_t>(rng() % (k + 2));
                if (kind == 2) p0 = x.pos + 1;
                label = "rm " + std::to_string(s) + " " + std::to_string(p0);
                bool want = true;
                if (x.has && p0 <= 0) {
                    x = oracle_seq{};
                } else if (x.has && p0 <= x.pos) {
                    const auto r = static_cast<size_t>(x.pos - p0 + 1);
                    want = k > 0 && sharers(s) == 1 && r <= x.hist.size();
                    if (want) {
                        x.h = x.hist[r - 1];
                        x.hist.erase(x.hist.begin(), x.hist.begin() + static_cast<ptrdiff_t>(r));
                        x.pos = p0 - 1;
                        ++rollbacks;
                    } else {
                        ++refused;
                    }
                }
                ASSERT_EQ(m.seq_rm(s, p0, -1), want) << label;
            } else if (what < 14) {  // seq_cp
                const seq_id_t a = rand_seq(), b = rand_seq();
                label = "cp";
                m.seq_cp(a, b, -1, -1);
                if (a != b) o[static_cast<size_t>(b)] = o[static_cast<size_t>(a)];
            } else if (what < 15) {  // seq_add / seq_div, keeping positions >= 0
                const seq_id_t s = rand_seq();
                oracle_seq& x = o[static_cast<size_t>(s)];
                label = "add/div";
                if (!x.has) continue;
                const pos_t old = x.pos;
                if (rng() % 2) {
                    const pos_t shift = static_cast<pos_t>(rng() % 6) - std::min<pos_t>(x.pos, 3);
                    m.seq_add(s, -1, -1, shift);
                    for (oracle_seq& y : o)
                        if (y.has && y.group == x.group) y.pos = old + shift;
                } else {
                    const int d = 1 + static_cast<int>(rng() % 3);
                    m.seq_div(s, 0, -1, d);
                    for (oracle_seq& y : o)
                        if (y.has && y.group == x.group) y.pos = old / d;
                }
            } else if (what < 16) {  // keep
                const seq_id_t s = rand_seq();
                label = "keep";
                m.seq_keep(s);
                for (size_t i = 0; i < o.size(); ++i)
                    if (static_cast<seq_id_t>(i) != s) o[i] = oracle_seq{};
            } else if (what < 18) {  // one sequence's state into another
                const seq_id_t a = rand_seq(), b = rand_seq();
                label = "restore " + std::to_string(a) + " -> " + std::to_string(b);
                state_seq_set_data(m, state_seq_get_data(m, a), b);
                const oracle_seq src = o[static_cast<size_t>(a)];
                oracle_seq& y = o[static_cast<size_t>(b)];
                y = oracle_seq{};
                if (src.has) {
                    y = src;
                    y.hist.clear();
                    y.group = next_group++;
                }
            } else if (what < 19) {  // whole memory through another memory
                label = "whole";
                memory_recurrent other(p);
                state_set_payload(other, payload(m, seq_all), seq_all);
                state_set_payload(m, payload(other, seq_all), seq_all);
                for (oracle_seq& x : o) x.hist.clear();
            } else {
                label = "rm all / clear";
                if (rng() % 2)
                    ASSERT_TRUE(m.seq_rm(seq_all, -1, -1));
                else
                    m.clear(rng() % 2);
                for (oracle_seq& x : o) x = oracle_seq{};
            }
            // every sequence holds exactly its own state; I1-I4
            ASSERT_NO_THROW(m.validate()) << label;
            uint32_t cells = 0;
            std::set<int> groups;
            for (seq_id_t s = 0; s < static_cast<seq_id_t>(n_seq); ++s) {
                const oracle_seq& x = o[static_cast<size_t>(s)];
                ASSERT_EQ(m.seq_pos_max(s), x.has ? x.pos : -1) << label << " seq " << s;
                ASSERT_EQ(m.seq_pos_min(s), m.seq_pos_max(s));
                ASSERT_EQ(m.seq_tail(s) >= 0, x.has) << label;
                if (!x.has) continue;
                ASSERT_EQ(state_of(m, s), x.h) << label << " seq " << s;
                const auto info = m.cell(static_cast<uint32_t>(m.seq_tail(s)));
                ASSERT_EQ(info.depth, x.hist.size()) << label << " seq " << s;
                for (uint32_t r = 1; r <= info.depth; ++r) {  // the history planes hold the earlier states
                    const int64_t row = int64_t{info.rs_idx + r} * n_seq + m.seq_tail(s);
                    for (const auto& [il, is_s] : tensors(m)) {
                        const tensor_view v = view_of(m, il, is_s);
                        ASSERT_EQ(read_row(row_ptr(v, row), v.row_bytes(), il, is_s), x.hist[r - 1])
                            << label << " seq " << s << " plane " << r;
                    }
                }
                ASSERT_EQ(static_cast<int>(info.seqs.size()), sharers(s)) << label << " seq " << s;
                cells += groups.insert(x.group).second;
            }
            ASSERT_EQ(m.get_used(), cells) << label;
            // rows are committed up to the last used cell, never below it (memory on demand)
            const memory_breakdown b = m.get_memory_breakdown();
            ASSERT_GE(b.committed, b.used) << label;
            ASSERT_EQ(b.committed, b.used + b.free) << label;
        }
    }
    EXPECT_GT(decodes, 1000);
    EXPECT_GT(rollbacks, 50);
    EXPECT_GT(refused, 50);
}

}  // namespace
}  // namespace kvc
