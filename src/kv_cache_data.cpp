// kv_cache: K/V rows, views, attention inputs (KQ mask, shifts, position buckets) and the K-shift.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include <fmt/format.h>
#include <kvcache/kv_cache.h>

#include "detail/kv_cache_layer.h"

namespace kvc {

// -- addressing --

std::byte* kv_cache::k_row_ptr(const layer& l, uint32_t stream, uint32_t cell) const {
    return const_cast<std::byte*>(l.k.data()) + (size_t{stream} * params_.kv_size + cell) * l.k_row;
}

std::byte* kv_cache::v_row_ptr(const layer& l, uint32_t stream, uint32_t cell) const {
    return const_cast<std::byte*>(l.v.data()) + (size_t{stream} * params_.kv_size + cell) * l.v_row;
}

size_t kv_cache::v_elem_offset(uint32_t stream, uint32_t channel, uint32_t cell) const {
    const size_t kv = params_.kv_size;
    return size_t{stream} * kv * e_vmax_ + size_t{channel} * kv + cell;
}

void kv_cache::copy_cell_data(uint32_t src_stream, uint32_t src_cell, uint32_t dst_stream,
                              uint32_t dst_cell) {
    const size_t esz = type_size(params_.type_v);
    for (const layer& l : layers_) {
        std::memcpy(k_row_ptr(l, dst_stream, dst_cell), k_row_ptr(l, src_stream, src_cell), l.k_row);
        if (!params_.v_trans) {
            std::memcpy(v_row_ptr(l, dst_stream, dst_cell), v_row_ptr(l, src_stream, src_cell), l.v_row);
            continue;
        }
        auto* v = const_cast<std::byte*>(l.v.data());
        for (uint32_t e = 0; e < e_vmax_; ++e)
            std::memcpy(v + v_elem_offset(dst_stream, e, dst_cell) * esz,
                        v + v_elem_offset(src_stream, e, src_cell) * esz, esz);
    }
}

// -- views --

namespace {

void check_view_slot(const slot_info& sinfo, uint32_t n_kv, uint32_t kv_size, size_t n_stream,
                     const char* what) {
    if (sinfo.empty() || sinfo.s1 < sinfo.s0 || sinfo.s1 >= n_stream)
        throw error(errc::invalid_argument, fmt::format("{}: slot has no valid stream range", what));
    if (n_kv == 0 || n_kv > kv_size)
        throw error(errc::out_of_range, fmt::format("{}: n_kv {} not in [1, {}]", what, n_kv, kv_size));
}

}  // namespace

tensor_view kv_cache::get_k(uint32_t il, uint32_t n_kv, const slot_info& sinfo) {
    const layer& l = own_layer(il);
    check_view_slot(sinfo, n_kv, params_.kv_size, streams_.size(), "get_k");
    tensor_view v;
    v.type = params_.type_k;
    v.ne[0] = l.desc.n_embd_head_k;
    v.ne[1] = l.desc.n_head_kv;
    v.ne[2] = n_kv;
    v.ne[3] = sinfo.s1 - sinfo.s0 + 1;
    v.nb[0] = type_size(params_.type_k);
    v.nb[1] = row_size(params_.type_k, l.desc.n_embd_head_k);
    v.nb[2] = l.k_row;
    v.nb[3] = l.k_row * params_.kv_size;
    v.data = k_row_ptr(l, sinfo.s0, 0);
    return v;
}

tensor_view kv_cache::get_v(uint32_t il, uint32_t n_kv, const slot_info& sinfo) {
    const layer& l = own_layer(il);
    check_view_slot(sinfo, n_kv, params_.kv_size, streams_.size(), "get_v");
    tensor_view v;
    v.type = params_.type_v;
    const size_t esz = type_size(params_.type_v);
    if (!params_.v_trans) {
        v.ne[0] = l.desc.n_embd_head_v;
        v.ne[1] = l.desc.n_head_kv;
        v.ne[2] = n_kv;
        v.ne[3] = sinfo.s1 - sinfo.s0 + 1;
        v.nb[0] = esz;
        v.nb[1] = row_size(params_.type_v, l.desc.n_embd_head_v);
        v.nb[2] = l.v_row;
        v.nb[3] = l.v_row * params_.kv_size;
        v.data = v_row_ptr(l, sinfo.s0, 0);
        return v;
    }
    const size_t kv = params_.kv_size;
    v.ne[0] = n_kv;  // cells fastest
    v.ne[1] = l.desc.n_head_kv;
    v.ne[2] = l.desc.n_embd_head_v;
    v.ne[3] = sinfo.s1 - sinfo.s0 + 1;
    v.nb[0] = esz;
    v.nb[1] = kv * l.desc.n_embd_head_v * esz;
    v.nb[2] = kv * esz;
    v.nb[3] = kv * e_vmax_ * esz;
    v.data = const_cast<std::byte*>(l.v.data()) + v_elem_offset(sinfo.s0, 0, 0) * esz;
    return v;
}

// -- writing rows --

namespace {

// Rows of E values per token from src: [E, n_tokens] or [head_dim, n_head, n_tokens], f32 or f16, contiguous.
const std::byte* token_row(const const_tensor_view& src, uint32_t e, uint32_t n_tokens, uint32_t t,
                           const char* what) {
    if (src.type != dtype::f32 && src.type != dtype::f16)
        throw error(errc::invalid_argument,
                    fmt::format("{}: source rows must be f32 or f16, not {}", what, to_string(src.type)));
    if (!src.is_contiguous() || src.nelements() != int64_t{e} * n_tokens)
        throw error(errc::invalid_argument,
                    fmt::format("{}: expected {} contiguous values ({} per token x {} tokens), "
                                "got {}",
                                what, int64_t{e} * n_tokens, e, n_tokens, src.describe()));
    return src.data + size_t{t} * e * type_size(src.type);
}

}  // namespace

void kv_cache::cpy_k(uint32_t il, const_tensor_view src, const slot_info& sinfo) {
    const layer& l = own_layer(il);
    const auto n = static_cast<uint32_t>(sinfo.n_stream() * sinfo.size());
    check_slot(sinfo, n, "cpy_k");
    uint32_t t = 0;  // token index: group by group, cell by cell
    for (size_t k = 0; k < sinfo.n_stream(); ++k)
        for (uint32_t cell : sinfo.idxs[k]) {
            const std::byte* row = token_row(src, l.e_k, n, t++, "cpy_k");
            convert_row(src.type, row, params_.type_k, k_row_ptr(l, sinfo.strm[k], cell), l.e_k);
        }
}

void kv_cache::cpy_v(uint32_t il, const_tensor_view src, const slot_info& sinfo) {
    const layer& l = own_layer(il);
    const auto n = static_cast<uint32_t>(sinfo.n_stream() * sinfo.size());
    check_slot(sinfo, n, "cpy_v");
    std::vector<float> x(e_vmax_, 0.0f);  // channels past E_v stay zero (padding of transposed V)
    const size_t esz = type_size(params_.type_v);
    auto* vdata = const_cast<std::byte*>(l.v.data());
    uint32_t t = 0;
    for (size_t k = 0; k < sinfo.n_stream(); ++k)
        for (uint32_t cell : sinfo.idxs[k]) {
            const std::byte* row = token_row(src, l.e_v, n, t++, "cpy_v");
            const uint32_t stream = sinfo.strm[k];
            if (!params_.v_trans) {
                convert_row(src.type, row, params_.type_v, v_row_ptr(l, stream, cell), l.e_v);
                continue;
            }
            to_f32(src.type, row, x.data(), l.e_v);
            for (uint32_t e = 0; e < e_vmax_; ++e)
                from_f32(params_.type_v, &x[e], vdata + v_elem_offset(stream, e, cell) * esz, 1);
        }
}

std::vector<int64_t> kv_cache::k_idxs(const slot_info& sinfo) const {
    std::vector<int64_t> idx;
    idx.reserve(sinfo.n_stream() * sinfo.size());
    for (size_t k = 0; k < sinfo.n_stream(); ++k)
        for (uint32_t c : sinfo.idxs[k]) idx.push_back(int64_t{sinfo.strm[k]} * params_.kv_size + c);
    return idx;
}

std::vector<int64_t> kv_cache::v_idxs(uint32_t il, const slot_info& sinfo) const {
    own_layer(il);
    if (!params_.v_trans) return k_idxs(sinfo);
    std::vector<int64_t> idx;
    idx.reserve(sinfo.n_stream() * sinfo.size() * e_vmax_);
    for (size_t k = 0; k < sinfo.n_stream(); ++k)
        for (uint32_t c : sinfo.idxs[k])
            for (uint32_t e = 0; e < e_vmax_; ++e)
                idx.push_back(static_cast<int64_t>(v_elem_offset(sinfo.strm[k], e, c)));
    return idx;
}

void kv_cache::read_k_row(uint32_t il, uint32_t stream, uint32_t cell, std::span<float> out) const {
    const layer& l = own_layer(il);
    cells(stream);
    if (cell >= params_.kv_size || out.size() < l.e_k)
        throw error(errc::out_of_range,
                    fmt::format("read_k_row: cell {} / output of {} values", cell, out.size()));
    to_f32(params_.type_k, k_row_ptr(l, stream, cell), out.data(), l.e_k);
}

void kv_cache::read_v_row(uint32_t il, uint32_t stream, uint32_t cell, std::span<float> out) const {
    const layer& l = own_layer(il);
    cells(stream);
    if (cell >= params_.kv_size || out.size() < l.e_v)
        throw error(errc::out_of_range,
                    fmt::format("read_v_row: cell {} / output of {} values", cell, out.size()));
    if (!params_.v_trans) {
        to_f32(params_.type_v, v_row_ptr(l, stream, cell), out.data(), l.e_v);
        return;
    }
    const size_t esz = type_size(params_.type_v);
    for (uint32_t e = 0; e < l.e_v; ++e)
        to_f32(params_.type_v, l.v.data() + v_elem_offset(stream, e, cell) * esz, &out[e], 1);
}

// -- attention inputs --

size_t kv_cache::kq_mask_elements(const ubatch& ub, uint32_t n_kv) const {
    return size_t{n_kv} * ub.n_tokens;
}

void kv_cache::set_input_kq_mask(tensor_view dst, const ubatch& ub, const slot_info& sinfo, uint32_t n_kv,
                                 bool causal, bool alibi) const {
    if (dst.type != dtype::f32 && dst.type != dtype::f16)
        throw error(
            errc::invalid_argument,
            fmt::format("set_input_kq_mask: mask type must be f32 or f16, not {}", to_string(dst.type)));
    if (n_kv == 0 || n_kv > params_.kv_size)
        throw error(errc::out_of_range,
                    fmt::format("set_input_kq_mask: n_kv {} not in [1, {}]", n_kv, params_.kv_size));
    if (!dst.is_contiguous() || static_cast<size_t>(dst.nelements()) != kq_mask_elements(ub, n_kv))
        throw error(errc::invalid_argument,
                    fmt::format("set_input_kq_mask: need {} contiguous elements ([{}, {}]), got {}",
                                kq_mask_elements(ub, n_kv), n_kv, ub.n_tokens, dst.describe()));
    check_ubatch(ub, "set_input_kq_mask");
    check_slot(sinfo, ub.n_tokens, "set_input_kq_mask");

    const bool f16 = dst.type == dtype::f16;
    if (reinterpret_cast<uintptr_t>(dst.data) % (f16 ? alignof(uint16_t) : alignof(float)) != 0)
        throw error(errc::invalid_argument,
                    "set_input_kq_mask: destination is not aligned to its element type");
    auto* m32 = reinterpret_cast<float*>(dst.data);
    auto* m16 = reinterpret_cast<uint16_t*>(dst.data);
    const auto put = [&](size_t at, float v) {
        if (f16)
            m16[at] = fp32_to_fp16(v);
        else
            m32[at] = v;
    };
    const uint32_t n = ub.n_tokens;
    const bool two_d = ub.n_pos >= 3;
    // Rows of one sequence differ only by the cells that became visible since its previous row (no
    // window, no ALiBi, no 2-D order): copy that row and open the new cells.
    const bool incremental = params_.swa == swa_type::none && !alibi && !two_d;
    std::vector<std::pair<seq_id_t, uint32_t>> last_row;  // per sequence: its latest row in this ubatch
    // Row i of the flat mask is token i in either layout ([n_kv, n_tps, 1, n_stream_mask] with token
    // i = s * n_tps + r). A row starts all -inf, then the cells of the token's sequence it may see open;
    // they come from the sequence's position index in position order, so causal rows stop early.
    for (uint32_t i = 0; i < n; ++i) {
        const size_t row = size_t{i} * n_kv;
        const seq_id_t q = ub.primary_seq(i);
        const kv_cells& cells = streams_[seq_to_stream(q)];
        const pos_t p1 = ub.pos[i];
        auto prev =
            std::find_if(last_row.begin(), last_row.end(), [q](const auto& e) { return e.first == q; });
        pos_t lo = 0;
        if (incremental && prev != last_row.end() && ub.pos[prev->second] <= p1) {
            const size_t from = size_t{prev->second} * n_kv;
            if (f16)
                std::copy_n(m16 + from, n_kv, m16 + row);
            else
                std::copy_n(m32 + from, n_kv, m32 + row);
            if (!causal) {  // every cell of the sequence is already open
                prev->second = i;
                continue;
            }
            lo = ub.pos[prev->second] + 1;
        } else {
            if (f16)
                std::fill_n(m16 + row, n_kv, uint16_t{0xfc00});  // -inf
            else
                std::fill_n(m32 + row, n_kv, -std::numeric_limits<float>::infinity());
            if (params_.swa == swa_type::standard) lo = std::max<int64_t>(0, int64_t{p1} - params_.n_swa + 1);
        }
        if (prev == last_row.end())
            last_row.emplace_back(q, i);
        else
            prev->second = i;
        const pos_t x1 = two_d ? ub.pos[i + 2 * n] : 0, y1 = two_d ? ub.pos[i + n] : 0;
        const pos_t hi = causal && p1 < std::numeric_limits<pos_t>::max() ? p1 + 1 : -1;
        for (const auto& [p0, c] : cells.seq_entries(q, lo, hi)) {
            if (c >= n_kv) continue;
            if (causal && two_d && p0 == p1 && cells.ext_get(c).is_2d_gt(x1, y1)) continue;
            if (params_.swa != swa_type::none && is_masked_swa(params_.n_swa, params_.swa, p0, p1)) continue;
            put(row + c, alibi ? -std::fabs(static_cast<float>(p0) - static_cast<float>(p1)) : 0.0f);
        }
    }
}

void kv_cache::set_input_k_shift(std::span<int32_t> dst) const {
    const size_t kv = params_.kv_size;
    if (dst.size() != kv * streams_.size())
        throw error(errc::invalid_argument, fmt::format("set_input_k_shift: need {} elements, got {}",
                                                        kv * streams_.size(), dst.size()));
    for (size_t s = 0; s < streams_.size(); ++s)
        for (uint32_t i = 0; i < kv; ++i)
            dst[s * kv + i] = streams_[s].is_empty(i) ? 0 : streams_[s].get_shift(i);
}

namespace {

// T5 relative position bucket (spec kv-core §4.5); the log branch only when needed.
int32_t pos_bucket(pos_t x, pos_t y, uint32_t n_buckets, bool bidirectional) {
    const int64_t max_distance = 128;
    if (bidirectional) n_buckets >>= 1;
    const int64_t max_exact = n_buckets >> 1;
    int64_t rel = int64_t{x} - y;
    int64_t b = 0;
    if (bidirectional) {
        b += rel > 0 ? n_buckets : 0;
        rel = rel < 0 ? -rel : rel;
    } else {
        rel = -std::min<int64_t>(rel, 0);
    }
    if (rel < max_exact) return static_cast<int32_t>(b + rel);
    const float large = static_cast<float>(max_exact) +
                        std::log(static_cast<float>(rel) / static_cast<float>(max_exact)) *
                            static_cast<float>(n_buckets - max_exact) /
                            std::log(static_cast<float>(max_distance) / static_cast<float>(max_exact));
    return static_cast<int32_t>(b +
                                std::min<int64_t>(n_buckets - 1, static_cast<int64_t>(std::floor(large))));
}

}  // namespace

void kv_cache::set_input_pos_bucket(std::span<int32_t> dst, const ubatch& ub, uint32_t n_kv,
                                    uint32_t n_buckets) const {
    if (streams_.size() != 1)
        throw error(errc::unsupported,
                    "set_input_pos_bucket: relative position buckets need a unified cache");
    if (n_buckets < 2) throw error(errc::invalid_argument, "set_input_pos_bucket: need at least 2 buckets");
    if (n_kv == 0 || n_kv > params_.kv_size || dst.size() != size_t{n_kv} * ub.n_tokens)
        throw error(errc::invalid_argument, fmt::format("set_input_pos_bucket: need {} elements for n_kv {}",
                                                        size_t{n_kv} * ub.n_tokens, n_kv));
    const kv_cells& cells = streams_[0];
    for (uint32_t i = 0; i < ub.n_tokens; ++i)
        for (uint32_t j = 0; j < n_kv; ++j)
            dst[size_t{i} * n_kv + j] =
                pos_bucket(cells.is_empty(j) ? -1 : cells.pos_get(j), ub.pos[i], n_buckets, false);
}

// -- K-shift --

void kv_cache::k_shift() {
    // Cells moved together share their delta (a context shift moves a whole suffix by one amount): one
    // rotation table per distinct delta, then every row is decoded, rotated and encoded again, whatever
    // the K type (decision 4), as a pure rotation (decision 5).
    std::vector<std::pair<pos_t, uint32_t>> shifted;  // (delta, cell) of one stream
    std::vector<float> row;
    for (uint32_t s = 0; s < streams_.size(); ++s) {
        const kv_cells& cells = streams_[s];
        shifted.clear();
        std::vector<uint32_t> used;
        cells.used_cells(used);
        for (uint32_t i : used)
            if (cells.get_shift(i) != 0) shifted.emplace_back(cells.get_shift(i), i);
        std::sort(shifted.begin(), shifted.end());
        for (const layer& l : layers_) {
            if (l.desc.rope.type == rope_type::none) continue;
            row.resize(l.e_k);
            ops::rope_table table;
            for (size_t k = 0; k < shifted.size(); ++k) {
                if (k == 0 || shifted[k].first != shifted[k - 1].first)
                    table = ops::make_rope_table(l.desc.n_embd_head_k, shifted[k].first, l.desc.rope, false);
                std::byte* kp = k_row_ptr(l, s, shifted[k].second);
                to_f32(params_.type_k, kp, row.data(), l.e_k);
                ops::apply_rope(row, l.desc.n_head_kv, l.desc.n_embd_head_k, table);
                from_f32(params_.type_k, row.data(), kp, l.e_k);
            }
        }
    }
}

}  // namespace kvc
