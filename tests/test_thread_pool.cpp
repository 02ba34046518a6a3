#include <atomic>
#include <stdexcept>
#include <vector>

#include <gtest/gtest.h>
#include <kvcache/runtime/thread_pool.h>
#include <kvcache/types.h>

namespace kvc {
namespace {

TEST(thread_pool, a_count_above_the_limit_is_an_error) {
    EXPECT_THROW(thread_pool(thread_pool::max_threads + 1), error);
    EXPECT_THROW(thread_pool(5000), error);
    EXPECT_EQ(thread_pool(3).size(), 3u);
}

TEST(thread_pool, pieces_cover_the_range_exactly_once) {
    for (unsigned threads : {1u, 2u, 3u, 8u}) {
        thread_pool pool(threads);
        EXPECT_EQ(pool.size(), threads);
        for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{1000}}) {
            std::vector<std::atomic<int>> hits(n);
            pool.parallel_for(n, [&](size_t b, size_t e) {
                ASSERT_LE(b, e);
                for (size_t i = b; i < e; ++i) ++hits[i];
            });
            for (size_t i = 0; i < n; ++i)
                EXPECT_EQ(hits[i].load(), 1) << threads << " threads, n " << n << ", i " << i;
        }
    }
}

TEST(thread_pool, grain_bounds_the_number_of_pieces) {
    thread_pool pool(4);
    std::atomic<int> pieces = 0;
    pool.parallel_for(
        10, [&](size_t, size_t) { ++pieces; }, 8);
    EXPECT_EQ(pieces.load(), 1) << "10 items with a grain of 8 make one piece";
}

TEST(thread_pool, an_exception_in_a_piece_reaches_the_caller_and_the_pool_stays_usable) {
    thread_pool pool(2);
    EXPECT_THROW(pool.parallel_for(100,
                                   [](size_t b, size_t) {
                                       if (b > 0) throw std::runtime_error("piece failed");
                                   }),
                 std::runtime_error);
    std::atomic<size_t> sum = 0;
    pool.parallel_for(100, [&](size_t b, size_t e) { sum += e - b; });
    EXPECT_EQ(sum.load(), 100u);
}

}  // namespace
}  // namespace kvc
