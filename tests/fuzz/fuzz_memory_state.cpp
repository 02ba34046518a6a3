// libFuzzer target: arbitrary bytes as state payloads restored into small memories other than the plain KV
// cache (fuzz_state covers that): recurrent memories (rollback depth 0 and 2, f32 / f16 / bf16 rows, layers
// without r or s, a shared cell, a pending rollback), iSWA memories (a full-size and a window-sized SWA
// cache) and hybrid memories (with plain and iSWA attention), each as a row of `variants`, read in full or
// partial-only. state_check must agree with state_read. A rejected payload must leave the memory byte for
// byte as it was: its state, and every cell and raw row (history planes too), every part of a composite
// memory. An accepted one must save back to bytes that restore into a fresh memory identically; a
// recurrent sequence's must save back to itself. The payloads go through kvcache inspect's parser
// (summarize_memory_state) as well.
// Input: one byte choosing the variant, the destination (seq 0, seq 1 or the whole memory) and the flags,
// then the payload (no buffer header).
#include <string>

#include <kvcache/batch.h>
#include <kvcache/kv_cache_iswa.h>
#include <kvcache/memory_hybrid.h>
#include <kvcache/memory_recurrent.h>
#include <kvcache/state_summary.h>

#include "../recurrent_test_util.h"
#include "fuzz_caches.h"

using namespace kvc;
using namespace kvc::fuzz;

namespace {

// -- recurrent memories --

// Every row of every plane of every tensor, filled from (layer, tensor, plane, cell, byte): no two rows
// alike, so a restore that writes the wrong row or plane shows.
void fill_rows(memory_recurrent& m) {
    for (uint32_t il : m.layer_ids())
        for (bool is_s : {false, true}) {
            if (!(is_s ? m.has_s(il) : m.has_r(il))) continue;
            const tensor_view v = is_s ? m.get_s(il) : m.get_r(il);
            for (int64_t p = 0; p < v.ne[2]; ++p)
                for (int64_t c = 0; c < v.ne[1]; ++c) {
                    std::byte* row = v.row(c, p);
                    for (size_t i = 0; i < v.row_bytes(); ++i)
                        row[i] = static_cast<std::byte>(il * 89 + (is_s ? 53 : 0) + p * 31 + c * 7 + i);
                }
        }
}

using test::place;

// One batch (tokens as (seq, pos)) through batch_allocr, init_batch and apply, as an engine decodes it
// (K/V and state rows are left as they are: fill_rows and the caches' zeroed storage give them content).
void decode(memory_i& m, uint32_t n_seq_max, const std::vector<std::pair<seq_id_t, pos_t>>& tokens) {
    batch_storage b = batch::init(static_cast<int32_t>(tokens.size()), 0, 1);
    for (const auto& [s, p] : tokens) {
        const seq_id_t ids[] = {s};
        b.add(1, p, ids, false);
    }
    batch_allocr a;
    a.init(b.view(), positions_of(m), {.n_seq_max = n_seq_max});
    const auto ctx = m.init_batch(a, 512, false);
    check(ctx->get_status() == memory_status::success);
    do {
        ctx->apply();
    } while (ctx->next());
}

// Tokens [p0, p0 + n) of s.
std::vector<std::pair<seq_id_t, pos_t>> run(seq_id_t s, pos_t p0, pos_t n) {
    std::vector<std::pair<seq_id_t, pos_t>> out;
    for (pos_t p = p0; p < p0 + n; ++p) out.emplace_back(s, p);
    return out;
}

// Two sequences, f32 rows, no rollback; content placed by find_slot.
std::unique_ptr<memory_i> recurrent_f32() {
    recurrent_params p;
    p.layers = {{.n_embd_r = 4, .n_embd_s = 8}, {.n_embd_r = 4, .n_embd_s = 8}};
    p.n_seq_max = 2;
    auto m = std::make_unique<memory_recurrent>(p);
    place(*m, 0, 0, 2);
    fill_rows(*m);
    return m;
}

// Three sequences, f16 rows, rollback depth 2; decoded, then seq 2 shares seq 1's cell and seq 0 has a
// pending rollback of one token (its logical state is in plane 1).
std::unique_ptr<memory_i> recurrent_f16_rollback() {
    recurrent_params p;
    p.layers = {{.n_embd_r = 8, .n_embd_s = 4}, {.n_embd_r = 8, .n_embd_s = 4}};
    p.type_r = p.type_s = dtype::f16;
    p.n_seq_max = 3;
    p.n_rs_seq = 2;
    auto m = std::make_unique<memory_recurrent>(p);
    decode(*m, 3, {{0, 0}, {0, 1}, {0, 2}, {1, 0}, {1, 1}});
    m->seq_cp(1, 2, -1, -1);
    check(m->seq_rm(0, 2, -1));
    fill_rows(*m);
    return m;
}

// Three sequences, rollback depth 2, three model layers: r f32 + s bf16, nothing, s only (so the r/s split
// of the payload is uneven); content placed by find_slot, seq 1 in two steps.
std::unique_ptr<memory_i> recurrent_uneven_layers() {
    recurrent_params p;
    p.layers = {{.n_embd_r = 4, .n_embd_s = 6}, {}, {.n_embd_r = 0, .n_embd_s = 2}};
    p.type_s = dtype::bf16;
    p.n_seq_max = 3;
    p.n_rs_seq = 2;
    auto m = std::make_unique<memory_recurrent>(p);
    place(*m, 1, 0, 3);
    place(*m, 1, 3, 1);
    place(*m, 2, 0, 1);
    fill_rows(*m);
    return m;
}

// Everything a restore could change: cells, tails, head, used and every raw row; checks the invariants.
std::string recurrent_snapshot(const memory_i& mem) {
    const auto& m = dynamic_cast<const memory_recurrent&>(mem);
    m.validate();
    std::string out = m.picture() + " " + std::to_string(m.get_head()) + " " + std::to_string(m.get_used());
    for (uint32_t c = 0; c < m.get_size(); ++c) {
        const auto x = m.cell(c);
        out += " " + std::to_string(x.pos) + "," + std::to_string(x.src) + "," + std::to_string(x.rs_idx) +
               "," + std::to_string(x.depth);
    }
    for (seq_id_t s = 0; s < static_cast<seq_id_t>(m.get_size()); ++s)
        out += " " + std::to_string(m.seq_tail(s));
    for (uint32_t il : m.layer_ids())
        for (bool is_s : {false, true}) {
            if (!(is_s ? m.has_s(il) : m.has_r(il))) continue;
            const const_tensor_view v = is_s ? m.get_s(il) : m.get_r(il);
            for (int64_t p = 0; p < v.ne[2]; ++p)
                for (int64_t c = 0; c < v.ne[1]; ++c)
                    out.append(reinterpret_cast<const char*>(v.row(c, p)), v.row_bytes());
        }
    return out;
}

// -- composite memories --

// Two layers, f16 K/V, head of 32 values: layer 0 slides a window of 4 positions.
kv_cache_params composite_kv(uint32_t kv_size) {
    kv_cache_params p;
    p.layers = {layer_desc{.n_head_kv = 1, .n_embd_head_k = 32, .n_embd_head_v = 32, .is_swa = true},
                layer_desc{.n_head_kv = 1, .n_embd_head_k = 32, .n_embd_head_v = 32}};
    p.kv_size = kv_size;
    p.n_seq_max = 2;
    p.v_trans = false;
    p.n_swa = 4;
    p.swa = swa_type::standard;
    return p;
}

// Both caches of 16 cells; seq 0 with 6 tokens, seq 1 with 2.
std::unique_ptr<memory_i> iswa_full() {
    auto m = std::make_unique<kv_cache_iswa>(
        kv_cache_iswa_params{.kv = composite_kv(16), .sizing = {.swa_full = true}});
    decode(*m, 2, run(0, 0, 6));
    decode(*m, 2, run(1, 0, 2));
    return m;
}

// A base cache of 512 cells and a 256-cell SWA cache that already wrapped around for seq 0.
std::unique_ptr<memory_i> iswa_windowed() {
    auto m = std::make_unique<kv_cache_iswa>(
        kv_cache_iswa_params{.kv = composite_kv(512), .sizing = {.swa_full = false, .n_ubatch = 8}});
    for (pos_t p = 0; p < 300; p += 50) decode(*m, 2, run(0, p, 50));
    decode(*m, 2, run(1, 0, 3));
    return m;
}

// Layer 0 recurrent (r 4, s 8 f32 values), layer 1 attention in 16 cells; rollback depth 1.
memory_hybrid_params hybrid_params() {
    memory_hybrid_params p;
    p.attn = composite_kv(16);
    p.attn.layers[0].has_kv = false;
    p.attn.layers[1].is_swa = false;
    p.recr.layers = {{.n_embd_r = 4, .n_embd_s = 8}, {}};
    p.recr.n_seq_max = 2;
    p.recr.n_rs_seq = 1;
    return p;
}

std::unique_ptr<memory_i> hybrid_plain() {
    auto m = std::make_unique<memory_hybrid>(hybrid_params());
    decode(*m, 2, run(0, 0, 5));
    decode(*m, 2, run(1, 0, 2));
    fill_rows(m->get_recr());
    return m;
}

// The attention part is an iSWA memory (both layers attend, layer 0 through the window).
std::unique_ptr<memory_i> hybrid_iswa() {
    memory_hybrid_params p = hybrid_params();
    p.attn.layers[0].has_kv = true;
    p.attn.layers[1].is_swa = false;
    p.iswa = iswa_sizing{};
    auto m = std::make_unique<memory_hybrid>(p);
    decode(*m, 2, run(0, 0, 7));
    fill_rows(m->get_recr());
    return m;
}

// Everything a restore could change in a KV cache: cells (through the whole state) and heads.
std::string kv_snapshot(const kv_cache& c) {
    const std::vector<uint8_t> bytes = state_seq_get_data(c, seq_all);
    std::string out(bytes.begin(), bytes.end());
    for (uint32_t s = 0; s < c.get_n_stream(); ++s) out += " " + std::to_string(c.head(s));
    return out;
}

std::string iswa_snapshot(const memory_i& mem) {
    const auto& m = dynamic_cast<const kv_cache_iswa&>(mem);
    return kv_snapshot(m.get_base()) + "|" + kv_snapshot(m.get_swa());
}

std::string hybrid_snapshot(const memory_i& mem) {
    const auto& m = dynamic_cast<const memory_hybrid&>(mem);
    const auto* kv = dynamic_cast<const kv_cache*>(&m.get_attn());
    return (kv ? kv_snapshot(*kv) : iswa_snapshot(m.get_attn())) + "|" + recurrent_snapshot(m.get_recr());
}

// -- the table --

// A memory to restore into: a factory (the memory with content) and everything a restore may change.
// exact: a sequence's accepted payload saves back to itself (not so for KV parts, whose cells may be
// placed in another order or fall out of a window).
struct variant {
    std::unique_ptr<memory_i> (*make)();
    std::string (*snapshot)(const memory_i&);
    bool exact;
};

const variant variants[] = {
    {recurrent_f32, recurrent_snapshot, true},
    {recurrent_f16_rollback, recurrent_snapshot, true},
    {recurrent_uneven_layers, recurrent_snapshot, true},
    {iswa_full, iswa_snapshot, false},
    {iswa_windowed, iswa_snapshot, false},
    {hybrid_plain, hybrid_snapshot, false},
    {hybrid_iswa, hybrid_snapshot, false},
};
constexpr int n_memory_variants = static_cast<int>(std::size(variants));
constexpr seq_id_t dests[] = {0, 1, seq_all};

std::vector<uint8_t> payload_of(const memory_i& m, seq_id_t s, state_seq_flags flags) {
    std::vector<uint8_t> out;
    io_vector_writer w(out);
    m.state_write(w, s, flags);
    return out;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
    std::vector<std::vector<uint8_t>> seeds;
    for (int v = 0; v < n_memory_variants; ++v)
        for (int d = 0; d < 3; ++d)
            for (int partial = 0; partial < 2; ++partial) {
                std::vector<uint8_t> seed = {static_cast<uint8_t>(v + n_memory_variants * (d + 3 * partial))};
                const auto bytes = payload_of(*variants[v].make(), dests[d], partial);
                seed.insert(seed.end(), bytes.begin(), bytes.end());
                seeds.push_back(std::move(seed));
            }
    write_seeds(seeds);
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size < 1) return 0;
    const variant& v = variants[data[0] % n_memory_variants];
    const seq_id_t dest = dests[data[0] / n_memory_variants % 3];
    const state_seq_flags flags = data[0] / n_memory_variants / 3 % 2 ? state_seq_flag_partial_only : 0;
    const std::span<const uint8_t> payload(data + 1, size - 1);
    try {  // kvcache inspect's parser never crashes either
        (void)summarize_memory_state(payload);
    } catch (const error&) {}
    auto mem = v.make();
    const std::vector<uint8_t> before = state_seq_get_data(*mem, seq_all);
    const std::string raw_before = v.snapshot(*mem);
    bool check_ok = true;
    try {
        io_span_reader r(payload, true);
        mem->state_check(r, dest, flags);
    } catch (const error&) {
        check_ok = false;
    }
    try {
        state_set_payload(*mem, payload, dest, flags);
    } catch (const error&) {
        check(!check_ok);
        check(state_seq_get_data(*mem, seq_all) == before);
        check(v.snapshot(*mem) == raw_before);
        return 0;
    }
    check(check_ok);
    (void)v.snapshot(*mem);  // the invariants hold
    // kvcache inspect reads what a memory accepts (given its layout and flags, as a session file holds them)
    check(summarize_memory_state(payload, mem->state_layout(), flags).bytes == payload.size());
    if (dest != seq_all && v.exact)
        check(payload_of(*mem, dest, flags) == std::vector<uint8_t>(payload.begin(), payload.end()));
    const std::vector<uint8_t> saved = state_seq_get_data(*mem, seq_all);
    auto fresh = v.make();
    state_seq_set_data(*fresh, saved, seq_all);  // must not throw
    check(state_seq_get_data(*fresh, seq_all) == saved);
    return 0;
}
