/// @file
/// Batches: what an engine submits (batch), how kvcache validates and completes it (batch_allocr), and the
/// micro-batches it is cut into (ubatch). Semantics of llama.cpp's llama_batch / llama_batch_allocr /
/// llama_ubatch (design/batch.md §1-3), with the recommendations of the design notes applied.
///
/// Ownership: a `batch` is a non-owning view of the caller's arrays (like llama_batch). Build one over
/// your own arrays, with batch::get_one over a token span, or use batch_storage (batch::init), which
/// owns its arrays. batch_allocr reads the view during init() and copies what it needs, so the caller's
/// arrays may change once init() returns. ubatches own their data.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <vector>

#include <kvcache/seq_set.h>
#include <kvcache/types.h>

namespace kvc {

class batch_storage;

/// The caller's input. All arrays have n_tokens entries unless noted; null optional arrays are filled in
/// by batch_allocr.
struct batch {
    int32_t n_tokens = 0;            ///< number of tokens
    const token_t* token = nullptr;  ///< [n_tokens] token ids; exactly one of token / embd
    const float* embd = nullptr;     ///< [n_tokens][n_embd] input embeddings
    /// [n_tokens] positions; null = continue each sequence from the memory. M-RoPE models (n_pos > 1)
    /// with embeddings input: [n_pos][n_tokens] section-major (temporal, y, x, other).
    const pos_t* pos = nullptr;
    const int32_t* n_seq_id = nullptr;        ///< [n_tokens] ids per token; null (with seq_id) = one each
    const seq_id_t* const* seq_id = nullptr;  ///< [n_tokens] -> [n_seq_id[i]]; the first id is the primary
    const int8_t* logits = nullptr;           ///< [n_tokens] non-zero = output; null = last token only

    /// One sequence (0), automatic positions, output for the last token. Views `tokens`.
    static batch get_one(std::span<const token_t> tokens);
    /// Owned arrays for up to n_tokens_alloc tokens; token ids when n_embd == 0, else embedding rows.
    static batch_storage init(int32_t n_tokens_alloc, int32_t n_embd, int32_t n_seq_max);
};

/// Owns the arrays of a batch (llama_batch_init + llama_batch_free). Move-only; view() is valid until the
/// next add/clear or until the storage is destroyed.
class batch_storage {
public:
    /// Room for n_tokens_alloc tokens (token ids when n_embd == 0, else embedding rows), each with up to
    /// n_seq_max sequence ids.
    batch_storage(int32_t n_tokens_alloc, int32_t n_embd, int32_t n_seq_max);
    batch_storage(batch_storage&&) noexcept = default;             ///< takes the other's arrays
    batch_storage& operator=(batch_storage&&) noexcept = default;  ///< takes the other's arrays
    batch_storage(const batch_storage&) = delete;
    batch_storage& operator=(const batch_storage&) = delete;

    /// Appends a token (or an embedding row of n_embd values). Throws kvc::error when full, when the
    /// kind (token vs embedding) does not match, or when seq_ids is empty or longer than n_seq_max.
    void add(token_t token, pos_t pos, std::span<const seq_id_t> seq_ids, bool output);
    /// Appends an embedding row of n_embd values (see the token overload).
    void add(std::span<const float> embd_row, pos_t pos, std::span<const seq_id_t> seq_ids, bool output);
    void clear() { n_tokens_ = 0; }           ///< no token (the capacity stays)
    void set_output(int32_t i, bool output);  ///< e.g. mark the last token after filling

    int32_t size() const { return n_tokens_; }      ///< tokens added
    int32_t capacity() const { return capacity_; }  ///< n_tokens_alloc
    batch view() const;                             ///< a batch over the arrays (see the class comment)

private:
    void add_common(pos_t pos, std::span<const seq_id_t> seq_ids, bool output);

    int32_t capacity_ = 0, n_embd_ = 0, n_seq_max_ = 0, n_tokens_ = 0;
    std::vector<token_t> token_;
    std::vector<float> embd_;
    std::vector<pos_t> pos_;
    std::vector<int32_t> n_seq_id_;
    std::vector<seq_id_t> ids_;          // [capacity][n_seq_max]
    std::vector<seq_id_t*> seq_id_ptr_;  // [capacity] -> rows of ids_
    std::vector<int8_t> logits_;
};

/// A micro-batch: the unit a memory places and an engine computes. Owns its data.
/// With equal_seqs, tokens form n_seqs blocks of n_seq_tokens tokens, block b at [b*n_seq_tokens,
/// (b+1)*n_seq_tokens), every token of a block having the same sequence set.
struct ubatch {
    bool equal_seqs = false;    ///< blocks of equal length (split_equal, split_seq, reserve)
    uint32_t n_tokens = 0;      ///< == n_seq_tokens * n_seqs
    uint32_t n_seq_tokens = 0;  ///< tokens per block (1 for split_simple)
    uint32_t n_seqs = 0;        ///< blocks (n_tokens for split_simple, 1 for split_seq)
    uint32_t n_seqs_unq = 0;    ///< distinct sequence ids
    uint32_t n_pos = 1;         ///< position sections per token (4 for M-RoPE)
    uint32_t n_embd = 0;        ///< embedding width (0 with token input)

    std::vector<token_t> token;     ///< [n_tokens] or empty with embeddings input
    std::vector<float> embd;        ///< [n_tokens * n_embd] or empty
    std::vector<pos_t> pos;         ///< [n_pos * n_tokens] section-major: pos[j * n_tokens + i]
    std::vector<int32_t> n_seq_id;  ///< [n_tokens]
    /// [n_tokens + 1] token i's ids are seq_id_data[begin[i], begin[i+1])
    std::vector<uint32_t> seq_id_begin;
    std::vector<seq_id_t> seq_id_data;  ///< ids of every token, each token's in its original order
    std::vector<seq_id_t> seq_id_unq;   ///< [n_seqs_unq] ascending
    std::vector<int8_t> output;         ///< [n_tokens] output flags
    std::vector<int32_t> batch_idx;     ///< [n_tokens] index of each token in the batch

    bool empty() const { return n_tokens == 0; }   ///< no token
    bool is_pos_2d() const { return n_pos >= 3; }  ///< positions carry (y, x) sections (M-RoPE)
    /// The sequence ids of token i.
    std::span<const seq_id_t> seq_ids(uint32_t i) const {
        return {seq_id_data.data() + seq_id_begin[i], seq_id_data.data() + seq_id_begin[i + 1]};
    }
    seq_id_t primary_seq(uint32_t i) const { return seq_id_data[seq_id_begin[i]]; }  ///< token i's first id
    /// Index of s in seq_id_unq, -1 if absent (O(log n_seqs_unq)).
    int32_t seq_idx(seq_id_t s) const;
};

/// What batch_allocr::init needs to know about the model and the call.
struct batch_options {
    uint32_t n_seq_max = 1;   ///< sequence ids must be in [0, n_seq_max)
    int32_t n_vocab = 0;      ///< > 0: token ids must be in [0, n_vocab); 0: only non-negative
    int32_t n_embd = 0;       ///< width of embedding rows (required with embeddings input)
    uint32_t n_pos = 1;       ///< positions per token (n_pos_per_embd; > 1 for M-RoPE)
    bool output_all = false;  ///< every token is an output (embeddings / pooling mode)
};

/// The memory a batch continues, as batch_allocr::init sees it: the first and the last position it holds
/// of each sequence, -1 when it holds none (memory_i::seq_pos_min / seq_pos_max). Empty (`{}`): no
/// memory, so positions start at 0 and nothing is checked against a stored history.
struct memory_positions {
    std::function<pos_t(seq_id_t)> seq_pos_min;  ///< first stored position of seq s, -1 if none
    std::function<pos_t(seq_id_t)> seq_pos_max;  ///< last stored position of seq s, -1 if none
    /// A memory is given (both functions are set).
    explicit operator bool() const { return seq_pos_min && seq_pos_max; }
};

/// The memory_positions of a memory (a memory_i, or anything with seq_pos_min / seq_pos_max), borrowed:
/// `mem` must outlive the result.
template <class Memory>
memory_positions positions_of(const Memory& mem) {
    return {[&mem](seq_id_t s) -> pos_t { return mem.seq_pos_min(s); },
            [&mem](seq_id_t s) -> pos_t { return mem.seq_pos_max(s); }};
}

/// The same through a pointer; null gives `{}` (no memory).
template <class Memory>
memory_positions positions_of(Memory* mem) {
    return mem ? positions_of(*mem) : memory_positions{};
}

/// Validates a batch, fills in what the caller left out, and cuts it into ubatches.
class batch_allocr {
public:
    /// Validates b against opt and the memory's contents (`{}`: no memory), fills positions,
    /// sequence ids and output flags, and resets the split state. Throws kvc::error naming the token and
    /// the values on the first rule broken; the allocator then holds no batch. Never changes the memory.
    void init(const batch& b, const memory_positions& memory, const batch_options& opt);

    // -- the validated batch --
    uint32_t get_n_tokens() const { return n_tokens_; }    ///< tokens of the batch
    uint32_t get_n_outputs() const { return n_outputs_; }  ///< output tokens of the batch
    uint32_t get_n_used() const { return n_used_; }        ///< tokens already split into ubatches
    bool has_coupled() const { return has_cpl_; }          ///< some token belongs to several sequences
    pos_t seq_pos_min(seq_id_t s) const;                   ///< within the batch; -1 if s has no token in it
    pos_t seq_pos_max(seq_id_t s) const;                   ///< within the batch; -1 if s has no token in it
    /// The distinct sequence ids of the batch, ascending.
    std::span<const seq_id_t> seq_id_unq() const { return seq_id_unq_; }
    /// Position of token i (section: M-RoPE position section).
    pos_t pos(uint32_t i, uint32_t section = 0) const { return pos_[section * n_tokens_ + i]; }
    /// The sequence ids of token i.
    std::span<const seq_id_t> seq_ids(uint32_t i) const {
        return {seq_ids_[i], static_cast<size_t>(n_seq_id_[i])};
    }
    bool is_output(uint32_t i) const { return output_[i] != 0; }  ///< token i produces an output

    // -- splitting (each returns an empty ubatch when nothing more can be produced) --
    void split_reset();                      ///< starts splitting again from the first token
    ubatch split_simple(uint32_t n_ubatch);  ///< the next <= n_ubatch tokens in batch order
    /// Disjoint sequence sets advancing in lock step; sequential: consecutive increasing primary ids
    /// (refused, empty, when tokens are shared by several sequences). Never more than n_ubatch tokens.
    /// n_keep_tail > 0: the last n_keep_tail tokens of each sequence set in the batch land in one ubatch
    /// (recurrent rollback snapshots: n_rs_seq + 1), by taking fewer rounds, or fewer sets, when a set
    /// would leave fewer than n_keep_tail (but some) tokens behind; n_ubatch still wins when smaller.
    ubatch split_equal(uint32_t n_ubatch, bool sequential, uint32_t n_keep_tail = 0);
    ubatch split_seq(uint32_t n_ubatch);  ///< tokens of one sequence set, in batch order
    /// A placeholder ubatch of n_seqs blocks of n_seq_tokens zero tokens, block b in sequence b, every
    /// token an output (for reserving compute buffers).
    static ubatch ubatch_reserve(uint32_t n_seq_tokens, uint32_t n_seqs, uint32_t n_pos = 1);

    // -- outputs --
    /// Batch indices of output tokens in the order the splits produced them (processing order).
    std::span<const int32_t> out_ids() const { return out_ids_; }
    /// For the j-th output in batch order, its row in processing order: rows_in_batch_order[j] =
    /// rows_in_processing_order[perm[j]].
    std::vector<uint32_t> output_permutation() const;
    /// Output row (in batch order) of batch token i, or -1 if it is not an output.
    int32_t output_row(uint32_t i) const;

private:
    ubatch make_ubatch(const std::vector<uint32_t>& idxs, uint32_t n_seqs, bool equal_seqs);
    void clear();
    uint32_t n_tokens_ = 0, n_outputs_ = 0, n_used_ = 0, n_pos_ = 1, n_embd_ = 0;
    bool has_cpl_ = false;
    std::vector<token_t> token_;                    // [n_tokens] copies (empty with embeddings)
    std::vector<float> embd_;                       // [n_tokens * n_embd]
    std::vector<pos_t> pos_;                        // [n_pos * n_tokens]
    std::vector<int32_t> n_seq_id_;                 // [n_tokens]
    std::vector<seq_id_t> seq_id_data_;             // all ids, token by token
    std::vector<const seq_id_t*> seq_ids_;          // [n_tokens] -> seq_id_data_
    std::vector<int8_t> output_;                    // [n_tokens]
    std::vector<uint32_t> set_of_;                  // [n_tokens] index into sets_
    std::vector<seq_set> sets_;                     // distinct sequence sets of the batch
    std::vector<seq_id_t> seq_id_unq_;              // ascending
    std::vector<pos_t> seq_pos_min_, seq_pos_max_;  // [seq_id_unq] batch extremes
    std::vector<bool> used_;                        // [n_tokens] already in a ubatch
    std::vector<int32_t> out_ids_;
};

}  // namespace kvc
