// kvc::limits (issue 21): every limit refuses what exceeds it before allocating, naming the limit and
// both values, and leaves what it guards unchanged; set_limits validates and returns the previous ones.
#include <fcntl.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <kvcache/batch.h>
#include <kvcache/kv_cache.h>
#include <kvcache/limits.h>
#include <kvcache/memory_recurrent.h>
#include <kvcache/session.h>
#include <kvcache/state.h>

namespace kvc {
namespace {

// Sets limits for a test and puts the previous ones back.
class scoped_limits {
public:
    explicit scoped_limits(const limits& l) : old_(set_limits(l)) {}
    ~scoped_limits() { set_limits(old_); }
    scoped_limits(const scoped_limits&) = delete;
    scoped_limits& operator=(const scoped_limits&) = delete;

private:
    limits old_;
};

// f throws kvc::error(code) whose message contains every one of `parts`.
template <class F>
void expect_refused(const F& f, errc code, std::initializer_list<std::string> parts) {
    try {
        f();
        ADD_FAILURE() << "no error";
    } catch (const error& e) {
        EXPECT_EQ(e.code(), code) << e.what();
        for (const std::string& p : parts)
            EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
    }
}

kv_cache_params small(uint32_t n_seq_max) {
    kv_cache_params p;
    p.layers = {layer_desc{.n_head_kv = 1, .n_embd_head_k = 8, .n_embd_head_v = 8}};
    p.kv_size = 16;
    p.n_seq_max = n_seq_max;
    return p;
}

TEST(limits, defaults_and_set_returns_the_previous_ones) {
    const limits d = get_limits();
    EXPECT_EQ(d.file_bytes, 0u);
    EXPECT_EQ(d.metadata_bytes, uint64_t{1} << 30);
    EXPECT_EQ(d.batch_tokens, 1u << 20);
    EXPECT_EQ(d.sequences, 65536u);
    EXPECT_EQ(d.memory_bytes, 0u);
    limits l = d;
    l.batch_tokens = 7;
    const limits old = set_limits(l);
    EXPECT_EQ(old.batch_tokens, d.batch_tokens);
    EXPECT_EQ(get_limits().batch_tokens, 7u);
    l.sequences = 0;  // refused, nothing changes
    expect_refused([&] { set_limits(l); }, errc::invalid_argument, {"sequences (0)"});
    EXPECT_EQ(get_limits().sequences, 65536u);
    EXPECT_EQ(get_limits().batch_tokens, 7u);
    set_limits(d);
}

TEST(limits, batch_tokens_sequences_and_bytes_of_a_batch) {
    limits l = get_limits();
    l.batch_tokens = 64;
    l.sequences = 4;
    const scoped_limits scope(l);
    EXPECT_NO_THROW(batch::init(64, 0, 4));
    expect_refused([] { batch::init(65, 0, 1); }, errc::out_of_range,
                   {"n_tokens_alloc: 65, over the limit batch_tokens of 64 (kvc::limits)"});
    expect_refused([] { batch::init(1, 0, 5); }, errc::out_of_range,
                   {"n_seq_max: 5", "limit sequences of 4"});
    // issue 21: kvc_batch_init(INT32_MAX, 0, INT32_MAX) zero-filled 14.8 GB before anyone stopped it
    set_limits(limits{});
    expect_refused([] { batch::init(INT32_MAX, 0, INT32_MAX); }, errc::out_of_range, {"batch_tokens"});
    // within the counts, the bytes: 2^20 tokens of 2^31 floats each
    expect_refused([] { batch::init(1 << 20, INT32_MAX, 1); }, errc::out_of_memory,
                   {"batch::init: 1048576 tokens x", "over the memory budget"});
}

TEST(limits, sequences_of_a_memory) {
    limits l = get_limits();
    l.sequences = 8;
    const scoped_limits scope(l);
    EXPECT_NO_THROW(kv_cache{small(8)});
    expect_refused([] { kv_cache c(small(9)); }, errc::out_of_range,
                   {"kv_cache: n_seq_max: 9, over the limit sequences of 8"});
    recurrent_params rp;
    rp.layers = {{.n_embd_r = 4, .n_embd_s = 4}};
    rp.n_seq_max = 9;
    expect_refused([&] { memory_recurrent m(rp); }, errc::out_of_range,
                   {"memory_recurrent: n_seq_max: 9, over the limit sequences of 8"});
}

TEST(limits, memory_bytes_is_the_default_budget) {
    limits l = get_limits();
    l.memory_bytes = 1024;  // a cache of 16 cells x 32 bytes fits, 64 cells do not
    const scoped_limits scope(l);
    EXPECT_NO_THROW(kv_cache{small(1)});
    kv_cache_params p = small(1);
    p.kv_size = 64;
    expect_refused([&] { kv_cache c(p); }, errc::out_of_memory,
                   {"over the memory budget of 1.00 KiB", "memory_budget 0: kvc::limits memory_bytes"});
    p.memory_budget = 4096;  // an explicit budget wins
    EXPECT_NO_THROW(kv_cache{p});
}

// A file over file_bytes is refused from its size alone: a sparse 3 GiB file is not read (issue 20: one
// was read for 20 s before being rejected).
TEST(limits, file_bytes_refuses_before_reading) {
    const auto path =
        (std::filesystem::temp_directory_path() / fmt::format("kvc-limits-{}.bin", ::getpid())).string();
    {
        const int fd = ::open(path.c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0600);
        ASSERT_GE(fd, 0);
        ASSERT_EQ(::ftruncate(fd, off_t{3} << 30), 0);  // sparse: no disk, no memory
        ::close(fd);
    }
    limits l = get_limits();
    l.file_bytes = uint64_t{1} << 30;
    const scoped_limits scope(l);
    expect_refused([&] { read_file_bytes(path); }, errc::out_of_range,
                   {"bytes in the file: 3221225472, over the limit file_bytes of 1073741824 (kvc::limits)"});
    kv_cache c(small(1));
    expect_refused([&] { load_file(c, path, 0); }, errc::out_of_range, {"load_file", "file_bytes"});
    expect_refused([&] { load_llama_seq_file(c, path, 0); }, errc::out_of_range, {"file_bytes"});
    std::filesystem::remove(path);
}

}  // namespace
}  // namespace kvc
