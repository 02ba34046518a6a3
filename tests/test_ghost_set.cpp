// The adaptive policy's ghosts (src/prefix/ghost_set.cpp) against an oracle that keeps every insertion in
// order and answers by brute force: a hash is remembered if one of the last `capacity` insertions holds it
// and nothing took or replaced it since.
#include <deque>
#include <random>

#include <gtest/gtest.h>

#include "prefix/ghost_set.h"

namespace kvc {
namespace {

using detail::ghost_set;

struct oracle {
    struct entry {
        ghost_set::ghost g;
        bool live;
    };
    uint32_t cap;
    std::deque<entry> d{};

    entry* find(uint64_t h) {
        for (entry& e : d)
            if (e.live && e.g.hash == h) return &e;
        return nullptr;
    }
    void insert(const ghost_set::ghost& g) {
        if (entry* e = find(g.hash)) e->live = false;
        d.push_back({g, true});
        if (d.size() > cap) d.pop_front();
    }
    std::optional<ghost_set::ghost> take(uint64_t h) {
        entry* e = find(h);
        if (e == nullptr) return std::nullopt;
        e->live = false;
        return e->g;
    }
    uint32_t size() const {
        uint32_t n = 0;
        for (const entry& e : d) n += e.live;
        return n;
    }
};

void run(uint32_t cap, uint32_t seed, int n_ops) {
    std::mt19937_64 rng(seed);
    ghost_set s(cap);
    oracle o{.cap = cap};
    // few distinct hashes, some colliding in the table's low bits: long probe runs and repeats
    const auto hash = [&] { return (rng() % (cap + 5)) * (rng() % 2 ? 1 : uint64_t{1} << 40); };
    uint64_t taken = 0;
    for (int op = 0; op < n_ops; ++op) {
        const uint64_t h = hash();
        const auto r = rng() % 100;
        if (r < 55) {
            const ghost_set::ghost g{.hash = h,
                                     .serial = static_cast<uint32_t>(op),
                                     .stream = static_cast<uint16_t>(rng() % 3),
                                     .kind = static_cast<uint8_t>(rng() % 2)};
            s.insert(g);
            o.insert(g);
        } else if (r < 99) {
            const auto got = s.take(h);
            const auto want = o.take(h);
            ASSERT_EQ(got.has_value(), want.has_value()) << "op " << op << " hash " << h;
            if (got) {
                ASSERT_EQ(got->serial, want->serial) << "op " << op;
                ASSERT_EQ(got->stream, want->stream);
                ASSERT_EQ(got->kind, want->kind);
                ++taken;
            }
        } else {
            s.clear();
            o.d.clear();
        }
        ASSERT_EQ(s.size(), o.size()) << "op " << op;
        ASSERT_LE(s.size(), cap);
    }
    EXPECT_GT(taken, static_cast<uint64_t>(n_ops) / 50) << "the test must find ghosts";
}

TEST(ghost_set_property, remembers_the_last_insertions_as_the_oracle) {
    for (uint32_t cap : {1u, 2u, 7u, 64u, 300u})
        for (uint32_t seed = 1; seed <= 3; ++seed) ASSERT_NO_FATAL_FAILURE(run(cap, seed, 20000));
}

TEST(ghost_set, capacity_zero_remembers_nothing) {
    ghost_set s(0);
    s.insert({.hash = 5, .serial = 0, .stream = 0, .kind = 0});
    EXPECT_EQ(s.size(), 0u);
    EXPECT_FALSE(s.take(5).has_value());
    EXPECT_EQ(s.bytes(), 0u);
}

TEST(ghost_set, memory_follows_the_ghosts_not_the_capacity) {
    ghost_set s(1u << 30);  // a huge cache's capacity allocates nothing up front
    EXPECT_EQ(s.bytes(), 0u);
    for (uint64_t h = 0; h < 1000; ++h) s.insert({.hash = h, .serial = 0, .stream = 0, .kind = 0});
    EXPECT_EQ(s.size(), 1000u);
    EXPECT_LT(s.bytes(), 1000u * 64);
}

}  // namespace
}  // namespace kvc
