#include <random>
#include <set>
#include <vector>

#include <gtest/gtest.h>
#include <kvcache/seq_set.h>

namespace kvc {
namespace {

using oracle = std::set<seq_id_t>;

void expect_same(const seq_set& s, const oracle& o, const char* where) {
    ASSERT_EQ(s.size(), o.size()) << where;
    ASSERT_EQ(s.empty(), o.empty()) << where;
    ASSERT_EQ(s.first(), o.empty() ? -1 : *o.begin()) << where;
    std::vector<seq_id_t> got(s.begin(), s.end());
    ASSERT_EQ(got, std::vector<seq_id_t>(o.begin(), o.end())) << where;
    ASSERT_EQ(s.is_only(o.empty() ? 0 : *o.begin()), o.size() == 1) << where;
}

oracle random_oracle(std::mt19937& rng, int n_seq_max, int n) {
    oracle o;
    std::uniform_int_distribution<seq_id_t> id(0, n_seq_max - 1);
    for (int i = 0; i < n; ++i) o.insert(id(rng));
    return o;
}

seq_set from_oracle(const oracle& o) {
    seq_set s;
    for (seq_id_t id : o) s.insert(id);
    return s;
}

class seq_set_vs_std_set : public testing::TestWithParam<int> {};

TEST_P(seq_set_vs_std_set, random_operations_agree) {
    const int n_seq_max = GetParam();
    std::mt19937 rng(static_cast<uint32_t>(n_seq_max));
    std::uniform_int_distribution<seq_id_t> id(0, n_seq_max - 1);
    std::uniform_int_distribution<int> op(0, 13);
    seq_set s;
    oracle o;
    for (int step = 0; step < 20000; ++step) {
        const seq_id_t a = id(rng);
        switch (op(rng)) {
            case 0:
            case 1:
            case 2:
                s.insert(a);
                o.insert(a);
                break;
            case 3:
            case 4:
                s.erase(a);
                o.erase(a);
                break;
            case 5:
                ASSERT_EQ(s.contains(a), o.count(a) == 1);
                break;
            case 6:
                ASSERT_EQ(s.next_from(a), o.lower_bound(a) == o.end() ? -1 : *o.lower_bound(a));
                break;
            case 7: {  // union
                const oracle r = random_oracle(rng, n_seq_max, 3);
                s |= from_oracle(r);
                o.insert(r.begin(), r.end());
                break;
            }
            case 8: {  // intersection, with a set that keeps about half
                oracle r = random_oracle(rng, n_seq_max, n_seq_max / 2 + 1);
                r.insert(o.begin(), std::next(o.begin(), static_cast<long>(o.size() / 2)));
                s &= from_oracle(r);
                oracle keep;
                for (seq_id_t x : o)
                    if (r.count(x)) keep.insert(x);
                o = keep;
                break;
            }
            case 9: {  // difference
                const oracle r = random_oracle(rng, n_seq_max, 2);
                s -= from_oracle(r);
                for (seq_id_t x : r) o.erase(x);
                break;
            }
            case 10: {  // relations
                const oracle r = random_oracle(rng, n_seq_max, 2);
                const seq_set rs = from_oracle(r);
                bool meet = false, sub = true;
                for (seq_id_t x : o) meet |= r.count(x) > 0, sub &= r.count(x) > 0;
                ASSERT_EQ(s.intersects(rs), meet);
                ASSERT_EQ(rs.intersects(s), meet);
                ASSERT_EQ(s.is_subset_of(rs), sub);
                ASSERT_EQ(s == rs, o == r);
                break;
            }
            case 11: {  // copies are deep and equal
                seq_set c = s;
                ASSERT_TRUE(c == s);
                c.insert(a);
                c.erase(a);
                if (o.count(a)) c.insert(a);
                ASSERT_TRUE(c == s);
                seq_set d;
                d.insert(n_seq_max - 1);
                d = c;  // assignment over an existing (maybe larger) allocation
                ASSERT_TRUE(d == s);
                s = std::move(d);
                break;
            }
            case 12:
                if (step % 50 == 0) {
                    s.clear();
                    o.clear();
                }
                break;
            default:
                ASSERT_EQ(s.is_only(a), o.size() == 1 && o.count(a));
                break;
        }
        expect_same(s, o, "after step");
    }
}

INSTANTIATE_TEST_SUITE_P(n_seq_max, seq_set_vs_std_set, testing::Values(1, 64, 65, 4096));

TEST(seq_set, ids_above_one_word) {
    seq_set s{3, 64, 4095};
    EXPECT_EQ(s.size(), 3u);
    EXPECT_TRUE(s.contains(4095));
    EXPECT_FALSE(s.contains(4094));
    EXPECT_EQ(s.to_string(), "{3, 64, 4095}");
    s.erase(3);
    s.erase(64);
    EXPECT_TRUE(s.is_only(4095));
    s.erase(4095);
    EXPECT_TRUE(s.empty());
    EXPECT_TRUE(s == seq_set{});  // an allocation with no bits equals the empty set
    EXPECT_EQ(s.first(), -1);
}

TEST(seq_set, negative_ids) {
    seq_set s{1};
    EXPECT_FALSE(s.contains(-1));
    EXPECT_NO_THROW(s.erase(-5));
    EXPECT_TRUE(s.is_only(1));
    EXPECT_FALSE(s.is_only(-1));
    try {
        s.insert(-3);
        FAIL() << "no error";
    } catch (const error& e) {
        EXPECT_EQ(e.code(), errc::out_of_range);
        EXPECT_NE(std::string(e.what()).find("-3"), std::string::npos);
    }
    EXPECT_TRUE(s.is_only(1)) << "a rejected insert changes nothing";
}

TEST(seq_set, small_sets_stay_inline) {
    static_assert(sizeof(seq_set) == 16);
    seq_set a{0, 63};
    seq_set b = a;
    EXPECT_TRUE(a == b);
    b.insert(5);
    EXPECT_FALSE(a.contains(5)) << "copy is independent";
}

}  // namespace
}  // namespace kvc
