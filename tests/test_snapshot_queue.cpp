// detail::snapshot_queue against an oracle that orders snapshots by (level, stamp) and scans for the first.
#include <algorithm>
#include <map>
#include <random>

#include <gtest/gtest.h>

#include "prefix/snapshot_queue.h"

namespace kvc::detail {
namespace {

// Level 0: rolling; then 1 + 2 x priority + protected. The first to go: the lowest level, oldest stamp.
struct oracle {
    uint32_t max_protected = 0;
    std::map<uint32_t, std::pair<uint32_t, int64_t>> items;  // slot -> (level, stamp)
    int64_t back = 0, front = 0;

    static bool is_protected(uint32_t l) { return l > 0 && l % 2 == 0; }
    void put_back(uint32_t s, uint32_t l) { items[s] = {l, ++back}; }
    void put_front(uint32_t s, uint32_t l) { items[s] = {l, --front}; }
    uint32_t first(bool protected_only) const {
        uint32_t best = snapshot_queue::none;
        for (const auto& [s, e] : items)
            if ((!protected_only || is_protected(e.first)) &&
                (best == snapshot_queue::none || e < items.at(best)))
                best = s;
        return best;
    }
    void bound() {
        for (;;) {
            const auto n = std::count_if(items.begin(), items.end(),
                                         [](const auto& e) { return is_protected(e.second.first); });
            if (static_cast<uint32_t>(n) <= max_protected) return;
            const uint32_t s = first(true);
            put_back(s, items[s].first - 1);
        }
    }
};

TEST(snapshot_queue, evicts_in_the_order_of_a_simple_model) {
    for (const evict_policy policy : {evict_policy::lru, evict_policy::slru}) {
        for (uint32_t seed = 1; seed <= 20; ++seed) {
            constexpr uint32_t n = 24;
            snapshot_queue q(n, policy, 5);
            oracle o;
            o.max_protected = policy == evict_policy::slru ? 5u : 0u;
            std::mt19937 rng(seed);
            const auto pick = [&] { return static_cast<uint32_t>(rng() % n); };
            const auto prio = [&] { return static_cast<uint8_t>(rng() % 4 == 0 ? rng() % 101 : 50); };
            for (int op = 0; op < 4000; ++op) {
                const uint32_t s = pick();
                const bool in = o.items.count(s) > 0;
                ASSERT_EQ(q.queued(s), in);
                const uint32_t what = static_cast<uint32_t>(rng() % 7);
                if (!in && what < 2) {
                    const uint8_t p = prio();
                    const bool first = rng() % 3 == 0;  // a cold kind
                    q.push(s, p, first);
                    if (first)
                        o.put_front(s, 1 + 2u * p);
                    else
                        o.put_back(s, 1 + 2u * p);
                } else if (!in && what < 4) {
                    q.push_rolling(s);
                    o.put_back(s, 0);
                } else if (in && what == 0) {
                    q.hit(s);
                    const uint32_t l = o.items[s].first;
                    if (l > 0) {
                        o.put_back(s, policy == evict_policy::slru && !oracle::is_protected(l) ? l + 1 : l);
                        o.bound();
                    }
                } else if (in && what == 1) {
                    q.demote(s);
                    const uint32_t l = o.items[s].first;
                    if (l > 0) o.put_front(s, oracle::is_protected(l) ? l - 1 : l);
                } else if (in && what == 2) {
                    const uint8_t p = prio();
                    q.set_priority(s, p);
                    const uint32_t l = o.items[s].first;
                    const uint32_t to = 1 + 2u * p + (oracle::is_protected(l) ? 1 : 0);
                    if (l > 0 && to != l) o.put_back(s, to);
                } else if (in && what == 3) {
                    const uint8_t p = prio();
                    q.push(s, p);  // a rolling snapshot kept when its sequence ends
                    o.put_back(s, 1 + 2u * p);
                } else if (in && what == 4) {
                    q.erase(s);
                    o.items.erase(s);
                } else if (what == 5) {  // evict the first
                    const uint32_t f = q.front();
                    ASSERT_EQ(f, o.first(false)) << "op " << op;
                    if (f != snapshot_queue::none) {
                        q.erase(f);
                        o.items.erase(f);
                    }
                }
                ASSERT_EQ(q.front(), o.first(false)) << "op " << op;
            }
            q.clear();
            EXPECT_EQ(q.front(), snapshot_queue::none);
        }
    }
}

}  // namespace
}  // namespace kvc::detail
