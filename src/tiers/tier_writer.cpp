// The background writer of a prefix cache's tiers.
#include "tiers/tier_writer.h"

#include <exception>

namespace kvc::detail {

tier_writer::tier_writer(uint32_t n_tiers, uint64_t max_bytes)
    : max_bytes_(max_bytes), counts_(n_tiers), thread_([this] { run(); }) {}

tier_writer::~tier_writer() {
    {
        const std::lock_guard lock(m_);
        stop_ = true;
    }
    work_.notify_one();
    thread_.join();
}

bool tier_writer::push(job j) {
    {
        const std::lock_guard lock(m_);
        if (bytes_ + j.bytes > max_bytes_) {
            counts_[j.tier].dropped += j.keys.size();
            return false;
        }
        bytes_ += j.bytes;
        q_.push_back(std::move(j));
    }
    work_.notify_one();
    return true;
}

void tier_writer::drain() {
    std::unique_lock lock(m_);
    idle_.wait(lock, [this] { return q_.empty() && !busy_; });
}

tier_writer::counts tier_writer::of(uint32_t tier) const {
    const std::lock_guard lock(m_);
    return counts_[tier];
}

void tier_writer::run() {
    std::unique_lock lock(m_);
    while (true) {
        work_.wait(lock, [this] { return stop_ || !q_.empty(); });
        if (q_.empty()) return;  // stopping, and everything is written
        job j = std::move(q_.front());
        q_.pop_front();
        busy_ = true;
        lock.unlock();
        std::vector<block_put> puts;
        puts.reserve(j.keys.size());
        for (size_t i = 0; i < j.keys.size(); ++i) puts.push_back({j.keys[i], *j.values[i]});
        bool ok = true;
        try {
            j.store->put_many(puts);
        } catch (const std::exception&) {  // counted, never the engine's problem
            ok = false;
        }
        lock.lock();
        if (ok)
            counts_[j.tier].written += j.keys.size();
        else
            ++counts_[j.tier].errors;
        bytes_ -= j.bytes;
        busy_ = false;
        if (q_.empty()) idle_.notify_all();
    }
}

}  // namespace kvc::detail
