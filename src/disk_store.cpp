#include <kvcache/disk_store.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>
#include <system_error>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "detail/file_ops.h"

namespace kvc {

using detail::file_io;

namespace {

constexpr std::string_view tmp_marker = ".tmp-";

// Keys become file names: a conservative alphabet, no leading dot, short enough for NAME_MAX with the
// temporary's suffix.
void check_key(std::string_view key) {
    const bool ok = !key.empty() && key.size() <= 200 && key[0] != '.' &&
                    std::all_of(key.begin(), key.end(),
                                [](char c) {
                                    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                                           (c >= '0' && c <= '9') || c == '-' || c == '_' || c == '.';
                                }) &&
                    key.find(tmp_marker) == std::string_view::npos;
    if (!ok)
        throw error(errc::invalid_argument,
                    fmt::format("disk store: key '{}' is not a file name of 1-200 characters [A-Za-z0-9._-] "
                                "without a leading dot or '.tmp-'",
                                key));
}

// A temporary of a writer that is gone: NAME.tmp-PID-XXXXXXXX whose PID does not exist.
bool is_stale_temp(std::string_view f) {
    const size_t at = f.find(tmp_marker);
    if (at == std::string_view::npos) return false;
    const std::string_view rest = f.substr(at + tmp_marker.size());
    const size_t dash = rest.find('-');
    if (dash == std::string_view::npos || dash == 0 || dash > 10) return false;
    long long pid = 0;
    for (const char c : rest.substr(0, dash)) {
        if (c < '0' || c > '9') return false;
        pid = pid * 10 + (c - '0');
    }
    if (pid <= 0 || pid == ::getpid() || pid > std::numeric_limits<pid_t>::max()) return false;
    return file_io.kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

}  // namespace

disk_block_store::disk_block_store(disk_store_params params) : p_(std::move(params)) {
    if (p_.dir.empty()) throw error(errc::invalid_argument, "disk store: no directory given");
    std::error_code ec;
    std::filesystem::create_directories(p_.dir, ec);
    if (ec)
        throw error(errc::io,
                    fmt::format("disk store: cannot create directory '{}': {}", p_.dir, ec.message()));
    DIR* d = file_io.opendir(p_.dir.c_str());
    if (!d)
        throw error(errc::io, fmt::format("disk store: cannot list '{}': {}", p_.dir, std::strerror(errno)));
    std::vector<std::string> names, stale;
    while (const struct dirent* e = file_io.readdir(d)) {
        const std::string f = e->d_name;
        if (f == "." || f == "..") continue;
        if (f.find(tmp_marker) != std::string::npos) {
            if (is_stale_temp(f)) stale.push_back(f);
            continue;
        }
        names.push_back(f);
    }
    file_io.closedir(d);
    for (const std::string& f : stale) file_io.unlink((p_.dir + "/" + f).c_str());  // best effort
    // size and age of each file; one that cannot be read now is left out (and left alone)
    struct found {
        std::string name;
        uint64_t size;
        struct timespec mtime;
    };
    std::vector<found> files;
    for (std::string& f : names) {
        const int fd = file_io.open((p_.dir + "/" + f).c_str(), O_RDONLY | O_CLOEXEC, 0);
        if (fd < 0) continue;
        struct stat st {};
        const bool ok = file_io.fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
        file_io.close(fd);
        if (ok) files.push_back({std::move(f), static_cast<uint64_t>(st.st_size), st.st_mtim});
    }
    std::sort(files.begin(), files.end(), [](const found& a, const found& b) {
        return std::pair(a.mtime.tv_sec, a.mtime.tv_nsec) < std::pair(b.mtime.tv_sec, b.mtime.tv_nsec);
    });
    for (found& f : files) {
        lru_.push_back(f.name);
        files_[std::move(f.name)] = {.size = f.size, .lru = std::prev(lru_.end())};
        bytes_ += f.size;
    }
    if (p_.max_bytes) evict_for(0);
}

disk_block_store::~disk_block_store() = default;

std::string disk_block_store::describe() const {
    return "disk:" + p_.dir;
}

uint64_t disk_block_store::bytes() const {
    const std::lock_guard lock(mu_);
    return bytes_;
}

uint64_t disk_block_store::entries() const {
    const std::lock_guard lock(mu_);
    return files_.size();
}

block_store_stats disk_block_store::stats() const {
    const std::lock_guard lock(mu_);
    return stats_;
}

void disk_block_store::fail(const std::string& what, int err) {
    ++stats_.errors;
    const bool full = err == ENOSPC || err == EDQUOT;
    bool& logged = full ? logged_full_ : (what.rfind("cannot read", 0) == 0 ? logged_read_ : logged_write_);
    const std::string msg =
        fmt::format("disk store '{}': {}: {}{}", p_.dir, what, std::strerror(err),
                    full ? " (the disk is full: blocks are not kept until space frees)" : "");
    if (p_.throw_errors) throw error(errc::io, msg);
    if (!logged) {
        logged = true;
        log(log_level::warn, msg + " (further errors of this kind are only counted)");
    }
}

void disk_block_store::forget(const std::string& name, bool unlink_file) {
    const auto it = files_.find(name);
    if (it == files_.end()) return;
    bytes_ -= it->second.size;
    lru_.erase(it->second.lru);
    files_.erase(it);
    if (unlink_file) file_io.unlink((p_.dir + "/" + name).c_str());
}

bool disk_block_store::evict_for(uint64_t need) {
    if (!p_.max_bytes) return true;
    if (need > p_.max_bytes) return false;
    while (bytes_ + need > p_.max_bytes && !lru_.empty()) {
        const std::string victim = lru_.front();
        forget(victim, true);
        ++stats_.evictions;
    }
    return true;
}

bool disk_block_store::read_one(const std::string& name, int fd, uint64_t size) {
    struct stat st {};
    int err = 0;
    bool damaged = false;
    if (file_io.fstat(fd, &st) != 0) {
        err = errno;
    } else if (static_cast<uint64_t>(st.st_size) != size || size > p_.max_value_bytes || size == 0) {
        damaged = true;  // changed behind the store's back, or larger than allowed: not read at all
    } else {
        if (buf_.size() < size) buf_.resize(size);  // bounded by the file's size and max_value_bytes
        size_t got = 0;
        while (got < size) {
            const ssize_t r = file_io.read(fd, buf_.data() + got, size - got);
            if (r < 0 && errno == EINTR) continue;
            if (r < 0) {
                err = errno;
                break;
            }
            if (r == 0) {
                damaged = true;  // shorter than it said
                break;
            }
            got += static_cast<size_t>(r);
        }
        if (!err && !damaged) ::futimens(fd, nullptr);  // its age for the LRU order after a restart
    }
    file_io.close(fd);
    if (err) {
        forget(name, false);
        fail(fmt::format("cannot read '{}'", name), err);
        return false;
    }
    if (damaged || (p_.check && !p_.check(name, std::span<const uint8_t>(buf_.data(), size)))) {
        ++stats_.damaged;
        forget(name, true);
        return false;
    }
    return true;
}

size_t disk_block_store::read_many(std::span<const std::string> keys, const block_value_fn& on_value) {
    const std::lock_guard lock(mu_);
    const block_store_call_timer timer(stats_);
    for (const std::string& k : keys) check_key(k);
    stats_.lookups += keys.size();
    size_t found = 0;
    // In waves: open every file of the wave and ask the kernel to read them all ahead (their reads overlap
    // on the disk), then read them in order.
    constexpr size_t wave = 64;
    struct open_files {  // closes what a wave left open when a callback or an error throws
        std::vector<int> fds;
        open_files() = default;
        ~open_files() {
            for (const int fd : fds)
                if (fd >= 0) file_io.close(fd);
        }
        open_files(const open_files&) = delete;
        open_files& operator=(const open_files&) = delete;
    } open;
    std::vector<int>& fds = open.fds;
    for (size_t w = 0; w < keys.size(); w += wave) {
        const size_t end = std::min(keys.size(), w + wave);
        fds.assign(end - w, -1);
        for (size_t i = w; i < end; ++i) {
            const auto it = files_.find(keys[i]);
            if (it == files_.end()) continue;
            const int fd = file_io.open((p_.dir + "/" + keys[i]).c_str(), O_RDONLY | O_CLOEXEC, 0);
            if (fd < 0) {
                const int err = errno;
                forget(keys[i], false);
                if (err != ENOENT)
                    fail(fmt::format("cannot read '{}'", keys[i]), err);  // gone meanwhile: a miss
                continue;
            }
            ::posix_fadvise(fd, 0, static_cast<off_t>(it->second.size), POSIX_FADV_WILLNEED);
            fds[i - w] = fd;
        }
        for (size_t i = w; i < end; ++i) {
            const int fd = fds[i - w];
            if (fd < 0) continue;
            fds[i - w] = -1;
            const auto it = files_.find(keys[i]);
            if (it == files_.end()) {  // the same key earlier in the wave was refused
                file_io.close(fd);
                continue;
            }
            const uint64_t size = it->second.size;
            if (!read_one(keys[i], fd, size)) continue;
            lru_.splice(lru_.end(), lru_, it->second.lru);  // most recently used
            ++stats_.hits;
            stats_.bytes_in += size;
            ++found;
            on_value(i, std::span<const uint8_t>(buf_.data(), size));
        }
    }
    return found;
}

std::vector<uint8_t> disk_block_store::contains_many(std::span<const std::string> keys) {
    const std::lock_guard lock(mu_);
    const block_store_call_timer timer(stats_);
    std::vector<uint8_t> out(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
        check_key(keys[i]);
        out[i] = files_.count(keys[i]) ? 1 : 0;
    }
    return out;
}

bool disk_block_store::write_one(const std::string& name, std::span<const uint8_t> value) {
    const std::string path = p_.dir + "/" + name;
    static thread_local std::mt19937 rng{std::random_device{}()};
    const std::string tmp =
        fmt::format("{}{}{}-{:08x}", path, tmp_marker, ::getpid(), static_cast<uint32_t>(rng()));
    const int fd = file_io.open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        fail(fmt::format("cannot create '{}'", tmp), errno);
        return false;
    }
    int err = 0;
    const char* what = "cannot write";
    size_t done = 0;
    while (done < value.size()) {
        const ssize_t w = file_io.write(fd, value.data() + done, value.size() - done);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            err = w < 0 ? errno : EIO;
            break;
        }
        done += static_cast<size_t>(w);
    }
    if (!err && file_io.fsync(fd) != 0) {
        err = errno;
        what = "cannot sync";
    }
    if (file_io.close(fd) != 0 && !err) {
        err = errno;
        what = "cannot close";
    }
    if (!err && file_io.rename(tmp.c_str(), path.c_str()) != 0) {
        err = errno;
        what = "cannot rename into place";
    }
    if (err) {
        file_io.unlink(tmp.c_str());
        fail(fmt::format("{} '{}'", what, tmp), err);
        return false;
    }
    return true;
}

void disk_block_store::put_many(std::span<const block_put> items) {
    const std::lock_guard lock(mu_);
    const block_store_call_timer timer(stats_);
    for (const block_put& it : items) {
        check_key(it.key);
        if (it.value.empty())
            throw error(errc::invalid_argument, fmt::format("disk store: empty value for '{}'", it.key));
    }
    bool wrote = false;
    for (const block_put& it : items) {
        const std::string name(it.key);
        if (files_.count(name) || it.value.size() > p_.max_value_bytes || !evict_for(it.value.size())) {
            ++stats_.skipped;  // present already, or larger than a value or the whole budget may be
            continue;
        }
        if (!write_one(name, it.value)) continue;
        wrote = true;
        lru_.push_back(name);
        files_[name] = {.size = it.value.size(), .lru = std::prev(lru_.end())};
        bytes_ += it.value.size();
        ++stats_.puts;
        stats_.bytes_out += it.value.size();
    }
    if (!wrote) return;
    // the renames reach the disk with the directory: once per call (EINVAL: a file system that cannot
    // sync a directory has nothing more to do)
    const int dfd = file_io.open(p_.dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0);
    if (dfd < 0) {
        fail("cannot open the directory to sync it", errno);
        return;
    }
    const int synced = file_io.fsync(dfd);
    const int err = errno;
    file_io.close(dfd);
    if (synced != 0 && err != EINVAL)
        fail("cannot sync the directory (the new files may not survive a power loss)", err);
}

}  // namespace kvc
