// What the files of the Python binding (module kvcache._kvcache) share: the objects Python holds for a
// memory and a batch context, the lock that keeps Python threads from using one memory at once, and
// conversions between numpy arrays and tensor views.
//
//   module.cpp    errors, enums, parameters, batches, the module itself
//   memory.cpp    the four memories, sequence operations, state, session files, prefix cache, stats
//   context.cpp   batch contexts: ubatches, K/V rows in, K/V views and masks out, recurrent rows
//   runtime.cpp   the submodule kvcache._kvcache.runtime: models, the tiny model, the runtime, the oracle
//
// Built on the public C++ API only (include/kvcache/). Every call that reaches a memory first releases the
// GIL, then takes the memory's lock (in that order, always: a prefix event callback takes the GIL back
// while the lock is held), so other Python threads run meanwhile and two threads never use one memory at
// once (the library takes no locks: one writer at a time is the caller's job).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <kvcache/batch.h>
#include <kvcache/kv_cache.h>
#include <kvcache/kv_cache_iswa.h>
#include <kvcache/memory.h>
#include <kvcache/memory_hybrid.h>
#include <kvcache/memory_recurrent.h>
#include <kvcache/tensor.h>

namespace kvc::py_binding {

namespace py = pybind11;

/// A memory as Python holds it: the owner of the whole memory (shared with parts, contexts and views), the
/// lock of the whole memory, and typed pointers to what it is (null when it is not that kind).
struct py_memory {
    std::shared_ptr<memory_i> owner;    // keeps the top-level memory alive (parts alias it)
    std::shared_ptr<std::mutex> mutex;  // one per top-level memory, shared by its parts and contexts
    memory_i* mem = nullptr;
    kv_cache* kv = nullptr;
    kv_cache_iswa* iswa = nullptr;
    memory_recurrent* recr = nullptr;
    memory_hybrid* hybrid = nullptr;

    /// Runs f on the memory without the GIL and with the memory's lock; f must not touch Python objects.
    template <class F>
    auto locked(F&& f) const {
        py::gil_scoped_release nogil;
        std::lock_guard<std::mutex> lock(*mutex);
        return std::forward<F>(f)();
    }
};

// The Python classes of each kind (KVCache, KVCacheISWA, MemoryRecurrent, MemoryHybrid).
struct py_kv_cache : py_memory {};
struct py_kv_cache_iswa : py_memory {};
struct py_memory_recurrent : py_memory {};
struct py_memory_hybrid : py_memory {};

/// A memory object for an owned memory (the top level) or a part of one (sharing its owner and lock); M
/// (kv_cache, kv_cache_iswa, memory_recurrent, memory_hybrid) sets the typed pointer of its class.
template <class M>
py_memory make_memory(std::shared_ptr<memory_i> owner, std::shared_ptr<std::mutex> mutex, M* mem);

/// What a batch context needs: the validated batch (which the context's ubatches came from), the context,
/// and the memory it belongs to (kept alive).
struct context_state {
    py_memory memory;
    batch_allocr balloc;  // declared before ctx: outlives it
    memory_context_ptr ctx;
    uint64_t generation = 0;  // bumped by apply() and next(): recurrent steps made before are stale
};

/// A batch context as Python holds it.
struct py_context {
    std::shared_ptr<context_state> state;
};

/// The attention part of a context for the layers of one cache (memory_context_i::get_attn).
struct py_attn_context {
    std::shared_ptr<context_state> state;
    kv_cache_context* kc = nullptr;
};

/// The recurrent part of a context (memory_context_i::get_recr).
struct py_recr_context {
    std::shared_ptr<context_state> state;
    memory_recurrent_context* rc = nullptr;
};

/// A batch Python builds: owned arrays and the kvc::batch over them.
class py_batch {
public:
    py_batch(int32_t capacity, int32_t n_embd, int32_t n_seq_max);
    /// Appends a token (or an embedding row when the batch holds embeddings).
    void add_token(token_t token, pos_t pos, std::vector<seq_id_t> seq_ids, bool output);
    void add_embd(std::vector<float> row, pos_t pos, std::vector<seq_id_t> seq_ids, bool output);
    void set_output(int32_t i, bool output);
    void clear();
    int32_t size() const { return static_cast<int32_t>(seqs.size()); }
    int32_t capacity() const { return capacity_; }
    int32_t n_embd() const { return n_embd_; }
    /// Which optional arrays the caller left out: null pointers in view() (batch_allocr fills them in).
    bool auto_pos = false, auto_seq = false, auto_logits = false;
    /// A batch over the arrays; valid until the next change.
    batch view() const;

    std::vector<token_t> token;
    std::vector<float> embd;
    std::vector<pos_t> pos;
    std::vector<int8_t> logits;
    std::vector<std::vector<seq_id_t>> seqs;

private:
    void add_common(pos_t p, std::vector<seq_id_t> seq_ids, bool output);
    int32_t capacity_ = 0, n_embd_ = 0, n_seq_max_ = 1;
    mutable std::vector<int32_t> n_seq_id_;  // scratch of view()
    mutable std::vector<const seq_id_t*> seq_ptr_;
};

/// Throws kvc::error(invalid_argument) naming `what` (argument checks of the binding itself).
[[noreturn]] void fail_argument(const std::string& what);

/// A numpy array viewing a tensor view's bytes (no copy), whose base keeps `owner` alive. f32 and f16
/// give float32 / float16 arrays of shape (ne3, ne2, ne1, ne0) with nb's strides, trailing dimensions of
/// 1 dropped down to `min_dims`; bf16 gives its bits as uint16; q8_0 / q4_0 give the blocks as uint8 with
/// a last dimension of the block's bytes: (..., ne0 / block_size, type_size).
py::array view_to_numpy(const tensor_view& v, std::shared_ptr<memory_i> owner, int min_dims);
/// The same values converted to f32, copied (any element type).
py::array_t<float> view_to_f32(const tensor_view& v, int min_dims);
/// A contiguous float32 (or float16 when the array is float16) array of `a`, with the const view over it
/// (numpy shape reversed into ne; at most 4 dimensions). The array must outlive the view.
std::pair<py::array, const_tensor_view> numpy_to_view(const py::handle& a, const char* what);

/// A 1-D numpy array copying `values`.
template <class T>
py::array_t<T> to_numpy(const std::vector<T>& values) {
    py::array_t<T> out(static_cast<py::ssize_t>(values.size()));
    std::copy(values.begin(), values.end(), out.mutable_data());
    return out;
}

void bind_memories(py::module_& m);
void bind_contexts(py::module_& m);
void bind_runtime(py::module_& m);

}  // namespace kvc::py_binding
