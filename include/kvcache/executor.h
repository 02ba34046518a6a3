/// @file
/// executor: how a memory may run a loop in parallel without depending on a thread pool of its own.
#pragma once

#include <cstddef>
#include <functional>

namespace kvc {

/// Runs fn(begin, end) on disjoint pieces covering [0, n), possibly in parallel, and returns when every
/// piece is done; an exception thrown by fn reaches the caller. kvc::thread_pool::parallel_for fits, as
/// does any engine's own pool. An empty executor means: the calling thread runs fn(0, n).
using executor = std::function<void(size_t n, const std::function<void(size_t, size_t)>& fn)>;

/// Runs fn over [0, n) with ex, or on the calling thread when ex is empty.
inline void run(const executor& ex, size_t n, const std::function<void(size_t, size_t)>& fn) {
    if (n == 0) return;
    if (ex)
        ex(n, fn);
    else
        fn(0, n);
}

}  // namespace kvc
