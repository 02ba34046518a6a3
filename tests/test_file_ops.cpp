// I/O fault injection for session files, in the spirit of SQLite's I/O error and crash tests: the table of
// POSIX calls (src/detail/file_ops.h) is swapped for one that counts calls and, at the Nth, fails it,
// shortens it, or "crashes" there: the save goes on in the process, but nothing it does reaches the disk any
// more (as if the process had died). A power loss also loses what was written and not synced, and renames
// whose directory was not synced. For every N over a whole save and a whole load: the target loads intact as
// the previous version or as the new one, never anything else; a failed save or load says what failed and
// the memory is unchanged.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <kvcache/kv_cache.h>
#include <kvcache/session.h>
#include <kvcache/state.h>

#include "detail/file_ops.h"
#include "state_test_util.h"

namespace kvc {
namespace {

using namespace kvc::test;
namespace fs = std::filesystem;
using detail::file_io;
using detail::file_ops;

enum class fault {
    none,
    fail,        // the call fails with EIO (a close still closes)
    short_io,    // a read or write moves half the bytes (legal: callers must loop)
    crash,       // from this call on nothing reaches the disk (the process died here)
    power_loss,  // a crash that also loses unsynced writes and renames of unsynced directories
};

const char* name(fault f) {
    switch (f) {
        case fault::none:
            return "none";
        case fault::fail:
            return "fail";
        case fault::short_io:
            return "short";
        case fault::crash:
            return "crash";
        case fault::power_loss:
            return "power loss";
    }
    return "?";
}

std::vector<uint8_t> bytes_of(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

void put_bytes(const std::string& path, const std::vector<uint8_t>& b) {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

// The injector's state: file_ops entries are plain function pointers, so it lives at namespace scope.
struct injector_state {
    const file_ops* sys = nullptr;
    uint64_t calls = 0;
    uint64_t at = 0;  // 1-based call to fault; 0: none
    fault kind = fault::none;
    bool crashed = false;
    bool injected = false;  // the fault at `at` happened (short_io only hits reads and writes)
    // what a power loss can take back
    std::map<int, std::string> fd_path;  // open descriptors
    std::set<int> dir_fds;               // ... of directories
    std::set<std::string> dirty;         // files written since their last fsync
    struct rename_record {
        std::string to;
        std::optional<std::vector<uint8_t>> old;  // what `to` held before (none: it did not exist)
    };
    std::vector<rename_record> unsynced_renames;  // since the last directory fsync
};
injector_state g;

// Counts the call; true when this one is to fail. After a crash every call is refused.
bool hit() {
    return ++g.calls == g.at && g.kind != fault::none;
}

void lose_unsynced() {  // the power goes: unsynced data and renames may be lost; here they are
    for (const std::string& p : g.dirty)
        if (fs::exists(p)) fs::resize_file(p, fs::file_size(p) / 2);
    for (auto it = g.unsynced_renames.rbegin(); it != g.unsynced_renames.rend(); ++it) {
        if (it->old)
            put_bytes(it->to, *it->old);
        else
            fs::remove(it->to);
    }
}

// Applies the fault of this call when it is one: returns true when the call must not happen (errno set).
bool refuse(bool is_io) {
    if (g.crashed) {
        errno = EIO;
        return true;
    }
    if (!hit()) return false;
    switch (g.kind) {
        case fault::fail:
            g.injected = true;
            errno = EIO;
            return true;
        case fault::crash:
        case fault::power_loss:
            g.injected = true;
            g.crashed = true;
            if (g.kind == fault::power_loss) lose_unsynced();
            errno = EIO;
            return true;
        case fault::short_io:
            g.injected = is_io;
            return false;
        case fault::none:
            break;
    }
    return false;
}

// A read or write that moves fewer bytes than asked for, when this call is the short one.
size_t io_size(size_t n) {
    return g.kind == fault::short_io && g.calls == g.at && n > 1 ? n / 2 : n;
}

const file_ops injecting{.open =
                             [](const char* path, int flags, mode_t mode) {
                                 if (refuse(false)) return -1;
                                 const int fd = g.sys->open(path, flags, mode);
                                 if (fd >= 0) {
                                     g.fd_path[fd] = path;
                                     if (flags & O_DIRECTORY) g.dir_fds.insert(fd);
                                     if (flags & (O_WRONLY | O_RDWR)) g.dirty.insert(path);
                                 }
                                 return fd;
                             },
                         .read = [](int fd, void* dst, size_t n) -> ssize_t {
                             if (refuse(true)) return -1;
                             return g.sys->read(fd, dst, io_size(n));
                         },
                         .write = [](int fd, const void* src, size_t n) -> ssize_t {
                             if (refuse(true)) return -1;
                             g.dirty.insert(g.fd_path[fd]);
                             return g.sys->write(fd, src, io_size(n));
                         },
                         .pwrite = [](int fd, const void* src, size_t n, off_t offset) -> ssize_t {
                             if (refuse(true)) return -1;
                             g.dirty.insert(g.fd_path[fd]);
                             return g.sys->pwrite(fd, src, io_size(n), offset);
                         },
                         .fstat =
                             [](int fd, struct stat* st) {
                                 if (refuse(false)) return -1;
                                 return g.sys->fstat(fd, st);
                             },
                         .fsync =
                             [](int fd) {
                                 if (refuse(false)) return -1;
                                 const int r = g.sys->fsync(fd);
                                 if (r == 0 && g.dir_fds.count(fd))
                                     g.unsynced_renames.clear();  // one directory in these tests
                                 else if (r == 0)
                                     g.dirty.erase(g.fd_path[fd]);
                                 return r;
                             },
                         .close =
                             [](int fd) {
                                 // a dead process's descriptors are closed too (closing changes nothing on
                                 // disk)
                                 const bool failed = refuse(false) && !g.crashed;
                                 g.fd_path.erase(fd);
                                 g.dir_fds.erase(fd);
                                 const int r = g.sys->close(fd);
                                 if (failed) errno = EIO;
                                 return failed ? -1 : r;
                             },
                         .rename =
                             [](const char* from, const char* to) {
                                 if (refuse(false)) return -1;
                                 injector_state::rename_record rec{to, std::nullopt};
                                 if (fs::exists(to)) rec.old = bytes_of(to);
                                 const int r = g.sys->rename(from, to);
                                 if (r == 0) {
                                     g.unsynced_renames.push_back(std::move(rec));
                                     if (g.dirty.erase(from)) g.dirty.insert(to);
                                     for (auto& [fd, p] : g.fd_path)
                                         if (p == from) p = to;
                                 }
                                 return r;
                             },
                         .unlink =
                             [](const char* path) {
                                 if (refuse(false)) return -1;
                                 g.dirty.erase(path);
                                 return g.sys->unlink(path);
                             },
                         .opendir = [](const char* path) -> DIR* {
                             if (refuse(false)) return nullptr;
                             return g.sys->opendir(path);
                         },
                         .readdir = [](DIR * d) -> struct dirent* {if (refuse(false)) return nullptr;
return g.sys->readdir(d);
}  // namespace
,
    .closedir =
        [](DIR* d) {
            const bool failed = refuse(false) && !g.crashed;  // closed anyway, as close
            const int r = g.sys->closedir(d);
            if (failed) errno = EIO;
            return failed ? -1 : r;
        },
    .kill = [](pid_t pid, int sig) {
        if (refuse(false)) return -1;  // EIO: the PID's state unknown
        return g.sys->kill(pid, sig);
    },
};  // namespace kvc

// Swaps the table in for its lifetime, with one fault (or none: counting) at call `at`.
class injection {
public:
    injection(fault kind, uint64_t at) {
        g = injector_state{};
        g.sys = &detail::system_file_ops();
        g.kind = kind;
        g.at = at;
        file_io = injecting;
    }
    ~injection() { file_io = detail::system_file_ops(); }
    injection(const injection&) = delete;
    injection& operator=(const injection&) = delete;
    uint64_t calls() const { return g.calls; }
    bool injected() const { return g.injected; }
};

class file_ops_faults : public ::testing::Test {
protected:
    void SetUp() override {
        dir_ = fs::temp_directory_path() /
               fmt::format("kvc-faults-{}-{}", ::getpid(),
                           ::testing::UnitTest::GetInstance()->current_test_info()->name());
        fs::remove_all(dir_);
        fs::create_directories(dir_);
    }
    void TearDown() override { fs::remove_all(dir_); }
    std::string path(const char* name) const { return (dir_ / name).string(); }
    // Temporary files beside the target (a crash may leave its own; a failed save must not).
    size_t remove_temporaries() const {
        size_t n = 0;
        for (const auto& e : fs::directory_iterator(dir_))
            if (e.path().filename().string().find(".tmp-") != std::string::npos) n += fs::remove(e.path());
        return n;
    }
    fs::path dir_;
};

// A cache whose rows of a sequence's state exceed the writer's 1 MiB buffer, so a save makes several
// write calls, and a small one.
kv_cache_params big_params() {
    kv_cache_params p;
    p.layers = {layer_desc{.n_head_kv = 8, .n_embd_head_k = 128, .n_embd_head_v = 128}};
    p.type_k = dtype::f32;
    p.type_v = dtype::f16;
    p.kv_size = 512;
    p.n_seq_max = 2;
    return p;
}

// One kind of file: how to save version `v` of the memory and load it back.
struct file_kind {
    std::string name;
    std::function<void(const kv_cache&, const std::string&)> save;
    std::function<void(kv_cache&, const std::string&)> load;  // into seq 1
};

std::vector<file_kind> kinds() {
    const std::vector<token_t> tokens = {1, 2, 3};
    return {
        {"session",
         [=](const kv_cache& c, const std::string& p) {
             session_save_options o;
             o.tokens = tokens;
             save_file(c, p, 0, o);
         },
         [](kv_cache& c, const std::string& p) { load_file(c, p, 1); }},
        {"session zstd",
         [](const kv_cache& c, const std::string& p) {
             session_save_options o;
             o.compress = true;
             save_file(c, p, 0, o);
         },
         [](kv_cache& c, const std::string& p) { load_file(c, p, 1); }},
        {"ggsq", [=](const kv_cache& c, const std::string& p) { save_llama_seq_file(c, p, 0, tokens); },
         [](kv_cache& c, const std::string& p) { (void)load_llama_seq_file(c, p, 1); }},
    };
}

// The state of seq 1 of a fresh cache that loaded `file`, or nothing when it does not load.
std::optional<std::vector<uint8_t>> loaded(const file_kind& k, const std::string& file) {
    kv_cache c(big_params());
    try {
        k.load(c, file);
    } catch (const error&) {
        return std::nullopt;
    }
    return state_seq_get_data(c, 1);
}

// A save's error names the file and what the system refused.
void expect_io_error(const error& e, const std::string& target, const std::string& where) {
    EXPECT_EQ(e.code(), errc::io) << where << ": " << e.what();
    const std::string m = e.what();
    EXPECT_NE(m.find(target), std::string::npos) << where << ": " << m;
    EXPECT_NE(m.find("Input/output error"), std::string::npos) << where << ": " << m;
}

TEST_F(file_ops_faults, every_call_of_a_save_fails_or_crashes_in_turn_and_the_target_is_old_or_new) {
    std::mt19937 rng(1);
    kv_cache a(big_params());
    decode(a, 0, 0, 300, rng);
    uint64_t faults = 0;
    for (const file_kind& k : kinds()) {
        const std::string target = path("s");
        // the previous version, and the new one (more tokens)
        kv_cache old_mem(big_params());
        decode(old_mem, 0, 0, 150, rng);
        k.save(old_mem, target);
        const auto old_file = bytes_of(target);
        const auto old_state = loaded(k, target);
        k.save(a, target);
        const auto new_file = bytes_of(target);
        const auto new_state = loaded(k, target);
        ASSERT_TRUE(old_state && new_state && *old_state != *new_state) << k.name;

        uint64_t total = 0;
        {
            put_bytes(target, old_file);
            const injection counting(fault::none, 0);
            k.save(a, target);
            total = counting.calls();
        }
        ASSERT_GE(total, 10u) << k.name << ": open, writes, header, fsync, close, rename, directory sync";
        for (const fault f : {fault::fail, fault::short_io, fault::crash, fault::power_loss})
            for (uint64_t n = 1; n <= total; ++n) {
                const std::string where = fmt::format("{}: {} at call {} of {}", k.name, name(f), n, total);
                put_bytes(target, old_file);
                bool saved = false;
                bool injected = false;
                {
                    const injection inj(f, n);
                    try {
                        k.save(a, target);
                        saved = true;
                    } catch (const error& e) {
                        if (f == fault::fail) expect_io_error(e, target, where);
                        EXPECT_NE(f, fault::short_io) << where << ": a short write is no error: " << e.what();
                    }
                    injected = inj.injected();
                }
                if (!injected) continue;  // a short "read" of a call that moves no bytes
                ++faults;
                const auto file = bytes_of(target);
                ASSERT_TRUE(file == old_file || file == new_file) << where << ": a torn file";
                const auto state = loaded(k, target);
                ASSERT_TRUE(state.has_value()) << where << ": the target does not load";
                EXPECT_EQ(*state, file == old_file ? *old_state : *new_state) << where;
                if (saved) {
                    EXPECT_EQ(file, new_file) << where << ": a successful save left the old file";
                }
                if (f == fault::short_io) {
                    EXPECT_TRUE(saved && file == new_file) << where;
                }
                const size_t temps = remove_temporaries();
                if (f == fault::fail || f == fault::short_io) {
                    EXPECT_EQ(temps, 0u) << where << ": a failed save must remove its temporary file";
                }
            }
    }
    std::printf("injected I/O faults into saves: %llu\n", static_cast<unsigned long long>(faults));
    RecordProperty("injected_faults", static_cast<int>(faults));
    EXPECT_GT(faults, 100u);
}

// The cleanup of stale temporary files (issue 21) under the same faults: with a dead writer's temporary
// file of the target beside it, a live writer's and another target's, every call of a save (listing the
// directory, asking whether a PID lives, removing, then the save itself) fails or crashes in turn. The
// target is old or new, the other files are untouched, and the dead writer's file is removed or left,
// nothing else; a save that succeeds without a fault in its cleanup removes it.
TEST_F(file_ops_faults, the_stale_temporary_cleanup_under_every_fault) {
    std::mt19937 rng(3);
    kv_cache a(big_params()), old_mem(big_params());
    decode(a, 0, 0, 40, rng);
    decode(old_mem, 0, 0, 20, rng);
    const file_kind k = kinds()[0];
    const std::string target = path("s");
    k.save(old_mem, target);
    const auto old_file = bytes_of(target);
    k.save(a, target);
    const auto new_file = bytes_of(target);
    const std::string dead = target + fmt::format(".tmp-{}-0badc0de", 2147483646);  // no such process
    const std::string live = target + fmt::format(".tmp-{}-00c0ffee", ::getpid());  // a writer at work
    const std::string other = path("t") + fmt::format(".tmp-{}-0badc0de", 2147483646);
    const std::vector<uint8_t> junk = {1, 2, 3};
    const auto prepare = [&] {
        put_bytes(target, old_file);
        for (const std::string& p : {dead, live, other}) put_bytes(p, junk);
    };
    uint64_t total = 0;
    {
        prepare();
        const injection counting(fault::none, 0);
        k.save(a, target);
        total = counting.calls();
    }
    EXPECT_FALSE(fs::exists(dead)) << "a save removes a dead writer's temporary file";
    ASSERT_GE(total, 16u) << "opendir, readdir of each entry, kill, closedir, unlink, then the save";
    uint64_t faults = 0, left = 0;
    for (const fault f : {fault::fail, fault::crash, fault::power_loss})
        for (uint64_t n = 1; n <= total; ++n) {
            const std::string where = fmt::format("{} at call {} of {}", name(f), n, total);
            prepare();
            bool injected = false;
            {
                const injection inj(f, n);
                try {
                    k.save(a, target);
                } catch (const error& e) {
                    EXPECT_EQ(e.code(), errc::io) << where << ": " << e.what();
                }
                injected = inj.injected();
            }
            if (!injected) continue;
            ++faults;
            const auto file = bytes_of(target);
            EXPECT_TRUE(file == old_file || file == new_file) << where << ": a torn file";
            EXPECT_EQ(bytes_of(live), junk) << where << ": a live writer's file";
            EXPECT_EQ(bytes_of(other), junk) << where << ": another target's file";
            if (fs::exists(dead)) {
                EXPECT_EQ(bytes_of(dead), junk) << where;
                ++left;
            }
            for (const auto& e : fs::directory_iterator(dir_)) {  // nothing else: no temporary of this save
                const std::string p = e.path().string();
                if (p != target && p != dead && p != live && p != other && f == fault::fail)
                    ADD_FAILURE() << where << ": " << p << " left behind";
            }
            fs::remove(dead);
            remove_temporaries();
        }
    std::printf(
        "injected I/O faults into saves with stale temporary files: %llu (the dead writer's file left by "
        "%llu)\n",
        static_cast<unsigned long long>(faults), static_cast<unsigned long long>(left));
    EXPECT_EQ(faults, 3 * total);  // every call is reached in each mode: the calls before it are unchanged
}

TEST_F(file_ops_faults, every_call_of_a_load_fails_in_turn_and_the_memory_is_unchanged) {
    std::mt19937 rng(2);
    kv_cache a(big_params());
    decode(a, 0, 0, 300, rng);
    uint64_t faults = 0;
    for (const file_kind& k : kinds()) {
        const std::string file = path("s");
        k.save(a, file);
        const auto want = loaded(k, file);
        ASSERT_TRUE(want.has_value());
        kv_cache b(big_params());
        decode(b, 1, 0, 20, rng);  // seq 1 holds something the load would replace
        const auto before = state_seq_get_data(b, seq_all);
        uint64_t total = 0;
        {
            kv_cache c(big_params());
            const injection counting(fault::none, 0);
            k.load(c, file);
            total = counting.calls();
        }
        ASSERT_GE(total, 4u) << k.name << ": open, fstat, read, close";
        for (const fault f : {fault::fail, fault::short_io})
            for (uint64_t n = 1; n <= total; ++n) {
                const std::string where = fmt::format("{}: {} at call {} of {}", k.name, name(f), n, total);
                bool done = false;
                bool injected = false;
                {
                    const injection inj(f, n);
                    try {
                        k.load(b, file);
                        done = true;
                    } catch (const error& e) {
                        expect_io_error(e, file, where);
                    }
                    injected = inj.injected();
                }
                if (!injected) continue;
                ++faults;
                if (f == fault::short_io) {
                    EXPECT_TRUE(done) << where << ": a short read is no error";
                }
                if (done) {  // the last close failing changes nothing read
                    EXPECT_EQ(state_seq_get_data(b, 1), *want) << where;
                    state_seq_set_data(b, before, seq_all);  // back to the memory before the load
                } else {
                    ASSERT_EQ(state_seq_get_data(b, seq_all), before)
                        << where << ": a failed load changed it";
                }
            }
    }
    std::printf("injected I/O faults into loads: %llu\n", static_cast<unsigned long long>(faults));
    RecordProperty("injected_faults", static_cast<int>(faults));
    EXPECT_GE(faults, 12u);  // 4 calls of each of the 3 loads, failed; and the short reads
}

// Without a table swapped in, the core uses the system's calls.
TEST(file_ops, the_default_table_is_the_systems) {
    const file_ops& sys = detail::system_file_ops();
    EXPECT_EQ(file_io.read, sys.read);
    EXPECT_EQ(file_io.write, sys.write);
    EXPECT_EQ(file_io.fsync, sys.fsync);
    EXPECT_EQ(file_io.rename, sys.rename);
}

}  // namespace
}  // namespace kvc
