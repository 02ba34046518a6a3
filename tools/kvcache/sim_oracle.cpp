// kvcache sim: the policy `oracle`, Belady's MIN over the trace's cache blocks. Requests are taken one
// after the other; each full cache block of a prompt is one access; a cache of budget / cache_block blocks
// keeps, on a miss, the blocks whose next use is nearest (a block never used again, or used later than
// every cached one, is not kept). That maximises block hits for a cache of this size, so its hit rate
// bounds every policy's at this budget, which hit whole blocks of a prefix only and must also find room
// for live requests.
#include <chrono>
#include <list>
#include <set>
#include <unordered_map>

#include "sim_backend.h"

namespace kvc::cli {

sim_result run_oracle(const std::vector<sim_request>& reqs, const sim_options& o) {
    const auto t0 = std::chrono::steady_clock::now();
    sim_result r;
    r.policy = sim_policy::oracle;
    r.budget_tokens = o.budget;
    r.has_serving = false;
    const uint32_t per = o.trace_block / o.cache_block;
    std::vector<uint64_t> keys;
    for (const sim_request& q : reqs) {
        r.prompt_tokens += q.input_length;
        r.output_tokens += q.output_length;
        for (uint32_t k = 0; k < q.input_length / o.cache_block; ++k)
            keys.push_back(cache_block_key(q, k, per));
    }
    r.requests = reqs.size();
    // next use of each access (SIZE_MAX: never)
    std::vector<size_t> next(keys.size());
    {
        std::unordered_map<uint64_t, size_t> later;
        later.reserve(keys.size());
        for (size_t i = keys.size(); i-- > 0;) {
            const auto it = later.find(keys[i]);
            next[i] = it == later.end() ? SIZE_MAX : it->second;
            later[keys[i]] = i;
        }
    }
    const size_t capacity = o.budget / o.cache_block;
    std::set<std::pair<size_t, uint64_t>> by_next;  // (next use, key) of every cached block
    std::unordered_map<uint64_t, size_t> cached;    // key -> its next use
    uint64_t hits = 0, evicted = 0;
    for (size_t i = 0; i < keys.size(); ++i) {
        const auto it = cached.find(keys[i]);
        if (it != cached.end()) {
            ++hits;
            by_next.erase({it->second, keys[i]});
            if (next[i] == SIZE_MAX) {
                cached.erase(it);
            } else {
                it->second = next[i];
                by_next.insert({next[i], keys[i]});
            }
            continue;
        }
        if (next[i] == SIZE_MAX || capacity == 0) continue;
        if (cached.size() == capacity) {
            const auto far = std::prev(by_next.end());
            if (far->first < next[i]) continue;  // the new block is needed last: do not keep it
            cached.erase(far->second);
            by_next.erase(far);
            ++evicted;
        }
        cached.emplace(keys[i], next[i]);
        by_next.insert({next[i], keys[i]});
    }
    r.hit_tokens = hits * o.cache_block;
    r.prefill_tokens = r.prompt_tokens - r.hit_tokens;
    r.evicted_tokens = evicted * o.cache_block;
    r.bookkeeping_ns =
        std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
    r.wall_seconds = r.bookkeeping_ns * 1e-9;
    return r;
}

// The yardstick of Mooncake's paper: every block of a prompt is touched in order (the root first, so the
// root is the least recent of its chain and goes first), the least recently used block is evicted, and a
// request hits its leading blocks that are still there.
sim_result run_lru_blocks(const std::vector<sim_request>& reqs, const sim_options& o) {
    const auto t0 = std::chrono::steady_clock::now();
    sim_result r;
    r.policy = sim_policy::lru_blocks;
    r.budget_tokens = o.budget;
    r.requests = reqs.size();
    r.has_serving = false;
    const uint32_t per = o.trace_block / o.cache_block;
    const size_t capacity = o.budget / o.cache_block;
    std::list<uint64_t> order;  // least recent first
    std::unordered_map<uint64_t, std::list<uint64_t>::iterator> where;
    uint64_t evicted = 0;
    for (const sim_request& q : reqs) {
        r.prompt_tokens += q.input_length;
        r.output_tokens += q.output_length;
        bool prefix = true;
        for (uint32_t k = 0; k < q.input_length / o.cache_block; ++k) {
            const uint64_t key = cache_block_key(q, k, per);
            const auto it = where.find(key);
            if (it != where.end()) {
                if (prefix) r.hit_tokens += o.cache_block;
                order.splice(order.end(), order, it->second);
                continue;
            }
            prefix = false;
            if (capacity == 0) continue;
            if (where.size() == capacity) {
                where.erase(order.front());
                order.pop_front();
                ++evicted;
            }
            where.emplace(key, order.insert(order.end(), key));
        }
    }
    r.prefill_tokens = r.prompt_tokens - r.hit_tokens;
    r.evicted_tokens = evicted * o.cache_block;
    r.bookkeeping_ns =
        std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
    r.wall_seconds = r.bookkeeping_ns * 1e-9;
    return r;
}

}  // namespace kvc::cli
