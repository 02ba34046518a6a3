// recurrent_step: the host reference of the recurrent engine contract (design/recurrent.md §4.6).
#include <algorithm>
#include <cstring>

#include <fmt/format.h>
#include <kvcache/batch.h>
#include <kvcache/dtype.h>
#include <kvcache/recurrent_engine.h>

namespace kvc {

recurrent_step::recurrent_step(memory_recurrent_context& rc, uint32_t il, rs_tensor which) {
    // The ubatch first: it throws on every context without an applied batch ubatch, before any write.
    const ubatch& ub = rc.get_ubatch();
    const uint32_t n = rc.get_n_rs();
    head_ = rc.get_head();
    size_ = rc.get_size();
    n_rs_seq_ = rc.get_n_rs_seq();
    n_seqs_ = ub.n_seqs;
    n_seq_tokens_ = ub.n_seq_tokens;
    view_ = which == rs_tensor::r ? rc.get_r(il) : rc.get_s(il);
    width_ = static_cast<uint32_t>(view_.ne[0]);
    hist_copy_ = rc.hist_copies();
    snaps_ = rc.snaps();
    const size_t bytes = view_.row_bytes();

    // 1. a fresh state reads the zero row, so it is zeroed before any gather
    if (rc.get_rs_z() >= 0) std::memset(row(rc.get_rs_z()), 0, bytes);
    // 2. every source is read before anything is written: sources and destinations may overlap (a
    //    block's cell may be another cell's source, history planes move within the range)
    states_.resize(size_t{n_seqs_} * width_);
    for (uint32_t b = 0; b < n_seqs_; ++b)
        to_f32(view_.type, row(rc.s_copy(b)), &states_[size_t{b} * width_], width_);
    std::vector<std::byte> extra(size_t{n - n_seqs_} * bytes);
    for (uint32_t i = n_seqs_; i < n; ++i)
        std::memcpy(&extra[(i - n_seqs_) * bytes], row(rc.s_copy(i)), bytes);
    hist_rows_.resize(hist_copy_.size() * bytes);
    for (size_t j = 0; j < hist_copy_.size(); ++j)
        std::memcpy(&hist_rows_[j * bytes], row(hist_copy_[j].src), bytes);
    // 3. cells of the range that no block uses keep their state, now in their own row
    for (uint32_t i = n_seqs_; i < n; ++i)
        std::memcpy(row(int64_t{head_} + i), &extra[(i - n_seqs_) * bytes], bytes);
    stored_last_.assign(n_seqs_, 0);
}

std::byte* recurrent_step::row(int64_t i) const {
    return view_.row(i % size_, i / size_);
}

std::span<float> recurrent_step::state(uint32_t b) {
    if (b >= n_seqs_)
        throw error(errc::out_of_range, fmt::format("recurrent_step: block {} not in [0, {})", b, n_seqs_));
    return {&states_[size_t{b} * width_], width_};
}

void recurrent_step::store(uint32_t b, uint32_t t) {
    if (b >= n_seqs_ || t >= n_seq_tokens_)
        throw error(errc::out_of_range,
                    fmt::format("recurrent_step: store of block {} token {}, ubatch {} x {}", b, t, n_seqs_,
                                n_seq_tokens_));
    const float* x = &states_[size_t{b} * width_];
    // 4. snapshots: rows after the planes of the contiguous tensor (the view ends with the planes)
    for (const rs_snap& sn : snaps_)
        if (sn.block == b && sn.token == t)
            from_f32(view_.type, x, view_.data + static_cast<size_t>(sn.dst) * view_.nb[1], width_);
    // plane r holds the state r tokens before the block's last one; deeper than k is not kept
    const uint32_t plane = n_seq_tokens_ - 1 - t;
    if (plane > n_rs_seq_) return;
    from_f32(view_.type, x, row(int64_t{plane} * size_ + head_ + b), width_);
    if (plane == 0) stored_last_[b] = 1;
}

void recurrent_step::finish() {
    if (finished_) throw error(errc::invalid_state, "recurrent_step: finish() called twice");
    const auto missing = std::find(stored_last_.begin(), stored_last_.end(), 0);
    if (missing != stored_last_.end())
        throw error(errc::invalid_state, fmt::format("recurrent_step: block {} did not store its last token",
                                                     missing - stored_last_.begin()));
    // 5. history planes the ubatch cannot compute (T <= k) come from the sources' own history
    const size_t bytes = view_.row_bytes();
    for (size_t j = 0; j < hist_copy_.size(); ++j)
        std::memcpy(row(hist_copy_[j].dst), &hist_rows_[j * bytes], bytes);
    finished_ = true;
}

void run_recurrent_ubatch(memory_recurrent_context& rc, const recurrent_fold& fold) {
    const memory_recurrent& mem = rc.memory();
    for (uint32_t il : mem.layer_ids())
        for (const rs_tensor which : {rs_tensor::r, rs_tensor::s}) {
            if (!(which == rs_tensor::r ? mem.has_r(il) : mem.has_s(il))) continue;
            recurrent_step step(rc, il, which);
            const uint32_t T = step.n_seq_tokens();
            for (uint32_t b = 0; b < step.n_seqs(); ++b) {
                const std::span<float> x = step.state(b);
                for (uint32_t t = 0; t < T; ++t) {
                    fold(il, which, b * T + t, x);
                    step.store(b, t);
                }
            }
            step.finish();
        }
}

}  // namespace kvc
