/// @file
/// The host reference of the recurrent engine contract (memory_recurrent.h, design/recurrent.md §4.6):
/// what an engine does with the state rows of one applied ubatch. Host engines (the synthetic engine of
/// `kvcache replay`, the runtime's recurrent forward passes) use it instead of each rewriting the gathers,
/// planes and copies; they bring only the model, i.e. how a token changes a sequence's state.
///
/// One recurrent_step covers one state tensor (layer il's r or s) of the applied ubatch of a
/// memory_recurrent_context rc, whose B blocks hold T tokens each:
/// @verbatim
///   recurrent_step conv(rc, il, rs_tensor::r);   // steps 1-3: zero rs_z, gather, move the extra cells
///   for (uint32_t b = 0; b < conv.n_seqs(); ++b)
///       for (uint32_t t = 0; t < conv.n_seq_tokens(); ++t) {
///           ... fold token b * T + t of the ubatch into conv.state(b) ...
///           conv.store(b, t);                    // step 4: the state after the token, to its plane
///       }
///   conv.finish();                               // step 5: the history copies
/// @endverbatim
/// The tensors of a layer are independent: an engine whose token update needs both (a Mamba layer: the
/// conv state r, then the SSM state s) keeps one recurrent_step per tensor and folds each token into
/// both; one that runs a layer in phases (every token through the conv, then every token through the
/// scan) finishes one tensor before the other.
///
/// While the engine works on it, a state is f32 whatever the tensor's type (f32, f16 or bf16): converted
/// once at the gather and at each store (bit-exact for f32). Rows that only move (extra cells, history
/// copies) are copied as bytes.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include <kvcache/memory_recurrent.h>
#include <kvcache/tensor.h>

namespace kvc {

/// One of the two state tensors of a recurrent layer.
enum class rs_tensor : uint8_t {
    r,  ///< conv / token-shift state (memory_recurrent::get_r)
    s,  ///< SSM / WKV state (memory_recurrent::get_s)
};

/// The engine contract for one state tensor of one applied ubatch (see the file comment). Valid until
/// rc.next(); not copyable (it holds the gathered rows).
class recurrent_step {
public:
    /// Steps 1-3 for layer il's `which` tensor of rc's applied ubatch: zeroes row rs_z, gathers every
    /// source row (s_copy and history sources) from the storage as it is, and writes the extra cells.
    /// Throws kvc::error(invalid_state) when rc has no applied batch ubatch (a failed, full or update
    /// context, or before apply()), and what memory_recurrent::get_r / get_s throw for a layer without
    /// that tensor.
    recurrent_step(memory_recurrent_context& rc, uint32_t il, rs_tensor which);
    recurrent_step(const recurrent_step&) = delete;
    recurrent_step& operator=(const recurrent_step&) = delete;

    /// Blocks of the ubatch (B); block b has tokens [b * T, (b + 1) * T) of the ubatch and cell head + b.
    uint32_t n_seqs() const { return n_seqs_; }
    /// Tokens per block (T).
    uint32_t n_seq_tokens() const { return n_seq_tokens_; }
    /// Values per state row (n_embd_r or n_embd_s).
    uint32_t width() const { return width_; }

    /// Block b's working state, width() values: the gathered initial state until the engine folds
    /// tokens into it. Throws kvc::error(out_of_range) when b >= n_seqs().
    std::span<float> state(uint32_t b);
    /// Records block b's working state as its state after token t of the block (t in [0, T)): written to
    /// plane T - 1 - t of the block's cell when that plane exists (plane 0 for the last token; rollback
    /// planes 1 .. min(k, T - 1)), and to the snapshot rows the context asks for after that token
    /// (memory_recurrent_context::snaps()); other states are not kept, so the call does nothing for them.
    /// Throws kvc::error(out_of_range) for b or t out of range. Calls for different blocks touch different
    /// rows and may run concurrently.
    void store(uint32_t b, uint32_t t);
    /// Step 5: writes the gathered history copies. Once, after every block stored its last token (that is
    /// checked: kvc::error(invalid_state) names the first block that did not, nothing written then).
    void finish();

private:
    std::byte* row(int64_t i) const;  // row i of the [n_embd, size * (1 + k)] layout

    tensor_view view_;
    uint32_t head_ = 0;
    uint32_t size_ = 0;
    uint32_t n_rs_seq_ = 0;
    uint32_t n_seqs_ = 0;
    uint32_t n_seq_tokens_ = 0;
    uint32_t width_ = 0;
    std::vector<float> states_;           // [B][width] working states
    std::vector<uint8_t> stored_last_;    // [B] whether block b stored its final state
    std::span<const rs_copy> hist_copy_;  // rc's, valid until rc.next()
    std::span<const rs_snap> snaps_;      // rc's, valid until rc.next()
    std::vector<std::byte> hist_rows_;    // gathered history sources, one row each
    bool finished_ = false;
};

/// Folds token `token` (its index in the ubatch) into `state`, a working state of layer il's `which`
/// tensor, in place.
using recurrent_fold =
    std::function<void(uint32_t il, rs_tensor which, uint32_t token, std::span<float> state)>;

/// The whole contract for rc's applied ubatch with a per-token model: for every layer of the memory and
/// each of its tensors (r before s), a recurrent_step whose blocks fold their tokens in order, storing
/// the state after each. For engines whose tokens change each tensor on its own (replay's synthetic
/// engine, tests); others use recurrent_step. Throws what recurrent_step throws, and what fold throws.
void run_recurrent_ubatch(memory_recurrent_context& rc, const recurrent_fold& fold);

}  // namespace kvc
