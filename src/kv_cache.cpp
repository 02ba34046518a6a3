// kv_cache: construction, placement (find_slot / apply_ubatch / prepare) and sequence operations. The
// context and the attention inputs are in kv_cache_context.cpp; every K/V byte moves through kv_storage.
#include <algorithm>
#include <cassert>
#include <limits>

#include <fmt/format.h>
#include <kvcache/kv_cache.h>
#include <kvcache/kv_storage_engine.h>
#include <kvcache/limits.h>
#include <kvcache/memory_budget.h>

#include "detail/kv_cache_layer.h"
#include "detail/kv_cache_prefix.h"
#include "detail/kv_prefix_part.h"
#include "prefix/prefix_coordinator.h"

namespace kvc {

const char* to_string(swa_type t) {
    switch (t) {
        case swa_type::none:
            return "none";
        case swa_type::standard:
            return "standard";
        case swa_type::chunked:
            return "chunked";
        case swa_type::symmetric:
            return "symmetric";
    }
    return "unknown";
}

bool is_masked_swa(uint32_t n_swa, swa_type type, pos_t p0, pos_t p1) {
    const int64_t d = int64_t{p1} - p0;
    switch (type) {
        case swa_type::none:
            return false;
        case swa_type::standard:
            return d >= n_swa;
        case swa_type::chunked:
            return n_swa > 0 && p0 < int64_t{p1} / n_swa * n_swa;
        case swa_type::symmetric: {
            const int64_t h = n_swa / 2;
            return d < -h || d > h;
        }
    }
    return false;
}

uint32_t slot_info::head() const {
    if (idxs.empty() || idxs[0].empty())
        throw error(errc::invalid_state, "slot_info::head: the slot is empty");
    return idxs[0][0];
}

bool slot_info::is_contiguous() const {
    if (idxs.size() != 1) return false;
    for (size_t i = 1; i < idxs[0].size(); ++i)
        if (idxs[0][i] != idxs[0][i - 1] + 1) return false;
    return true;
}

namespace {

// Values per K or V row (heads x head size) a layer may declare: far above any model's, and low enough
// that no size computed from it overflows.
constexpr uint64_t max_row_values = uint64_t{1} << 24;

// K/V bytes of every cell of every stream for the layers kept (saturating: p is not checked yet).
uint64_t reserve_bytes_of(const kv_cache_params& p, std::span<const uint32_t> kept) {
    const auto values = [](uint32_t heads, uint32_t per_head) { return uint64_t{heads} * per_head; };
    const auto bytes = [](dtype t, uint64_t n) {
        return is_valid(t) ? mul_sat(n / block_size(t), type_size(t)) : uint64_t{0};
    };
    uint64_t e_vmax = 0;  // transposed V: every layer's rows are as wide as the widest
    for (uint32_t il : kept)
        e_vmax = std::max(e_vmax, values(p.layers[il].n_head_kv, p.layers[il].n_embd_head_v));
    uint64_t cell = 0;  // K and V bytes of one cell over every layer
    for (uint32_t il : kept) {
        const layer_desc& d = p.layers[il];
        cell = add_sat(cell, bytes(p.type_k, values(d.n_head_kv, d.n_embd_head_k)));
        cell = add_sat(cell, p.v_trans && is_valid(p.type_v)
                                 ? mul_sat(e_vmax, type_size(p.type_v))
                                 : bytes(p.type_v, values(d.n_head_kv, d.n_embd_head_v)));
    }
    const uint64_t n_stream = p.unified ? 1 : p.n_seq_max;
    return mul_sat(cell, mul_sat(p.kv_size, n_stream));
}

}  // namespace

struct kv_cache::journal {
    struct entry {
        uint32_t stream;
        std::vector<uint32_t> idxs;
        cells_snapshot snap;
        size_t released;  // the stream's released() before: a rollback must not leave releases behind
    };
    std::vector<entry> entries;
};

// -- construction --

kv_cache::kv_cache(kv_cache_params params) : params_(std::move(params)) {
    const kv_cache_params& p = params_;
    set_shape(
        {.n_seq_max = p.n_seq_max, .n_pos = p.n_pos, .n_layer = static_cast<uint32_t>(p.layers.size())});
    const auto bad = [](const std::string& msg) { throw error(errc::invalid_argument, "kv_cache: " + msg); };
    if (p.kv_size == 0) bad("kv_size must be positive");
    if (p.n_seq_max == 0) bad("n_seq_max must be at least 1");
    check_limit("kv_cache: n_seq_max", "sequences", p.n_seq_max, get_limits().sequences);
    if (p.n_pad == 0 || p.kv_size % p.n_pad != 0)
        bad(fmt::format("kv_size {} must be a positive multiple of n_pad {}", p.kv_size, p.n_pad));
    if (p.n_pos == 0) bad("n_pos must be at least 1");
    if (!is_valid(p.type_k) || !is_valid(p.type_v)) bad("invalid type_k or type_v");
    if (p.v_trans && is_quantized(p.type_v))
        bad(fmt::format("transposed V needs a float type, not {} (quantized V needs v_trans = false)",
                        to_string(p.type_v)));
    if (p.swa == swa_type::chunked && p.n_swa == 0) bad("chunked SWA needs n_swa > 0");
    if (p.layers.empty()) bad("no layers");
    if (p.engine && p.allocator) bad("an engine that owns the storage (engine) takes no allocator");
    if (!p.unified && p.n_seq_max > 65536) bad("one stream per sequence allows at most 65536 sequences");

    const uint32_t n_stream = p.unified ? 1 : p.n_seq_max;
    std::vector<uint32_t> kept;  // model indices of the layers this cache holds
    for (uint32_t il = 0; il < p.layers.size(); ++il) {
        const layer_desc& d = p.layers[il];
        if (!d.has_kv || (p.filter && !p.filter(il))) continue;
        if (d.n_head_kv == 0 || d.n_embd_head_k == 0 || d.n_embd_head_v == 0)
            bad(fmt::format("layer {}: n_head_kv, n_embd_head_k and n_embd_head_v must be positive", il));
        if (uint64_t{d.n_head_kv} * std::max(d.n_embd_head_k, d.n_embd_head_v) > max_row_values)
            bad(fmt::format("layer {}: {} KV heads x {} values is over the limit of {} values per row", il,
                            d.n_head_kv, std::max(d.n_embd_head_k, d.n_embd_head_v), max_row_values));
        if (d.n_embd_head_k % block_size(p.type_k) != 0)
            bad(fmt::format("layer {}: key head of {} values is not a whole number of {} blocks", il,
                            d.n_embd_head_k, to_string(p.type_k)));
        if (!p.v_trans && d.n_embd_head_v % block_size(p.type_v) != 0)
            bad(fmt::format("layer {}: value head of {} values is not a whole number of {} blocks", il,
                            d.n_embd_head_v, to_string(p.type_v)));
        const uint32_t rot = d.rope.n_rot > 0 ? static_cast<uint32_t>(d.rope.n_rot) : d.n_embd_head_k;
        if (d.rope.type != rope_type::none && (rot % 2 != 0 || rot > d.n_embd_head_k))
            bad(fmt::format("layer {}: n_rot {} must be even and at most the key head size {}", il, rot,
                            d.n_embd_head_k));
        kept.push_back(il);
    }
    if (kept.empty()) bad("the filter keeps no layer");
    // every byte the cache may grow to, before anything is allocated
    check_memory_budget("kv_cache", reserve_bytes_of(p, kept), p.memory_budget,
                        fmt::format("{} layers x {} cells x {} streams", kept.size(), p.kv_size, n_stream));
    layer_map_.assign(p.layers.size(), -1);
    for (uint32_t il : kept) {
        layer_map_[il] = static_cast<int32_t>(layers_.size());
        layers_.push_back({il, p.layers[il]});
    }
    layer_ids_ = std::move(kept);
    if (p.prefix.enabled) check_prefix_params(p, n_stream);
    kv_storage_params sp;
    for (const layer& l : layers_)
        sp.layers.push_back({l.desc.n_head_kv, l.desc.n_embd_head_k, l.desc.n_embd_head_v, l.desc.rope});
    sp.type_k = p.type_k;
    sp.type_v = p.type_v;
    sp.v_trans = p.v_trans;
    sp.kv_size = p.kv_size;
    sp.n_stream = n_stream;
    sp.allocator = p.allocator;
    storage_ = p.engine ? make_engine_kv_storage(std::move(sp), layer_ids_, *p.engine)
                        : make_host_kv_storage(std::move(sp));
    granule_ = storage_->commit_granule();
    streams_.reserve(n_stream);
    for (uint32_t s = 0; s < n_stream; ++s) streams_.emplace_back(p.kv_size, p.n_seq_max);
    heads_.assign(n_stream, 0);
    committed_.assign(n_stream, granule_ == 0 ? p.kv_size : 0);
    if (p.prefix.enabled) prefix_init();
}

kv_cache::~kv_cache() = default;

uint64_t kv_cache::reserve_bytes(const kv_cache_params& p) {
    std::vector<uint32_t> kept;
    for (uint32_t il = 0; il < p.layers.size(); ++il)
        if (p.layers[il].has_kv && (!p.filter || p.filter(il))) kept.push_back(il);
    return reserve_bytes_of(p, kept);
}

uint64_t kv_cache::committed_bytes() const {
    uint64_t cells = 0;
    for (uint32_t n : committed_) cells += n;
    return cells * cell_bytes();
}

memory_breakdown kv_cache::get_memory_breakdown() const {
    const uint64_t cell = cell_bytes();
    memory_breakdown b;
    b.seq.assign(params_.n_seq_max, 0);
    std::vector<uint32_t> used;
    for (uint32_t s = 0; s < streams_.size(); ++s) {
        const kv_cells& c = streams_[s];
        b.reserved += uint64_t{params_.kv_size} * cell;
        used.clear();
        c.used_cells(used);
        for (uint32_t i : used) {
            (c.seq_count(i) == 0 ? b.cached : b.used) += cell;  // no sequence: only the prefix cache holds it
            for (seq_id_t q : c.seqs(i)) b.seq[static_cast<size_t>(q)] += cell;
        }
        if (prefix_) b.pinned += uint64_t{prefix_->index.pinned_blocks(s)} * prefix_->bs() * cell;
    }
    b.committed = committed_bytes();
    assert(b.committed >= b.used + b.cached);  // every placement moves the commit mark first
    b.free = b.committed - b.used - b.cached;
    return b;
}

void kv_cache::fit_storage(uint32_t stream, bool release) {
    if (granule_ == 0) return;
    const uint64_t g = granule_;
    const uint64_t extent = (uint64_t{streams_[stream].used_max_p1()} + g - 1) / g * g;
    const auto mark = static_cast<uint32_t>(std::min<uint64_t>(params_.kv_size, extent));
    if (mark == committed_[stream] || (!release && mark < committed_[stream])) return;
    committed_[stream] = mark;
    storage_->set_committed(stream, mark);
}

void kv_cache::fit_storage_of(seq_id_t seq_id) {
    if (seq_id != seq_all && streams_.size() > 1) {
        fit_storage(seq_to_stream(seq_id));
        return;
    }
    for (uint32_t s = 0; s < streams_.size(); ++s) fit_storage(s);
}

// -- shape --

uint32_t kv_cache::seq_to_stream(seq_id_t s) const {
    check_seq(s, "seq_to_stream");
    return params_.unified ? 0 : static_cast<uint32_t>(s);
}

bool kv_cache::has_layer(uint32_t il) const {
    return il < layer_map_.size() && layer_map_[il] >= 0;
}

const kv_cells& kv_cache::cells(uint32_t stream) const {
    if (stream >= streams_.size())
        throw error(errc::out_of_range,
                    fmt::format("kv_cache: stream {} not in [0, {})", stream, streams_.size()));
    return streams_[stream];
}

uint32_t kv_cache::head(uint32_t stream) const {
    cells(stream);
    return heads_[stream];
}

bool kv_cache::get_has_shift() const {
    return std::any_of(streams_.begin(), streams_.end(), [](const kv_cells& c) { return c.get_has_shift(); });
}

uint32_t kv_cache::own_layer(uint32_t il) const {
    if (il >= layer_map_.size())
        throw error(errc::out_of_range,
                    fmt::format("kv_cache: no model layer {} (the model has {})", il, layer_map_.size()));
    if (layer_map_[il] < 0)
        throw error(errc::out_of_range, fmt::format("kv_cache: model layer {} has no K/V in this cache", il));
    return static_cast<uint32_t>(layer_map_[il]);
}

void kv_cache::check_seq(seq_id_t s, const char* what) const {
    if (s < 0 || static_cast<uint32_t>(s) >= params_.n_seq_max)
        throw error(errc::out_of_range,
                    fmt::format("{}: seq_id {} not in [0, {})", what, s, params_.n_seq_max));
}

size_t kv_cache::size_bytes(kv_part part) const {
    size_t n = 0;
    for (uint32_t li = 0; li < layers_.size(); ++li) n += storage_->bytes(part, li);
    return n;
}

size_t kv_cache::layer_bytes(kv_part part, uint32_t il) const {
    return storage_->bytes(part, own_layer(il));
}

void kv_cache::read_row(kv_part part, uint32_t il, uint32_t stream, uint32_t cell,
                        std::span<float> out) const {
    const uint32_t li = own_layer(il);
    cells(stream);
    const size_t e = part == kv_part::k ? storage_->e_k(li) : storage_->e_v(li);
    if (cell >= params_.kv_size || out.size() < e)
        throw error(errc::out_of_range,
                    fmt::format("read_row: cell {} of {} / output of {} values (a row has {})", cell,
                                params_.kv_size, out.size(), e));
    storage_->read_row(part, li, row(stream, cell), out);
}

bool kv_cache::get_can_shift() const {
    // Multi-section (M-RoPE) positions cannot be shifted by one delta per cell.
    return params_.n_pos == 1;
}

// -- placement --

bool kv_cache::find_slot_group(uint32_t stream, uint32_t n, bool cont, std::vector<uint32_t>& out) const {
    const kv_cells& cells = streams_[stream];
    const uint32_t kv_size = params_.kv_size;
    uint32_t head_cur = heads_[stream];
    if (head_cur > cells.get_used() + 2 * uint64_t{n}) head_cur = 0;  // prefer refilling the front
    if (n > kv_size) return false;

    if (params_.swa == swa_type::none) {  // only empty cells are usable: search by words
        if (!cont) return cells.find_free(n, head_cur, out);
        const auto run = cells.find_contiguous(n, head_cur);
        if (!run) return false;
        for (uint32_t i = 0; i < n; ++i) out.push_back(*run + i);
        return true;
    }

    // SWA: a used cell of one sequence is reusable once no later token of that sequence can see it.
    const auto usable = [&](uint32_t idx) {
        if (cells.is_empty(idx)) return true;
        if (cells.seq_count(idx) != 1) return false;
        const seq_id_t q = cells.seq_get(idx);
        // a cell the prefix cache holds keeps its rows for other sequences; with a prefix cache, a
        // sequence keeps its newest cell (a chunked window masks it at a chunk's end), so that its
        // positions go on from there (design D30)
        const pos_t max = cells.seq_pos_max(q);
        return !cells.is_held(idx) && !(prefix_ && cells.pos_get(idx) == max) &&
               is_masked_swa(params_.n_swa, params_.swa, cells.pos_get(idx), max + 1);
    };
    const size_t start = out.size();
    const uint32_t n_test = cont ? n : 1;
    uint64_t tested = 0;
    while (true) {
        if (head_cur + uint64_t{n_test} > kv_size) {
            tested += kv_size - head_cur;
            head_cur = 0;
            if (tested >= kv_size) break;
            continue;
        }
        for (uint32_t i = 0; i < n_test; ++i) {
            const uint32_t idx = head_cur++;
            ++tested;
            if (usable(idx)) {
                out.push_back(idx);
            } else if (cont) {
                break;
            }
        }
        if (out.size() - start == n) return true;
        if (cont) out.resize(start);
        if (tested >= kv_size) break;
    }
    out.resize(start);
    return false;
}

slot_info kv_cache::find_slot(const ubatch& ub, bool cont) const {
    slot_info res;
    if (ub.n_tokens == 0) return res;
    const uint32_t n_groups = streams_.size() > 1 ? ub.n_seqs_unq : 1;  // check_ubatch: a group per sequence
    const uint32_t size = ub.n_tokens / n_groups;
    slot_info s;
    s.strm.resize(n_groups);
    s.idxs.resize(n_groups);
    for (uint32_t k = 0; k < n_groups; ++k) {
        const uint32_t stream = streams_.size() > 1 ? static_cast<uint32_t>(ub.seq_id_unq[k]) : 0;
        s.strm[k] = stream;
        if (!find_slot_group(stream, size, cont, s.idxs[k])) return res;
    }
    s.s0 = *std::min_element(s.strm.begin(), s.strm.end());
    s.s1 = *std::max_element(s.strm.begin(), s.strm.end());
    return s;
}

void kv_cache::lower_head(uint32_t stream, uint32_t cell) {
    if (cell < heads_[stream]) heads_[stream] = cell;
}

void kv_cache::check_ubatch(const ubatch& ub) const {
    const size_t n = ub.n_tokens;
    bool ok = ub.n_pos >= 1 && ub.pos.size() >= n * ub.n_pos && ub.seq_id_begin.size() == n + 1 &&
              ub.seq_id_begin[0] == 0 && ub.seq_id_begin[n] == ub.seq_id_data.size();
    for (size_t i = 0; ok && i < n; ++i) ok = ub.seq_id_begin[i] < ub.seq_id_begin[i + 1];
    if (!ok) throw error(errc::invalid_argument, fmt::format("kv_cache: malformed ubatch of {} tokens", n));
    for (uint32_t i = 0; i < n; ++i) {
        for (seq_id_t s : ub.seq_ids(i)) check_seq(s, "kv_cache: ubatch");
        if (ub.pos[i] < 0)
            throw error(errc::invalid_argument,
                        fmt::format("kv_cache: token {} has position {}", i, ub.pos[i]));
    }
    if (streams_.size() == 1 || n == 0) return;
    // One stream per sequence: the ubatch is n_seqs_unq equal groups, group k all of seq_id_unq[k] only.
    const uint32_t n_groups = ub.n_seqs_unq;
    if (n_groups == 0 || n % n_groups != 0 || ub.seq_id_unq.size() != n_groups)
        throw error(
            errc::invalid_argument,
            fmt::format("kv_cache: a ubatch of {} tokens cannot be {} equal groups of one sequence each "
                        "(one stream per sequence)",
                        n, n_groups));
    const size_t size = n / n_groups;
    for (uint32_t t = 0; t < n; ++t) {
        const auto ids = ub.seq_ids(t);
        const seq_id_t q = ub.seq_id_unq[t / size];
        if (ids.size() != 1 || ids[0] != q)
            throw error(
                errc::invalid_argument,
                fmt::format("kv_cache: token {} of a ubatch must belong to seq {} only (one stream per "
                            "sequence)",
                            t, q));
    }
}

void kv_cache::apply_ubatch(const slot_info& sinfo, const ubatch& ub, journal* j) {
    // prepare checked the ubatch (check_ubatch) and found the slot (find_slot) for it
    assert(!sinfo.empty() && sinfo.n_stream() * sinfo.size() == ub.n_tokens);
    if (!j) {  // for real: all or nothing, as an allocation may fail half-way (issue 21)
        journal own;
        const std::vector<uint32_t> saved_heads = heads_;
        try {
            apply_ubatch(sinfo, ub, &own);
            prefix_record(sinfo, ub);  // all or nothing too
        } catch (...) {
            for (auto e = own.entries.rbegin(); e != own.entries.rend(); ++e) {
                streams_[e->stream].set(e->idxs, e->snap);
                streams_[e->stream].truncate_released(e->released);
            }
            heads_ = saved_heads;
            throw;
        }
        for (uint32_t s : sinfo.strm) fit_storage(s);  // before the engine writes the rows
        return;
    }
    // An SWA-dead cell the ubatch reuses took an old position of its one sequence: to keep every sequence
    // gap-free, the sequence first leaves everything up to that position (a range at the front of its
    // index: no cost per cell kept). Only cells slid out of the window go, so a prefix tracker need not
    // hear of it (its blocks over them are skipped when published); a trial placement rolls it back, and
    // keeps its memory.
    std::vector<std::pair<seq_id_t, pos_t>> max_rm;  // per sequence: highest position of a reused cell
    for (size_t k = 0; k < sinfo.n_stream(); ++k) {
        const kv_cells& cells = streams_[sinfo.strm[k]];
        for (uint32_t c : sinfo.idxs[k]) {
            if (cells.is_empty(c)) continue;
            const seq_id_t q = cells.seq_get(c);
            auto it = std::find_if(max_rm.begin(), max_rm.end(), [q](const auto& e) { return e.first == q; });
            if (it == max_rm.end())
                max_rm.emplace_back(q, cells.pos_get(c));
            else
                it->second = std::max(it->second, cells.pos_get(c));
        }
    }
    for (const auto& [q, m] : max_rm) {
        const uint32_t st = seq_to_stream(q);
        kv_cells& cells = streams_[st];
        const pos_t pmin = cells.seq_pos_min(q);
        if (j) {
            std::vector<uint32_t> idxs;
            cells.seq_cells(q, pmin, m + 1, idxs);
            auto snap = cells.cp(idxs);
            j->entries.push_back({st, std::move(idxs), std::move(snap), cells.released().size()});
        }
        lower_head(st, cells.seq_rm_range(q, pmin, m + 1));
        if (!j) prefix_sync(q, /*slid=*/true);  // held cells it left are cached now
    }
    // the cells as the tokens find them (a rollback empties them, then gives back what the ranges took:
    // each index changes at its ends only)
    if (j)
        for (size_t k = 0; k < sinfo.n_stream(); ++k)
            j->entries.push_back({sinfo.strm[k], sinfo.idxs[k], streams_[sinfo.strm[k]].cp(sinfo.idxs[k]),
                                  streams_[sinfo.strm[k]].released().size()});
    const uint32_t n = ub.n_tokens;
    uint32_t i = 0;  // token index: group by group, cell by cell
    for (size_t k = 0; k < sinfo.n_stream(); ++k) {
        kv_cells& cells = streams_[sinfo.strm[k]];
        for (uint32_t c : sinfo.idxs[k]) {
            cells.pos_set(c, ub.pos[i]);
            if (ub.n_pos >= 3) cells.ext_set(c, {ub.pos[i + 2 * n], ub.pos[i + n]});
            for (seq_id_t s : ub.seq_ids(i)) cells.seq_add(c, s);
            ++i;
        }
    }
    for (size_t k = 0; k < sinfo.n_stream(); ++k) heads_[sinfo.strm[k]] = sinfo.idxs[k].back() + 1;
}

std::vector<slot_info> kv_cache::prepare(std::span<const ubatch> ubatches) {
    journal j;
    const std::vector<uint32_t> saved_heads = heads_;
    std::vector<slot_info> res;
    const auto rollback = [&] {
        for (auto e = j.entries.rbegin(); e != j.entries.rend(); ++e) {
            streams_[e->stream].set(e->idxs, e->snap);
            streams_[e->stream].truncate_released(e->released);
        }
        heads_ = saved_heads;  // every stream's own head (design D3)
    };
    for (const ubatch& ub : ubatches) check_ubatch(ub);  // the only validation: placement relies on it
    if (prefix_ && !prefix_make_room_for(ubatches)) return res;  // evicts cached blocks only if that fits
    try {  // an allocation failing mid-way must not leave the trial placement behind
        for (const ubatch& ub : ubatches) {
            slot_info sinfo = find_slot(ub);
            if (sinfo.empty()) {
                res.clear();
                break;
            }
            apply_ubatch(sinfo, ub, &j);  // later ubatches see earlier ones
            res.push_back(std::move(sinfo));
        }
    } catch (...) {
        rollback();
        throw;
    }
    rollback();
    return res;
}

std::vector<uint64_t> kv_cache::rows_of(const slot_info& sinfo) const {
    std::vector<uint64_t> rows;
    rows.reserve(sinfo.n_stream() * sinfo.size());
    for (size_t k = 0; k < sinfo.n_stream(); ++k)
        for (uint32_t c : sinfo.idxs[k]) rows.push_back(row(sinfo.strm[k], c));
    return rows;
}

uint32_t kv_cache::get_n_kv(const slot_info& sinfo) const {
    const uint64_t pad = std::max<uint64_t>(1, std::max(params_.n_pad, params_.n_kv_pad));
    uint32_t n_kv = 0;
    for (uint32_t s : sinfo.strm) {
        const uint64_t used = streams_[s].used_max_p1();
        const uint64_t padded = std::max(pad, (used + pad - 1) / pad * pad);
        n_kv = std::max(n_kv, static_cast<uint32_t>(std::min<uint64_t>(params_.kv_size, padded)));
    }
    return n_kv;
}

// -- memory_i: batches --

memory_context_ptr kv_cache::init_batch(batch_allocr& balloc, uint32_t n_ubatch, bool /*embd_all*/) {
    for (seq_id_t s : balloc.seq_id_unq()) check_seq(s, "init_batch");
    balloc.split_reset();
    std::vector<ubatch> ubatches;
    while (true) {
        ubatch ub = streams_.size() == 1 ? balloc.split_simple(n_ubatch) : balloc.split_equal(n_ubatch, true);
        if (ub.empty()) break;
        ubatches.push_back(std::move(ub));
    }
    if (balloc.get_n_used() < balloc.get_n_tokens())
        return memory_context_ptr(
            new kv_cache_context(*this, memory_status::failed_prepare, kv_cache_context::kind::batch));
    return init_ubatches(std::move(ubatches), {balloc.out_ids().begin(), balloc.out_ids().end()});
}

memory_context_ptr kv_cache::init_ubatches(std::vector<ubatch> ubatches, std::vector<int32_t> out_ids) {
    // placement does not depend on the K rows: the pending shifts are applied only for a batch that fits,
    // so a failed prepare leaves them pending, as everything else
    std::vector<slot_info> sinfos = prepare(ubatches);
    if (sinfos.empty())
        return memory_context_ptr(
            new kv_cache_context(*this, memory_status::failed_prepare, kv_cache_context::kind::batch));
    if (params_.auto_update) update();  // no-op without pending shifts
    return memory_context_ptr(
        new kv_cache_context(*this, std::move(ubatches), std::move(sinfos), std::move(out_ids)));
}

memory_context_ptr kv_cache::init_full() {
    return memory_context_ptr(
        new kv_cache_context(*this, memory_status::success, kv_cache_context::kind::full));
}

memory_context_ptr kv_cache::init_update(bool optimize) {
    const float frag = fragmentation();
    const bool compacting =
        frag > 0.0f && (optimize || (params_.compact_threshold > 0.0f && frag > params_.compact_threshold));
    const memory_status st =
        get_has_shift() || compacting ? memory_status::success : memory_status::no_update;
    return memory_context_ptr(new kv_cache_context(
        *this, st, compacting ? kv_cache_context::kind::compact_update : kv_cache_context::kind::update));
}

float kv_cache::fragmentation() const {
    float worst = 0.0f;
    for (const kv_cells& c : streams_) {
        const uint32_t top = c.used_max_p1();
        if (top > 0)
            worst = std::max(worst, static_cast<float>(top - c.get_used()) / static_cast<float>(top));
    }
    return worst;
}

uint32_t kv_cache::compact() {
    // Sources are used cells above every destination hole: no copy reads a row another one wrote, so the
    // rows move in one batch at the end.
    std::vector<row_copy> copies;
    for (uint32_t s = 0; s < streams_.size(); ++s) {
        kv_cells& c = streams_[s];
        std::vector<uint32_t> used;
        c.used_cells(used);
        // the highest used cells fill the lowest holes, until every cell sits below the used count
        size_t hi = used.size();
        uint32_t hole = 0;
        while (hi > 0) {
            while (hole < c.size() && !c.is_empty(hole)) ++hole;
            const uint32_t from = used[hi - 1];
            if (hole >= from) break;
            c.mv(from, hole);
            prefix_moved(s, from, hole);
            copies.push_back({row(s, from), row(s, hole)});
            --hi;
        }
        heads_[s] = c.get_used();
    }
    storage_->copy_rows(copies);
    fit_storage_of(seq_all);  // after the copies: the rows above the used count go back
    return static_cast<uint32_t>(copies.size());
}

void kv_cache::k_shift() {
    // Cells moved together share their delta (a context shift moves a whole suffix by one amount): sorted
    // by delta, the storage builds one rotation table per delta and piece. Every row is decoded, rotated
    // and encoded again, whatever the K type (design D4), as a pure rotation (design D5).
    std::vector<row_shift> shifts;
    std::vector<uint32_t> used;
    for (uint32_t s = 0; s < streams_.size(); ++s) {
        const kv_cells& cells = streams_[s];
        used.clear();
        cells.used_cells(used);
        for (uint32_t i : used)
            if (cells.get_shift(i) != 0) shifts.push_back({cells.get_shift(i), row(s, i)});
    }
    std::sort(shifts.begin(), shifts.end(), [](const row_shift& a, const row_shift& b) {
        return a.delta != b.delta ? a.delta < b.delta : a.row < b.row;
    });
    storage_->shift_k(shifts, params_.exec);
}

bool kv_cache::update() {
    if (!get_has_shift()) return false;
    if (!get_can_shift())
        throw error(errc::unsupported, "kv_cache::update: positions of an M-RoPE cache cannot be shifted");
    k_shift();
    for (kv_cells& c : streams_) c.reset_shift();
    return true;
}

// -- memory_i: sequences --

void kv_cache::clear(bool data) {
    prefix_reset();
    for (kv_cells& c : streams_) c.reset();
    std::fill(heads_.begin(), heads_.end(), 0);
    if (data) storage_->clear();
    fit_storage_of(seq_all);
}

bool kv_cache::seq_rm(seq_id_t seq_id, pos_t p0, pos_t p1) {
    if (seq_id != seq_all) check_seq(seq_id, "seq_rm");
    remove(seq_id, p0, p1);
    fit_storage_of(seq_id);
    return true;
}

void kv_cache::remove(seq_id_t seq_id, pos_t p0, pos_t p1) {
    prefix_before_rm(seq_id, p0, p1);
    if (seq_id == seq_all) {
        for (uint32_t s = 0; s < streams_.size(); ++s)
            lower_head(s, streams_[s].seq_rm_range(seq_all, p0, p1));
    } else {
        const uint32_t s = seq_to_stream(seq_id);
        lower_head(s, streams_[s].seq_rm_range(seq_id, p0, p1));
    }
    prefix_sync(seq_id);
}

void kv_cache::seq_cp(seq_id_t src, seq_id_t dst, pos_t p0, pos_t p1) {
    check_seq(src, "seq_cp");
    check_seq(dst, "seq_cp");
    if (src == dst) return;
    const uint32_t ss = seq_to_stream(src), sd = seq_to_stream(dst);
    if (ss == sd) {
        prefix_before_cp(src, dst, p0, p1);
        streams_[ss].seq_cp_range(src, dst, p0, p1);
        return;
    }
    // Across streams (design D10): the cells are copied, with their K/V rows, into free cells of dst's
    // stream right away. Rows keep their pending shift, which the next update applies in both streams.
    const kv_cells& from = streams_[ss];
    kv_cells& to = streams_[sd];
    const auto entries = from.seq_entries(src, p0, p1);
    std::vector<uint32_t> free;
    if (!prefix_make_room(sd, static_cast<uint32_t>(entries.size())) ||
        !to.find_free(static_cast<uint32_t>(entries.size()), heads_[sd], free))
        throw error(errc::invalid_state,
                    fmt::format("seq_cp: stream {} of seq {} has {} free cells, {} needed", sd, dst,
                                to.size() - to.get_used(), entries.size()));
    prefix_before_cp(src, dst, p0, p1);  // after the only check that can fail
    std::vector<row_copy> copies(entries.size());
    for (size_t k = 0; k < entries.size(); ++k) {
        const uint32_t c_src = entries[k].second, c_dst = free[k];
        const pos_t shift = from.get_shift(c_src);
        to.pos_set(c_dst, entries[k].first - shift);  // the position the rows were written at
        to.seq_add(c_dst, dst);
        to.ext_set(c_dst, from.ext_get(c_src));
        if (shift != 0) to.pos_add(c_dst, shift);
        copies[k] = {row(ss, c_src), row(sd, c_dst)};
    }
    fit_storage(sd);
    storage_->copy_rows(copies);
    prefix_copied(dst, entries, free);
}

void kv_cache::seq_keep(seq_id_t seq_id) {
    check_seq(seq_id, "seq_keep");
    const uint32_t keep = seq_to_stream(seq_id);
    for (uint32_t s = 0; s < streams_.size(); ++s) {
        if (s == keep || prefix_) {  // with a prefix cache, other streams keep their cached cells
            lower_head(s, streams_[s].seq_keep_all(seq_id));
        } else if (streams_[s].get_used() > 0) {  // design D9: other streams hold only other sequences
            streams_[s].reset();
            heads_[s] = 0;
        }
    }
    prefix_sync(seq_all);
    fit_storage_of(seq_all);
}

void kv_cache::seq_add(seq_id_t seq_id, pos_t p0, pos_t p1, pos_t shift) {
    check_seq(seq_id, "seq_add");
    if (params_.n_pos > 1)
        throw error(errc::unsupported, "seq_add: positions of an M-RoPE cache cannot be shifted");
    if (shift == 0) return;
    if (p0 < 0) p0 = 0;
    if (p1 >= 0 && p0 >= p1) return;  // p1 < 0: to the end, INT32_MAX included (as seq_rm and seq_div)
    prefix_before_shift(seq_id, p0, p1);
    const uint32_t s = seq_to_stream(seq_id);
    const uint32_t lowest = streams_[s].seq_add_range(seq_id, p0, p1, shift);
    heads_[s] = lowest != params_.kv_size ? lowest : 0;  // as upstream: back to the front when nothing freed
    fit_storage(s);
}

void kv_cache::seq_div(seq_id_t seq_id, pos_t p0, pos_t p1, int d) {
    check_seq(seq_id, "seq_div");
    if (params_.n_pos > 1)
        throw error(errc::unsupported, "seq_div: positions of an M-RoPE cache cannot be shifted");
    if (d < 1) throw error(errc::invalid_argument, fmt::format("seq_div: divisor {} must be >= 1", d));
    if (d == 1) return;
    prefix_before_shift(seq_id, p0, p1);
    streams_[seq_to_stream(seq_id)].seq_div_range(seq_id, p0, p1, d);
}

pos_t kv_cache::seq_pos_min(seq_id_t seq_id) const {
    check_seq(seq_id, "seq_pos_min");
    return streams_[seq_to_stream(seq_id)].seq_pos_min(seq_id);
}

pos_t kv_cache::seq_pos_max(seq_id_t seq_id) const {
    check_seq(seq_id, "seq_pos_max");
    return streams_[seq_to_stream(seq_id)].seq_pos_max(seq_id);
}

}  // namespace kvc
