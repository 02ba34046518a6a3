// memory_recurrent: construction, placement (find_slot / prepare), contexts, sequence operations and
// inspection. State payloads are in memory_recurrent_state.cpp.
#include <algorithm>
#include <cassert>
#include <limits>
#include <new>
#include <tuple>

#include <fmt/format.h>
#include <kvcache/limits.h>
#include <kvcache/memory_budget.h>
#include <kvcache/memory_recurrent.h>

#include "detail/memory_recurrent_impl.h"
#include "detail/recurrent_prefix.h"
#include "detail/recurrent_prefix_part.h"
#include "prefix/prefix_coordinator.h"

namespace kvc {

namespace {

// Half-open position range [lo, hi) of a sequence operation: a negative p0 has no lower bound (a
// recurrent tail may sit below 0 after seq_add), a negative p1 no upper bound.
struct pos_range {
    int64_t lo, hi;
    pos_range(pos_t p0, pos_t p1)
        : lo(p0 < 0 ? std::numeric_limits<int64_t>::min() : p0),
          hi(p1 < 0 ? std::numeric_limits<int64_t>::max() : p1) {}
    bool contains(pos_t p) const { return p >= lo && p < hi; }
    bool empty() const { return lo >= hi; }
};

bool is_float_type(dtype t) {
    return t == dtype::f32 || t == dtype::f16 || t == dtype::bf16;
}

// Snapshot rows of a memory made from p (prefix.max_snapshots resolved).
constexpr uint64_t max_snapshot_rows = uint64_t{1} << 24;
uint64_t snapshot_rows(const recurrent_params& p) {
    if (!p.prefix.enabled) return 0;
    return p.prefix.max_snapshots ? p.prefix.max_snapshots : uint64_t{4} * p.n_seq_max;
}

}  // namespace

// -- construction --

memory_recurrent::memory_recurrent(recurrent_params params) : params_(std::move(params)) {
    set_shape({.n_seq_max = params_.n_seq_max,
               .n_pos = 1,
               .n_layer = static_cast<uint32_t>(params_.layers.size())});
    const recurrent_params& p = params_;
    const auto bad = [](const std::string& msg) {
        throw error(errc::invalid_argument, "memory_recurrent: " + msg);
    };
    if (p.n_seq_max == 0) bad("n_seq_max must be at least 1");
    if (p.n_seq_max > static_cast<uint32_t>(std::numeric_limits<int32_t>::max()))
        bad(fmt::format("n_seq_max {} does not fit int32", p.n_seq_max));
    check_limit("memory_recurrent: n_seq_max", "sequences", p.n_seq_max, get_limits().sequences);
    if (!is_float_type(p.type_r) || !is_float_type(p.type_s))
        bad(fmt::format("state rows must be f32, f16 or bf16, not {} / {}", to_string(p.type_r),
                        to_string(p.type_s)));
    if (p.layers.empty()) bad("no layers");
    size_ = p.n_seq_max;
    const uint64_t planes = uint64_t{p.n_rs_seq} + 1;
    if (snapshot_rows(p) > max_snapshot_rows)
        bad(fmt::format("prefix max_snapshots {} is over the limit of {}", snapshot_rows(p),
                        max_snapshot_rows));
    n_snap_ = static_cast<uint32_t>(snapshot_rows(p));
    const uint64_t rows = planes * size_ + n_snap_;  // the planes, then the snapshots

    layer_map_.assign(p.layers.size(), -1);
    for (uint32_t il = 0; il < p.layers.size(); ++il) {
        const recurrent_layer_desc& d = p.layers[il];
        if ((d.n_embd_r == 0 && d.n_embd_s == 0) || (p.filter && !p.filter(il))) continue;
        layer l;
        l.il = il;
        l.n_embd_r = d.n_embd_r;
        l.n_embd_s = d.n_embd_s;
        l.row_r = d.n_embd_r ? row_size(p.type_r, d.n_embd_r) : 0;
        l.row_s = d.n_embd_s ? row_size(p.type_s, d.n_embd_s) : 0;
        for (const size_t row : {l.row_r, l.row_s})
            if (row && (rows > std::numeric_limits<size_t>::max() / row))
                bad(fmt::format("layer {}: {} rows of {} bytes overflow size_t", il, rows, row));
        layer_map_[il] = static_cast<int32_t>(layers_.size());
        layer_ids_.push_back(il);
        layers_.push_back(std::move(l));
    }
    if (layers_.empty()) bad("no layer has a state row (or the filter keeps none)");
    uint64_t need = 0;  // every plane of every cell and the snapshots, computed without overflowing
    for (const layer& l : layers_) need = add_sat(need, mul_sat(l.row_r + l.row_s, rows));
    check_memory_budget("memory_recurrent", need, p.memory_budget,
                        fmt::format("{} layers x ({} cells x {} planes + {} snapshots)", layers_.size(),
                                    size_, planes, n_snap_));
    if (p.prefix.enabled) prefix_init();
    for (layer& l : layers_) {  // zeros: a fresh state reads zeros, and so do never-written planes
        if (l.row_r) l.r = state_rows(l.row_r * rows, p.allocator);
        if (l.row_s) l.s = state_rows(l.row_s * rows, p.allocator);
    }
    cells_.assign(size_, cell_rec{});
    tail_.assign(size_, -1);
    next_.assign(size_, -1);
    refs_.assign(size_, 0);
}

memory_recurrent::~memory_recurrent() = default;

uint64_t memory_recurrent::reserve_bytes(const recurrent_params& p) {
    const auto bytes = [](dtype t, uint32_t n) {
        return n && is_valid(t) ? mul_sat(n / block_size(t), type_size(t)) : uint64_t{0};
    };
    uint64_t cell = 0;  // one cell's rows over every layer, one plane
    for (uint32_t il = 0; il < p.layers.size(); ++il) {
        if (p.filter && !p.filter(il)) continue;
        cell = add_sat(
            cell, add_sat(bytes(p.type_r, p.layers[il].n_embd_r), bytes(p.type_s, p.layers[il].n_embd_s)));
    }
    return mul_sat(cell, add_sat(mul_sat(p.n_seq_max, uint64_t{p.n_rs_seq} + 1), snapshot_rows(p)));
}

memory_breakdown memory_recurrent::get_memory_breakdown() const {
    const uint64_t snap = snapshot_bytes();
    const uint64_t cell = snap * (uint64_t{params_.n_rs_seq} + 1);  // every plane of one cell
    memory_breakdown b;
    b.reserved = size_bytes();
    const layer& l0 = layers_[0];
    const bool elastic = (l0.row_r ? l0.r : l0.s).elastic();
    b.committed =
        elastic ? uint64_t{mark_} * cell + (prefix_ ? uint64_t{prefix_->top} * snap : 0) : b.reserved;
    for (const cell_rec& c : cells_) b.used += c.n_seq > 0 ? cell : 0;
    if (prefix_) b.cached = uint64_t{get_prefix_stats().snapshots} * snap;
    b.free = b.committed - b.used - b.cached;
    b.seq.assign(params_.n_seq_max, 0);
    for (uint32_t q = 0; q < params_.n_seq_max; ++q) b.seq[q] = tail_[q] >= 0 ? cell : 0;
    return b;
}

// -- shape, sizes, data --

void memory_recurrent::check_seq(seq_id_t s, const char* what) const {
    if (s < 0 || static_cast<uint32_t>(s) >= params_.n_seq_max)
        throw error(errc::out_of_range,
                    fmt::format("{}: seq_id {} not in [0, {})", what, s, params_.n_seq_max));
}

const memory_recurrent::layer& memory_recurrent::own_layer(uint32_t il) const {
    if (il >= layer_map_.size() || layer_map_[il] < 0)
        throw error(errc::out_of_range,
                    fmt::format("memory_recurrent: model layer {} has no state in this memory", il));
    return layers_[static_cast<size_t>(layer_map_[il])];
}

bool memory_recurrent::has_r(uint32_t il) const {
    return il < layer_map_.size() && layer_map_[il] >= 0 &&
           layers_[static_cast<size_t>(layer_map_[il])].row_r;
}

bool memory_recurrent::has_s(uint32_t il) const {
    return il < layer_map_.size() && layer_map_[il] >= 0 &&
           layers_[static_cast<size_t>(layer_map_[il])].row_s;
}

size_t memory_recurrent::size_r_bytes() const {
    size_t n = 0;
    for (const layer& l : layers_) n += l.r.size();
    return n;
}

size_t memory_recurrent::size_s_bytes() const {
    size_t n = 0;
    for (const layer& l : layers_) n += l.s.size();
    return n;
}

tensor_view memory_recurrent::get_r(uint32_t il) {
    const layer& l = own_layer(il);
    if (!l.row_r)
        throw error(errc::out_of_range, fmt::format("memory_recurrent: layer {} has no r tensor", il));
    return tensor_view::contiguous(params_.type_r, l.r.data(), l.n_embd_r, size_,
                                   int64_t{params_.n_rs_seq} + 1);
}

const_tensor_view memory_recurrent::get_r(uint32_t il) const {
    return const_cast<memory_recurrent*>(this)->get_r(il);
}

tensor_view memory_recurrent::get_s(uint32_t il) {
    const layer& l = own_layer(il);
    if (!l.row_s)
        throw error(errc::out_of_range, fmt::format("memory_recurrent: layer {} has no s tensor", il));
    return tensor_view::contiguous(params_.type_s, l.s.data(), l.n_embd_s, size_,
                                   int64_t{params_.n_rs_seq} + 1);
}

const_tensor_view memory_recurrent::get_s(uint32_t il) const {
    return const_cast<memory_recurrent*>(this)->get_s(il);
}

// -- membership --

void memory_recurrent::link(uint32_t c, seq_id_t s) {
    assert(tail_[static_cast<size_t>(s)] < 0);
    cell_rec& x = cells_[c];
    if (x.n_seq++ == 0) ++used_;
    next_[static_cast<size_t>(s)] = x.first;
    x.first = s;
    tail_[static_cast<size_t>(s)] = static_cast<int32_t>(c);
}

void memory_recurrent::unlink(uint32_t c, seq_id_t s) {
    cell_rec& x = cells_[c];
    assert(tail_[static_cast<size_t>(s)] == static_cast<int32_t>(c) && x.n_seq > 0);
    if (x.first == s) {
        x.first = next_[static_cast<size_t>(s)];
    } else {
        seq_id_t q = x.first;
        while (next_[static_cast<size_t>(q)] != s) q = next_[static_cast<size_t>(q)];
        next_[static_cast<size_t>(q)] = next_[static_cast<size_t>(s)];
    }
    next_[static_cast<size_t>(s)] = -1;
    tail_[static_cast<size_t>(s)] = -1;
    --x.n_seq;
}

bool memory_recurrent::free_if_empty(uint32_t c) {
    cell_rec& x = cells_[c];
    if (x.n_seq != 0) return false;
    x = cell_rec{};
    --used_;
    return true;
}

void memory_recurrent::swap_cells(uint32_t a, uint32_t b) {
    std::swap(cells_[a], cells_[b]);
    for (uint32_t c : {a, b})
        for (seq_id_t s = cells_[c].first; s >= 0; s = next_[static_cast<size_t>(s)])
            tail_[static_cast<size_t>(s)] = static_cast<int32_t>(c);
}

int32_t memory_recurrent::next_free(uint32_t from) const {
    for (uint32_t k = 0; k < size_; ++k) {
        const uint32_t c = (from + k) % size_;
        if (cells_[c].n_seq == 0) return static_cast<int32_t>(c);
    }
    return -1;
}

std::vector<seq_id_t> memory_recurrent::members(uint32_t c) const {
    std::vector<seq_id_t> out;
    out.reserve(cells_[c].n_seq);
    for (seq_id_t s = cells_[c].first; s >= 0; s = next_[static_cast<size_t>(s)]) out.push_back(s);
    std::sort(out.begin(), out.end());
    return out;
}

// -- placement --

void memory_recurrent::check_ubatch(const ubatch& ub) const {
    const auto bad = [](errc code, const std::string& msg) { throw error(code, "find_slot: " + msg); };
    const size_t n = ub.n_tokens;
    if (n == 0) bad(errc::invalid_argument, "empty ubatch");
    if (!ub.equal_seqs) bad(errc::invalid_argument, "the recurrent memory needs an equal-seqs ubatch");
    if (ub.n_seqs == 0 || size_t{ub.n_seqs} * ub.n_seq_tokens != n || ub.n_pos < 1 ||
        ub.pos.size() < n * ub.n_pos || ub.seq_id_begin.size() != n + 1 || ub.seq_id_begin[0] != 0 ||
        ub.seq_id_begin[n] != ub.seq_id_data.size())
        bad(errc::invalid_argument, fmt::format("malformed ubatch of {} tokens", n));
    for (size_t i = 0; i < n; ++i)
        if (ub.seq_id_begin[i] >= ub.seq_id_begin[i + 1])
            bad(errc::invalid_argument, fmt::format("token {} has no sequence", i));
    const uint32_t T = ub.n_seq_tokens;
    // ids in range, no id twice in one block or in two blocks
    std::vector<bool> seen(size_, false);
    for (uint32_t b = 0; b < ub.n_seqs; ++b) {
        const auto ids = ub.seq_ids(b * T);
        for (seq_id_t s : ids) {
            if (s < 0 || static_cast<uint32_t>(s) >= size_)
                bad(errc::out_of_range,
                    fmt::format("seq_id {} not in [0, {}) (n_seq_max: one cell per sequence)", s, size_));
            if (seen[static_cast<size_t>(s)])
                bad(errc::invalid_argument,
                    fmt::format("seq_id {} appears in two blocks (or twice in one)", s));
            seen[static_cast<size_t>(s)] = true;
        }
        for (uint32_t t = b * T + 1; t < (b + 1) * T; ++t) {
            const auto other = ub.seq_ids(t);
            bool same = other.size() == ids.size();
            for (size_t q = 0; same && q < other.size(); ++q)
                same = std::find(ids.begin(), ids.end(), other[q]) != ids.end();
            if (!same)
                bad(errc::invalid_argument,
                    fmt::format("token {} of block {} belongs to other sequences than the block's first", t,
                                b));
        }
    }
}

rs_slot memory_recurrent::find_slot(const ubatch& ub) {
    return place(ub, false);
}

// design/recurrent.md §4.5, step by step. Everything is validated first (check_ubatch), so nothing
// below can fail half-way.
rs_slot memory_recurrent::place(const ubatch& ub, bool dry_run) {
    check_ubatch(ub);
    const uint32_t T = ub.n_seq_tokens, B = ub.n_seqs, k = params_.n_rs_seq;
    rs_slot slot;
    if (!dry_run) {  // allocations first: nothing below may fail once the cells change
        slot.s_copy.reserve(size_);
        slot.hist_copy.reserve(size_t{size_} * k);
    }

    // 1. prefer refilling the front when the head is far beyond the used cells
    if (head_ > used_ + 2 * uint64_t{B}) head_ = 0;

    // 2. a sequence coupled to a block's primary forgets its own state: it will share the block's result
    for (uint32_t b = 0; b < B; ++b) {
        const auto ids = ub.seq_ids(b * T);
        for (size_t q = 1; q < ids.size(); ++q) {
            const int32_t c = tail_[static_cast<size_t>(ids[q])];
            if (c < 0) continue;
            unlink(static_cast<uint32_t>(c), ids[q]);
            (void)free_if_empty(static_cast<uint32_t>(c));
        }
    }

    // 3. + 4. one cell per block: its own cell if it holds it alone, else a free one (copy-on-write of a
    //         shared state: the new cell takes the shared cell's position, source row and history)
    int32_t next_empty = next_free(head_);
    uint32_t lo = size_, hi = 0;
    for (uint32_t b = 0; b < B; ++b) {
        const seq_id_t p = ub.primary_seq(b * T);
        int32_t c = tail_[static_cast<size_t>(p)];
        if (c < 0 || cells_[static_cast<size_t>(c)].n_seq > 1) {
            // A free cell exists: p has no state or shares one, so fewer cells than sequences are used.
            assert(next_empty >= 0);
            const auto e = static_cast<uint32_t>(next_empty);
            cells_[e] = cell_rec{};
            if (c >= 0) {
                const cell_rec& shared = cells_[static_cast<size_t>(c)];
                cells_[e].pos = shared.pos;
                cells_[e].src = shared.src;
                cells_[e].rs_idx = shared.rs_idx;
                cells_[e].depth = shared.depth;
                unlink(static_cast<uint32_t>(c), p);
            }
            link(e, p);
            c = next_empty;
            if (b + 1 < B) next_empty = next_free((e + 1) % size_);
        }
        lo = std::min(lo, static_cast<uint32_t>(c));
        hi = std::max(hi, static_cast<uint32_t>(c));
    }

    // 5. gather the blocks' cells into [lo, lo + B): metadata moves, src says where the data is
    for (uint32_t b = 0; b < B; ++b) {
        const uint32_t d = lo + b;
        const auto c = static_cast<uint32_t>(tail_[static_cast<size_t>(ub.primary_seq(b * T))]);
        if (d != c) swap_cells(d, c);
    }

    // 6. positions advance to each block's last token; coupled sequences join the block's cell
    for (uint32_t b = 0; b < B; ++b) {
        cell_rec& x = cells_[lo + b];
        const pos_t last = ub.pos[b * T + T - 1];
        if (!dry_run && x.pos >= 0 && int64_t{last} != int64_t{x.pos} + T)
            log(log_level::warn,
                fmt::format("memory_recurrent: non-consecutive position {} after {} for seq {} ({} tokens)",
                            last, x.pos, ub.primary_seq(b * T), T));
        x.pos = last;
        const auto ids = ub.seq_ids(b * T);
        for (size_t q = 1; q < ids.size(); ++q) link(lo + b, ids[q]);
    }

    // 7. stage the sources: rs_z is a row of the range no cell reads from (zeroed for fresh states)
    std::fill(refs_.begin(), refs_.end(), 0u);
    for (const cell_rec& x : cells_)
        if (x.src >= 0) ++refs_[static_cast<size_t>(x.src)];
    int32_t rs_z = -1;
    for (uint32_t i = lo; i <= hi && rs_z < 0; ++i)
        if (refs_[i] == 0) rs_z = static_cast<int32_t>(i);

    slot.head = lo;
    slot.n = hi - lo + 1;
    slot.n_seqs = B;
    slot.rs_z = rs_z;
    if (!dry_run) slot.s_copy.resize(slot.n);
    const int64_t size = size_;
    for (uint32_t i = lo; i <= hi; ++i) {
        cell_rec& x = cells_[i];
        const bool fresh = x.src < 0;  // a new sequence, or a free cell inside the range
        assert(!fresh || rs_z >= 0);   // a fresh cell's row is referenced by nobody else in the range
        const int64_t src0 = fresh ? rs_z : x.src;
        const uint32_t shift0 = fresh ? 0 : x.rs_idx;
        const uint32_t depth0 = fresh ? 0 : x.depth;
        const bool main = i < lo + B;
        if (!dry_run) {
            slot.s_copy[i - lo] = shift0 * size + src0;
            if (main) {  // planes T.. of the new history: the initial state, then the source's history
                for (uint32_t j = 0; uint64_t{T} + j <= k && j <= depth0; ++j)
                    slot.hist_copy.push_back({(shift0 + j) * size + src0, (int64_t{T} + j) * size + i});
            } else {  // an extra cell moves with its history
                for (uint32_t j = 1; j <= depth0; ++j)
                    if ((shift0 + j) * size + src0 != j * size + i)
                        slot.hist_copy.push_back({(shift0 + j) * size + src0, j * size + i});
            }
        }
        if (x.n_seq == 0) continue;  // a free cell stays fresh
        x.src = static_cast<int32_t>(i);
        x.rs_idx = 0;
        x.depth = main ? static_cast<uint32_t>(std::min<uint64_t>(k, uint64_t{T} + depth0)) : depth0;
    }

    // 8.
    head_ = lo;
    return slot;
}

void memory_recurrent::prepare(std::span<const ubatch> ubatches) {
    saved_cells_ = cells_;
    saved_tail_ = tail_;
    saved_next_ = next_;
    const uint32_t head = head_, used = used_;
    const auto restore = [&] {
        cells_.swap(saved_cells_);
        tail_.swap(saved_tail_);
        next_.swap(saved_next_);
        head_ = head;
        used_ = used;
    };
    try {
        for (const ubatch& ub : ubatches) (void)place(ub, true);
    } catch (...) {
        restore();
        throw;
    }
    restore();
}

// -- memory_i: batches --

memory_context_ptr memory_recurrent::init_batch(batch_allocr& balloc, uint32_t n_ubatch, bool embd_all) {
    for (seq_id_t s : balloc.seq_id_unq()) check_seq(s, "init_batch");
    prefix_publish();  // the last step's snapshots are written by now
    balloc.split_reset();
    const uint32_t keep_tail = params_.n_rs_seq ? params_.n_rs_seq + 1 : 0;
    std::vector<ubatch> ubatches;
    while (true) {
        ubatch ub = embd_all ? balloc.split_seq(n_ubatch) : balloc.split_equal(n_ubatch, true, keep_tail);
        if (ub.empty()) break;
        ubatches.push_back(std::move(ub));
    }
    if (balloc.get_n_used() < balloc.get_n_tokens())
        return std::make_unique<memory_recurrent_context>(*this, memory_status::failed_prepare,
                                                          memory_recurrent_context::kind::batch);
    return init_ubatches(std::move(ubatches), {balloc.out_ids().begin(), balloc.out_ids().end()});
}

memory_context_ptr memory_recurrent::init_ubatches(std::vector<ubatch> ubatches,
                                                   std::vector<int32_t> out_ids) {
    prefix_publish();
    prepare(ubatches);
    return std::make_unique<memory_recurrent_context>(*this, std::move(ubatches), std::move(out_ids));
}

memory_context_ptr memory_recurrent::init_full() {
    return std::make_unique<memory_recurrent_context>(*this, memory_status::success,
                                                      memory_recurrent_context::kind::full);
}

memory_context_ptr memory_recurrent::init_update(bool /*optimize: nothing to compact*/) {
    return std::make_unique<memory_recurrent_context>(*this, memory_status::no_update,
                                                      memory_recurrent_context::kind::update);
}

// -- memory_i: sequences --

void memory_recurrent::clear(bool data) {
    prefix_reset();
    clear_cells(data);
}

void memory_recurrent::clear_cells(bool data) {
    std::fill(cells_.begin(), cells_.end(), cell_rec{});
    std::fill(tail_.begin(), tail_.end(), -1);
    std::fill(next_.begin(), next_.end(), -1);
    head_ = 0;
    used_ = 0;
    if (data)
        for (layer& l : layers_) {
            l.r.clear();
            l.s.clear();
        }
    fit_rows();
}

void memory_recurrent::fit_rows() {
    // every used cell is below the mark (placements and restores raise it): the scan costs what the mark
    // drops, not the memory's size
    uint32_t top = mark_;
    while (top > 0 && cells_[top - 1].n_seq == 0) --top;
    // Between ubatches every used cell's state is in its own row: rows of the free cells above the last
    // used one hold nothing needed
    if (top < mark_)
        for (layer& l : layers_)  // plane by plane: the snapshot rows after the planes stay
            for (uint64_t p = 0; p <= params_.n_rs_seq; ++p) {
                l.r.release((p * size_ + top) * l.row_r, size_t{mark_ - top} * l.row_r);
                l.s.release((p * size_ + top) * l.row_s, size_t{mark_ - top} * l.row_s);
            }
    mark_ = top;
}

bool memory_recurrent::seq_rm(seq_id_t seq_id, pos_t p0, pos_t p1) {
    const pos_range range(p0, p1);
    if (seq_id == seq_all) {
        if (range.empty()) return true;
        if (p0 > 0 || (p1 >= 0 && p1 != std::numeric_limits<pos_t>::max())) return false;  // partial
        prefix_publish();
        clear_cells(/*data=*/false);  // design D13: no sequence keeps a tail into an emptied cell
        prefix_forget(seq_all);       // the snapshots stay cached
        return true;
    }
    check_seq(seq_id, "seq_rm");
    prefix_publish();  // the snapshots of the last step, which a sequence that ends leaves behind
    const int32_t t = tail_[static_cast<size_t>(seq_id)];
    if (t < 0) return true;
    const auto c = static_cast<uint32_t>(t);
    cell_rec& x = cells_[c];
    if (!range.contains(x.pos)) return true;  // the state is not in the range: nothing to remove
    if (range.lo <= 0) {                      // the whole state goes
        unlink(c, seq_id);
        if (free_if_empty(c)) head_ = std::min(head_, c);
        prefix_forget(seq_id);
        fit_rows();
        return true;
    }
    // 0 < p0 <= P < p1: only a rollback can remove the last r tokens
    const auto r = static_cast<uint64_t>(int64_t{x.pos} - range.lo + 1);
    if (x.n_seq != 1 || r > x.depth) return false;
    x.pos = static_cast<pos_t>(range.lo - 1);
    x.rs_idx += static_cast<uint32_t>(r);
    x.depth -= static_cast<uint32_t>(r);
    prefix_cut(seq_id, static_cast<pos_t>(range.lo));
    return true;
}

void memory_recurrent::seq_cp(seq_id_t src, seq_id_t dst, pos_t /*p0*/, pos_t /*p1*/) {
    check_seq(src, "seq_cp");
    check_seq(dst, "seq_cp");
    if (src == dst) return;
    prefix_publish();
    const int32_t d = tail_[static_cast<size_t>(dst)];
    if (d >= 0) {
        unlink(static_cast<uint32_t>(d), dst);
        (void)free_if_empty(static_cast<uint32_t>(d));  // as upstream: the head stays
    }
    const int32_t s = tail_[static_cast<size_t>(src)];
    if (s >= 0) link(static_cast<uint32_t>(s), dst);
    prefix_copy(src, dst);
    fit_rows();
}

void memory_recurrent::seq_keep(seq_id_t seq_id) {
    check_seq(seq_id, "seq_keep");
    prefix_publish();
    for (uint32_t s = 0; s < size_; ++s) {
        const int32_t c = tail_[s];
        if (static_cast<seq_id_t>(s) == seq_id || c < 0) continue;
        unlink(static_cast<uint32_t>(c), static_cast<seq_id_t>(s));
        if (free_if_empty(static_cast<uint32_t>(c))) head_ = std::min(head_, static_cast<uint32_t>(c));
        prefix_forget(static_cast<seq_id_t>(s));
    }
    fit_rows();
}

void memory_recurrent::seq_add(seq_id_t seq_id, pos_t p0, pos_t p1, pos_t shift) {
    check_seq(seq_id, "seq_add");
    const pos_range range(p0, p1);
    const int32_t c = tail_[static_cast<size_t>(seq_id)];
    if (shift == 0 || range.empty() || c < 0) return;
    cell_rec& x = cells_[static_cast<size_t>(c)];
    if (!range.contains(x.pos)) return;
    const int64_t moved = int64_t{x.pos} + shift;
    if (moved < std::numeric_limits<pos_t>::min() || moved > std::numeric_limits<pos_t>::max())
        throw error(errc::out_of_range,
                    fmt::format("seq_add: position {} + {} of seq {} overflows int32", x.pos, shift, seq_id));
    prefix_publish();
    x.pos = static_cast<pos_t>(moved);
    for (seq_id_t s = x.first; s >= 0; s = next_[static_cast<size_t>(s)]) prefix_forget(s);  // not from 0
}

void memory_recurrent::seq_div(seq_id_t seq_id, pos_t p0, pos_t p1, int d) {
    check_seq(seq_id, "seq_div");
    if (d < 1) throw error(errc::invalid_argument, fmt::format("seq_div: divisor {} must be >= 1", d));
    const pos_range range(p0, p1);
    const int32_t c = tail_[static_cast<size_t>(seq_id)];
    if (d == 1 || range.empty() || c < 0) return;
    cell_rec& x = cells_[static_cast<size_t>(c)];
    if (!range.contains(x.pos) || x.pos / d == x.pos) return;
    prefix_publish();
    x.pos /= d;
    for (seq_id_t s = x.first; s >= 0; s = next_[static_cast<size_t>(s)]) prefix_forget(s);
}

pos_t memory_recurrent::seq_pos_min(seq_id_t seq_id) const {
    return seq_pos_max(seq_id);
}

pos_t memory_recurrent::seq_pos_max(seq_id_t seq_id) const {
    check_seq(seq_id, "seq_pos");
    const int32_t c = tail_[static_cast<size_t>(seq_id)];
    return c < 0 ? pos_none : cells_[static_cast<size_t>(c)].pos;
}

// -- inspection --

memory_recurrent::cell_info memory_recurrent::cell(uint32_t i) const {
    if (i >= size_)
        throw error(errc::out_of_range, fmt::format("memory_recurrent: cell {} not in [0, {})", i, size_));
    const struct cell_rec& x = cells_[i];
    return {x.pos, x.src, x.rs_idx, x.depth, members(i)};
}

int32_t memory_recurrent::seq_tail(seq_id_t seq_id) const {
    check_seq(seq_id, "seq_tail");
    return tail_[static_cast<size_t>(seq_id)];
}

std::string memory_recurrent::picture() const {
    std::string out(size_, '.');
    for (uint32_t c = 0; c < size_; ++c) {
        const struct cell_rec& x = cells_[c];
        if (x.n_seq > 1) {
            out[c] = 'M';
        } else if (x.n_seq == 1) {
            const seq_id_t s = x.first;
            out[c] = s < 10 ? static_cast<char>('0' + s) : s < 36 ? static_cast<char>('a' + s - 10) : '*';
        }
    }
    return out;
}

void memory_recurrent::validate() const {
    const auto broken = [](const std::string& what) {
        throw error(errc::invalid_state, "memory_recurrent::validate: " + what);
    };
    uint32_t used = 0;
    for (uint32_t c = 0; c < size_; ++c) {
        const struct cell_rec& x = cells_[c];
        uint32_t n = 0;
        for (seq_id_t s = x.first; s >= 0; s = next_[static_cast<size_t>(s)]) {
            if (static_cast<uint32_t>(s) >= size_ || ++n > size_)
                broken(fmt::format("cell {}: bad member list", c));
            if (tail_[static_cast<size_t>(s)] != static_cast<int32_t>(c))  // I1
                broken(fmt::format("cell {} holds seq {} whose tail is {}", c, s,
                                   tail_[static_cast<size_t>(s)]));
        }
        if (n != x.n_seq) broken(fmt::format("cell {}: {} members listed, {} counted", c, n, x.n_seq));
        if (n == 0) {
            if (x.pos != -1 || x.src != -1 || x.rs_idx != 0 || x.depth != 0)
                broken(fmt::format("free cell {} keeps pos {} src {} rs_idx {} depth {}", c, x.pos, x.src,
                                   x.rs_idx, x.depth));
            continue;
        }
        ++used;
        if (x.src != static_cast<int32_t>(c))  // I3
            broken(fmt::format("cell {} reads its state from row {}", c, x.src));
        if (uint64_t{x.rs_idx} + x.depth > params_.n_rs_seq)
            broken(fmt::format("cell {}: pending plane {} + history {} > n_rs_seq {}", c, x.rs_idx, x.depth,
                               params_.n_rs_seq));
    }
    for (uint32_t s = 0; s < size_; ++s) {
        const int32_t c = tail_[s];
        if (c < -1 || c >= static_cast<int32_t>(size_)) broken(fmt::format("seq {} has tail {}", s, c));
        if (c >= 0) {
            bool found = false;
            for (seq_id_t q = cells_[static_cast<size_t>(c)].first; q >= 0 && !found;
                 q = next_[static_cast<size_t>(q)])
                found = q == static_cast<seq_id_t>(s);
            if (!found) broken(fmt::format("seq {} has tail {} but is not in it", s, c));
        }
    }
    if (used != used_) broken(fmt::format("{} cells in use, {} counted", used, used_));  // I2
}

// -- context --

memory_recurrent_context::memory_recurrent_context(memory_recurrent& mem, memory_status status, kind k)
    : mem_(&mem), status_(status), kind_(k) {
    if (k == kind::full) {  // worst case: every cell, each reading its own row
        rs_slot s;
        s.n = mem.get_size();
        s.n_seqs = mem.get_size();
        s.rs_z = 0;
        s.s_copy.resize(s.n);
        for (uint32_t i = 0; i < s.n; ++i) s.s_copy[i] = i;
        slot_ = std::move(s);
    }
}

memory_recurrent_context::memory_recurrent_context(memory_recurrent& mem, std::vector<ubatch> ubatches,
                                                   std::vector<int32_t> out_ids)
    : mem_(&mem),
      status_(memory_status::success),
      kind_(kind::batch),
      ubatches_(std::move(ubatches)),
      out_ids_(std::move(out_ids)) {
    if (!mem.prefix_) return;
    // Sequences with several tokens in the batch (prompts): the snapshot at the newest boundary the
    // batch takes them to is kept, not rolled over by their next one.
    std::vector<std::tuple<seq_id_t, uint32_t, uint64_t>> seen;  // (seq, ubatch, tokens)
    for (uint32_t u = 0; u < ubatches_.size(); ++u) {
        const ubatch& ub = ubatches_[u];
        for (uint32_t b = 0; b < ub.n_seqs; ++b)
            seen.emplace_back(ub.primary_seq(b * ub.n_seq_tokens), u, ub.n_seq_tokens);
    }
    std::sort(seen.begin(), seen.end());
    for (size_t i = 0; i < seen.size();) {
        size_t j = i;
        uint64_t n = 0;
        for (; j < seen.size() && std::get<0>(seen[j]) == std::get<0>(seen[i]); ++j)
            n += std::get<2>(seen[j]);
        uint64_t later = n;
        for (size_t k = i; k < j && n > 1; ++k) {
            later -= std::get<2>(seen[k]);
            prompts_.emplace_back(std::get<1>(seen[k]), std::get<0>(seen[k]), later);
        }
        i = j;
    }
}

bool memory_recurrent_context::next() {
    if (kind_ != kind::batch || i_cur_ >= ubatches_.size()) return false;
    // past the last ubatch the step is computed: its snapshots are published (as a kv_cache_context's
    // blocks are, for the same reasons); out of memory they stay pending for the next step
    if (i_cur_ + 1 == ubatches_.size()) {
        try {
            mem_->prefix_publish();
        } catch (const std::bad_alloc&) {}
    }
    slot_.reset();
    return ++i_cur_ < ubatches_.size();
}

void memory_recurrent_context::apply() {
    if (is_fail(status_)) throw error(errc::invalid_state, "memory context: apply() on a failed context");
    if (kind_ != kind::batch) return;
    if (i_cur_ >= ubatches_.size())
        throw error(errc::invalid_state, "memory context: no ubatch left to apply");
    if (n_applied_ > i_cur_)
        throw error(errc::invalid_state,
                    fmt::format("memory context: ubatch {} was already applied", i_cur_));
    const ubatch& ub = ubatches_[i_cur_];
    std::vector<std::pair<seq_id_t, uint64_t>> prompts;
    for (const auto& [u, s, later] : prompts_)
        if (u == i_cur_) prompts.emplace_back(s, later);
    mem_->prefix_plan(ub, prompts);  // snapshot rows first: it may evict, placing may not fail half-way
    slot_ = mem_->find_slot(ub);
    mem_->prefix_record(ub, *slot_);
    // the rows the engine writes now are below the mark (its sources, used cells, were already)
    mem_->mark_ = std::max(mem_->mark_, slot_->head + slot_->n);
    n_applied_ = i_cur_ + 1;
}

memory_recurrent_context* memory_recurrent_context::get_recr() {
    return is_fail(status_) ? nullptr : this;
}

const ubatch& memory_recurrent_context::get_ubatch() const {
    if (kind_ != kind::batch || i_cur_ >= ubatches_.size())
        throw error(errc::invalid_state, "memory context: no current ubatch");
    return ubatches_[i_cur_];
}

const rs_slot& memory_recurrent_context::slot() const {
    if (!slot_)
        throw error(errc::invalid_state,
                    kind_ != kind::batch         ? "memory context: an update context has no state rows"
                    : i_cur_ >= ubatches_.size() ? "memory context: no current ubatch"
                                                 : "memory context: apply() the current ubatch first");
    return *slot_;
}

int64_t memory_recurrent_context::s_copy(uint32_t i) const {
    const rs_slot& s = slot();
    if (i >= s.n) throw error(errc::out_of_range, fmt::format("s_copy: {} not in [0, {})", i, s.n));
    return s.s_copy[i];
}

}  // namespace kvc
