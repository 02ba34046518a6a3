/// @file
/// A small fixed pool of worker threads for the reference runtime's loops (and, as a memory's executor,
/// the K-shift): the caller splits a range, the pool runs the pieces, the caller waits. No task queue, no
/// futures.
#pragma once

// Layer guard: this header belongs to the runtime library (kvcache_runtime). The core library and the C
// API are built with KVC_LAYER_CORE / KVC_LAYER_CAPI and must not depend on the runtime.
#if defined(KVC_LAYER_CORE) || defined(KVC_LAYER_CAPI)
#error "kvcache layers: a runtime header (<kvcache/runtime/...>) included from the core library or the C API"
#endif

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include <kvcache/executor.h>

namespace kvc {

/// A fixed pool of worker threads that runs the pieces of a range in parallel.
class thread_pool {
public:
    /// Most threads a pool runs: more only queue on the cores and take seconds to start.
    static constexpr unsigned max_threads = 512;
    /// n_threads workers in all, the calling thread included (0: the hardware's count). Throws
    /// kvc::error(invalid_argument) above max_threads.
    explicit thread_pool(unsigned n_threads = 0);
    ~thread_pool();
    thread_pool(const thread_pool&) = delete;
    thread_pool& operator=(const thread_pool&) = delete;

    unsigned size() const { return n_threads_; }  ///< threads in all, the calling thread included
    /// Calls fn(begin, end) on disjoint pieces covering [0, n), in parallel, and returns when all are
    /// done. Pieces are at least `grain` long. An exception thrown by fn is rethrown here (the first one).
    /// One caller at a time: a pool is not shared by concurrent parallel_for calls.
    void parallel_for(size_t n, const std::function<void(size_t, size_t)>& fn, size_t grain = 1);
    /// This pool as a memory's executor (kv_cache_params::exec), pieces of at least `grain`; the pool must
    /// outlive the memory.
    executor as_executor(size_t grain = 1) {
        return [this, grain](size_t n, const std::function<void(size_t, size_t)>& fn) {
            parallel_for(n, fn, grain);
        };
    }

private:
    void worker(unsigned index);

    unsigned n_threads_ = 1;
    std::vector<std::thread> workers_;
    std::mutex mu_;
    std::condition_variable wake_, done_;
    const std::function<void(size_t, size_t)>* job_ = nullptr;
    size_t job_n_ = 0, job_pieces_ = 0;
    uint64_t generation_ = 0;
    unsigned pending_ = 0;
    std::exception_ptr error_;
    bool stop_ = false;
};

}  // namespace kvc
