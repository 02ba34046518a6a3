#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <kvcache/types.h>
#include <kvcache/version.h>

namespace kvc {
namespace {

constexpr memory_status S = memory_status::success;
constexpr memory_status N = memory_status::no_update;
constexpr memory_status P = memory_status::failed_prepare;
constexpr memory_status C = memory_status::failed_compute;

TEST(memory_status, is_fail_only_for_failures) {
    EXPECT_FALSE(is_fail(S));
    EXPECT_FALSE(is_fail(N));
    EXPECT_TRUE(is_fail(P));
    EXPECT_TRUE(is_fail(C));
}

TEST(memory_status, combine_follows_spec_table) {
    // design/kv-cache.md §1.4: first failure wins, else success if either is success, else no_update
    struct row {
        memory_status a, b, want;
    };
    const std::vector<row> table = {
        {S, S, S}, {S, N, S}, {N, S, S}, {N, N, N}, {P, S, P}, {S, P, P}, {P, C, P},
        {C, P, C}, {N, C, C}, {C, N, C}, {P, P, P}, {C, C, C}, {N, P, P}, {S, C, C},
    };
    for (const row& r : table)
        EXPECT_EQ(combine(r.a, r.b), r.want) << to_string(r.a) << " + " << to_string(r.b);
    static_assert(combine(N, S) == S, "combine is usable in constant expressions");
}

TEST(memory_status, names) {
    EXPECT_STREQ(to_string(S), "success");
    EXPECT_STREQ(to_string(N), "no_update");
    EXPECT_STREQ(to_string(P), "failed_prepare");
    EXPECT_STREQ(to_string(C), "failed_compute");
}

TEST(error, carries_code_and_message) {
    try {
        throw error(errc::out_of_range, "seq_rm: seq_id 9 not in [0, 4)");
    } catch (const std::runtime_error& e) {  // catchable as a standard exception
        const auto* ke = dynamic_cast<const error*>(&e);
        ASSERT_NE(ke, nullptr);
        EXPECT_EQ(ke->code(), errc::out_of_range);
        EXPECT_STREQ(e.what(), "seq_rm: seq_id 9 not in [0, 4)");
    }
    EXPECT_STREQ(to_string(errc::corrupt_data), "corrupt_data");
}

struct captured {
    std::vector<std::pair<log_level, std::string>> lines;
};

void capture(log_level level, const char* message, void* user) {
    static_cast<captured*>(user)->lines.emplace_back(level, message);
}

TEST(logging, callback_receives_every_level) {
    captured c;
    set_log_callback(capture, &c);
    log(log_level::debug, "d");
    log(log_level::error, "e 42");
    set_log_callback(nullptr);
    log(log_level::debug, "not captured");  // default sink again
    ASSERT_EQ(c.lines.size(), 2u);
    EXPECT_EQ(c.lines[0].first, log_level::debug);
    EXPECT_EQ(c.lines[1].second, "e 42");
}

TEST(logging, default_prints_warnings_and_errors_only) {
    set_log_callback(nullptr);
    testing::internal::CaptureStderr();
    log(log_level::info, "quiet info");
    log(log_level::warn, "loud warning");
    const std::string out = testing::internal::GetCapturedStderr();
    EXPECT_EQ(out.find("quiet info"), std::string::npos);
    EXPECT_NE(out.find("kvcache warning: loud warning"), std::string::npos);
}

TEST(version, library_matches_headers) {
    EXPECT_STREQ(version_string(), KVC_VERSION_STRING);
}

}  // namespace
}  // namespace kvc
