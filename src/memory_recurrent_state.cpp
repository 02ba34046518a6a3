// memory_recurrent: state payloads in llama.cpp's recurrent layout (design/recurrent.md §4.9), read
// transactionally (design D6): parsed and checked completely before the memory changes.
#include <algorithm>
#include <cstring>

#include <fmt/format.h>
#include <kvcache/memory_budget.h>
#include <kvcache/memory_recurrent.h>
#include <kvcache/state.h>

#include "detail/memory_recurrent_impl.h"
#include "detail/state_io.h"

namespace kvc {

using detail::bad;
using detail::get;
using detail::put;

// -- writing --

void memory_recurrent::state_write(io_write_i& io, seq_id_t seq_id,
                                   state_seq_flags /*flags: the memory is already a partial one*/) const {
    std::vector<uint32_t> cells;
    if (seq_id == seq_all) {
        for (uint32_t c = 0; c < size_; ++c)
            if (cells_[c].n_seq > 0) cells.push_back(c);
    } else {
        check_seq(seq_id, "state_write");
        if (tail_[static_cast<size_t>(seq_id)] >= 0)
            cells.push_back(static_cast<uint32_t>(tail_[static_cast<size_t>(seq_id)]));
    }
    put<uint32_t>(io, static_cast<uint32_t>(cells.size()));
    for (uint32_t c : cells) {
        put<int32_t>(io, cells_[c].pos);
        if (seq_id != seq_all) {  // seq-agnostic: restorable into any sequence
            put<uint32_t>(io, 0);
            continue;
        }
        const std::vector<seq_id_t> ids = members(c);
        put<uint32_t>(io, static_cast<uint32_t>(ids.size()));
        for (seq_id_t s : ids) put<int32_t>(io, s);
    }
    put<uint32_t>(io, 0);  // s_trans
    put<uint32_t>(io, static_cast<uint32_t>(params_.layers.size()));
    // the logical state of each cell: plane rs_idx when a rollback is pending (between ubatches src == c)
    const auto rows = [&](const state_rows& b, size_t row) {
        for (uint32_t c : cells) io.write(b.data() + (size_t{cells_[c].rs_idx} * size_ + c) * row, row);
    };
    for (const layer& l : layers_) {
        if (!l.row_r) continue;
        put<int32_t>(io, static_cast<int32_t>(params_.type_r));
        put<uint64_t>(io, l.row_r);
        rows(l.r, l.row_r);
    }
    for (const layer& l : layers_) {
        if (!l.row_s) continue;
        put<int32_t>(io, static_cast<int32_t>(params_.type_s));
        put<uint64_t>(io, l.row_s);
        rows(l.s, l.row_s);
    }
}

std::string memory_recurrent::state_layout() const {
    std::string out = fmt::format("recurrent n_layer={} layers=", params_.layers.size());
    const auto shape = [&](const layer& l) {
        std::string s;
        if (l.row_r) s += fmt::format("r={}x{}", to_string(params_.type_r), l.n_embd_r);
        if (l.row_s) s += fmt::format("{}s={}x{}", l.row_r ? "," : "", to_string(params_.type_s), l.n_embd_s);
        return s;
    };
    out += detail::layer_runs(
        layers_.size(), [&](size_t i) { return layers_[i].il; }, [&](size_t i) { return shape(layers_[i]); });
    return out;
}

uint64_t memory_recurrent::state_max_bytes() const {
    // state_write's fields with every cell used; a sequence has its state in one cell, so the cells list
    // n_seq_max (= size_) ids in all
    const uint64_t cells = size_;
    uint64_t n = add_sat(4 + 8, mul_sat(cells, 8 + 4));  // count, s_trans, n_layer; pos, n_ids, one id each
    for (const layer& l : layers_) {
        if (l.row_r) n = add_sat(n, add_sat(12, mul_sat(cells, l.row_r)));
        if (l.row_s) n = add_sat(n, add_sat(12, mul_sat(cells, l.row_s)));
    }
    return n;
}

// -- reading --

struct memory_recurrent::staged_state final : state_stage_i {
    const memory_recurrent* owner = nullptr;
    seq_id_t seq_id = seq_all;                  // destination
    std::vector<pos_t> pos;                     // [cells]
    std::vector<std::vector<seq_id_t>> seqs;    // [cells] whole restore only
    std::vector<std::span<const std::byte>> r;  // [own layer] the cells' rows back to back (or empty)
    std::vector<std::span<const std::byte>> s;
    std::vector<std::vector<std::byte>> owned;  // bytes behind r and s unless the reader lends them
};

state_stage_ptr memory_recurrent::state_stage(io_read_i& io, seq_id_t seq_id,
                                              state_seq_flags /*flags*/) const {
    if (seq_id != seq_all) check_seq(seq_id, "state_read");
    auto stage = std::make_unique<staged_state>();
    staged_state& st = *stage;
    st.owner = this;
    st.seq_id = seq_id;
    const auto count = get<uint32_t>(io);
    if (seq_id == seq_all && count > size_)
        bad(io, fmt::format("the state holds {} cells, this memory has {}", count, size_));
    if (seq_id != seq_all && count > 1)
        bad(io, fmt::format(
                    "a sequence's recurrent state holds at most one cell, this one has {} (a whole-memory "
                    "state cannot be restored into one sequence)",
                    count));
    st.pos.resize(count);
    if (seq_id == seq_all) st.seqs.resize(count);
    std::vector<bool> has_state(size_, false);
    for (uint32_t j = 0; j < count; ++j) {
        st.pos[j] = get<int32_t>(io);
        const auto n_ids = get<uint32_t>(io);
        if (seq_id != seq_all) {
            if (n_ids != 0)
                bad(io,
                    fmt::format("cell {} lists {} sequence ids; a sequence's state is seq-agnostic (0 ids) "
                                "(a whole-memory state cannot be restored into one sequence)",
                                j, n_ids));
            continue;
        }
        if (n_ids == 0) bad(io, fmt::format("cell {} belongs to no sequence", j));
        if (n_ids > size_)
            bad(io, fmt::format("cell {} lists {} sequence ids, more than n_seq_max {}", j, n_ids, size_));
        for (uint32_t q = 0; q < n_ids; ++q) {
            const auto id = get<int32_t>(io);
            if (id < 0 || static_cast<uint32_t>(id) >= size_)
                bad(io, fmt::format("cell {} holds seq_id {} not in [0, {})", j, id, size_));
            if (has_state[static_cast<size_t>(id)])
                bad(io, fmt::format("seq_id {} has a state in two cells (or twice in cell {})", id, j));
            has_state[static_cast<size_t>(id)] = true;
            st.seqs[j].push_back(id);
        }
    }
    const auto s_trans = get<uint32_t>(io);
    if (s_trans != 0) bad(io, fmt::format("transposed s rows (s_trans = {}) are not supported", s_trans));
    const auto n_layer = get<uint32_t>(io);
    if (n_layer != params_.layers.size())
        bad(io, fmt::format("the state has {} layers, this memory {}", n_layer, params_.layers.size()));
    st.owned.reserve(2 * layers_.size());  // no reallocation: r and s point into it
    const auto tensor = [&](const char* name, dtype type, uint32_t il, size_t row) {
        const auto t = get<int32_t>(io);
        if (t != static_cast<int32_t>(type))
            bad(io, fmt::format("layer {} {} type {} (ggml id), this memory has {} ({})", il, name, t,
                                to_string(type), static_cast<int32_t>(type)));
        const auto bytes = get<uint64_t>(io);
        if (bytes != row)
            bad(io, fmt::format("layer {} {} rows of {} bytes, this memory {}", il, name, bytes, row));
        return io.read_span(size_t{count} * row, st.owned.emplace_back());
    };
    for (const layer& l : layers_)
        st.r.push_back(l.row_r ? tensor("r", params_.type_r, l.il, l.row_r) : std::span<const std::byte>{});
    for (const layer& l : layers_)
        st.s.push_back(l.row_s ? tensor("s", params_.type_s, l.il, l.row_s) : std::span<const std::byte>{});
    return stage;
}

void memory_recurrent::state_commit(state_stage_i& stage) {
    auto* staged = dynamic_cast<staged_state*>(&stage);
    if (staged == nullptr || staged->owner != this)
        throw error(errc::invalid_argument, "state_commit: the stage was made by another memory");
    const staged_state& st = *staged;
    const seq_id_t seq_id = st.seq_id;

    const auto n = static_cast<uint32_t>(st.pos.size());
    uint32_t first = 0;  // restored cells are [first, first + n)
    if (seq_id == seq_all) {
        clear(/*data=*/false);  // cells compacted to 0..n-1
        for (uint32_t j = 0; j < n; ++j) {
            cells_[j].pos = st.pos[j];
            cells_[j].src = static_cast<int32_t>(j);
            for (seq_id_t s : st.seqs[j]) link(j, s);
        }
    } else {
        prefix_publish();
        const int32_t old = tail_[static_cast<size_t>(seq_id)];
        if (old >= 0) {
            unlink(static_cast<uint32_t>(old), seq_id);
            if (free_if_empty(static_cast<uint32_t>(old)))
                head_ = std::min(head_, static_cast<uint32_t>(old));
        }
        if (n == 0) {
            prefix_forget(seq_id);  // empty: it publishes again from position 0
            fit_rows();
            return;
        }
        const int32_t c = next_free(head_);  // exists: seq_id holds no cell now
        first = static_cast<uint32_t>(c);
        cells_[first] = cell_rec{};
        cells_[first].pos = st.pos[0];
        cells_[first].src = c;
        link(first, seq_id);
        head_ = first;
        prefix_forget(seq_id);  // its tokens are not in the state: it publishes nothing until emptied
    }
    if (n == 0) {
        fit_rows();
        return;
    }
    for (size_t li = 0; li < layers_.size(); ++li) {
        layer& l = layers_[li];
        if (l.row_r) std::memcpy(l.r.data() + size_t{first} * l.row_r, st.r[li].data(), st.r[li].size());
        if (l.row_s) std::memcpy(l.s.data() + size_t{first} * l.row_s, st.s[li].data(), st.s[li].size());
    }
    mark_ = std::max(mark_, first + n);
    fit_rows();  // the cells it filled, and those the destination left
}

}  // namespace kvc
