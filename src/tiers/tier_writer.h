// The background writer of a prefix cache's tiers (prefix_tier_params::async_writes): put_many calls on a
// thread of its own, so that a step that evicts never waits for a store. Records wait in a queue bounded
// in bytes; what does not fit is dropped and counted (a tier is a cache: the block is lost as it would be
// without tiers).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <kvcache/block_store.h>

namespace kvc::detail {

class tier_writer {
public:
    // One store's part of a flush.
    struct job {
        uint32_t tier = 0;
        std::shared_ptr<block_store_i> store;
        std::vector<std::string> keys;
        std::vector<std::shared_ptr<const std::vector<uint8_t>>> values;
        uint64_t bytes = 0;
    };
    // What the thread did for one tier.
    struct counts {
        uint64_t written = 0;  // records handed to put_many
        uint64_t errors = 0;   // put_many calls that threw
        uint64_t dropped = 0;  // records the full queue refused
    };

    tier_writer(uint32_t n_tiers, uint64_t max_bytes);
    ~tier_writer();  // writes what is queued, then stops
    tier_writer(const tier_writer&) = delete;
    tier_writer& operator=(const tier_writer&) = delete;

    // Queues j; false (counted as dropped) when its bytes do not fit beside what waits.
    bool push(job j);
    // Returns when everything queued so far is written.
    void drain();
    counts of(uint32_t tier) const;

private:
    void run();

    const uint64_t max_bytes_;
    mutable std::mutex m_;
    std::condition_variable work_, idle_;
    std::deque<job> q_;
    uint64_t bytes_ = 0;
    bool busy_ = false, stop_ = false;
    std::vector<counts> counts_;
    std::thread thread_;  // last: started once the rest is ready
};

}  // namespace kvc::detail
