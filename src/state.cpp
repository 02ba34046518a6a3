#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <kvcache/limits.h>
#include <kvcache/state.h>

#include "detail/copy.h"
#include "detail/file_ops.h"

namespace kvc {

using detail::file_io;

namespace {

constexpr size_t file_buffer_size = size_t{1} << 20;

[[noreturn]] void io_fail(const char* what, const std::string& path) {
    throw error(errc::io, fmt::format("{} '{}': {}", what, path, std::strerror(errno)));
}

// Restores the payload data[start..], which must end with data. Error offsets count from data's start.
size_t restore_from(memory_i& mem, std::span<const uint8_t> data, size_t start, seq_id_t dest,
                    state_seq_flags flags) {
    io_span_reader r(data, true);
    std::vector<std::byte> skipped;
    r.read_span(start, skipped);
    mem.state_read(r, dest, flags);  // parses and checks everything (trailing bytes too), then restores
    return data.size();
}

}  // namespace

void check_state_seq_flags(state_seq_flags flags) {
    if ((flags & ~state_seq_flag_partial_only) != 0)
        throw error(errc::invalid_argument,
                    fmt::format("state flags {:#x}: bits {:#x} are no state_seq_flag (known: {:#x})", flags,
                                flags & ~state_seq_flag_partial_only, state_seq_flag_partial_only));
}

void memory_i::state_read(io_read_i& io, seq_id_t seq_id, state_seq_flags flags) {
    check_state_seq_flags(flags);
    const state_stage_ptr st = state_stage(io, seq_id, flags);  // everything checked before anything changes
    io.end_of_state();
    state_commit(*st);
}

void memory_i::state_check(io_read_i& io, seq_id_t seq_id, state_seq_flags flags) const {
    check_state_seq_flags(flags);
    (void)state_stage(io, seq_id, flags);
    io.end_of_state();
}

// -- files --

io_file_writer::io_file_writer(std::string path) : path_(std::move(path)) {
    fd_ = file_io.open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) io_fail("cannot create", path_);
    buf_.reserve(file_buffer_size);
}

io_file_writer::~io_file_writer() {
    if (fd_ >= 0) file_io.close(fd_);
}

void io_file_writer::flush() {
    const uint8_t* p = buf_.data();
    size_t left = buf_.size();
    while (left > 0) {
        const ssize_t w = file_io.write(fd_, p, left);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) io_fail("cannot write", path_);
        p += w;
        left -= static_cast<size_t>(w);
    }
    buf_.clear();
}

void io_file_writer::write(const void* src, size_t size) {
    if (fd_ < 0) throw error(errc::io, fmt::format("cannot write '{}': closed", path_));
    if (size >= file_buffer_size) {  // large pieces go straight through
        flush();
        const auto* p = static_cast<const uint8_t*>(src);
        size_t left = size;
        while (left > 0) {
            const ssize_t w = file_io.write(fd_, p, left);
            if (w < 0 && errno == EINTR) continue;
            if (w <= 0) io_fail("cannot write", path_);
            p += w;
            left -= static_cast<size_t>(w);
        }
    } else {
        if (buf_.size() + size > file_buffer_size) flush();
        const auto* p = static_cast<const uint8_t*>(src);
        buf_.insert(buf_.end(), p, p + size);
    }
    n_ += size;
}

void io_file_writer::write_at(uint64_t offset, const void* src, size_t size) {
    if (offset + size > n_)
        throw error(errc::out_of_range, fmt::format("write_at '{}': bytes [{}, {}) not written yet", path_,
                                                    offset, offset + size));
    flush();
    const auto* p = static_cast<const uint8_t*>(src);
    while (size > 0) {
        const ssize_t w = file_io.pwrite(fd_, p, size, static_cast<off_t>(offset));
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) io_fail("cannot write", path_);
        p += w;
        offset += static_cast<uint64_t>(w);
        size -= static_cast<size_t>(w);
    }
}

void io_file_writer::sync() {
    flush();
    if (file_io.fsync(fd_) != 0) io_fail("cannot sync", path_);
}

void io_file_writer::close() {
    if (fd_ < 0) return;
    flush();
    const int fd = fd_;
    fd_ = -1;
    if (file_io.close(fd) != 0) io_fail("cannot close", path_);
}

io_file_reader::io_file_reader(std::string path) : path_(std::move(path)) {
    fd_ = file_io.open(path_.c_str(), O_RDONLY | O_CLOEXEC, 0);
    if (fd_ < 0) io_fail("cannot open", path_);
    struct stat st {};
    if (file_io.fstat(fd_, &st) != 0) {
        file_io.close(fd_);
        io_fail("cannot stat", path_);
    }
    size_ = static_cast<uint64_t>(st.st_size);
}

io_file_reader::~io_file_reader() {
    if (fd_ >= 0) file_io.close(fd_);
}

void io_file_reader::read(void* dst, size_t size) {
    if (size > remaining())
        throw error(errc::corrupt_data, fmt::format("'{}' truncated at byte {}: {} bytes needed, {} left",
                                                    path_, n_, size, remaining()));
    auto* p = static_cast<uint8_t*>(dst);
    size_t left = size;
    while (left > 0) {
        const ssize_t r = file_io.read(fd_, p, left);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) io_fail("cannot read", path_);
        if (r == 0)
            throw error(errc::corrupt_data,
                        fmt::format("'{}' ended at byte {} while being read", path_, n_ + (size - left)));
        p += r;
        left -= static_cast<size_t>(r);
    }
    n_ += size;
}

namespace {

// The temporary files of earlier saves into `path` whose writer is gone (crashed or killed mid-save):
// NAME.tmp-PID-XXXXXXXX where no process PID exists. A live PID (this process, or a writer at work, or
// a reused PID) keeps its file, and so does one whose state cannot be known. Best effort: a directory
// that cannot be read, or a file that cannot be removed, is left alone. Every call goes through file_io
// (fault injection: tests/test_file_ops.cpp).
void remove_stale_temps(const std::string& dir, const std::string& name) {
    const std::string prefix = name + ".tmp-";
    DIR* d = file_io.opendir(dir.c_str());
    if (!d) return;
    std::vector<std::string> stale;  // removed after the listing: a directory changing under readdir is
                                     // allowed to skip or repeat entries
    while (const struct dirent* e = file_io.readdir(d)) {
        const std::string f = e->d_name;
        if (f.compare(0, prefix.size(), prefix) != 0) continue;
        const size_t dash = f.find('-', prefix.size());
        if (dash == std::string::npos || f.size() - dash != 9 || dash == prefix.size()) continue;
        const std::string pid_text = f.substr(prefix.size(), dash - prefix.size());
        if (pid_text.find_first_not_of("0123456789") != std::string::npos || pid_text.size() > 10) continue;
        if (f.find_first_not_of("0123456789abcdef", dash + 1) != std::string::npos) continue;
        const long long pid = std::stoll(pid_text);
        if (pid <= 0 || pid == ::getpid()) continue;
        if (pid <= std::numeric_limits<pid_t>::max() &&
            (file_io.kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH))
            continue;
        stale.push_back(fmt::format("{}/{}", dir, f));
    }
    file_io.closedir(d);
    for (const std::string& p : stale) file_io.unlink(p.c_str());  // gone meanwhile is fine
}

}  // namespace

uint64_t write_file_atomically(const std::string& path, const std::function<void(io_file_writer&)>& fill) {
    const size_t slash = path.rfind('/');
    const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
    remove_stale_temps(dir, slash == std::string::npos ? path : path.substr(slash + 1));
    std::random_device rd;
    const std::string tmp = fmt::format("{}.tmp-{}-{:08x}", path, ::getpid(), rd());
    try {
        io_file_writer f(tmp);
        fill(f);
        f.sync();
        const uint64_t bytes = f.n_bytes();
        f.close();
        if (file_io.rename(tmp.c_str(), path.c_str()) != 0)
            throw error(errc::io,
                        fmt::format("cannot rename '{}' to '{}': {}", tmp, path, std::strerror(errno)));
        // the rename itself reaches the disk with the directory (a file system that cannot sync a
        // directory, EINVAL, has nothing more to do)
        const int dfd = file_io.open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0);
        if (dfd < 0) io_fail("the file is replaced, but cannot open its directory to sync it", dir);
        const int synced = file_io.fsync(dfd);
        const int sync_errno = errno;
        file_io.close(dfd);
        if (synced != 0 && sync_errno != EINVAL) {
            errno = sync_errno;
            io_fail("the file is replaced, but the rename may not be durable: cannot sync directory", dir);
        }
        return bytes;
    } catch (...) {
        file_io.unlink(tmp.c_str());
        throw;
    }
}

std::vector<uint8_t> read_file_bytes(const std::string& path) {
    io_file_reader r(path);
    check_limit("bytes in the file", "file_bytes", r.size(), file_bytes_limit());  // before reading any
    std::vector<uint8_t> out(r.size());
    r.read(out.data(), out.size());
    return out;
}

void io_vector_writer::write(const void* src, size_t size) {
    const auto* p = static_cast<const uint8_t*>(src);
    out_->insert(out_->end(), p, p + size);
    n_ += size;
}

void io_span_writer::write(const void* src, size_t size) {
    if (size > dst_.size() - n_)
        throw error(errc::out_of_range,
                    fmt::format("state: buffer of {} bytes is too small ({} more needed at byte {})",
                                dst_.size(), size - (dst_.size() - n_), n_));
    detail::copy_bytes(dst_.data() + n_, src, size);
    n_ += size;
}

std::span<const std::byte> io_read_i::read_span(size_t size, std::vector<std::byte>& scratch) {
    scratch.resize(size);
    read(scratch.data(), size);
    return scratch;
}

void io_span_reader::need(size_t size) const {
    if (size > src_.size() - n_)
        throw error(errc::corrupt_data, fmt::format("state: truncated at byte {}: {} bytes needed, {} left",
                                                    n_, size, src_.size() - n_));
}

void io_span_reader::read(void* dst, size_t size) {
    if (size > src_.size() - n_) need(size);  // throws
    const uint8_t* src = src_.data() + n_;
    if (size == 4)  // the fields of a state: copies of a known size, not calls
        std::memcpy(dst, src, 4);
    else if (size == 8)
        std::memcpy(dst, src, 8);
    else if (size)
        std::memcpy(dst, src, size);
    n_ += size;
}

void io_span_reader::end_of_state() {
    if (exact_ && remaining() != 0)
        throw error(errc::corrupt_data,
                    fmt::format("state: {} trailing bytes after the state at byte {}", remaining(), n_));
}

std::span<const std::byte> io_span_reader::read_span(size_t size, std::vector<std::byte>& /*scratch*/) {
    if (size > src_.size() - n_) need(size);  // throws
    const auto out = std::as_bytes(src_.subspan(n_, size));
    n_ += size;
    return out;
}

size_t state_seq_get_size(const memory_i& mem, seq_id_t seq_id, state_seq_flags flags) {
    io_size_counter counter;
    check_state_seq_flags(flags);
    mem.state_write(counter, seq_id, flags);
    return 8 + counter.n_bytes();
}

size_t state_seq_get_data(const memory_i& mem, seq_id_t seq_id, std::span<uint8_t> dst,
                          state_seq_flags flags) {
    check_state_seq_flags(flags);
    io_span_writer w(dst);
    const uint32_t magic = state_seq_magic;
    w.write(&magic, 4);
    w.write(&seq_id, 4);
    mem.state_write(w, seq_id, flags);
    return w.n_bytes();
}

std::vector<uint8_t> state_seq_get_data(const memory_i& mem, seq_id_t seq_id, state_seq_flags flags) {
    std::vector<uint8_t> out;
    out.reserve(state_seq_get_size(mem, seq_id, flags));
    io_vector_writer w(out);
    const uint32_t magic = state_seq_magic;
    w.write(&magic, 4);
    w.write(&seq_id, 4);
    mem.state_write(w, seq_id, flags);
    return out;
}

size_t state_seq_set_data(memory_i& mem, std::span<const uint8_t> data, seq_id_t dest,
                          state_seq_flags flags) {
    io_span_reader r(data);
    uint32_t magic = 0;
    seq_id_t source = 0;
    r.read(&magic, 4);
    if (magic != state_seq_magic)
        throw error(errc::corrupt_data,
                    fmt::format("state: not a sequence state (magic {:#010x}, expected {:#010x})", magic,
                                state_seq_magic));
    r.read(&source, 4);
    return restore_from(mem, data, 8, dest, flags);
}

size_t state_set_payload(memory_i& mem, std::span<const uint8_t> payload, seq_id_t dest,
                         state_seq_flags flags) {
    return restore_from(mem, payload, 0, dest, flags);
}

}  // namespace kvc
