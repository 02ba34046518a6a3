// kv_storage: the shape every storage shares, and the host storage (one buffer per layer and part).
#include <algorithm>
#include <cassert>
#include <cstring>

#include <fmt/format.h>
#include <kvcache/io.h>
#include <kvcache/kv_storage.h>

#include "detail/copy.h"
#include "detail/reserved_memory.h"

namespace kvc {

kv_storage::kv_storage(kv_storage_params params) : params_(std::move(params)) {
    for (const kv_storage_layer& l : params_.layers)
        e_vmax_ = std::max(e_vmax_, l.n_head_kv * l.n_embd_head_v);
    for (uint32_t li = 0; li < params_.layers.size(); ++li) {
        k_row_.push_back(row_size(params_.type_k, e_k(li)));
        v_row_.push_back(params_.v_trans ? type_size(params_.type_v) * e_vmax_
                                         : row_size(params_.type_v, e_v(li)));
    }
}

uint32_t kv_storage::e_k(uint32_t li) const {
    return params_.layers[li].n_head_kv * params_.layers[li].n_embd_head_k;
}

uint32_t kv_storage::e_v(uint32_t li) const {
    return params_.layers[li].n_head_kv * params_.layers[li].n_embd_head_v;
}

size_t kv_storage::bytes(kv_part part, uint32_t li) const {
    const size_t rows = size_t{params_.kv_size} * params_.n_stream;
    return rows * (part == kv_part::k ? k_row_[li] : v_row_[li]);
}

uint64_t kv_storage::v_trans_index(uint64_t row, uint32_t e) const {
    const uint64_t kv = params_.kv_size;
    return row / kv * kv * e_vmax_ + uint64_t{e} * kv + row % kv;
}

namespace {

// Runs rows[j..j+n) of consecutive rows within one stream, as (j, n): their bytes move in one piece.
std::vector<std::pair<size_t, size_t>> runs_of(std::span<const uint64_t> rows, uint64_t kv_size) {
    std::vector<std::pair<size_t, size_t>> runs;
    for (size_t j = 0; j < rows.size();) {
        size_t n = 1;
        while (j + n < rows.size() && rows[j + n] == rows[j] + n && rows[j + n] % kv_size != 0) ++n;
        runs.emplace_back(j, n);
        j += n;
    }
    return runs;
}

// The same runs, given to fn(j, n) one by one without allocating (restores write rows after the memory's
// cells changed: nothing may fail there, issue 21).
template <class F>
void for_each_run(std::span<const uint64_t> rows, uint64_t kv_size, const F& fn) {
    for (size_t j = 0; j < rows.size();) {
        size_t n = 1;
        while (j + n < rows.size() && rows[j + n] == rows[j] + n && rows[j + n] % kv_size != 0) ++n;
        fn(j, n);
        j += n;
    }
}

// Rows of E values per token from src: [E, n_tokens] or [head_dim, n_head, n_tokens], f32 or f16, contiguous.
void check_source(const const_tensor_view& src, uint32_t e, size_t n_tokens, const char* what) {
    if (src.type != dtype::f32 && src.type != dtype::f16)
        throw error(errc::invalid_argument,
                    fmt::format("{}: source rows must be f32 or f16, not {}", what, to_string(src.type)));
    if (!src.is_contiguous() || src.nelements() != static_cast<int64_t>(e * n_tokens))
        throw error(errc::invalid_argument,
                    fmt::format("{}: expected {} contiguous values ({} per token x {} tokens), got {}", what,
                                e * n_tokens, e, n_tokens, src.describe()));
}

class host_kv_storage final : public kv_storage {
public:
    explicit host_kv_storage(kv_storage_params p) : kv_storage(std::move(p)) {
        const size_t n_layer = params_.layers.size();
        if (params_.allocator) {  // the engine's allocator: every byte up front, zeroed
            for (uint32_t li = 0; li < n_layer; ++li)
                for (kv_part part : {kv_part::k, kv_part::v}) {
                    // zeroed: attention over a never-written cell must not meet NaNs
                    buffers_.emplace_back(bytes(part, li), true, *params_.allocator);
                    (part == kv_part::k ? k_ : v_).push_back(buffers_.back().data());
                }
            return;
        }
        // Host memory is elastic: one reservation for every tensor, each starting on a page, whose
        // pages arrive when cells are first written (zeros until then) and leave with set_committed.
        const size_t page = detail::reserved_memory::page_size();
        const auto round = [page](size_t n) { return (n + page - 1) / page * page; };
        size_t total = 0;
        for (uint32_t li = 0; li < n_layer; ++li)
            total += round(bytes(kv_part::k, li)) + round(bytes(kv_part::v, li));
        mem_ = detail::reserved_memory(total);
        size_t at = 0;
        for (uint32_t li = 0; li < n_layer; ++li) {
            k_.push_back(mem_.data() + at);
            at += round(bytes(kv_part::k, li));
            v_.push_back(mem_.data() + at);
            at += round(bytes(kv_part::v, li));
        }
    }

    uint32_t commit_granule() const override {
        if (!elastic()) return 0;
        // the fewest cells whose bytes fill whole pages in every tensor (a transposed V commits channel
        // by channel: a page holds page / element-size cells of one channel)
        const size_t page = detail::reserved_memory::page_size();
        size_t g = 16;
        for (uint32_t li = 0; li < params_.layers.size(); ++li) {
            const size_t v_unit = params_.v_trans ? type_size(params_.type_v) : v_row_[li];
            while (g * k_row_[li] < page || g * v_unit < page) g *= 2;
        }
        return static_cast<uint32_t>(std::min<size_t>(g, params_.kv_size));
    }

    void set_committed(uint32_t stream, uint32_t n_cells) override {
        if (!elastic()) return;
        const size_t kv = params_.kv_size, first = size_t{stream} * kv;
        const size_t n_free = kv - n_cells;  // cells [n_cells, kv) of the stream go back to the system
        for (uint32_t li = 0; li < k_.size(); ++li) {
            mem_.release(offset(k_[li]) + (first + n_cells) * k_row_[li], n_free * k_row_[li]);
            if (!params_.v_trans) {
                mem_.release(offset(v_[li]) + (first + n_cells) * v_row_[li], n_free * v_row_[li]);
                continue;
            }
            const size_t esz = type_size(params_.type_v);
            for (uint32_t e = 0; e < e_vmax_; ++e)
                mem_.release(offset(v_[li]) + (v_trans_index(first + n_cells, e)) * esz, n_free * esz);
        }
    }

    void write(kv_part part, uint32_t li, const_tensor_view src, std::span<const uint64_t> rows) override {
        const bool is_k = part == kv_part::k;
        const uint32_t e = is_k ? e_k(li) : e_v(li);
        check_source(src, e, rows.size(), is_k ? "cpy_k" : "cpy_v");
        const size_t src_row = size_t{e} * type_size(src.type);
        const dtype type = is_k ? params_.type_k : params_.type_v;
        if (is_k || !params_.v_trans) {
            for (size_t t = 0; t < rows.size(); ++t)
                convert_row(src.type, src.data + t * src_row, type, row_ptr(part, li, rows[t]), e);
            return;
        }
        std::vector<float> x(e_vmax_, 0.0f);  // channels past E_v stay zero (padding of transposed V)
        const size_t esz = type_size(type);
        for (size_t t = 0; t < rows.size(); ++t) {
            to_f32(src.type, src.data + t * src_row, x.data(), e);
            for (uint32_t c = 0; c < e_vmax_; ++c)
                from_f32(type, &x[c], v_[li] + v_trans_index(rows[t], c) * esz, 1);
        }
    }

    void copy_rows(std::span<const row_copy> copies) override {
        const size_t esz = type_size(params_.type_v);
        for (uint32_t li = 0; li < k_.size(); ++li)
            for (const row_copy& c : copies) {
                std::memcpy(row_ptr(kv_part::k, li, c.dst), row_ptr(kv_part::k, li, c.src), k_row_[li]);
                if (!params_.v_trans) {
                    std::memcpy(row_ptr(kv_part::v, li, c.dst), row_ptr(kv_part::v, li, c.src), v_row_[li]);
                    continue;
                }
                std::byte* v = v_[li];
                for (uint32_t e = 0; e < e_vmax_; ++e)
                    std::memcpy(v + v_trans_index(c.dst, e) * esz, v + v_trans_index(c.src, e) * esz, esz);
            }
    }

    void shift_k(std::span<const row_shift> shifts, const executor& ex) override {
        std::vector<uint32_t> roped;  // layers whose keys carry RoPE
        for (uint32_t li = 0; li < params_.layers.size(); ++li)
            if (params_.layers[li].rope.type != rope_type::none) roped.push_back(li);
        const size_t n = shifts.size();
        // Pieces of (layer, shift) pairs; a piece builds a rotation table whenever the delta changes
        // (shifts come sorted by delta: one table per piece and delta).
        run(ex, roped.size() * n, [&](size_t begin, size_t end) {
            std::vector<float> x;
            ops::rope_table table;
            uint32_t table_li = UINT32_MAX;
            pos_t table_delta = 0;
            for (size_t i = begin; i < end; ++i) {
                const uint32_t li = roped[i / n];
                const row_shift& s = shifts[i % n];
                const kv_storage_layer& l = params_.layers[li];
                if (table_li != li || table_delta != s.delta) {
                    table = ops::make_rope_table(l.n_embd_head_k, s.delta, l.rope, false);
                    table_li = li;
                    table_delta = s.delta;
                    x.resize(e_k(li));
                }
                std::byte* p = row_ptr(kv_part::k, li, s.row);
                to_f32(params_.type_k, p, x.data(), e_k(li));
                ops::apply_rope(x, l.n_head_kv, l.n_embd_head_k, table);
                from_f32(params_.type_k, x.data(), p, e_k(li));
            }
        });
    }

    void clear() override {
        if (elastic()) {
            mem_.release(0, mem_.size());
            return;
        }
        for (buffer& b : buffers_) b.clear_bytes();
    }

    void save_k(io_write_i& io, uint32_t li, std::span<const uint64_t> rows,
                std::span<const pos_t> deltas) const override {
        const size_t row_bytes = k_row_[li];
        const bool any = std::any_of(deltas.begin(), deltas.end(), [](pos_t d) { return d != 0; });
        if (!any) {
            for (const auto& [j, n] : runs_of(rows, params_.kv_size))
                io.write(row_ptr(kv_part::k, li, rows[j]), n * row_bytes);
            return;
        }
        const kv_storage_layer& l = params_.layers[li];
        std::vector<float> x(e_k(li));
        std::vector<std::byte> shifted(row_bytes);
        ops::rope_table table;
        pos_t table_for = 0;
        for (size_t j = 0; j < rows.size(); ++j) {
            const pos_t d = deltas[j];
            if (d == 0 || l.rope.type == rope_type::none) {
                io.write(row_ptr(kv_part::k, li, rows[j]), row_bytes);
                continue;
            }
            if (table.c.empty() || table_for != d) {
                table = ops::make_rope_table(l.n_embd_head_k, d, l.rope, false);
                table_for = d;
            }
            to_f32(params_.type_k, row_ptr(kv_part::k, li, rows[j]), x.data(), e_k(li));
            ops::apply_rope(x, l.n_head_kv, l.n_embd_head_k, table);
            from_f32(params_.type_k, x.data(), shifted.data(), e_k(li));
            io.write(shifted.data(), row_bytes);
        }
    }

    void save_v(io_write_i& io, uint32_t li, std::span<const uint64_t> rows) const override {
        const auto runs = runs_of(rows, params_.kv_size);
        if (!params_.v_trans) {
            for (const auto& [j, n] : runs) io.write(row_ptr(kv_part::v, li, rows[j]), n * v_row_[li]);
            return;
        }
        const size_t esz = type_size(params_.type_v);
        const std::byte* v = v_[li];
        for (uint32_t e = 0; e < e_v(li); ++e)
            for (const auto& [j, n] : runs) io.write(v + v_trans_index(rows[j], e) * esz, n * esz);
    }

    void load(kv_part part, uint32_t li, std::span<const uint64_t> rows, const std::byte* src) override {
        if (part == kv_part::k || !params_.v_trans) {
            const size_t row_bytes = part == kv_part::k ? k_row_[li] : v_row_[li];
            for_each_run(rows, params_.kv_size, [&](size_t j, size_t n) {
                detail::copy_bytes(row_ptr(part, li, rows[j]), src + j * row_bytes, n * row_bytes);
            });
            return;
        }
        // src is channel-major, [E_v][rows]; channel e of a run is e * kv_size elements after channel 0
        const size_t esz = type_size(params_.type_v);
        const size_t channel = size_t{params_.kv_size} * esz;
        for_each_run(rows, params_.kv_size, [&](size_t j, size_t n) {  // run by run: the runs are found once
            std::byte* dst = v_[li] + v_trans_index(rows[j], 0) * esz;
            for (uint32_t e = 0; e < e_v(li); ++e)
                std::memcpy(dst + e * channel, src + (size_t{e} * rows.size() + j) * esz, n * esz);
        });
    }

    void read_row(kv_part part, uint32_t li, uint64_t row, std::span<float> out) const override {
        const bool is_k = part == kv_part::k;
        const uint32_t e = is_k ? e_k(li) : e_v(li);
        assert(out.size() >= e);
        if (is_k || !params_.v_trans) {
            to_f32(is_k ? params_.type_k : params_.type_v, row_ptr(part, li, row), out.data(), e);
            return;
        }
        const size_t esz = type_size(params_.type_v);
        for (uint32_t c = 0; c < e; ++c)
            to_f32(params_.type_v, v_[li] + v_trans_index(row, c) * esz, &out[c], 1);
    }

    tensor_view view(kv_part part, uint32_t li, uint32_t s0, uint32_t ns, uint32_t n_kv) override {
        const kv_storage_layer& l = params_.layers[li];
        const uint64_t first = uint64_t{s0} * params_.kv_size;
        tensor_view v;
        if (part == kv_part::k || !params_.v_trans) {
            const bool is_k = part == kv_part::k;
            const dtype type = is_k ? params_.type_k : params_.type_v;
            const uint32_t head = is_k ? l.n_embd_head_k : l.n_embd_head_v;
            const size_t row = is_k ? k_row_[li] : v_row_[li];
            v.type = type;
            v.ne[0] = head;
            v.ne[1] = l.n_head_kv;
            v.ne[2] = n_kv;
            v.ne[3] = ns;
            v.nb[0] = type_size(type);
            v.nb[1] = row_size(type, head);
            v.nb[2] = row;
            v.nb[3] = row * params_.kv_size;
            v.data = row_ptr(part, li, first);
            return v;
        }
        const size_t kv = params_.kv_size, esz = type_size(params_.type_v);
        v.type = params_.type_v;
        v.ne[0] = n_kv;  // cells fastest
        v.ne[1] = l.n_head_kv;
        v.ne[2] = l.n_embd_head_v;
        v.ne[3] = ns;
        v.nb[0] = esz;
        v.nb[1] = kv * l.n_embd_head_v * esz;
        v.nb[2] = kv * esz;
        v.nb[3] = kv * e_vmax_ * esz;
        v.data = v_[li] + v_trans_index(first, 0) * esz;
        return v;
    }

private:
    bool elastic() const { return params_.allocator == nullptr; }
    size_t offset(const std::byte* p) const { return static_cast<size_t>(p - mem_.data()); }

    // Row-major rows only (K, or V not transposed).
    std::byte* row_ptr(kv_part part, uint32_t li, uint64_t row) {
        return part == kv_part::k ? k_[li] + row * k_row_[li] : v_[li] + row * v_row_[li];
    }
    const std::byte* row_ptr(kv_part part, uint32_t li, uint64_t row) const {
        return const_cast<host_kv_storage*>(this)->row_ptr(part, li, row);
    }

    detail::reserved_memory mem_;    // host memory: every tensor
    std::vector<buffer> buffers_;    // an engine's allocator: one per tensor
    std::vector<std::byte*> k_, v_;  // per layer: where its K and V start
};

}  // namespace

std::unique_ptr<kv_storage> make_host_kv_storage(kv_storage_params params) {
    return std::make_unique<host_kv_storage>(std::move(params));
}

}  // namespace kvc
