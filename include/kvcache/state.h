/// @file
/// Saving and restoring memories: byte streams over memory and files (implementing io.h's io_write_i /
/// io_read_i) and the per-sequence buffer of llama.cpp (magic 0xaf143cd8, source sequence id, then the
/// memory's payload).
///
/// Payloads are llama.cpp's memory state layout (design/kv-cache.md §7), byte for byte: a state written by
/// one can be read by the other when layer shapes and types match. Reading is transactional: everything is
/// parsed and checked before the memory changes, so a bad or truncated state leaves it exactly as it was
/// and the error names what was wrong and at which byte.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include <kvcache/io.h>
#include <kvcache/memory.h>
#include <kvcache/types.h>

namespace kvc {

// -- byte streams (the interfaces are in io.h) --

/// Counts bytes without storing them (the size of a state before allocating for it).
class io_size_counter final : public io_write_i {
public:
    void write(const void*, size_t size) override { n_ += size; }
    size_t n_bytes() const override { return n_; }

private:
    size_t n_ = 0;
};

/// Appends to a growing byte vector.
class io_vector_writer final : public io_write_i {
public:
    explicit io_vector_writer(std::vector<uint8_t>& out) : out_(&out) {}  ///< appends to out (borrowed)
    void write(const void* src, size_t size) override;
    size_t n_bytes() const override { return n_; }

private:
    std::vector<uint8_t>* out_;  // borrowed
    size_t n_ = 0;
};

/// Writes into a fixed span; throws when it would overflow.
class io_span_writer final : public io_write_i {
public:
    explicit io_span_writer(std::span<uint8_t> dst) : dst_(dst) {}  ///< writes into dst (borrowed)
    void write(const void* src, size_t size) override;
    size_t n_bytes() const override { return n_; }

private:
    std::span<uint8_t> dst_;
    size_t n_ = 0;
};

/// Reads from a span of bytes (borrowed).
class io_span_reader final : public io_read_i {
public:
    /// exact: the span holds one state and nothing after it (see end_of_state).
    explicit io_span_reader(std::span<const uint8_t> src, bool exact = false) : src_(src), exact_(exact) {}
    void read(void* dst, size_t size) override;
    size_t n_bytes() const override { return n_; }
    std::span<const std::byte> read_span(size_t size, std::vector<std::byte>& scratch) override;
    void end_of_state() override;
    size_t remaining() const { return src_.size() - n_; }  ///< bytes not read yet

private:
    void need(size_t size) const;  // throws when fewer bytes remain

    std::span<const uint8_t> src_;
    bool exact_ = false;
    size_t n_ = 0;
};

/// Writes a file through a buffer (created or truncated); throws kvc::error(io) naming the path and the
/// system's reason when the operating system refuses.
class io_file_writer final : public io_write_i {
public:
    explicit io_file_writer(std::string path);  ///< creates or truncates the file
    ~io_file_writer() override;  ///< closes; bytes not flushed are lost (call close() to keep them)
    io_file_writer(const io_file_writer&) = delete;
    io_file_writer& operator=(const io_file_writer&) = delete;

    void write(const void* src, size_t size) override;
    size_t n_bytes() const override { return n_; }
    void write_at(uint64_t offset, const void* src, size_t size);  ///< over bytes already written
    void sync();                                       ///< everything written so far reaches the disk (fsync)
    void close();                                      ///< flushes and closes
    const std::string& path() const { return path_; }  ///< the file

private:
    void flush();

    std::string path_;
    int fd_ = -1;
    std::vector<uint8_t> buf_;
    size_t n_ = 0;
};

/// Reads a file through a buffer; running out of bytes is kvc::error(corrupt_data) naming the offset.
class io_file_reader final : public io_read_i {
public:
    explicit io_file_reader(std::string path);  ///< opens the file (kvc::error(io) when it cannot)
    ~io_file_reader() override;
    io_file_reader(const io_file_reader&) = delete;
    io_file_reader& operator=(const io_file_reader&) = delete;

    void read(void* dst, size_t size) override;
    size_t n_bytes() const override { return n_; }
    uint64_t size() const { return size_; }            ///< of the file when it was opened
    uint64_t remaining() const { return size_ - n_; }  ///< bytes not read yet

private:
    std::string path_;
    int fd_ = -1;
    uint64_t size_ = 0;
    size_t n_ = 0;
};

/// Writes a file safely: `fill` writes it under a temporary name beside `path`, which is then synced and
/// renamed over `path` (and the directory synced), so a crash leaves the old file or the new one, never a
/// torn one. On any error the temporary file is removed, `path` is untouched and the kvc::error is
/// rethrown. Returns the size of the file.
uint64_t write_file_atomically(const std::string& path, const std::function<void(io_file_writer&)>& fill);

/// Every byte of a file (kvc::error(io) when it cannot be read; kvc::error(out_of_range) for a file larger
/// than kvc::limits::file_bytes, before a byte is read).
std::vector<uint8_t> read_file_bytes(const std::string& path);

// -- raw payloads --

/// Restores a payload without header (what state_write wrote) into dest (-1: the whole memory): the
/// payload is checked first and must end with the span, then read. Returns its size. Throws kvc::error
/// and leaves the memory unchanged on any problem.
size_t state_set_payload(memory_i& mem, std::span<const uint8_t> payload, seq_id_t dest,
                         state_seq_flags flags = 0);

// -- per-sequence buffers (llama_state_seq_get_size / get_data / set_data) --

inline constexpr uint32_t state_seq_magic = 0xaf143cd8u;  ///< first 4 bytes of a per-sequence buffer

/// Bytes of the buffer for seq_id (-1: the whole memory): 8-byte header + payload.
size_t state_seq_get_size(const memory_i& mem, seq_id_t seq_id, state_seq_flags flags = 0);
/// The buffer: u32 magic, i32 seq_id, payload.
std::vector<uint8_t> state_seq_get_data(const memory_i& mem, seq_id_t seq_id, state_seq_flags flags = 0);
/// The same into the caller's buffer (reused across saves, no allocation); returns the bytes written.
/// Throws kvc::error(out_of_range) when dst is smaller than state_seq_get_size (its content is then
/// unspecified).
size_t state_seq_get_data(const memory_i& mem, seq_id_t seq_id, std::span<uint8_t> dst,
                          state_seq_flags flags = 0);
/// Restores a buffer into dest (-1: the whole memory); the stored source id is not used, so a sequence
/// restores into any destination. Every byte must be consumed. Returns the bytes read. Throws
/// kvc::error and leaves the memory unchanged on any problem.
size_t state_seq_set_data(memory_i& mem, std::span<const uint8_t> data, seq_id_t dest,
                          state_seq_flags flags = 0);

}  // namespace kvc
