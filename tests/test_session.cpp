#include <sys/resource.h>
#include <unistd.h>
#include <xxhash.h>
#include <zstd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <kvcache/kv_cache.h>
#include <kvcache/session.h>
#include <kvcache/state.h>

#include "state_test_util.h"

namespace kvc {
namespace {

using namespace kvc::test;
namespace fs = std::filesystem;

// A fresh directory per test, removed afterwards.
class session : public ::testing::Test {
protected:
    void SetUp() override {
        dir_ = fs::temp_directory_path() /
               fmt::format("kvc-session-{}-{}", ::getpid(),
                           ::testing::UnitTest::GetInstance()->current_test_info()->name());
        fs::remove_all(dir_);
        fs::create_directories(dir_);
    }
    void TearDown() override { fs::remove_all(dir_); }
    std::string path(const char* name) const { return (dir_ / name).string(); }
    std::vector<std::string> files() const {
        std::vector<std::string> out;
        for (const auto& e : fs::directory_iterator(dir_)) out.push_back(e.path().filename().string());
        std::sort(out.begin(), out.end());
        return out;
    }
    fs::path dir_;
};

std::vector<uint8_t> bytes_of(const std::string& path) {
    return read_file_bytes(path);
}

void put_bytes(const std::string& path, std::span<const uint8_t> b) {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

// Loading path into c must fail with an error containing `want`, leaving c byte for byte as it was.
// Limits the address space to `extra` bytes beyond what the process maps now, for its lifetime (not under
// AddressSanitizer, which maps terabytes of shadow memory).
class address_space_limit {
public:
    explicit address_space_limit(uint64_t extra) {
#if !defined(__SANITIZE_ADDRESS__)
        std::ifstream statm("/proc/self/statm");
        uint64_t pages = 0;
        statm >> pages;
        getrlimit(RLIMIT_AS, &old_);
        rlimit r = old_;
        r.rlim_cur = pages * static_cast<uint64_t>(sysconf(_SC_PAGESIZE)) + extra;
        active_ = setrlimit(RLIMIT_AS, &r) == 0;
#else
        (void)extra;
#endif
    }
    ~address_space_limit() {
        if (active_) setrlimit(RLIMIT_AS, &old_);
    }
    address_space_limit(const address_space_limit&) = delete;
    address_space_limit& operator=(const address_space_limit&) = delete;

private:
    rlimit old_{};
    bool active_ = false;
};

void expect_load_fails(kv_cache& c, const std::string& path, seq_id_t dest, const std::string& want) {
    const auto before = whole(c);
    try {
        load_file(c, path, dest);
        ADD_FAILURE() << "accepted, expected: " << want;
    } catch (const error& e) {
        EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
    EXPECT_EQ(whole(c), before) << "after: " << want;
}

TEST_F(session, round_trips_a_sequence_and_the_whole_memory_with_tokens_compressed_or_not) {
    std::mt19937 rng(1);
    for (const dtype tk : {dtype::f32, dtype::f16, dtype::bf16, dtype::q8_0, dtype::q4_0})
        for (const bool v_trans : {false, true})
            for (const bool unified : {true, false})
                for (const bool compress : {false, true}) {
                    SCOPED_TRACE(fmt::format("{} v_trans={} unified={} zstd={}", to_string(tk), v_trans,
                                             unified, compress));
                    const auto p = params_for(tk, v_trans ? dtype::f16 : tk, v_trans, unified);
                    kv_cache a(p);
                    decode(a, 0, 0, 5, rng);
                    decode(a, 2, 3, 4, rng);
                    const std::vector<token_t> tokens = {7, 8, 9, 10, 11};
                    session_save_options o;
                    o.compress = compress;
                    o.tokens = tokens;
                    const uint64_t n = save_file(a, path("all.kvc"), seq_all, o);
                    EXPECT_EQ(n, fs::file_size(path("all.kvc")));
                    kv_cache b(p);
                    decode(b, 1, 0, 2, rng);
                    const session_info info = load_file(b, path("all.kvc"), seq_all);
                    EXPECT_EQ(whole(b), whole(a));
                    EXPECT_EQ(info.tokens, tokens);
                    EXPECT_EQ(info.seq_id, seq_all);
                    EXPECT_EQ(info.layout, a.state_layout());
                    EXPECT_EQ(info.payload_bytes, whole(a).size() - 8);

                    o.tokens = {};
                    save_file(a, path("seq2.kvc"), 2, o);
                    const session_info one = load_file(b, path("seq2.kvc"), unified ? 3 : 2);
                    EXPECT_TRUE(one.tokens.empty());
                    EXPECT_EQ(one.seq_id, 2);
                    EXPECT_EQ(state_seq_get_data(b, unified ? 3 : 2).size(), state_seq_get_data(a, 2).size());
                    EXPECT_EQ(files(), (std::vector<std::string>{"all.kvc", "seq2.kvc"}))
                        << "no temporary files";
                }
}

TEST_F(session, compression_shrinks_a_cleared_cache_and_changes_nothing_else) {
    auto p = params_for(dtype::f16, dtype::f16, true, true);
    p.kv_size = 1024;
    kv_cache a(p);
    std::mt19937 rng(2);
    decode(a, 0, 0, 600, rng);
    a.clear(true);  // zero rows...
    decode(a, 0, 0, 40, rng);
    for (uint32_t i = 0; i < 560; ++i) {  // ...and many cells of zeros
        a.init_ubatches({make_ub({static_cast<pos_t>(40 + i)}, 0)}, {})->apply();
    }
    session_save_options o;
    const uint64_t plain = save_file(a, path("plain.kvc"), 0, o);
    o.compress = true;
    const uint64_t small = save_file(a, path("small.kvc"), 0, o);
    EXPECT_LT(small * 4, plain);
    std::vector<uint8_t> p1, p2;
    read_session(bytes_of(path("plain.kvc")), &p1);
    const session_info info = read_session(bytes_of(path("small.kvc")), &p2);
    EXPECT_EQ(p1, p2);
    EXPECT_EQ(info.file_flags, session_flag_zstd);
    EXPECT_EQ(info.stored_bytes + session_header_size + info.layout.size(), small);
}

TEST_F(session, saving_replaces_the_target_atomically_and_a_failed_save_leaves_it_alone) {
    std::mt19937 rng(3);
    const auto p = params_for(dtype::f16, dtype::f16, false, true);
    kv_cache a(p);
    decode(a, 0, 0, 3, rng);
    save_file(a, path("s.kvc"), 0);
    const auto first = bytes_of(path("s.kvc"));
    EXPECT_THROW(save_file(a, path("s.kvc"), 9), error) << "seq 9 is not a sequence of this cache";
    EXPECT_EQ(bytes_of(path("s.kvc")), first);
    session_save_options bad_level;
    bad_level.zstd_level = 99;
    try {
        save_file(a, path("s.kvc"), 0, bad_level);
        ADD_FAILURE() << "zstd level 99 accepted";
    } catch (const error& e) {
        EXPECT_EQ(e.code(), errc::invalid_argument);
        EXPECT_NE(std::string(e.what()).find("zstd level 99"), std::string::npos) << e.what();
    }
    try {
        save_file(a, path("no/such/dir/s.kvc"), 0);
        ADD_FAILURE() << "saved into a missing directory";
    } catch (const error& e) {
        EXPECT_EQ(e.code(), errc::io);
        EXPECT_NE(std::string(e.what()).find("no/such/dir"), std::string::npos) << e.what();
    }
    decode(a, 0, 3, 2, rng);
    save_file(a, path("s.kvc"), 0);
    EXPECT_NE(bytes_of(path("s.kvc")), first);
    EXPECT_EQ(files(), std::vector<std::string>{"s.kvc"});
}

// Regression (issue 21): saves killed mid-write left NAME.tmp-PID-RAND files that nothing removed. The
// next save into the same target removes those whose writer is gone, and nothing else.
TEST_F(session, a_save_removes_the_temporary_files_of_crashed_saves_of_its_target) {
    std::mt19937 rng(6);
    kv_cache a(params_for(dtype::f16, dtype::f16, false, true));
    decode(a, 0, 0, 3, rng);
    const std::string dead = fmt::format("x.kvc.tmp-{}-0badc0de", 2147483646);   // no such process
    const std::string mine = fmt::format("x.kvc.tmp-{}-00c0ffee", ::getpid());   // a writer at work
    const std::string other = fmt::format("y.kvc.tmp-{}-0badc0de", 2147483646);  // another target
    const std::string odd = "x.kvc.tmp-12x-0badc0de";                            // not the pattern
    for (const std::string& f : {dead, mine, other, odd})
        put_bytes(path(f.c_str()), std::vector<uint8_t>(8, 1));
    save_file(a, path("x.kvc"), 0);
    EXPECT_FALSE(fs::exists(path(dead.c_str())));
    for (const std::string& f : {mine, other, odd}) EXPECT_TRUE(fs::exists(path(f.c_str()))) << f;
    kv_cache b(params_for(dtype::f16, dtype::f16, false, true));
    load_file(b, path("x.kvc"), 0);
    EXPECT_EQ(b.seq_pos_max(0), 2);
}

TEST_F(session, load_errors_name_the_problem_and_change_nothing) {
    std::mt19937 rng(4);
    const auto p = params_for(dtype::q8_0, dtype::f16, true, true);
    kv_cache a(p);
    decode(a, 0, 0, 4, rng);
    decode(a, 1, 0, 2, rng);
    const std::vector<token_t> tokens = {1, 2, 3};
    session_save_options o;
    o.tokens = tokens;
    save_file(a, path("good.kvc"), seq_all, o);
    const auto good = bytes_of(path("good.kvc"));
    kv_cache b(p);
    decode(b, 2, 0, 3, rng);

    expect_load_fails(b, path("missing.kvc"), seq_all, "cannot open");
    put_bytes(path("x"), {});
    expect_load_fails(b, path("x"), seq_all, "not a kvcache session file (0 bytes)");
    put_bytes(path("x"), std::vector<uint8_t>{'h', 'e', 'l', 'l', 'o'});
    expect_load_fails(b, path("x"), seq_all, "not a kvcache session file: it starts with 0x6c6c6568");
    save_llama_seq_file(a, path("x"), 0, tokens);
    expect_load_fails(b, path("x"), seq_all, "llama.cpp sequence file ('ggsq'");
    put_bytes(path("x"), state_seq_get_data(a, 0));
    expect_load_fails(b, path("x"), seq_all, "per-sequence state buffer");

    auto v2 = good;
    v2[4] = 2;
    put_bytes(path("x"), v2);
    expect_load_fails(b, path("x"), seq_all, "unsupported format version 2 (this build reads version 1)");
    for (size_t n = 4; n < good.size(); n += (n < 200 ? 1 : 97)) {
        put_bytes(path("x"), std::span(good.data(), n));
        expect_load_fails(b, path("x"), seq_all, "truncated");
    }
    auto longer = good;
    longer.push_back(0);
    put_bytes(path("x"), longer);
    expect_load_fails(b, path("x"), seq_all, "1 trailing bytes");
    auto header = good;
    header[20] ^= 1;  // token count
    put_bytes(path("x"), header);
    expect_load_fails(b, path("x"), seq_all, "header checksum mismatch");
    auto body = good;
    body.back() ^= 0x40;  // last V byte
    put_bytes(path("x"), body);
    expect_load_fails(b, path("x"), seq_all, "checksum mismatch (stored");

    // a cache of another layout: both layouts are printed
    kv_cache other(params_for(dtype::f16, dtype::f16, true, true));
    try {
        load_file(other, path("good.kvc"), seq_all);
        ADD_FAILURE() << "loaded into another layout";
    } catch (const error& e) {
        const std::string m = e.what();
        EXPECT_EQ(e.code(), errc::invalid_state);
        EXPECT_NE(m.find("layout mismatch"), std::string::npos) << m;
        EXPECT_NE(m.find("the file's is \"" + a.state_layout() + "\""), std::string::npos) << m;
        EXPECT_NE(m.find("this memory's is \"" + other.state_layout() + "\""), std::string::npos) << m;
        EXPECT_NE(m.find(path("good.kvc")), std::string::npos) << m;
    }
    // the payload's own checks still apply: a whole-memory file of two sequences is not one sequence
    expect_load_fails(b, path("good.kvc"), 3, "cannot be restored into one sequence");
}

// Little-endian fields of a session file (docs/state-format.md).
uint64_t field(const std::vector<uint8_t>& file, size_t off, int bytes) {
    uint64_t v = 0;
    for (int k = 0; k < bytes; ++k) v |= uint64_t{file[off + k]} << (8 * k);
    return v;
}

// A session file with another stored payload and state flags, the lengths and both checksums made valid
// again through the documented layout: what anyone can forge.
std::vector<uint8_t> forge(const std::vector<uint8_t>& file, std::span<const uint8_t> stored,
                           uint64_t payload_bytes, uint32_t state_flags) {
    const size_t body_head = 72 + field(file, 24, 4) + 4 * field(file, 20, 4);  // layout and tokens
    std::vector<uint8_t> out(file.begin(), file.begin() + static_cast<ptrdiff_t>(body_head));
    out.insert(out.end(), stored.begin(), stored.end());
    const auto put = [&](size_t off, uint64_t v, int bytes) {
        for (int k = 0; k < bytes; ++k) out[off + k] = static_cast<uint8_t>(v >> (8 * k));
    };
    put(16, state_flags, 4);
    put(32, payload_bytes, 8);
    put(40, stored.size(), 8);
    put(56, XXH3_64bits(out.data() + 72, out.size() - 72), 8);
    put(64, XXH3_64bits(out.data(), 64), 8);
    return out;
}

// Regression (issue 21): a zstd frame declaring 8 GiB was zero-filled (31 s) before it was refused. With
// the address space limited to 1 GiB more than in use, allocating what the frame declares fails with
// another message ("cannot allocate"), so the test tells the two apart without timing anything.
// A frame may ask zstd for a window of up to 128 MiB, held beside the payload: kvcache writes and reads
// windows of at most 8 MiB, so such a frame is refused from its header, within the memory's largest
// state or not (issue 21).
TEST_F(session, a_frame_whose_window_is_over_8_mib_is_refused_before_it_is_held) {
    std::mt19937 rng(6);
    auto p = params_for(dtype::f16, dtype::f16, false, true);
    p.kv_size = 65536;  // a largest state of ~29 MiB (memory comes on demand)
    kv_cache a(p);
    decode(a, 0, 0, 4, rng);
    session_save_options o;
    o.compress = true;
    save_file(a, path("z.kvc"), seq_all, o);
    const auto good = bytes_of(path("z.kvc"));
    const uint64_t declared = uint64_t{16} << 20;
    ASSERT_LT(declared, a.state_max_bytes());
    // a frame header with a window of 2^27 and a 4-byte content size of 16 MiB, then one RLE block
    std::vector<uint8_t> frame = {0x28, 0xb5, 0x2f, 0xfd, 0x80, 0x88};
    for (int k = 0; k < 4; ++k) frame.push_back(static_cast<uint8_t>(declared >> (8 * k)));
    frame.insert(frame.end(), {0x23, 0x03, 0x00, 0x00});
    put_bytes(path("w.kvc"), forge(good, frame, declared, 0));
    kv_cache b(p);
    expect_load_fails(b, path("w.kvc"), seq_all, "the frame needs a window over 8388608 bytes");
    // without a memory, read_session inflates at most what its caller accepts
    std::vector<uint8_t> payload;
    try {
        read_session(forge(good, frame, declared, 0), &payload, declared - 1);
        ADD_FAILURE() << "inflated";
    } catch (const error& e) {
        EXPECT_NE(std::string(e.what()).find(fmt::format("the payload: {}, over the limit max_payload of {}",
                                                         declared, declared - 1)),
                  std::string::npos)
            << e.what();
    }
    EXPECT_TRUE(payload.empty());
    // the writer keeps to it at every level (here on a small payload: the window follows its size)
    for (const int level : {1, 19, 22}) {
        o.zstd_level = level;
        save_file(a, path("z.kvc"), seq_all, o);
        load_file(b, path("z.kvc"), seq_all);
    }
}

TEST_F(session, forged_files_are_refused_without_allocating_what_they_declare) {
    std::mt19937 rng(5);
    const auto p = params_for(dtype::f16, dtype::f16, false, true);
    kv_cache a(p);
    decode(a, 0, 0, 4, rng);
    session_save_options o;
    o.compress = true;
    save_file(a, path("z.kvc"), seq_all, o);
    const auto good = bytes_of(path("z.kvc"));
    const size_t body_head = 72 + field(good, 24, 4) + 4 * field(good, 20, 4);
    const auto stored = std::span(good).subspan(body_head);
    kv_cache b(p);
    put_bytes(path("x"), forge(good, stored, field(good, 32, 8), 0));  // forging keeps a valid file valid
    load_file(b, path("x"), seq_all);
    b.clear(/*data=*/true);
    // one frame header (single segment, an 8-byte content size of 8 GiB) and one RLE block of 100 bytes
    const uint64_t huge = uint64_t{8} << 30;
    std::vector<uint8_t> bomb = {0x28, 0xb5, 0x2f, 0xfd, 0xe0};
    for (int k = 0; k < 8; ++k) bomb.push_back(static_cast<uint8_t>(huge >> (8 * k)));
    bomb.insert(bomb.end(), {0x23, 0x03, 0x00, 0x00});
    ASSERT_EQ(ZSTD_getFrameContentSize(bomb.data(), bomb.size()), huge);
    put_bytes(path("bomb.kvc"), forge(good, bomb, huge, 0));
    {
        // refused from the declared size against the most this cache can hold, before the frame is read
        address_space_limit limit(uint64_t{1} << 30);
        double ms = 1e9;  // the best of 5: a busy machine may pause any one of them
        for (int k = 0; k < 5; ++k) {
            const auto t0 = std::chrono::steady_clock::now();
            expect_load_fails(
                b, path("bomb.kvc"), seq_all,
                fmt::format("session: the payload is {} bytes, more than the {} bytes of the largest "
                            "state this memory can hold",
                            huge, b.state_max_bytes()));
            ms = std::min(
                ms, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
        }
        std::printf("the %zu-byte file declaring 8 GiB refused in %.3f ms\n",
                    forge(good, bomb, huge, 0).size(), ms);
        EXPECT_LT(ms, 10.0);
    }
    // just over the largest state: a real frame of that many zero bytes, refused before it is inflated
    // (read, it would fail later, on its stream count: "the state has 0 streams")
    const uint64_t over = b.state_max_bytes() + 1;
    std::vector<uint8_t> zeros(static_cast<size_t>(over));
    std::vector<uint8_t> frame(ZSTD_compressBound(zeros.size()));
    frame.resize(ZSTD_compress(frame.data(), frame.size(), zeros.data(), zeros.size(), 1));
    put_bytes(path("x"), forge(good, frame, over, 0));
    expect_load_fails(b, path("x"), seq_all,
                      fmt::format("the payload is {} bytes, more than the {} bytes", over, over - 1));
    // the same in a 'ggsq' file (no declared size: the file's own)
    const uint32_t ggsq_head[3] = {llama_seq_file_magic, llama_seq_file_version, 0};  // no tokens
    std::vector<uint8_t> ggsq(sizeof ggsq_head);
    std::memcpy(ggsq.data(), ggsq_head, sizeof ggsq_head);
    ggsq.insert(ggsq.end(), zeros.begin(), zeros.end());
    put_bytes(path("x"), ggsq);
    const auto before = whole(b);
    try {
        load_llama_seq_file(b, path("x"), seq_all);
        ADD_FAILURE() << "loaded";
    } catch (const error& e) {
        EXPECT_NE(std::string(e.what()).find(
                      fmt::format("the payload is {} bytes, more than the {} bytes", over, over - 1)),
                  std::string::npos)
            << e.what();
    }
    EXPECT_EQ(whole(b), before);
    put_bytes(path("x"), forge(good, stored, field(good, 32, 8), 0xffffffff));
    expect_load_fails(b, path("x"), seq_all, "unknown state flags 0xffffffff");
    // regression (fuzz_session_forged): a frame of 0 bytes was "more than the 0 bytes the header says";
    // it decodes, and the empty payload is what is refused
    std::vector<uint8_t> empty(ZSTD_compressBound(0));
    empty.resize(ZSTD_compress(empty.data(), empty.size(), nullptr, 0, 1));
    put_bytes(path("x"), forge(good, empty, 0, 0));
    expect_load_fails(b, path("x"), seq_all, "state: truncated at byte 0");
    // a frame holding more than declared
    put_bytes(path("x"), forge(good, stored, field(good, 32, 8) - 1, 0));
    expect_load_fails(b, path("x"), seq_all, "the zstd frame holds");
}

// state_max_bytes is the size of a full cache's whole state when every cell lists every sequence it can
// (unified: all of them; one stream per sequence: its own), with and without transposed V and M-RoPE cells.
TEST_F(session, the_largest_state_is_what_a_full_cache_writes) {
    std::mt19937 rng(8);
    for (const bool unified : {true, false})
        for (const bool v_trans : {false, true})
            for (const uint32_t n_pos : {1u, 4u}) {
                SCOPED_TRACE(fmt::format("unified={} v_trans={} n_pos={}", unified, v_trans, n_pos));
                auto p = params_for(dtype::f16, dtype::f16, v_trans, unified);
                p.n_pos = n_pos;
                kv_cache c(p);
                EXPECT_EQ(whole(c).size() - 8, 4 + 4 * (unified ? 1 : p.n_seq_max)) << "empty";
                if (unified) {
                    decode(c, 0, 0, p.kv_size, rng, n_pos);
                    for (seq_id_t s = 1; s < static_cast<seq_id_t>(p.n_seq_max); ++s) c.seq_cp(0, s, -1, -1);
                } else {
                    for (seq_id_t s = 0; s < static_cast<seq_id_t>(p.n_seq_max); ++s)
                        decode(c, s, 0, p.kv_size, rng, n_pos);
                }
                EXPECT_EQ(whole(c).size() - 8, c.state_max_bytes());
            }
}

// Every single-byte corruption of a session file is caught by its checksums, before the memory changes.
TEST_F(session, random_byte_corruptions_are_always_rejected) {
    std::mt19937 rng(5);
    const auto p = params_for(dtype::f16, dtype::f16, true, true);
    kv_cache a(p);
    decode(a, 0, 0, 6, rng);
    decode(a, 1, 0, 3, rng);
    kv_cache b(p);
    decode(b, 2, 0, 2, rng);
    const auto before = whole(b);
    for (const bool compress : {false, true}) {
        session_save_options o;
        o.compress = compress;
        save_file(a, path("good.kvc"), seq_all, o);
        const auto good = bytes_of(path("good.kvc"));
        for (int i = 0; i < 5000; ++i) {
            auto bad = good;
            const size_t at = std::uniform_int_distribution<size_t>(0, bad.size() - 1)(rng);
            bad[at] ^= static_cast<uint8_t>(std::uniform_int_distribution<int>(1, 255)(rng));
            EXPECT_THROW(read_session(bad), error) << "byte " << at;
            if (i % 50 == 0) {  // through the file too
                put_bytes(path("bad.kvc"), bad);
                EXPECT_THROW(load_file(b, path("bad.kvc"), seq_all), error) << "byte " << at;
                ASSERT_EQ(whole(b), before);
            }
        }
    }
}

// B.6's sequence saved as llama.cpp's 'ggsq' file with 3 tokens: the 12-byte header, the tokens, then the
// 128 bytes of the per-sequence buffer after its magic and seq id (design/kv-cache.md B.6).
TEST_F(session, llama_seq_files_are_byte_exact_and_load_into_any_sequence) {
    std::mt19937 rng(6);
    const auto p = params_for(dtype::f16, dtype::f16, false, true);
    kv_cache a(p);
    decode(a, 0, 0, 3, rng);
    decode(a, 2, 0, 2, rng);
    const std::vector<token_t> tokens = {101, 102, 103};
    const uint64_t n = save_llama_seq_file(a, path("s.ggsq"), 2, tokens);
    const auto file = bytes_of(path("s.ggsq"));
    ASSERT_EQ(n, file.size());
    std::vector<uint8_t> want(24);
    const uint32_t head[3] = {0x67677371u, 2, 3};
    std::memcpy(want.data(), head, 12);
    std::memcpy(want.data() + 12, tokens.data(), 12);
    const auto buffer = state_seq_get_data(a, 2);
    want.insert(want.end(), buffer.begin() + 8, buffer.end());
    EXPECT_EQ(file, want);

    kv_cache same(p);
    EXPECT_EQ(load_llama_seq_file(same, path("s.ggsq"), 2), tokens);
    EXPECT_EQ(state_seq_get_data(same, 2), buffer);
    kv_cache b(p);
    EXPECT_EQ(load_llama_seq_file(b, path("s.ggsq"), 1), tokens);
    EXPECT_EQ(b.seq_pos_min(1), 0);
    EXPECT_EQ(b.seq_pos_max(1), 1);

    const auto before = whole(b);
    auto bad = file;
    bad[4] = 3;
    put_bytes(path("bad"), bad);
    EXPECT_THROW(load_llama_seq_file(b, path("bad"), 1), error);
    put_bytes(path("bad"), std::span(file.data(), file.size() - 1));
    EXPECT_THROW(load_llama_seq_file(b, path("bad"), 1), error);
    save_file(a, path("kvc"), 2);
    try {
        load_llama_seq_file(b, path("kvc"), 1);
        ADD_FAILURE();
    } catch (const error& e) {
        EXPECT_NE(std::string(e.what()).find("a kvcache session file"), std::string::npos) << e.what();
    }
    EXPECT_EQ(whole(b), before);
}

// 'ggsq' files have no checksum (llama.cpp's format): a damaged byte is caught only where the format has
// structure. Random single-byte corruptions (seeded) of a sequence's file: those in the header, the counts,
// ids, types and row sizes are always refused, with the memory unchanged; those in tokens (unless one turns
// negative), positions and K/V bytes may load as data, and the test counts them (docs/state-format.md).
TEST_F(session, llama_seq_file_corruptions_are_refused_where_the_format_has_structure) {
    std::mt19937 rng(8);
    const auto p = params_for(dtype::f16, dtype::f16, false, true);
    kv_cache a(p);
    decode(a, 0, 0, 5, rng);
    decode(a, 1, 0, 3, rng);
    const std::vector<token_t> tokens = {11, 12, 13, 14, 15};
    save_llama_seq_file(a, path("s.ggsq"), 0, tokens);
    const auto good = bytes_of(path("s.ggsq"));
    // the bytes that are data: tokens, cell positions, K and V rows (one stream, 5 cells, 2 layers)
    const size_t n_cells = 5, payload = 12 + 4 * tokens.size();
    std::vector<bool> data(good.size(), false);
    for (size_t i = 12; i < payload; ++i) data[i] = true;
    const size_t cells_at = payload + 8;  // n_stream, cell_count
    for (size_t c = 0; c < n_cells; ++c)
        for (size_t k = 0; k < 4; ++k) data[cells_at + 12 * c + k] = true;  // pos (then n_seq_id, seq_id)
    size_t at = cells_at + 12 * n_cells + 8;                                // v_trans, n_layer
    for (int kv = 0; kv < 2; ++kv)
        for (const layer_desc& l : p.layers) {
            const size_t row = 2 * size_t{l.n_head_kv} * (kv == 0 ? l.n_embd_head_k : l.n_embd_head_v);
            at += 12;  // type, row size
            for (size_t i = 0; i < n_cells * row; ++i) data[at + i] = true;
            at += n_cells * row;
        }
    ASSERT_EQ(at, good.size());

    kv_cache b(p);
    decode(b, 2, 0, 2, rng);
    const auto before = whole(b);
    int loaded = 0, loaded_data = 0, negative_tokens = 0;
    const int n = 2000;
    for (int i = 0; i < n; ++i) {
        auto bad = good;
        const size_t k = std::uniform_int_distribution<size_t>(0, bad.size() - 1)(rng);
        bad[k] ^= static_cast<uint8_t>(std::uniform_int_distribution<int>(1, 255)(rng));
        put_bytes(path("bad.ggsq"), bad);
        try {
            (void)load_llama_seq_file(b, path("bad.ggsq"), 1);
        } catch (const error& e) {
            ASSERT_EQ(whole(b), before) << "byte " << k << ": " << e.what();
            negative_tokens += std::string(e.what()).find("not a token id") != std::string::npos;
            continue;
        }
        ++loaded;
        EXPECT_TRUE(data[k]) << "a corruption of structural byte " << k << " loaded";
        loaded_data += data[k];
        state_seq_set_data(b, before, seq_all);
    }
    std::printf("'ggsq' corruptions: %d of %d loaded as data (%d refused as negative tokens)\n", loaded, n,
                negative_tokens);
    RecordProperty("ggsq_corruptions_loaded", loaded);
    EXPECT_EQ(loaded, loaded_data);
    EXPECT_GT(negative_tokens, 0);
    EXPECT_LT(loaded, n);
}

// read_session_header: the format, version and token count of either kind of file, from its header alone;
// a header that is missing, foreign, truncated or damaged is an error naming the file.
TEST_F(session, read_session_header_reads_either_format_from_the_header_alone) {
    std::mt19937 rng(7);
    const auto p = params_for(dtype::f16, dtype::f16, true, true);
    kv_cache a(p);
    decode(a, 0, 0, 3, rng);
    const std::vector<token_t> tokens = {7, 8, 9, 10};
    for (const bool compress : {false, true}) {
        session_save_options o;
        o.tokens = tokens;
        o.compress = compress;
        save_file(a, path("s.kvc"), 0, o);
        const session_header h = read_session_header(path("s.kvc"));
        EXPECT_EQ(h.format, session_file_format::kvcache);
        EXPECT_EQ(h.version, session_version);
        EXPECT_EQ(h.n_tokens, 4u);
    }
    save_file(a, path("none.kvc"), seq_all);
    EXPECT_EQ(read_session_header(path("none.kvc")).n_tokens, 0u);
    save_llama_seq_file(a, path("s.ggsq"), 0, std::span(tokens).first(3));
    const session_header l = read_session_header(path("s.ggsq"));
    EXPECT_EQ(l.format, session_file_format::llama_seq);
    EXPECT_EQ(l.version, llama_seq_file_version);
    EXPECT_EQ(l.n_tokens, 3u);

    // the body is not read: a damaged body still has a readable header (load_file refuses it)
    auto body = bytes_of(path("s.kvc"));
    body.back() ^= 1;
    put_bytes(path("body.kvc"), body);
    EXPECT_EQ(read_session_header(path("body.kvc")).n_tokens, 4u);

    const auto fails = [&](const std::string& file, errc code, const std::string& want) {
        try {
            (void)read_session_header(file);
            ADD_FAILURE() << "accepted, expected: " << want;
        } catch (const error& e) {
            EXPECT_EQ(e.code(), code) << e.what();
            EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
            EXPECT_NE(std::string(e.what()).find("read_session_header '" + file + "'"), std::string::npos)
                << e.what();
        }
    };
    fails(path("missing"), errc::io, "cannot open");
    put_bytes(path("x"), {});
    fails(path("x"), errc::corrupt_data,
          "neither a kvcache session file nor a llama.cpp sequence file: 0 bytes");
    put_bytes(path("x"), std::vector<uint8_t>{'h', 'e', 'l', 'l', 'o'});
    fails(path("x"), errc::corrupt_data, "it starts with 0x6c6c6568");
    put_bytes(path("x"), state_seq_get_data(a, 0));
    fails(path("x"), errc::corrupt_data, "per-sequence state buffer");
    const auto good = bytes_of(path("s.kvc"));
    put_bytes(path("x"), std::span(good.data(), 40));
    fails(path("x"), errc::corrupt_data, "truncated: 40 bytes, the header has 72");
    auto header = good;
    header[20] ^= 1;  // token count
    put_bytes(path("x"), header);
    fails(path("x"), errc::corrupt_data, "header checksum mismatch");
    auto v2 = good;
    v2[4] = 2;
    put_bytes(path("x"), v2);
    fails(path("x"), errc::unsupported, "unsupported format version 2");
    const auto ggsq = bytes_of(path("s.ggsq"));
    auto l3 = ggsq;
    l3[4] = 3;
    put_bytes(path("x"), l3);
    fails(path("x"), errc::unsupported, "unsupported llama.cpp sequence file version 3");
    put_bytes(path("x"), std::span(ggsq.data(), 20));  // 3 tokens announced, 2 present
    fails(path("x"), errc::corrupt_data, "truncated: 3 tokens announced, 8 bytes left");
    put_bytes(path("x"), std::span(ggsq.data(), 10));
    fails(path("x"), errc::corrupt_data, "truncated: 10 bytes, the header has 12");
}

TEST(io_file, writer_and_reader_round_trip_and_report_errors) {
    const std::string p = (fs::temp_directory_path() / fmt::format("kvc-io-{}", ::getpid())).string();
    std::vector<uint8_t> big(3 << 20);
    for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<uint8_t>(i * 31);
    {
        io_file_writer w(p);
        w.write(big.data(), 10);
        w.write(big.data() + 10, big.size() - 20);  // larger than the buffer: straight through
        w.write(big.data() + big.size() - 10, 10);
        const uint8_t patch[2] = {0xaa, 0xbb};
        w.write_at(5, patch, 2);
        big[5] = 0xaa, big[6] = 0xbb;
        EXPECT_THROW(w.write_at(big.size() - 1, patch, 2), error);
        w.close();
    }
    EXPECT_EQ(read_file_bytes(p), big);
    io_file_reader r(p);
    EXPECT_EQ(r.size(), big.size());
    std::vector<uint8_t> head(7);
    r.read(head.data(), 7);
    EXPECT_TRUE(std::equal(head.begin(), head.end(), big.begin()));
    std::vector<std::byte> scratch;
    EXPECT_EQ(r.read_span(100, scratch).size(), 100u);
    EXPECT_EQ(r.n_bytes(), 107u);
    std::vector<uint8_t> rest(r.remaining() + 1);
    try {
        r.read(rest.data(), rest.size());
        ADD_FAILURE();
    } catch (const error& e) {
        EXPECT_EQ(e.code(), errc::corrupt_data);
        EXPECT_NE(std::string(e.what()).find("truncated at byte 107"), std::string::npos) << e.what();
    }
    fs::remove(p);
    EXPECT_THROW(io_file_reader{p}, error);
}

}  // namespace
}  // namespace kvc
