// kv_cache: state payloads in llama.cpp's layout (design/kv-cache.md §7.1-7.3), read transactionally.
#include <algorithm>
#include <cstring>
#include <numeric>

#include <fmt/format.h>
#include <kvcache/kv_cache.h>
#include <kvcache/memory_budget.h>
#include <kvcache/state.h>

#include "detail/kv_cache_layer.h"
#include "detail/state_io.h"

namespace kvc {

using detail::bad;
using detail::get;
using detail::put;

namespace {

// detail::bad for an error found in bytes already taken from the reader (decoded from one span):
// `at` is the byte offset the reader would have reached reading field by field.
[[noreturn]] void bad_at(size_t at, const std::string& what) {
    throw error(errc::corrupt_data, fmt::format("state: at byte {}: {}", at, what));
}

template <class T>
T load(const std::byte* p) {
    T v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

// The cells of a one-sequence state (per cell i32 pos, u32 n_ids = 1, [i32 x, i32 y with M-RoPE], i32 id),
// decoded from the span `meta` that starts at byte `at`: the same checks, in the same order and with the
// same offsets, as reading them field by field, without a virtual read per field.
void decode_seq_cells(std::span<const std::byte> meta, size_t at, uint32_t stream, bool has_ext,
                      std::vector<pos_t>& pos, std::vector<cell_ext>& ext) {
    const size_t stride = has_ext ? 20 : 12;
    const size_t count = pos.size();
    int32_t first_id = 0;
    for (size_t j = 0; j < count; ++j) {
        const std::byte* c = meta.data() + j * stride;
        const size_t off = at + j * stride;
        const auto p = load<int32_t>(c);
        if (p < 0) bad_at(off + 4, fmt::format("cell {} of stream {} has position {}", j, stream, p));
        pos[j] = p;
        const auto n_ids = load<uint32_t>(c + 4);
        if (has_ext) ext[j] = {load<int32_t>(c + 8), load<int32_t>(c + 12)};
        if (n_ids != 1)
            bad_at(off + stride - 4,
                   fmt::format("cell {} has {} sequence ids; a sequence's state has exactly one per cell "
                               "(a whole-memory state cannot be restored into one sequence)",
                               j, n_ids));
        const auto id = load<int32_t>(c + stride - 4);
        if (j == 0)
            first_id = id;
        else if (id != first_id)
            bad_at(off + stride,
                   fmt::format("cells of seq {} and seq {}: a whole-memory state cannot be restored into one "
                               "sequence",
                               first_id, id));
    }
}

// The cells of a one-sequence state as the ubatch whose placement restores them into seq_id.
ubatch restore_ubatch(std::span<const pos_t> pos, std::span<const cell_ext> ext, seq_id_t seq_id,
                      uint32_t n_pos) {
    const auto n = static_cast<uint32_t>(pos.size());
    ubatch ub;
    ub.n_tokens = n;
    ub.n_seq_tokens = n;
    ub.n_seqs = 1;
    ub.equal_seqs = true;
    ub.n_pos = n_pos >= 3 ? n_pos : 1;
    ub.pos.assign(size_t{n} * ub.n_pos, 0);
    for (uint32_t j = 0; j < n; ++j) {
        ub.pos[j] = pos[j];
        if (ub.n_pos >= 3) {
            ub.pos[j + n] = ext[j].y;
            ub.pos[j + 2 * n] = ext[j].x;
        }
    }
    ub.n_seq_id.assign(n, 1);
    ub.seq_id_data.assign(n, seq_id);
    ub.seq_id_begin.resize(n + 1);
    for (uint32_t j = 0; j <= n; ++j) ub.seq_id_begin[j] = j;
    ub.seq_id_unq = {seq_id};
    ub.n_seqs_unq = 1;
    ub.output.assign(n, 0);
    return ub;
}

}  // namespace

// -- writing --

void kv_cache::write_cells(io_write_i& io, uint32_t stream, std::span<const uint32_t> cells,
                           seq_id_t seq_id) const {
    const kv_cells& c = streams_[stream];
    put<uint32_t>(io, static_cast<uint32_t>(cells.size()));
    if (cells.empty()) return;
    for (uint32_t i : cells) {
        put<int32_t>(io, c.pos_get(i));
        const seq_set& seqs = c.seqs(i);
        const uint32_t n_ids = seq_id >= 0 ? 1 : static_cast<uint32_t>(seqs.size());
        put<uint32_t>(io, n_ids);
        if (params_.n_pos > 1) {
            put<int32_t>(io, c.ext_get(i).x);
            put<int32_t>(io, c.ext_get(i).y);
        }
        if (seq_id >= 0)
            put<int32_t>(io, seq_id);
        else
            for (seq_id_t s : seqs) put<int32_t>(io, s);
    }
    put<uint32_t>(io, params_.v_trans ? 1 : 0);
    put<uint32_t>(io, static_cast<uint32_t>(layers_.size()));
    std::vector<uint64_t> rows(cells.size());
    for (size_t j = 0; j < cells.size(); ++j) rows[j] = row(stream, cells[j]);
    // Design D8: a pending shift never leaks into a state; keys are written as the K-shift would leave
    // them, so that restoring gives the attention results of the cache that was saved.
    std::vector<pos_t> deltas;
    if (c.get_has_shift())
        for (uint32_t i : cells) deltas.push_back(c.get_shift(i));
    const kv_storage& st = *storage_;
    for (uint32_t li = 0; li < layers_.size(); ++li) {
        put<int32_t>(io, static_cast<int32_t>(params_.type_k));
        put<uint64_t>(io, st.k_row_bytes(li));
        st.save_k(io, li, rows, deltas);
    }
    for (uint32_t li = 0; li < layers_.size(); ++li) {
        put<int32_t>(io, static_cast<int32_t>(params_.type_v));
        if (!params_.v_trans) {
            put<uint64_t>(io, st.v_row_bytes(li));
        } else {
            put<uint32_t>(io, static_cast<uint32_t>(type_size(params_.type_v)));
            put<uint32_t>(io, st.e_v(li));
        }
        st.save_v(io, li, rows);
    }
}

void kv_cache::state_write(io_write_i& io, seq_id_t seq_id,
                           state_seq_flags /*flags: none apply to a plain cache*/) const {
    if (seq_id != seq_all) check_seq(seq_id, "state_write");
    put<uint32_t>(io, static_cast<uint32_t>(streams_.size()));
    std::vector<uint32_t> cells;
    for (uint32_t s = 0; s < streams_.size(); ++s) {
        const kv_cells& c = streams_[s];
        cells.clear();
        if (seq_id == seq_all) {
            c.used_cells(cells);
            // cached cells (the prefix cache's, no sequence) are no sequence's state: the index is not saved
            std::erase_if(cells, [&](uint32_t i) { return c.is_held(i) && c.seq_count(i) == 0; });
        } else if (seq_to_stream(seq_id) == s) {
            const pos_t pmax = c.seq_pos_max(seq_id);
            for (const auto& [pos, i] : c.seq_entries(seq_id, -1, -1))  // SWA: cells the sequence still sees
                if (!is_masked_swa(params_.n_swa, params_.swa, pos, pmax)) cells.push_back(i);
            std::sort(cells.begin(), cells.end());  // cell order, as llama.cpp writes ranges
        }
        write_cells(io, s, cells, seq_id);
    }
}

std::string kv_cache::state_layout() const {
    std::string out = fmt::format("kv streams={} v_trans={} n_pos={} hadamard=none layers=", streams_.size(),
                                  params_.v_trans ? 1 : 0, params_.n_pos);
    const auto shape = [&](const layer& l) {
        return fmt::format("k={}x{},v={}x{}", to_string(params_.type_k),
                           l.desc.n_head_kv * l.desc.n_embd_head_k, to_string(params_.type_v),
                           l.desc.n_head_kv * l.desc.n_embd_head_v);
    };
    out += detail::layer_runs(
        layers_.size(), [&](size_t i) { return layers_[i].il; }, [&](size_t i) { return shape(layers_[i]); });
    return out;
}

uint64_t kv_cache::state_max_bytes() const {
    // write_cells' fields with every cell of every stream used; a cell of a unified stream lists up to
    // n_seq_max ids, one of a per-sequence stream its own sequence only (state_stage refuses others)
    const uint64_t cells = params_.kv_size;
    const uint64_t ids = params_.unified ? params_.n_seq_max : 1;
    const uint64_t cell_meta = 8 + (params_.n_pos > 1 ? 8 : 0) + mul_sat(4, ids);  // pos, n_ids, x y, ids
    uint64_t stream = add_sat(4 + 8, mul_sat(cells, cell_meta));  // count, v_trans, n_layer, cells
    const uint64_t esz = type_size(params_.type_v);
    for (uint32_t li = 0; li < layers_.size(); ++li) {
        const uint64_t v_row = params_.v_trans ? mul_sat(storage_->e_v(li), esz) : storage_->v_row_bytes(li);
        stream = add_sat(stream, add_sat(12 + 12, mul_sat(cells, add_sat(storage_->k_row_bytes(li), v_row))));
    }
    return add_sat(4, mul_sat(streams_.size(), stream));
}

// -- reading --

struct kv_cache::staged_state final : state_stage_i {
    const kv_cache* owner = nullptr;
    seq_id_t seq_id = seq_all;  // destination
    struct stream_part {
        uint32_t stream = 0;  // target stream
        std::vector<pos_t> pos;
        std::vector<cell_ext> ext;                  // M-RoPE (n_pos > 1) only, else empty
        std::vector<std::vector<seq_id_t>> seqs;    // whole restore only
        std::vector<std::span<const std::byte>> k;  // [layer] cell rows back to back
        std::vector<std::span<const std::byte>> v;  // [layer] rows, or channel-major elements (transposed)
        std::vector<std::vector<std::byte>> owned;  // bytes behind k and v when the reader copied them
                                                    // (io_span_reader lends its own: then none)
    };
    std::vector<stream_part> parts;  // streams with cells, ascending
};

state_stage_ptr kv_cache::state_stage(io_read_i& io, seq_id_t seq_id, state_seq_flags /*flags*/) const {
    if (seq_id != seq_all) check_seq(seq_id, "state_read");
    auto stage = std::make_unique<staged_state>();
    staged_state& st = *stage;
    st.owner = this;
    st.seq_id = seq_id;
    // A reader over memory holds every byte already: cell metadata is decoded from one span of it.
    auto* const in_memory = dynamic_cast<io_span_reader*>(&io);
    const bool has_ext = params_.n_pos > 1;
    std::vector<std::byte> scratch;  // bytes of a reader that copies (not io_span_reader)
    const auto read_rows = [&](size_t bytes, staged_state::stream_part& part) {
        const auto rows = io.read_span(bytes, scratch);
        if (!scratch.empty()) part.owned.push_back(std::move(scratch));  // the moved buffer stays put
        scratch.clear();
        return rows;
    };
    const auto n_stream = get<uint32_t>(io);
    if (n_stream != streams_.size())
        bad(io, fmt::format(
                    "the state has {} streams, this cache {} (unified and per-sequence caches do not mix)",
                    n_stream, streams_.size()));
    for (uint32_t s = 0; s < n_stream; ++s) {
        const auto count = get<uint32_t>(io);
        if (count == 0) continue;
        if (count > params_.kv_size)
            bad(io, fmt::format("stream {} holds {} cells, this cache has {} per stream", s, count,
                                params_.kv_size));
        staged_state::stream_part part;
        part.stream = seq_id == seq_all ? s : seq_to_stream(seq_id);
        if (seq_id != seq_all && !st.parts.empty())
            bad(io, "a sequence's state holds cells in more than one stream");
        part.k.reserve(layers_.size());
        part.v.reserve(layers_.size());
        part.pos.resize(count);
        if (has_ext) part.ext.resize(count);
        int32_t first_id = 0;
        if (seq_id == seq_all) part.seqs.resize(count);
        // One sequence: fixed-size cells, decoded from one span when the reader has them all (else read
        // field by field below, so that a truncated state fails where it always did).
        const size_t meta = size_t{count} * (has_ext ? 20 : 12);
        const bool bulk = seq_id != seq_all && in_memory != nullptr && in_memory->remaining() >= meta;
        if (bulk) {
            const size_t at = io.n_bytes();
            decode_seq_cells(io.read_span(meta, scratch), at, s, has_ext, part.pos, part.ext);
        }
        for (uint32_t j = 0; !bulk && j < count; ++j) {
            const auto pos = get<int32_t>(io);
            if (pos < 0) bad(io, fmt::format("cell {} of stream {} has position {}", j, s, pos));
            part.pos[j] = pos;
            const auto n_ids = get<uint32_t>(io);
            if (params_.n_pos > 1) {
                part.ext[j].x = get<int32_t>(io);
                part.ext[j].y = get<int32_t>(io);
            }
            if (seq_id != seq_all) {
                if (n_ids != 1)
                    bad(io, fmt::format(
                                "cell {} has {} sequence ids; a sequence's state has exactly one per cell "
                                "(a whole-memory state cannot be restored into one sequence)",
                                j, n_ids));
                // The source id does not matter (a sequence restores into any destination), but every
                // cell must carry the same one: cells of several sequences make no single sequence.
                const auto id = get<int32_t>(io);
                if (j == 0)
                    first_id = id;
                else if (id != first_id)
                    bad(io, fmt::format(
                                "cells of seq {} and seq {}: a whole-memory state cannot be restored into "
                                "one sequence",
                                first_id, id));
                continue;
            }
            if (n_ids > params_.n_seq_max)
                bad(io, fmt::format("cell {} lists {} sequence ids, more than n_seq_max {}", j, n_ids,
                                    params_.n_seq_max));
            for (uint32_t q = 0; q < n_ids; ++q) {
                const auto id = get<int32_t>(io);
                if (id < 0 || static_cast<uint32_t>(id) >= params_.n_seq_max)
                    bad(io, fmt::format("cell {} holds seq_id {} not in [0, {})", j, id, params_.n_seq_max));
                if (!params_.unified && static_cast<uint32_t>(id) != s)
                    bad(io, fmt::format("cell {} of stream {} holds seq_id {}, which lives in stream {}", j,
                                        s, id, id));
                if (std::find(part.seqs[j].begin(), part.seqs[j].end(), id) != part.seqs[j].end())
                    bad(io, fmt::format("cell {} lists seq_id {} twice", j, id));
                part.seqs[j].push_back(id);
            }
        }
        const auto v_trans = get<uint32_t>(io);
        if (v_trans != (params_.v_trans ? 1u : 0u))
            bad(io, fmt::format("the state's V is {}transposed, this cache's is {}", v_trans ? "" : "not ",
                                params_.v_trans ? "transposed" : "not"));
        const auto n_layer = get<uint32_t>(io);
        if (n_layer != layers_.size())
            bad(io, fmt::format("the state has {} layers, this cache {}", n_layer, layers_.size()));
        for (uint32_t li = 0; li < layers_.size(); ++li) {
            const layer& l = layers_[li];
            const size_t k_row = storage_->k_row_bytes(li);
            const auto type = get<int32_t>(io);
            if (type != static_cast<int32_t>(params_.type_k))
                bad(io, fmt::format("layer {} K type {} (ggml id), this cache has {} ({})", l.il, type,
                                    to_string(params_.type_k), static_cast<int32_t>(params_.type_k)));
            const auto row = get<uint64_t>(io);
            if (row != k_row)
                bad(io, fmt::format("layer {} K rows of {} bytes, this cache {}", l.il, row, k_row));
            part.k.push_back(read_rows(size_t{count} * k_row, part));
        }
        const size_t esz = type_size(params_.type_v);
        for (uint32_t li = 0; li < layers_.size(); ++li) {
            const layer& l = layers_[li];
            const size_t v_row = storage_->v_row_bytes(li);
            const uint32_t l_e_v = storage_->e_v(li);
            const auto type = get<int32_t>(io);
            if (type != static_cast<int32_t>(params_.type_v))
                bad(io, fmt::format("layer {} V type {} (ggml id), this cache has {} ({})", l.il, type,
                                    to_string(params_.type_v), static_cast<int32_t>(params_.type_v)));
            if (!params_.v_trans) {
                const auto row = get<uint64_t>(io);
                if (row != v_row)
                    bad(io, fmt::format("layer {} V rows of {} bytes, this cache {}", l.il, row, v_row));
            } else {
                const auto elem = get<uint32_t>(io);
                const auto e_v = get<uint32_t>(io);
                if (elem != esz || e_v != l_e_v)
                    bad(io, fmt::format("layer {} V of {} channels x {} bytes, this cache {} x {}", l.il, e_v,
                                        elem, l_e_v, esz));
            }
            const size_t bytes = params_.v_trans ? size_t{count} * l_e_v * esz : size_t{count} * v_row;
            part.v.push_back(read_rows(bytes, part));
        }
        st.parts.push_back(std::move(part));
    }
    return stage;
}

struct kv_cache::commit_undo {
    std::vector<uint32_t> streams;  // the streams the commit changed
    std::vector<kv_cells> cells;    // [streams] as they were
    std::vector<uint32_t> heads;    // every stream's head, as it was
    struct rows_backup {
        std::vector<uint64_t> rows;
        std::vector<std::vector<uint8_t>> k, v;  // [layer] the rows' bytes as they were, as load takes them
    };
    std::vector<rows_backup> data;  // the rows the commit overwrote
};

void kv_cache::state_commit(state_stage_i& stage) {
    state_commit(stage, nullptr);
}

std::shared_ptr<kv_cache::commit_undo> kv_cache::state_commit_undoable(state_stage_i& stage) {
    auto undo = std::make_shared<commit_undo>();
    state_commit(stage, undo.get());
    return undo;
}

void kv_cache::state_undo(commit_undo& undo) {
    for (size_t k = 0; k < undo.streams.size(); ++k) streams_[undo.streams[k]] = std::move(undo.cells[k]);
    for (const auto& d : undo.data)
        for (uint32_t li = 0; li < layers_.size(); ++li) {
            storage_->load(kv_part::k, li, d.rows, reinterpret_cast<const std::byte*>(d.k[li].data()));
            storage_->load(kv_part::v, li, d.rows, reinterpret_cast<const std::byte*>(d.v[li].data()));
        }
    std::copy(undo.heads.begin(), undo.heads.end(), heads_.begin());
    fit_storage_of(seq_all);  // the commit only grew the marks (fit_storage without release)
}

void kv_cache::state_commit(state_stage_i& stage, commit_undo* undo) {
    auto* staged = dynamic_cast<staged_state*>(&stage);
    if (staged == nullptr || staged->owner != this)
        throw error(errc::invalid_argument, "state_commit: the stage was made by another memory");
    const staged_state& st = *staged;
    const seq_id_t seq_id = st.seq_id;

    // data: the part's j-th K/V row goes to cells[j] of the stream
    std::vector<uint64_t> rows;
    const auto copy_rows = [&](const staged_state::stream_part& part, uint32_t stream,
                               std::span<const uint32_t> cells) {
        rows.resize(cells.size());
        for (size_t j = 0; j < cells.size(); ++j) rows[j] = row(stream, cells[j]);
        for (uint32_t li = 0; li < layers_.size(); ++li) {
            storage_->load(kv_part::k, li, rows, part.k[li].data());
            storage_->load(kv_part::v, li, rows, part.v[li].data());
        }
    };
    // an undoable commit keeps the rows it will overwrite (before any is written)
    const auto back_up_rows = [&](uint32_t stream, std::span<const uint32_t> cells) {
        commit_undo::rows_backup& d = undo->data.emplace_back();
        for (uint32_t c : cells) d.rows.push_back(row(stream, c));
        for (uint32_t li = 0; li < layers_.size(); ++li) {
            io_vector_writer k(d.k.emplace_back()), v(d.v.emplace_back());
            storage_->save_k(k, li, d.rows, {});
            storage_->save_v(v, li, d.rows);
        }
    };
    if (undo) {
        undo->heads = heads_;
        if (seq_id != seq_all) {
            undo->streams = {seq_to_stream(seq_id)};
            undo->cells = {streams_[seq_to_stream(seq_id)]};
        }
    }

    // An allocation may fail while the cells change (issue 21): they are put back then. K/V rows are written
    // last, by calls that allocate nothing, so a failure never leaves rows of the state in old cells.
    size_t most = 0;  // cells of the largest part: room for rows and cells is made before anything changes
    for (const auto& part : st.parts) most = std::max(most, part.pos.size());
    rows.reserve(most);

    if (seq_id == seq_all) {
        std::vector<kv_cells> saved = streams_;  // design D2: every stream is replaced
        const std::vector<uint32_t> saved_heads = heads_;
        std::vector<std::vector<uint32_t>> cells(st.parts.size());  // a part's cells are 0..n-1 of its stream
        if (undo) {
            for (const auto& part : st.parts) {
                std::vector<uint32_t> first(part.pos.size());
                std::iota(first.begin(), first.end(), 0u);
                back_up_rows(part.stream, first);
            }
            for (uint32_t s = 0; s < streams_.size(); ++s) undo->streams.push_back(s);
            undo->cells = saved;
        }
        try {
            for (kv_cells& c : streams_) c.reset();
            std::fill(heads_.begin(), heads_.end(), 0);
            for (size_t k = 0; k < st.parts.size(); ++k) {
                const auto& part = st.parts[k];
                kv_cells& c = streams_[part.stream];
                cells[k].reserve(part.pos.size());
                for (uint32_t j = 0; j < part.pos.size(); ++j) {
                    c.pos_set(j, part.pos[j]);
                    if (!part.ext.empty()) c.ext_set(j, part.ext[j]);  // else (0, 0), as reset left it
                    for (seq_id_t q : part.seqs[j]) c.seq_add(j, q);
                    cells[k].push_back(j);
                }
            }
        } catch (...) {
            streams_ = std::move(saved);
            heads_ = saved_heads;
            throw;
        }
        prefix_reset();  // after the cells changed: a failure above keeps the index that matches them
        // commit marks of the new cells; the emptied streams give memory back, unless the commit may be
        // undone (its old rows must stay)
        for (uint32_t q = 0; q < streams_.size(); ++q) fit_storage(q, undo == nullptr);
        for (size_t k = 0; k < st.parts.size(); ++k) copy_rows(st.parts[k], st.parts[k].stream, cells[k]);
        prefix_forget(seq_all);  // the restored sequences' tokens are unknown: none publishes
        prefix_sync(seq_all);
        return;
    }

    const uint32_t s = seq_to_stream(seq_id);
    kv_cells& c = streams_[s];
    const staged_state::stream_part* part = st.parts.empty() ? nullptr : &st.parts[0];
    const auto n = part ? static_cast<uint32_t>(part->pos.size()) : 0;
    const auto no_room = [&] {
        return error(errc::invalid_state,
                     fmt::format("state_read: no room for the {} cells of the state in the stream of seq {}",
                                 n, seq_id));
    };
    std::vector<uint32_t> cells;  // where the state's cells go, in the state's order
    cells.reserve(n);
    // the destination's cells, to put back when an allocation fails once they changed
    std::vector<uint32_t> old;
    c.seq_cells(seq_id, -1, -1, old);
    const cells_snapshot saved = c.cp(old);
    const std::vector<uint32_t> saved_heads = heads_;
    const auto put_back = [&] {
        c.set(old, saved);
        heads_ = saved_heads;
    };
    if (params_.swa == swa_type::none) {
        // Only empty cells take the state's cells, so whether they fit is known before anything changes:
        // the empty cells and those the destination alone holds (it leaves them) must number at least n.
        if (n > params_.kv_size - c.get_used()) {  // else there is room whatever the destination frees
            // (a cell the prefix cache holds stays when the destination leaves it; cached blocks may be
            // evicted for the rest)
            uint32_t freed = 0;
            for (const auto& e : c.seq_entries(seq_id, -1, -1))
                freed += c.seqs(e.second).is_only(seq_id) && !c.is_held(e.second) ? 1 : 0;
            if (n > params_.kv_size - (c.get_used() - freed) && !prefix_make_room(s, n - freed))
                throw no_room();
        }
        try {
            remove(seq_id, -1, -1);  // may be put back: its memory stays
            if (n > 0) {
                // find_slot for the cells of one sequence: one group in its stream, from the stream's head
                if (!find_slot_group(s, n, false, cells))
                    throw error(errc::invalid_state,
                                "state_read: internal error: free cells counted but not found");
                // apply_ubatch into empty cells (all or nothing)
                c.fill(cells, part->pos,
                       params_.n_pos >= 3 ? std::span(part->ext) : std::span<const cell_ext>{}, seq_id);
                heads_[s] = cells.back() + 1;
            }
        } catch (...) {
            put_back();
            throw;
        }
    } else {
        // An SWA cache may also reuse cells that go out of its window: place the cells as a ubatch, on the
        // memory without the destination, and put the destination back when they do not fit.
        try {
            remove(seq_id, -1, -1);  // may be put back: its memory stays
            if (n > 0) {
                const ubatch ub = restore_ubatch(part->pos, part->ext, seq_id, params_.n_pos);
                slot_info si = find_slot(ub);
                if (si.empty()) throw no_room();
                apply_ubatch(si, ub);  // all or nothing
                cells = std::move(si.idxs[0]);
            }
        } catch (...) {
            put_back();
            throw;
        }
    }
    if (undo && part) {
        try {
            back_up_rows(s, cells);
        } catch (...) {
            streams_[s] = std::move(undo->cells[0]);
            heads_ = undo->heads;
            throw;
        }
    }
    fit_storage(s, undo == nullptr);
    if (part) copy_rows(*part, s, cells);
    prefix_forget(seq_id);  // its tokens are unknown: it does not publish
}

bool kv_cache::state_fits(const state_stage_i& stage) {
    const auto* st = dynamic_cast<const staged_state*>(&stage);
    if (st == nullptr || st->owner != this)
        throw error(errc::invalid_argument, "state_fits: the stage was made by another memory");
    if (st->seq_id == seq_all || st->parts.empty()) return true;  // a whole state is placed at 0..n-1
    // what state_commit does (the destination leaves its cells, then the state's cells are placed), undone
    const seq_id_t seq_id = st->seq_id;
    kv_cells& c = streams_[seq_to_stream(seq_id)];
    if (prefix_) {  // no window: empty cells, those the destination alone leaves, and evictable ones
        const auto n = static_cast<uint32_t>(st->parts[0].pos.size());
        uint32_t freed = 0;
        for (const auto& e : c.seq_entries(seq_id, -1, -1))
            freed += c.seqs(e.second).is_only(seq_id) && !c.is_held(e.second) ? 1 : 0;
        return n <= freed || prefix_room_possible(seq_to_stream(seq_id), n - freed);
    }
    std::vector<uint32_t> old;
    c.seq_cells(seq_id, -1, -1, old);
    const cells_snapshot saved = c.cp(old);
    const std::vector<uint32_t> saved_heads = heads_;
    bool fits = false;
    try {  // an allocation may fail on the trial: the destination comes back all the same
        remove(seq_id, -1, -1);  // put back below: its memory stays
        const ubatch ub = restore_ubatch(st->parts[0].pos, st->parts[0].ext, seq_id, params_.n_pos);
        fits = !prepare(std::span(&ub, 1)).empty();
    } catch (...) {
        c.set(old, saved);
        heads_ = saved_heads;
        throw;
    }
    c.set(old, saved);
    heads_ = saved_heads;
    return fits;
}

}  // namespace kvc
