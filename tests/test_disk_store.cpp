// disk_block_store (include/kvcache/disk_store.h): round trips, restarts, the LRU budget, damaged files,
// and I/O faults injected through the table of POSIX calls (src/detail/file_ops.h, as in
// tests/test_file_ops.cpp): after a failed or "crashed" call at every point of a put_many, a reopened
// store holds only whole, verified values, and nothing was thrown into the caller.
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <kvcache/block_record.h>
#include <kvcache/disk_store.h>

#include "detail/file_ops.h"

namespace kvc {
namespace {

namespace fs = std::filesystem;
using detail::file_io;
using detail::file_ops;

block_layout test_layout() {
    block_layout l;
    l.model_id = 1;
    l.block_size = 4;
    l.layers = {{.il = 0, .n_k = 64, .n_v = 64}};  // 4 x 128 bytes K and V: records of 1104 bytes
    return l;
}

// A verified record for block number i (a chain of one block under key i).
struct blocks {
    block_layout layout = test_layout();
    std::vector<std::string> keys;
    std::vector<std::vector<uint8_t>> values;

    explicit blocks(int n) {
        for (int i = 0; i < n; ++i) {
            const std::vector<token_t> t{i, i + 1, i + 2, i + 3};
            const block_id id{.key = static_cast<uint64_t>(i),
                              .hash = block_chain_hash(i, t),
                              .parent_hash = static_cast<uint64_t>(i),
                              .depth = 0};
            std::vector<uint8_t> rows(layout.row_bytes(), static_cast<uint8_t>(i));
            values.push_back(encode_block(layout, id, t, rows));
            keys.push_back(block_key(layout.fingerprint(), id.key, id.hash));
        }
    }
    std::vector<block_put> puts(size_t from, size_t to) const {
        std::vector<block_put> out;
        for (size_t i = from; i < to; ++i) out.push_back({keys[i], values[i]});
        return out;
    }
};

struct temp_dir {
    fs::path path;
    temp_dir() {
        path = fs::temp_directory_path() / fmt::format("kvc-disk-store-{}-{}", ::getpid(), counter()++);
        fs::remove_all(path);
    }
    ~temp_dir() { fs::remove_all(path); }
    temp_dir(const temp_dir&) = delete;
    temp_dir& operator=(const temp_dir&) = delete;
    static int& counter() {
        static int n = 0;
        return n;
    }
    std::vector<std::string> files() const {
        std::vector<std::string> out;
        if (fs::exists(path))
            for (const auto& e : fs::directory_iterator(path)) out.push_back(e.path().filename().string());
        std::sort(out.begin(), out.end());
        return out;
    }
};

disk_store_params params_for(const temp_dir& d, const blocks& b, uint64_t max_bytes = 0) {
    return {.dir = d.path.string(), .max_bytes = max_bytes, .check = block_value_check(b.layout)};
}

// -- fault injection: the Nth call fails with `err`, or (crash) every call from the Nth on fails --
struct injector {
    const file_ops* sys = nullptr;
    uint64_t calls = 0, at = 0;
    int err = EIO;
    bool crash = false, injected = false;
};
injector inj;

bool refuse() {
    ++inj.calls;
    if (inj.at == 0 || inj.calls < inj.at || (!inj.crash && inj.calls > inj.at)) return false;
    inj.injected = true;
    errno = inj.err;
    return true;
}

const file_ops injecting{
    .open = [](const char* p, int f, mode_t m) { return refuse() ? -1 : inj.sys->open(p, f, m); },
    .read = [](int fd, void* d, size_t n) -> ssize_t { return refuse() ? -1 : inj.sys->read(fd, d, n); },
    .write = [](int fd, const void* s, size_t n) -> ssize_t {
        return refuse() ? -1 : inj.sys->write(fd, s, n);
    },
    .pwrite = [](int fd, const void* s, size_t n, off_t o) -> ssize_t {
        return refuse() ? -1 : inj.sys->pwrite(fd, s, n, o);
    },
    .fstat = [](int fd, struct stat* st) { return refuse() ? -1 : inj.sys->fstat(fd, st); },
    .fsync = [](int fd) { return refuse() ? -1 : inj.sys->fsync(fd); },
    .close =
        [](int fd) {
            const bool failed = refuse();
            inj.sys->close(fd);  // a failed close still closes
            return failed ? -1 : 0;
        },
    .rename = [](const char* a, const char* b) { return refuse() ? -1 : inj.sys->rename(a, b); },
    .unlink = [](const char* p) { return refuse() ? -1 : inj.sys->unlink(p); },
    .opendir = [](const char* p) { return refuse() ? nullptr : inj.sys->opendir(p); },
    .readdir = [](DIR* d) { return inj.sys->readdir(d); },
    .closedir = [](DIR* d) { return inj.sys->closedir(d); },
    .kill = [](pid_t pid, int sig) { return inj.sys->kill(pid, sig); },
};

struct injection {
    injection(uint64_t at, int err, bool crash) {
        inj = {.sys = &detail::system_file_ops(), .calls = 0, .at = at, .err = err, .crash = crash};
        file_io = injecting;
    }
    ~injection() { file_io = detail::system_file_ops(); }
    injection(const injection&) = delete;
    injection& operator=(const injection&) = delete;
};

// Every file of the directory named like a key holds a verified value of that key.
void expect_whole(const temp_dir& d, const blocks& b) {
    const auto check = block_value_check(b.layout);
    for (const std::string& f : d.files()) {
        if (f.find(".tmp-") != std::string::npos) continue;
        std::ifstream in(d.path / f, std::ios::binary);
        const std::vector<uint8_t> v{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
        EXPECT_TRUE(check(f, v)) << f;
    }
}

TEST(disk_store, round_trip_and_restart) {
    const temp_dir d;
    const blocks b(3);
    {
        disk_block_store s(params_for(d, b));
        EXPECT_EQ(s.describe(), "disk:" + d.path.string());
        s.put_many(b.puts(0, 2));
        const auto got = s.get_many(std::vector{b.keys[0], b.keys[2], b.keys[1]});
        EXPECT_EQ(got[0], b.values[0]);
        EXPECT_TRUE(got[1].empty());
        EXPECT_EQ(got[2], b.values[1]);
        EXPECT_EQ(s.contains_many(b.keys), (std::vector<uint8_t>{1, 1, 0}));
        s.put_many(b.puts(0, 1));  // present already: not written again
        const block_store_stats st = s.stats();
        EXPECT_EQ(st.lookups, 3u);
        EXPECT_EQ(st.hits, 2u);
        EXPECT_EQ(st.puts, 2u);
        EXPECT_EQ(st.skipped, 1u);
        EXPECT_EQ(st.bytes_out, b.values[0].size() + b.values[1].size());
        EXPECT_EQ(st.bytes_in, st.bytes_out);
        EXPECT_EQ(st.errors, 0u);
        EXPECT_EQ(st.calls, 4u);
        EXPECT_GT(st.latency_ns, 0u);
    }
    EXPECT_EQ(d.files().size(), 2u);  // no temporaries left
    disk_block_store s(params_for(d, b));
    EXPECT_EQ(s.entries(), 2u);
    EXPECT_EQ(s.bytes(), b.values[0].size() + b.values[1].size());
    EXPECT_EQ(s.get_many(std::vector{b.keys[1]})[0], b.values[1]);
}

TEST(disk_store, lru_budget_survives_a_restart) {
    const temp_dir d;
    const blocks b(6);
    const uint64_t size = b.values[0].size();
    const auto pause = [] { std::this_thread::sleep_for(std::chrono::milliseconds(15)); };  // file times
    {
        disk_block_store s(params_for(d, b, 3 * size));
        for (int i = 0; i < 3; ++i) {
            s.put_many(b.puts(i, i + 1));
            pause();
        }
        ASSERT_EQ(s.get_many(std::vector{b.keys[0]})[0], b.values[0]);  // 0 is now the most recent
        pause();
        s.put_many(b.puts(3, 4));  // evicts 1, the least recently used
        EXPECT_EQ(s.contains_many(b.keys), (std::vector<uint8_t>{1, 0, 1, 1, 0, 0}));
        EXPECT_EQ(s.bytes(), 3 * size);
        EXPECT_EQ(s.stats().evictions, 1u);
        EXPECT_EQ(d.files().size(), 3u);
    }
    pause();
    disk_block_store s(params_for(d, b, 3 * size));  // the order comes back from the files' times
    s.put_many(b.puts(4, 5));                        // evicts 2: written before 0 was last read
    EXPECT_EQ(s.contains_many(b.keys), (std::vector<uint8_t>{1, 0, 0, 1, 1, 0}));
    // a smaller budget at open evicts the oldest at once
    disk_block_store smaller(params_for(d, b, size));
    EXPECT_EQ(smaller.contains_many(b.keys), (std::vector<uint8_t>{0, 0, 0, 0, 1, 0}));
    // a value larger than the whole budget is not stored
    disk_block_store tiny(params_for(d, b, size - 1));
    tiny.put_many(b.puts(5, 6));
    EXPECT_EQ(tiny.stats().skipped, 1u);
    EXPECT_EQ(tiny.entries(), 0u);
}

TEST(disk_store, damaged_files_are_misses_and_removed) {
    const temp_dir d;
    const blocks b(3);
    disk_block_store s(params_for(d, b));
    s.put_many(b.puts(0, 3));
    {  // a flipped byte, same size
        std::fstream f(d.path / b.keys[0], std::ios::binary | std::ios::in | std::ios::out);
        f.seekp(100);
        f.put('\x55');
    }
    fs::resize_file(d.path / b.keys[1], 10);  // truncated behind the store's back
    // another block's value under this key (foreign)
    fs::copy_file(d.path / b.keys[0], d.path / b.keys[2], fs::copy_options::overwrite_existing);
    const auto got = s.get_many(b.keys);
    for (const auto& v : got) EXPECT_TRUE(v.empty());
    EXPECT_EQ(s.stats().damaged, 3u);
    EXPECT_EQ(s.stats().errors, 0u);
    EXPECT_EQ(s.entries(), 0u);
    EXPECT_TRUE(d.files().empty());
}

TEST(disk_store, keys_must_be_file_names) {
    const temp_dir d;
    const blocks b(1);
    disk_block_store s(params_for(d, b));
    for (const std::string& bad :
         std::vector<std::string>{"", "../x", "a/b", ".hidden", "x.tmp-1-2", std::string(201, 'a')})
        EXPECT_THROW((void)s.get_many(std::vector{bad}), error) << bad;
    const std::vector<uint8_t> none;
    EXPECT_THROW(s.put_many(std::vector{block_put{b.keys[0], none}}), error);
}

TEST(disk_store, stale_temporaries_are_removed_at_open) {
    const temp_dir d;
    const blocks b(1);
    fs::create_directories(d.path);
    const pid_t child = ::fork();
    if (child == 0) ::_exit(0);
    ::waitpid(child, nullptr, 0);  // a PID that no longer exists
    const std::string dead = fmt::format("{}.tmp-{}-0000abcd", b.keys[0], child);
    const std::string live = fmt::format("{}.tmp-{}-0000abcd", b.keys[0], ::getpid());
    std::ofstream(d.path / dead) << "half";
    std::ofstream(d.path / live) << "half";
    disk_block_store s(params_for(d, b));
    EXPECT_EQ(d.files(), std::vector<std::string>{live});  // a live writer's is left alone, and not indexed
    EXPECT_EQ(s.entries(), 0u);
}

// Every call of a put_many of two values fails in turn (EIO, then ENOSPC), or the process "crashes" there:
// nothing is thrown, the failure is counted, the store's own view stays right, and a reopened store finds
// only whole values.
TEST(disk_store, faults_at_every_call_of_a_put) {
    const blocks b(3);
    uint64_t total = 0;
    {  // the number of calls of a fault-free put_many
        const temp_dir d;
        disk_block_store s(params_for(d, b));
        s.put_many(b.puts(0, 1));
        const injection count(0, 0, false);
        s.put_many(b.puts(1, 3));
        total = inj.calls;
    }
    ASSERT_GE(total,
              12u);  // per value open, write, fsync, close, rename; then the directory's open, fsync, close
    uint64_t faults = 0;
    set_log_callback([](log_level, const char*, void*) {});  // one warning per store: not wanted here
    for (const bool crash : {false, true})
        for (const int err : {EIO, ENOSPC})
            for (uint64_t at = 1; at <= total; ++at) {
                SCOPED_TRACE(
                    fmt::format("call {} of {}: {} {}", at, total, crash ? "crash" : "fail", strerror(err)));
                const temp_dir d;
                {
                    disk_block_store s(params_for(d, b));
                    s.put_many(b.puts(0, 1));
                    const injection fault(at, err, crash);
                    ASSERT_NO_THROW(s.put_many(b.puts(1, 3)));
                    ASSERT_TRUE(inj.injected);
                    ++faults;
                    if (at < total)  // the last call closes the synced directory: nothing to report
                        EXPECT_GE(s.stats().errors, 1u);
                    else
                        EXPECT_EQ(s.stats().errors, 0u);
                    // what the store believes it holds is there and whole, unless it crashed
                    if (!crash) {
                        const auto has = s.contains_many(b.keys);
                        const auto got = s.get_many(b.keys);
                        for (size_t i = 0; i < 3; ++i) {
                            if (has[i]) {
                                EXPECT_EQ(got[i], b.values[i]) << i;
                            }
                        }
                        EXPECT_EQ(got[0], b.values[0]);
                    }
                }
                expect_whole(d, b);
                disk_block_store again(params_for(d, b));
                const auto got = again.get_many(b.keys);
                EXPECT_EQ(got[0], b.values[0]);
                for (size_t i = 1; i < 3; ++i)
                    if (!got[i].empty()) {
                        EXPECT_EQ(got[i], b.values[i]);
                    }
                EXPECT_EQ(again.stats().damaged, 0u);
                if (!crash) {  // a failed write leaves no temporary behind
                    for (const std::string& f : d.files()) EXPECT_EQ(f.find(".tmp-"), std::string::npos) << f;
                }
            }
    set_log_callback(nullptr);
    EXPECT_EQ(faults, 4 * total);
}

// A full disk: every put fails, nothing is thrown, the error is counted per value and logged once.
TEST(disk_store, full_disk_is_counted_and_logged_once) {
    static std::vector<std::string> logged;
    logged.clear();
    set_log_callback([](log_level, const char* m, void*) { logged.emplace_back(m); });
    const temp_dir d;
    const blocks b(5);
    {
        disk_block_store s(params_for(d, b));
        inj = {.sys = &detail::system_file_ops()};
        file_io = injecting;
        file_io.write = [](int, const void*, size_t) -> ssize_t {
            errno = ENOSPC;
            return -1;
        };
        for (size_t i = 0; i < 4; ++i) s.put_many(b.puts(i, i + 1));
        file_io = detail::system_file_ops();
        EXPECT_EQ(s.stats().errors, 4u);
        EXPECT_EQ(s.stats().puts, 0u);
        EXPECT_EQ(s.entries(), 0u);
        s.put_many(b.puts(4, 5));  // space again
        EXPECT_EQ(s.stats().puts, 1u);
    }
    set_log_callback(nullptr);
    ASSERT_EQ(logged.size(), 1u);
    EXPECT_NE(logged[0].find("No space left on device (the disk is full"), std::string::npos) << logged[0];
    EXPECT_EQ(d.files().size(), 1u);
    // asked to, the store throws instead
    disk_store_params p = params_for(d, b);
    p.throw_errors = true;
    disk_block_store s(p);
    file_io.write = [](int, const void*, size_t) -> ssize_t {
        errno = ENOSPC;
        return -1;
    };
    try {
        s.put_many(b.puts(0, 1));
        ADD_FAILURE() << "no throw";
    } catch (const error& e) {
        EXPECT_EQ(e.code(), errc::io);
        EXPECT_NE(std::string(e.what()).find("the disk is full"), std::string::npos);
    }
    file_io = detail::system_file_ops();
}

}  // namespace
}  // namespace kvc
