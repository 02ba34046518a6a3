// kv_cache property tests: masks against a naive reference, and what every sequence sees against a
// simple model, under random placements and sequence operations.
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include <gtest/gtest.h>
#include <kvcache/kv_cache.h>

#include "kv_cache_test_util.h"

namespace kvc {
namespace {

// -- masks against a naive reference --

TEST(kv_cache_property, masks_match_a_naive_reference) {
    std::mt19937 rng(99);
    for (int iter = 0; iter < 300; ++iter) {
        const swa_type sw = static_cast<swa_type>(iter % 4);
        auto p = small_params(64, 3);
        p.swa = sw;
        p.n_swa = sw == swa_type::none ? 0 : 2 + rng() % 6;
        p.n_kv_pad = 16;
        kv_cache c(p);
        // random occupancy: three sequences with random positions in random cells, some shared
        std::vector<uint32_t> cells(64);
        std::iota(cells.begin(), cells.end(), 0u);
        std::shuffle(cells.begin(), cells.end(), rng);
        std::vector<pos_t> next(3, 0);
        for (uint32_t k = 0; k < 24; ++k) {
            const auto s = static_cast<seq_id_t>(rng() % 3);
            place(c, {cells[k]}, {next[s]++}, s);
            if (rng() % 5 == 0) {
                const auto o = static_cast<seq_id_t>(rng() % 3);
                if (o != s) c.seq_cp(s, o, next[s] - 1, next[s]);
            }
        }
        const auto q = static_cast<seq_id_t>(rng() % 3);
        const ubatch ub = make_ub({next[q], next[q] + 1}, {q, q});
        auto ctx = peer::placed(c, slot({cells[40], cells[41]}), ub);
        kv_cache_context& kc = *ctx->get_attn(0);
        const uint32_t n_kv = kc.get_n_kv();
        for (bool causal : {true, false}) {
            for (dtype mt : {dtype::f32, dtype::f16}) {
                std::vector<std::byte> buf(size_t{n_kv} * 2 * type_size(mt));
                kc.set_input_kq_mask(tensor_view::contiguous(mt, buf.data(), n_kv, 2), {.causal = causal});
                std::vector<float> got(size_t{n_kv} * 2);
                to_f32(mt, buf.data(), got.data(), static_cast<int64_t>(got.size()));
                for (uint32_t i = 0; i < 2; ++i)
                    for (uint32_t j = 0; j < n_kv; ++j) {
                        const kv_cells& cs = c.cells(0);
                        bool keep = !cs.is_empty(j) && cs.seq_has(j, q);
                        if (keep && causal && cs.pos_get(j) > ub.pos[i]) keep = false;
                        if (keep && is_masked_swa(p.n_swa, sw, cs.pos_get(j), ub.pos[i])) keep = false;
                        ASSERT_EQ(got[i * n_kv + j], keep ? 0.0f : ninf)
                            << "iter " << iter << " swa " << to_string(sw) << " row " << i << " cell " << j;
                    }
            }
        }
    }
}

// -- property: what every sequence sees --

// The model: a list of token records (position, tag, sequences holding it). The tag is the value of the
// V row written with the token; V is never rotated, so tags survive shifts. A unified cache shares
// records between sequences (seq_cp), a split cache copies them.
struct record {
    pos_t pos;
    float tag;
    std::set<seq_id_t> seqs;
};
using seen_t = std::map<seq_id_t, std::multiset<std::pair<pos_t, float>>>;

seen_t seen_by_model(const std::vector<record>& recs) {
    seen_t out;
    for (const record& r : recs)
        for (seq_id_t s : r.seqs) out[s].insert({r.pos, r.tag});
    return out;
}

seen_t seen_by_cache(const kv_cache& c, uint32_t n_seq) {
    seen_t out;
    std::vector<float> v(c.storage().e_v(0));
    for (seq_id_t s = 0; s < static_cast<seq_id_t>(n_seq); ++s) {
        const uint32_t stream = c.seq_to_stream(s);
        for (const auto& [pos, cell] : c.cells(stream).seq_entries(s, -1, -1)) {
            c.read_row(kv_part::v, 0, stream, cell, v);
            out[s].insert({pos, v[0]});
        }
    }
    return out;
}

void drop_empty(std::vector<record>& recs) {
    recs.erase(
        std::remove_if(recs.begin(), recs.end(), [](const record& r) { return r.seqs.empty() || r.pos < 0; }),
        recs.end());
}

// Host memory is elastic (kv_storage.h): the commit mark of each stream is its used extent rounded up to
// the granule, and the bytes of used, cached and free cells add up to the committed ones.
void expect_commit_marks(const kv_cache& c) {
    const uint64_t g = c.storage().commit_granule();
    const memory_breakdown b = c.get_memory_breakdown();
    uint64_t cells = 0;
    for (uint32_t s = 0; s < c.get_n_stream(); ++s)
        cells += std::min<uint64_t>(c.get_size(), (c.cells(s).used_max_p1() + g - 1) / g * g);
    const uint64_t cell_bytes = c.size_bytes() / (uint64_t{c.get_size()} * c.get_n_stream());
    ASSERT_EQ(b.committed, cells * cell_bytes);
    ASSERT_EQ(b.committed, b.used + b.cached + b.free);
    ASSERT_EQ(b.reserved, c.size_bytes());
}

TEST(kv_cache_property, sequences_see_what_a_simple_model_says) {
    std::mt19937 rng(7);
    // narrow transposed rows (the commit granule is the whole stream), and rows of a page each (V not
    // transposed): the commit mark moves in granules of 16 cells, and memory goes back as cells empty
    for (const bool wide : {false, true})
        for (bool unified : {true, false}) {
            const uint32_t n_seq = 4;
            auto p = small_params(wide ? 64 : 48, n_seq);
            p.unified = unified;
            if (wide) {
                p.layers[0].n_head_kv = 4;
                p.layers[0].n_embd_head_k = p.layers[0].n_embd_head_v = 256;
                p.v_trans = false;
            }
            const auto e = static_cast<size_t>(p.layers[0].n_head_kv) * p.layers[0].n_embd_head_v;
            kv_cache c(p);
            ASSERT_EQ(c.storage().commit_granule(), wide ? 16u : 48u);
            std::vector<record> recs;
            float tag = 1;
            for (int step = 0; step < 3000; ++step) {
                const auto s = static_cast<seq_id_t>(rng() % n_seq);
                const int op = static_cast<int>(rng() % 8);
                if (op <= 2) {  // decode 1-6 tokens of 1-2 sequences
                    batch_storage b = batch::init(12, 0, static_cast<int32_t>(n_seq));
                    std::map<seq_id_t, pos_t> next;
                    const int n = 1 + static_cast<int>(rng() % 6);
                    const std::vector<seq_id_t> who = {s, static_cast<seq_id_t>(rng() % n_seq)};
                    std::vector<record> added;
                    for (int k = 0; k < n; ++k) {
                        const seq_id_t q = who[rng() % 2];
                        if (!next.count(q)) next[q] = c.seq_pos_max(q) + 1;
                        added.push_back({next[q], tag + static_cast<float>(k), {q}});
                        b.add(1, next[q]++, std::vector<seq_id_t>{q}, false);
                    }
                    batch_allocr a;
                    a.init(b.view(), positions_of(c), {.n_seq_max = n_seq});
                    auto ctx = c.init_batch(a, 4, false);
                    if (!is_fail(ctx->get_status())) {
                        kv_cache_context& kc = *ctx->get_attn(0);
                        do {
                            ctx->apply();
                            const ubatch& ub = kc.get_ubatch();
                            std::vector<float> rows(ub.n_tokens * e);
                            for (uint32_t t = 0; t < ub.n_tokens; ++t)
                                std::fill_n(rows.begin() + t * e, e,
                                            tag + static_cast<float>(ub.batch_idx[t]));
                            const auto view = const_tensor_view::contiguous(
                                dtype::f32, reinterpret_cast<const std::byte*>(rows.data()),
                                static_cast<int64_t>(e), ub.n_tokens);
                            kc.cpy_k(0, view);
                            kc.cpy_v(0, view);
                        } while (ctx->next());
                        recs.insert(recs.end(), added.begin(), added.end());
                    }  // else: the model is unchanged and the check below proves the cache is too
                    tag += 100;
                } else if (op == 3) {
                    const pos_t p0 = static_cast<pos_t>(rng() % 20) - 1,
                                p1 = static_cast<pos_t>(rng() % 24) - 1;
                    c.seq_rm(s, p0, p1);
                    const pos_t lo = p0 < 0 ? 0 : p0, hi = p1 < 0 ? std::numeric_limits<pos_t>::max() : p1;
                    for (record& r : recs)
                        if (r.pos >= lo && r.pos < hi) r.seqs.erase(s);
                    drop_empty(recs);
                } else if (op == 4) {
                    const auto d = static_cast<seq_id_t>(rng() % n_seq);
                    if (d == s || c.seq_pos_max(d) >= 0)
                        continue;  // copy onto an empty sequence, as engines do
                    try {
                        c.seq_cp(s, d, -1, -1);
                    } catch (const error&) {  // split streams: no room in d's stream; nothing changed
                        ASSERT_EQ(seen_by_cache(c, n_seq), seen_by_model(recs));
                        continue;
                    }
                    std::vector<record> copies;
                    for (record& r : recs) {
                        if (!r.seqs.count(s)) continue;
                        if (unified)
                            r.seqs.insert(d);  // the same cells
                        else
                            copies.push_back({r.pos, r.tag, {d}});
                    }
                    recs.insert(recs.end(), copies.begin(), copies.end());
                } else if (op == 5) {
                    if (step % 50 != 0) continue;
                    c.seq_keep(s);
                    for (record& r : recs)
                        r.seqs = r.seqs.count(s) ? std::set<seq_id_t>{s} : std::set<seq_id_t>{};
                    drop_empty(recs);
                } else if (op == 6) {  // a context shift: drop positions 0-1, move the rest down by 2
                    if (c.seq_pos_max(s) < 4) continue;
                    c.seq_rm(s, 0, 2);
                    c.seq_add(s, 2, -1, -2);
                    for (record& r : recs)
                        if (r.pos < 2) r.seqs.erase(s);
                    drop_empty(recs);
                    for (record& r : recs)  // whole cells move, for every sequence sharing them
                        if (r.seqs.count(s) && r.pos >= 2) r.pos -= 2;
                } else if (step % 3 == 0) {  // compaction: invisible to every sequence
                    auto up = c.init_update(true);
                    if (up->get_status() == memory_status::success) up->apply();
                    ASSERT_EQ(c.fragmentation(), 0.0f);
                } else {
                    c.update();
                }
                const seen_t want = seen_by_model(recs);
                ASSERT_EQ(seen_by_cache(c, n_seq), want)
                    << "step " << step << " op " << op << (unified ? " unified" : " split")
                    << (wide ? " wide" : "");
                expect_commit_marks(c);
                for (seq_id_t q = 0; q < static_cast<seq_id_t>(n_seq); ++q) {
                    const auto it = want.find(q);
                    const bool empty = it == want.end() || it->second.empty();
                    ASSERT_EQ(c.seq_pos_min(q), empty ? -1 : it->second.begin()->first);
                    ASSERT_EQ(c.seq_pos_max(q), empty ? -1 : it->second.rbegin()->first);
                }
            }
        }
}

}  // namespace
}  // namespace kvc
