#include <algorithm>
#include <limits>
#include <map>
#include <numeric>

#include <fmt/format.h>
#include <kvcache/batch.h>
#include <kvcache/limits.h>
#include <kvcache/memory_budget.h>

namespace kvc {

// -- batch and batch_storage --

batch batch::get_one(std::span<const token_t> tokens) {
    if (tokens.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max()))
        throw error(errc::invalid_argument,
                    fmt::format("batch::get_one: {} tokens do not fit int32", tokens.size()));
    batch b;
    b.n_tokens = static_cast<int32_t>(tokens.size());
    b.token = tokens.data();
    return b;
}

batch_storage batch::init(int32_t n_tokens_alloc, int32_t n_embd, int32_t n_seq_max) {
    return batch_storage(n_tokens_alloc, n_embd, n_seq_max);
}

batch_storage::batch_storage(int32_t n_tokens_alloc, int32_t n_embd, int32_t n_seq_max)
    : capacity_(n_tokens_alloc), n_embd_(n_embd), n_seq_max_(n_seq_max) {
    if (n_tokens_alloc < 1 || n_embd < 0 || n_seq_max < 1)
        throw error(
            errc::invalid_argument,
            fmt::format("batch::init: need n_tokens_alloc >= 1, n_embd >= 0, n_seq_max >= 1; got {}, {}, {}",
                        n_tokens_alloc, n_embd, n_seq_max));
    // what the arguments would allocate, bounded before anything is (issue 21: INT32_MAX tokens of INT32_MAX
    // sequences zero-filled 14.8 GB before anyone stopped it)
    const limits lim = get_limits();
    check_limit("batch::init: n_tokens_alloc", "batch_tokens", static_cast<uint64_t>(n_tokens_alloc),
                lim.batch_tokens);
    check_limit("batch::init: n_seq_max", "sequences", static_cast<uint64_t>(n_seq_max), lim.sequences);
    const uint64_t per_token =
        (n_embd == 0 ? sizeof(token_t) : uint64_t{sizeof(float)} * static_cast<uint64_t>(n_embd)) +
        sizeof(pos_t) + sizeof(int32_t) + sizeof(seq_id_t*) + sizeof(int8_t) +
        uint64_t{sizeof(seq_id_t)} * static_cast<uint64_t>(n_seq_max);
    check_memory_budget("batch::init", mul_sat(per_token, static_cast<uint64_t>(n_tokens_alloc)), 0,
                        fmt::format("{} tokens x {} bytes", n_tokens_alloc, per_token));
    const auto cap = static_cast<size_t>(n_tokens_alloc);
    if (n_embd == 0)
        token_.resize(cap);
    else
        embd_.resize(cap * static_cast<size_t>(n_embd));
    pos_.resize(cap);
    n_seq_id_.resize(cap);
    ids_.resize(cap * static_cast<size_t>(n_seq_max));
    seq_id_ptr_.resize(cap);
    for (size_t i = 0; i < cap; ++i) seq_id_ptr_[i] = ids_.data() + i * static_cast<size_t>(n_seq_max);
    logits_.resize(cap);
}

void batch_storage::add_common(pos_t pos, std::span<const seq_id_t> seq_ids, bool output) {
    if (seq_ids.empty() || seq_ids.size() > static_cast<size_t>(n_seq_max_))
        throw error(
            errc::invalid_argument,
            fmt::format("batch_storage::add: {} sequence ids, expected 1 to {}", seq_ids.size(), n_seq_max_));
    const auto i = static_cast<size_t>(n_tokens_);
    pos_[i] = pos;
    n_seq_id_[i] = static_cast<int32_t>(seq_ids.size());
    std::copy(seq_ids.begin(), seq_ids.end(), seq_id_ptr_[i]);
    logits_[i] = output ? 1 : 0;
    ++n_tokens_;
}

void batch_storage::add(token_t token, pos_t pos, std::span<const seq_id_t> seq_ids, bool output) {
    if (n_embd_ != 0)
        throw error(errc::invalid_argument, "batch_storage::add: this batch holds embeddings, not tokens");
    if (n_tokens_ == capacity_)
        throw error(errc::out_of_range,
                    fmt::format("batch_storage::add: batch is full ({} tokens)", capacity_));
    token_[static_cast<size_t>(n_tokens_)] = token;
    add_common(pos, seq_ids, output);
}

void batch_storage::add(std::span<const float> embd_row, pos_t pos, std::span<const seq_id_t> seq_ids,
                        bool output) {
    if (n_embd_ == 0)
        throw error(errc::invalid_argument, "batch_storage::add: this batch holds tokens, not embeddings");
    if (embd_row.size() != static_cast<size_t>(n_embd_))
        throw error(errc::invalid_argument,
                    fmt::format("batch_storage::add: embedding row of {} values, expected {}",
                                embd_row.size(), n_embd_));
    if (n_tokens_ == capacity_)
        throw error(errc::out_of_range,
                    fmt::format("batch_storage::add: batch is full ({} tokens)", capacity_));
    std::copy(embd_row.begin(), embd_row.end(), embd_.begin() + static_cast<ptrdiff_t>(n_tokens_) * n_embd_);
    add_common(pos, seq_ids, output);
}

void batch_storage::set_output(int32_t i, bool output) {
    if (i < 0 || i >= n_tokens_)
        throw error(errc::out_of_range,
                    fmt::format("batch_storage::set_output: token {} not in [0, {})", i, n_tokens_));
    logits_[static_cast<size_t>(i)] = output ? 1 : 0;
}

batch batch_storage::view() const {
    batch b;
    b.n_tokens = n_tokens_;
    b.token = n_embd_ == 0 ? token_.data() : nullptr;
    b.embd = n_embd_ != 0 ? embd_.data() : nullptr;
    b.pos = pos_.data();
    b.n_seq_id = n_seq_id_.data();
    b.seq_id = seq_id_ptr_.data();
    b.logits = logits_.data();
    return b;
}

// -- ubatch --

int32_t ubatch::seq_idx(seq_id_t s) const {
    const auto it = std::lower_bound(seq_id_unq.begin(), seq_id_unq.end(), s);
    return it != seq_id_unq.end() && *it == s ? static_cast<int32_t>(it - seq_id_unq.begin()) : -1;
}

// -- batch_allocr: validation --

void batch_allocr::clear() {
    n_tokens_ = n_outputs_ = n_used_ = 0;
    n_pos_ = 1;
    n_embd_ = 0;
    has_cpl_ = false;
    token_.clear();
    embd_.clear();
    pos_.clear();
    n_seq_id_.clear();
    seq_id_data_.clear();
    seq_ids_.clear();
    output_.clear();
    set_of_.clear();
    sets_.clear();
    seq_id_unq_.clear();
    seq_pos_min_.clear();
    seq_pos_max_.clear();
    used_.clear();
    out_ids_.clear();
}

void batch_allocr::init(const batch& b, const memory_positions& memory, const batch_options& opt) {
    clear();
    try {
        const auto fail = [](errc code, const std::string& msg) { throw error(code, "batch: " + msg); };
        if (opt.n_seq_max < 1) fail(errc::invalid_argument, "n_seq_max must be at least 1");
        if (opt.n_pos < 1) fail(errc::invalid_argument, "n_pos must be at least 1");
        if (b.n_tokens <= 0)
            fail(errc::invalid_argument, fmt::format("n_tokens = {} must be positive", b.n_tokens));
        if ((b.token == nullptr) == (b.embd == nullptr))
            fail(errc::invalid_argument, b.token ? "both token and embd are set; give exactly one"
                                                 : "neither token nor embd is set; give exactly one");
        if (b.embd && opt.n_embd <= 0)
            fail(errc::invalid_argument,
                 fmt::format("embeddings input needs n_embd > 0, got {}", opt.n_embd));
        if ((b.seq_id == nullptr) != (b.n_seq_id == nullptr))
            fail(errc::invalid_argument, b.seq_id
                                             ? "seq_id is set but n_seq_id is null; give both or neither"
                                             : "n_seq_id is set but seq_id is null; give both or neither");
        if (b.embd && opt.n_pos > 1 && !b.pos)
            fail(
                errc::invalid_argument,
                fmt::format("embeddings input for a model with {} position sections needs explicit positions "
                            "({} x n_tokens)",
                            opt.n_pos, opt.n_pos));

        const auto n = static_cast<uint32_t>(b.n_tokens);
        const auto n_seq_max = static_cast<int64_t>(opt.n_seq_max);
        n_tokens_ = n;
        n_pos_ = opt.n_pos;

        // tokens / embeddings
        if (b.token) {
            for (uint32_t i = 0; i < n; ++i)  // a token id is never negative, vocabulary known or not
                if (b.token[i] < 0 || (opt.n_vocab > 0 && b.token[i] >= opt.n_vocab))
                    fail(errc::out_of_range,
                         opt.n_vocab > 0
                             ? fmt::format("token[{}] = {} not in [0, {})", i, b.token[i], opt.n_vocab)
                             : fmt::format("token[{}] = {} is negative", i, b.token[i]));
            token_.assign(b.token, b.token + n);
        } else {
            n_embd_ = static_cast<uint32_t>(opt.n_embd);
            embd_.assign(b.embd, b.embd + static_cast<size_t>(n) * n_embd_);
        }

        // sequence ids
        n_seq_id_.resize(n);
        for (uint32_t i = 0; i < n; ++i) {
            const int32_t k = b.n_seq_id ? b.n_seq_id[i] : 1;
            if (k < 1 || k > n_seq_max)
                fail(errc::out_of_range, fmt::format("n_seq_id[{}] = {} not in [1, {}]", i, k, n_seq_max));
            if (b.seq_id && !b.seq_id[i]) fail(errc::invalid_argument, fmt::format("seq_id[{}] is null", i));
            n_seq_id_[i] = k;
            for (int32_t j = 0; j < k; ++j) {
                const seq_id_t s = b.seq_id ? b.seq_id[i][j] : 0;
                if (s < 0 || s >= n_seq_max)
                    fail(errc::out_of_range,
                         fmt::format("seq_id[{}][{}] = {} not in [0, {})", i, j, s, n_seq_max));
                for (int32_t q = 0; q < j; ++q)
                    if (seq_id_data_[seq_id_data_.size() - static_cast<size_t>(j - q)] == s)
                        fail(errc::invalid_argument, fmt::format("token {} lists seq_id {} twice", i, s));
                seq_id_data_.push_back(s);
            }
        }
        seq_ids_.resize(n);
        for (uint32_t i = 0, off = 0; i < n; off += static_cast<uint32_t>(n_seq_id_[i]), ++i)
            seq_ids_[i] = seq_id_data_.data() + off;

        // distinct sequences of the batch, ascending
        seq_id_unq_ = seq_id_data_;
        std::sort(seq_id_unq_.begin(), seq_id_unq_.end());
        seq_id_unq_.erase(std::unique(seq_id_unq_.begin(), seq_id_unq_.end()), seq_id_unq_.end());
        const auto unq = [&](seq_id_t s) {
            return static_cast<size_t>(std::lower_bound(seq_id_unq_.begin(), seq_id_unq_.end(), s) -
                                       seq_id_unq_.begin());
        };

        // positions: given, or continuing each sequence from the memory (driven by the primary id)
        pos_.resize(static_cast<size_t>(n) * n_pos_);
        if (b.pos) {
            const uint32_t given = b.embd ? n_pos_ : 1;  // token input: one section, broadcast
            for (uint32_t j = 0; j < n_pos_; ++j)
                std::copy(b.pos + (j < given ? j : 0) * n, b.pos + (j < given ? j : 0) * n + n,
                          pos_.begin() + j * n);
            for (uint32_t i = 0; i < n; ++i)
                if (pos_[i] < 0)
                    fail(errc::out_of_range, fmt::format("pos[{}] = {} is negative", i, pos_[i]));
        } else {
            std::vector<int64_t> next(seq_id_unq_.size());
            for (size_t k = 0; k < seq_id_unq_.size(); ++k)
                next[k] = memory ? int64_t{memory.seq_pos_max(seq_id_unq_[k])} + 1 : 0;
            for (uint32_t i = 0; i < n; ++i) {
                const int64_t p = next[unq(seq_ids_[i][0])];
                if (p > std::numeric_limits<pos_t>::max())
                    fail(errc::out_of_range,
                         fmt::format("automatic position of token {} overflows int32", i));
                for (uint32_t j = 0; j < n_pos_; ++j) pos_[j * n + i] = static_cast<pos_t>(p);
                for (int32_t q = 0; q < n_seq_id_[i]; ++q) next[unq(seq_ids_[i][q])] = p + 1;
            }
        }

        // outputs
        output_.resize(n);
        if (!b.logits) {
            std::fill(output_.begin(), output_.end(), opt.output_all ? 1 : 0);
            output_.back() = 1;
        } else {
            bool overridden = false;
            for (uint32_t i = 0; i < n; ++i) {
                output_[i] = b.logits[i] != 0 || opt.output_all;
                overridden |= opt.output_all && b.logits[i] == 0;
            }
            if (overridden)
                log(log_level::warn,
                    "batch: every token must be an output here (output_all); marking all as outputs");
        }
        n_outputs_ = static_cast<uint32_t>(std::count(output_.begin(), output_.end(), 1));

        // coupled sequences (a token shared by several) must have identical histories in the memory
        for (uint32_t i = 0; i < n; ++i) {
            if (n_seq_id_[i] < 2) continue;
            has_cpl_ = true;
            if (!memory) continue;
            const seq_id_t p = seq_ids_[i][0];
            for (int32_t q = 1; q < n_seq_id_[i]; ++q) {
                const seq_id_t t = seq_ids_[i][q];
                const pos_t tmin = memory.seq_pos_min(t), tmax = memory.seq_pos_max(t);
                const pos_t pmin = memory.seq_pos_min(p), pmax = memory.seq_pos_max(p);
                if (tmin != pmin || tmax != pmax)
                    fail(
                        errc::invalid_state,
                        fmt::format("token {} couples seq {} to seq {}, but they have diverged in the memory "
                                    "(seq {}: [{}, {}], seq {}: [{}, {}])",
                                    i, t, p, t, tmin, tmax, p, pmin, pmax));
            }
        }

        // per-sequence order, extremes and distinct positions of the batch
        seq_pos_min_.assign(seq_id_unq_.size(), -1);
        seq_pos_max_.assign(seq_id_unq_.size(), -1);
        std::vector<std::pair<size_t, pos_t>> seq_pos;  // (sequence slot, position) for the gap check
        seq_pos.reserve(seq_id_data_.size());
        for (uint32_t i = 0; i < n; ++i) {
            for (int32_t q = 0; q < n_seq_id_[i]; ++q) {
                const seq_id_t s = seq_ids_[i][q];
                const size_t k = unq(s);
                if (seq_pos_max_[k] > pos_[i])
                    fail(errc::invalid_argument,
                         fmt::format("positions of seq {} decrease: token {} has pos {} after pos {}", s, i,
                                     pos_[i], seq_pos_max_[k]));
                if (seq_pos_min_[k] < 0) seq_pos_min_[k] = pos_[i];
                seq_pos_max_[k] = pos_[i];
                seq_pos.emplace_back(k, pos_[i]);
            }
        }
        std::sort(seq_pos.begin(), seq_pos.end());
        seq_pos.erase(std::unique(seq_pos.begin(), seq_pos.end()), seq_pos.end());
        for (size_t k = 0, at = 0; k < seq_id_unq_.size(); ++k) {
            size_t distinct = 0;
            for (; at < seq_pos.size() && seq_pos[at].first == k; ++at) ++distinct;
            const seq_id_t s = seq_id_unq_[k];
            const pos_t y = seq_pos_min_[k];
            const pos_t x = memory ? memory.seq_pos_max(s) : -1;
            if (n_pos_ == 1) {
                if (x >= 0 && int64_t{y} != int64_t{x} + 1)
                    fail(errc::invalid_state, fmt::format("seq {} starts at pos {} but the memory ends at "
                                                          "pos {}; the next position must be "
                                                          "{}",
                                                          s, y, x, int64_t{x} + 1));
                if (int64_t{seq_pos_max_[k]} - y + 1 > static_cast<int64_t>(distinct))
                    fail(errc::invalid_argument,
                         fmt::format("positions of seq {} have gaps: {} distinct positions in [{}, {}]", s,
                                     distinct, y, seq_pos_max_[k]));
            } else if (x >= 0 && (b.token ? x >= y : x > y)) {
                fail(errc::invalid_state,
                     fmt::format(
                         "seq {} starts at pos {} but the memory ends at pos {}; M-RoPE {} must start {} it",
                         s, y, x, b.token ? "tokens" : "embeddings", b.token ? "after" : "at or after"));
            }
        }

        // distinct sequence sets, for the equal and seq splits
        std::map<std::vector<seq_id_t>, uint32_t> set_index;
        set_of_.resize(n);
        for (uint32_t i = 0; i < n; ++i) {
            std::vector<seq_id_t> key(seq_ids_[i], seq_ids_[i] + n_seq_id_[i]);
            std::sort(key.begin(), key.end());
            const auto [it, added] = set_index.emplace(std::move(key), static_cast<uint32_t>(sets_.size()));
            if (added) {
                seq_set s;
                for (seq_id_t id : it->first) s.insert(id);
                sets_.push_back(std::move(s));
            }
            set_of_[i] = it->second;
        }
        split_reset();
    } catch (...) {
        clear();
        throw;
    }
}

pos_t batch_allocr::seq_pos_min(seq_id_t s) const {
    const auto it = std::lower_bound(seq_id_unq_.begin(), seq_id_unq_.end(), s);
    return it != seq_id_unq_.end() && *it == s ? seq_pos_min_[static_cast<size_t>(it - seq_id_unq_.begin())]
                                               : -1;
}

pos_t batch_allocr::seq_pos_max(seq_id_t s) const {
    const auto it = std::lower_bound(seq_id_unq_.begin(), seq_id_unq_.end(), s);
    return it != seq_id_unq_.end() && *it == s ? seq_pos_max_[static_cast<size_t>(it - seq_id_unq_.begin())]
                                               : -1;
}

// -- batch_allocr: splitting --

void batch_allocr::split_reset() {
    used_.assign(n_tokens_, false);
    n_used_ = 0;
    out_ids_.clear();
}

static void check_n_ubatch(uint32_t n_ubatch, const char* what) {
    if (n_ubatch == 0)
        throw error(errc::invalid_argument, fmt::format("{}: n_ubatch must be at least 1", what));
}

ubatch batch_allocr::make_ubatch(const std::vector<uint32_t>& idxs, uint32_t n_seqs, bool equal_seqs) {
    ubatch u;
    const auto n = static_cast<uint32_t>(idxs.size());
    u.equal_seqs = equal_seqs;
    u.n_tokens = n;
    u.n_seqs = n_seqs;
    u.n_seq_tokens = n / n_seqs;
    u.n_pos = n_pos_;
    u.n_embd = n_embd_;
    if (!token_.empty()) u.token.reserve(n);
    u.pos.resize(static_cast<size_t>(n) * n_pos_);
    u.n_seq_id.reserve(n);
    u.seq_id_begin.reserve(n + 1);
    u.output.reserve(n);
    u.batch_idx.reserve(n);
    u.seq_id_begin.push_back(0);
    for (uint32_t k = 0; k < n; ++k) {
        const uint32_t i = idxs[k];
        if (!token_.empty()) u.token.push_back(token_[i]);
        if (n_embd_) {
            const auto row = embd_.begin() + static_cast<ptrdiff_t>(i) * n_embd_;
            u.embd.insert(u.embd.end(), row, row + n_embd_);
        }
        for (uint32_t j = 0; j < n_pos_; ++j) u.pos[j * n + k] = pos_[j * n_tokens_ + i];
        u.n_seq_id.push_back(n_seq_id_[i]);
        u.seq_id_data.insert(u.seq_id_data.end(), seq_ids_[i], seq_ids_[i] + n_seq_id_[i]);
        u.seq_id_begin.push_back(static_cast<uint32_t>(u.seq_id_data.size()));
        u.output.push_back(output_[i]);
        u.batch_idx.push_back(static_cast<int32_t>(i));
        if (output_[i]) out_ids_.push_back(static_cast<int32_t>(i));
        used_[i] = true;
    }
    n_used_ += n;
    u.seq_id_unq = u.seq_id_data;
    std::sort(u.seq_id_unq.begin(), u.seq_id_unq.end());
    u.seq_id_unq.erase(std::unique(u.seq_id_unq.begin(), u.seq_id_unq.end()), u.seq_id_unq.end());
    u.n_seqs_unq = static_cast<uint32_t>(u.seq_id_unq.size());
    return u;
}

ubatch batch_allocr::split_simple(uint32_t n_ubatch) {
    check_n_ubatch(n_ubatch, "split_simple");
    std::vector<uint32_t> idxs;
    for (uint32_t i = 0; i < n_tokens_ && idxs.size() < n_ubatch; ++i)
        if (!used_[i]) idxs.push_back(i);
    if (idxs.empty()) return {};
    return make_ubatch(idxs, static_cast<uint32_t>(idxs.size()), false);
}

ubatch batch_allocr::split_equal(uint32_t n_ubatch, bool sequential, uint32_t n_keep_tail) {
    check_n_ubatch(n_ubatch, "split_equal");
    if (sequential && has_cpl_) {
        log(log_level::warn,
            "batch: a sequential split is not possible when tokens are shared by several sequences "
            "(use a unified cache)");
        return {};
    }
    // 1. choose pairwise disjoint sequence sets (at most n_ubatch), in batch order. A token passed over
    //    holds back its sequences: no later set containing one of them may go before it.
    std::vector<uint32_t> chosen;                    // indices into sets_
    std::vector<uint32_t> first_tok;                 // [chosen] the token that chose it
    std::vector<int32_t> slot_of(sets_.size(), -1);  // [set] its index in chosen, or -1
    seq_set held;                                    // sequences of passed-over tokens
    seq_set taken;                                   // sequences of the chosen sets
    seq_id_t last_primary = -1;
    for (uint32_t i = 0; i < n_tokens_ && chosen.size() < n_ubatch; ++i) {
        if (used_[i]) continue;
        const uint32_t c = set_of_[i];
        if (slot_of[c] >= 0) continue;
        bool ok = !sets_[c].intersects(held) && !sets_[c].intersects(taken);
        if (sequential && !chosen.empty() && seq_ids_[i][0] != last_primary + 1) ok = false;
        if (!ok) {
            held |= sets_[c];
            continue;
        }
        slot_of[c] = static_cast<int32_t>(chosen.size());
        chosen.push_back(c);
        first_tok.push_back(i);
        taken |= sets_[c];
        last_primary = seq_ids_[i][0];
    }
    if (chosen.empty()) return {};
    const size_t m = chosen.size();

    // 2. each set's unused tokens in batch order, up to the first unused token of an overlapping other
    //    set: taking tokens beyond it would reorder a sequence. The chosen sets are disjoint, so each
    //    sequence belongs to at most one of them (owner). One pass collects (set, token) picks, a
    //    counting sort groups them by set: avail(k) = the picks of set k, in batch order.
    std::vector<int32_t> owner(static_cast<size_t>(seq_id_unq_.back()) + 1, -1);
    for (size_t k = 0; k < m; ++k)
        for (int32_t q = 0; q < n_seq_id_[first_tok[k]]; ++q)
            owner[static_cast<size_t>(seq_ids_[first_tok[k]][q])] = static_cast<int32_t>(k);
    std::vector<std::pair<uint32_t, uint32_t>> picks;  // (set, token)
    std::vector<bool> blocked(m, false);
    std::vector<size_t> remaining(m, 0);  // unused tokens of each set in the whole batch
    std::vector<size_t> begin(m + 1, 0);  // avail(k) = flat[begin[k], begin[k + 1])
    for (uint32_t i = 0; i < n_tokens_; ++i) {
        if (used_[i]) continue;
        if (const int32_t k = slot_of[set_of_[i]]; k >= 0) {
            const auto kk = static_cast<size_t>(k);
            ++remaining[kk];
            if (!blocked[kk]) {
                picks.emplace_back(kk, i);
                ++begin[kk + 1];
            }
            continue;
        }
        for (int32_t q = 0; q < n_seq_id_[i]; ++q)
            if (const int32_t o = owner[static_cast<size_t>(seq_ids_[i][q])]; o >= 0)
                blocked[static_cast<size_t>(o)] = true;
    }
    for (size_t k = 0; k < m; ++k) begin[k + 1] += begin[k];
    std::vector<uint32_t> flat(picks.size());
    {
        std::vector<size_t> at(begin.begin(), begin.end() - 1);
        for (const auto& [k, i] : picks) flat[at[k]++] = i;
    }
    const auto n_avail = [&](size_t k) { return begin[k + 1] - begin[k]; };

    // 3. lock step: the same number of tokens from every set, at least one round. With n_keep_tail, a
    //    set whose tail is within reach (all its remaining tokens available) must either finish or keep
    //    at least n_keep_tail tokens back; the first m sets that allow a round count do so.
    const auto rounds_for = [&](size_t n_sets, bool keep_tail) -> size_t {
        if (n_sets == 0) return 0;
        const size_t cap = std::max<size_t>(1, n_ubatch / n_sets);
        size_t min_avail = cap;
        for (size_t k = 0; k < n_sets; ++k) min_avail = std::min(min_avail, n_avail(k));
        if (!keep_tail) return min_avail;
        const auto tail_ok = [&](size_t k, size_t r) {
            const size_t left = n_avail(k) - r;
            return n_avail(k) != remaining[k] || left == 0 || left >= n_keep_tail;
        };
        bool ok = true;
        for (size_t k = 0; k < n_sets && ok; ++k) ok = tail_ok(k, min_avail);
        if (ok) return min_avail;
        size_t r = min_avail;  // else: every constrained set keeps n_keep_tail back
        for (size_t k = 0; k < n_sets; ++k)
            if (n_avail(k) == remaining[k]) {
                if (n_avail(k) <= n_keep_tail) return 0;
                r = std::min(r, n_avail(k) - n_keep_tail);
            }
        return r;
    };
    size_t n_sets = m;
    size_t rounds = rounds_for(n_sets, n_keep_tail > 0);
    while (rounds == 0 && n_sets > 1) rounds = rounds_for(--n_sets, true);
    if (rounds == 0) rounds = rounds_for(1, false);  // n_keep_tail > n_ubatch: n_ubatch wins
    std::vector<uint32_t> idxs;
    idxs.reserve(rounds * n_sets);
    for (size_t k = 0; k < n_sets; ++k)
        idxs.insert(idxs.end(), flat.begin() + static_cast<ptrdiff_t>(begin[k]),
                    flat.begin() + static_cast<ptrdiff_t>(begin[k] + rounds));
    return make_ubatch(idxs, static_cast<uint32_t>(n_sets), true);
}

ubatch batch_allocr::split_seq(uint32_t n_ubatch) {
    check_n_ubatch(n_ubatch, "split_seq");
    uint32_t first = 0;
    while (first < n_tokens_ && used_[first]) ++first;
    if (first == n_tokens_) return {};
    const uint32_t s = set_of_[first];
    std::vector<uint32_t> idxs = {first};
    // Only tokens of exactly this set (so the whole ubatch belongs to one set); stop at a token of an
    // overlapping set, which must come first for its sequences.
    for (uint32_t i = first + 1; i < n_tokens_ && idxs.size() < n_ubatch; ++i) {
        if (used_[i]) continue;
        if (set_of_[i] == s)
            idxs.push_back(i);
        else if (sets_[set_of_[i]].intersects(sets_[s]))
            break;
    }
    return make_ubatch(idxs, 1, true);
}

ubatch batch_allocr::ubatch_reserve(uint32_t n_seq_tokens, uint32_t n_seqs, uint32_t n_pos) {
    if (n_seq_tokens == 0 || n_seqs == 0 || n_pos == 0)
        throw error(errc::invalid_argument,
                    fmt::format("ubatch_reserve: need positive sizes, got {} x {} (n_pos {})", n_seq_tokens,
                                n_seqs, n_pos));
    ubatch u;
    const uint32_t n = n_seq_tokens * n_seqs;
    u.equal_seqs = true;
    u.n_tokens = n;
    u.n_seq_tokens = n_seq_tokens;
    u.n_seqs = n_seqs;
    u.n_seqs_unq = n_seqs;
    u.n_pos = n_pos;
    u.token.assign(n, 0);
    u.pos.assign(static_cast<size_t>(n) * n_pos, 0);
    u.n_seq_id.assign(n, 1);
    u.seq_id_begin.resize(n + 1);
    std::iota(u.seq_id_begin.begin(), u.seq_id_begin.end(), 0u);
    u.seq_id_data.resize(n);
    for (uint32_t i = 0; i < n; ++i) u.seq_id_data[i] = static_cast<seq_id_t>(i / n_seq_tokens);
    u.seq_id_unq.resize(n_seqs);
    std::iota(u.seq_id_unq.begin(), u.seq_id_unq.end(), 0);
    u.output.assign(n, 1);
    u.batch_idx.resize(n);
    std::iota(u.batch_idx.begin(), u.batch_idx.end(), 0);
    return u;
}

// -- outputs --

std::vector<uint32_t> batch_allocr::output_permutation() const {
    std::vector<uint32_t> perm(out_ids_.size());
    std::iota(perm.begin(), perm.end(), 0u);
    std::sort(perm.begin(), perm.end(), [&](uint32_t a, uint32_t b) { return out_ids_[a] < out_ids_[b]; });
    return perm;
}

int32_t batch_allocr::output_row(uint32_t i) const {
    if (i >= n_tokens_ || !output_[i]) return -1;
    return static_cast<int32_t>(std::count(output_.begin(), output_.begin() + i, 1));
}

}  // namespace kvc
