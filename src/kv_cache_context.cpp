// kv_cache_context (the engine's way to a ubatch's K/V rows, views and attention inputs) and the
// attention inputs themselves (KQ mask, shifts, position buckets).
#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <limits>
#include <new>

#include <fmt/format.h>
#include <kvcache/kv_cache.h>

#include "detail/kv_cache_layer.h"

namespace kvc {

// -- context --

kv_cache_context::kv_cache_context(kv_cache& cache, memory_status status, kind k)
    : cache_(&cache), status_(status), kind_(k) {
    if (k == kind::full) {  // worst case: every cell of every stream
        n_kv_ = cache.get_size();
        slot_info s;
        s.s0 = 0;
        s.s1 = cache.get_n_stream() - 1;
        for (uint32_t i = 0; i < cache.get_n_stream(); ++i) {
            s.strm.push_back(i);
            s.idxs.push_back({0});
        }
        sinfos_.push_back(std::move(s));
    }
}

kv_cache_context::kv_cache_context(kv_cache& cache, std::vector<ubatch> ubatches,
                                   std::vector<slot_info> sinfos, std::vector<int32_t> out_ids)
    : cache_(&cache),
      status_(memory_status::success),
      kind_(kind::batch),
      ubatches_(std::move(ubatches)),
      sinfos_(std::move(sinfos)),
      out_ids_(std::move(out_ids)) {
    assert(ubatches_.size() == sinfos_.size());
}

bool kv_cache_context::next() {
    if (kind_ != kind::batch || i_cur_ >= ubatches_.size()) return false;
    // The engine moves past the last ubatch once it computed it: the blocks the batch completed are
    // reusable now, so that a sequence removed right after its last step leaves them cached (a failed
    // step is not followed by next(): its blocks go with the cells seq_rm takes back). Not between
    // ubatches: publishing may share or move cells the later ubatches' slots were planned on. Out of
    // memory, the blocks stay pending and the next step publishes them: next() itself never fails.
    if (i_cur_ + 1 == ubatches_.size()) {
        try {
            cache_->prefix_publish();
        } catch (const std::bad_alloc&) {}
    }
    n_kv_ = 0;  // nothing of the next ubatch is known before its apply()
    rows_.clear();
    return ++i_cur_ < ubatches_.size();
}

void kv_cache_context::apply() {
    if (is_fail(status_)) throw error(errc::invalid_state, "memory context: apply() on a failed context");
    switch (kind_) {
        case kind::update:
            cache_->update();
            return;
        case kind::compact_update:
            cache_->update();  // shifts first: compaction moves the rotated rows
            cache_->compact();
            return;
        case kind::full:
            return;
        case kind::batch:
            break;
    }
    if (i_cur_ >= ubatches_.size())
        throw error(errc::invalid_state, "memory context: no ubatch left to apply");
    if (n_applied_ > i_cur_)
        throw error(errc::invalid_state,
                    fmt::format("memory context: ubatch {} was already applied", i_cur_));
    std::vector<uint64_t> rows = cache_->rows_of(sinfos_[i_cur_]);  // allocates: before the memory changes
    cache_->apply_ubatch(sinfos_[i_cur_], ubatches_[i_cur_]);       // all or nothing
    n_applied_ = i_cur_ + 1;
    n_kv_ = cache_->get_n_kv(sinfos_[i_cur_]);
    rows_ = std::move(rows);
}

const ubatch& kv_cache_context::get_ubatch() const {
    if (kind_ != kind::batch || i_cur_ >= ubatches_.size())
        throw error(errc::invalid_state, "memory context: no current ubatch");
    return ubatches_[i_cur_];
}

kv_cache_context* kv_cache_context::get_attn(uint32_t il) {
    return !is_fail(status_) && cache_->has_layer(il) ? this : nullptr;
}

const slot_info& kv_cache_context::get_sinfo() const {
    if (sinfos_.empty() || (kind_ == kind::batch && i_cur_ >= sinfos_.size()))
        throw error(errc::invalid_state, "memory context: no current slot");
    return sinfos_[kind_ == kind::batch ? i_cur_ : 0];
}

void kv_cache_context::check_applied(const char* what) const {
    if (kind_ != kind::batch)
        throw error(errc::invalid_state, fmt::format("{}: no current slot (not a batch context)", what));
    if (n_applied_ != i_cur_ + 1)
        throw error(errc::invalid_state, fmt::format("{}: apply() the current ubatch first", what));
}

tensor_view kv_cache_context::get_k(uint32_t il) {
    if (kind_ != kind::full) check_applied("get_k");
    const slot_info& s = get_sinfo();
    return cache_->storage_->view(kv_part::k, cache_->own_layer(il), s.s0, s.s1 - s.s0 + 1, n_kv_);
}

tensor_view kv_cache_context::get_v(uint32_t il) {
    if (kind_ != kind::full) check_applied("get_v");
    const slot_info& s = get_sinfo();
    return cache_->storage_->view(kv_part::v, cache_->own_layer(il), s.s0, s.s1 - s.s0 + 1, n_kv_);
}

void kv_cache_context::cpy_k(uint32_t il, const_tensor_view src) {
    check_applied("cpy_k");
    cache_->storage_->write(kv_part::k, cache_->own_layer(il), src, rows_);
}

void kv_cache_context::cpy_v(uint32_t il, const_tensor_view src) {
    check_applied("cpy_v");
    cache_->storage_->write(kv_part::v, cache_->own_layer(il), src, rows_);
}

std::vector<int64_t> kv_cache_context::k_idxs() const {
    check_applied("k_idxs");
    return {rows_.begin(), rows_.end()};
}

std::vector<int64_t> kv_cache_context::v_idxs(uint32_t il) const {
    check_applied("v_idxs");
    cache_->own_layer(il);
    const kv_storage& st = *cache_->storage_;
    if (!st.params().v_trans) return {rows_.begin(), rows_.end()};
    // channel e of a row is e * kv_size elements after its channel 0
    const uint32_t e_vmax = st.e_vmax();
    const auto kv = static_cast<int64_t>(cache_->params_.kv_size);
    std::vector<int64_t> idx(rows_.size() * e_vmax);
    int64_t* out = idx.data();
    for (uint64_t r : rows_) {
        const auto base = static_cast<int64_t>(st.v_trans_index(r, 0));
        for (uint32_t e = 0; e < e_vmax; ++e) *out++ = base + e * kv;
    }
    return idx;
}

size_t kv_cache_context::kq_mask_elements() const {
    check_applied("kq_mask_elements");
    return size_t{n_kv_} * get_ubatch().n_tokens;
}

void kv_cache_context::set_input_kq_mask(tensor_view dst, kq_mask_options opt) const {
    check_applied("set_input_kq_mask");
    cache_->set_input_kq_mask(dst, get_ubatch(), n_kv_, opt);
}

void kv_cache_context::set_input_pos_bucket(std::span<int32_t> dst, uint32_t n_buckets) const {
    check_applied("set_input_pos_bucket");
    cache_->set_input_pos_bucket(dst, get_ubatch(), n_kv_, n_buckets);
}

// -- attention inputs (the ubatch was checked by prepare and applied; n_kv came from get_n_kv) --

void kv_cache::set_input_kq_mask(tensor_view dst, const ubatch& ub, uint32_t n_kv,
                                 kq_mask_options opt) const {
    const bool causal = opt.causal, alibi = opt.alibi;
    if (dst.type != dtype::f32 && dst.type != dtype::f16)
        throw error(
            errc::invalid_argument,
            fmt::format("set_input_kq_mask: mask type must be f32 or f16, not {}", to_string(dst.type)));
    const size_t n_elements = size_t{n_kv} * ub.n_tokens;
    if (!dst.is_contiguous() || static_cast<size_t>(dst.nelements()) != n_elements)
        throw error(errc::invalid_argument,
                    fmt::format("set_input_kq_mask: need {} contiguous elements ([{}, {}]), got {}",
                                n_elements, n_kv, ub.n_tokens, dst.describe()));

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

// T5 relative position bucket (design/kv-cache.md §4.5); the log branch only when needed.
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
    if (dst.size() != size_t{n_kv} * ub.n_tokens)
        throw error(errc::invalid_argument, fmt::format("set_input_pos_bucket: need {} elements for n_kv {}",
                                                        size_t{n_kv} * ub.n_tokens, n_kv));
    const kv_cells& cells = streams_[0];
    for (uint32_t i = 0; i < ub.n_tokens; ++i)
        for (uint32_t j = 0; j < n_kv; ++j)
            dst[size_t{i} * n_kv + j] =
                pos_bucket(cells.is_empty(j) ? -1 : cells.pos_get(j), ub.pos[i], n_buckets, false);
}

}  // namespace kvc
