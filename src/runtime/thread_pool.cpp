#include <algorithm>
#include <exception>

#include <fmt/format.h>
#include <kvcache/runtime/thread_pool.h>
#include <kvcache/types.h>

namespace kvc {

thread_pool::thread_pool(unsigned n_threads) {
    if (n_threads > max_threads)
        throw error(errc::invalid_argument,
                    fmt::format("thread_pool: {} threads, at most {}", n_threads, max_threads));
    if (n_threads == 0) n_threads = std::max(1u, std::thread::hardware_concurrency());
    n_threads_ = n_threads;
    for (unsigned i = 1; i < n_threads_; ++i) workers_.emplace_back([this, i] { worker(i); });
}

thread_pool::~thread_pool() {
    {
        std::lock_guard lock(mu_);
        stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
}

namespace {

// Piece i of [0, n) cut into `pieces` nearly equal parts.
std::pair<size_t, size_t> piece(size_t n, size_t pieces, size_t i) {
    return {n * i / pieces, n * (i + 1) / pieces};
}

}  // namespace

void thread_pool::worker(unsigned index) {
    uint64_t seen = 0;
    while (true) {
        const std::function<void(size_t, size_t)>* job = nullptr;
        size_t n = 0, pieces = 0;
        {
            std::unique_lock lock(mu_);
            wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
            if (stop_) return;
            seen = generation_;
            job = job_;
            n = job_n_;
            pieces = job_pieces_;
        }
        std::exception_ptr err;
        if (index < pieces) {
            const auto [b, e] = piece(n, pieces, index);
            try {
                (*job)(b, e);
            } catch (...) {
                err = std::current_exception();
            }
        }
        {
            std::lock_guard lock(mu_);
            if (err && !error_) error_ = err;
            if (--pending_ == 0) done_.notify_one();
        }
    }
}

void thread_pool::parallel_for(size_t n, const std::function<void(size_t, size_t)>& fn, size_t grain) {
    if (n == 0) return;
    const size_t pieces = std::min<size_t>(n_threads_, std::max<size_t>(1, n / std::max<size_t>(1, grain)));
    if (pieces <= 1 || workers_.empty()) {
        fn(0, n);
        return;
    }
    {
        std::lock_guard lock(mu_);
        job_ = &fn;
        job_n_ = n;
        job_pieces_ = pieces;
        pending_ = static_cast<unsigned>(workers_.size());
        error_ = nullptr;
        ++generation_;
    }
    wake_.notify_all();
    std::exception_ptr err;
    try {
        const auto [b, e] = piece(n, pieces, 0);
        fn(b, e);
    } catch (...) {
        err = std::current_exception();
    }
    std::unique_lock lock(mu_);
    done_.wait(lock, [&] { return pending_ == 0; });
    job_ = nullptr;
    if (!err) err = error_;
    lock.unlock();
    if (err) std::rethrow_exception(err);
}

}  // namespace kvc
