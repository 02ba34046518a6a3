/// @file
/// The byte streams a memory saves its state to and restores it from (io_write_i / io_read_i). Memories
/// depend only on these interfaces; the streams over memory and files and the per-sequence buffer format
/// are in state.h.
#pragma once

#include <cstddef>
#include <span>
#include <vector>

namespace kvc {

/// Where a state is written: a byte sink.
class io_write_i {
public:
    virtual ~io_write_i() = default;
    virtual void write(const void* src, size_t size) = 0;  ///< throws kvc::error when it cannot
    virtual size_t n_bytes() const = 0;                    ///< written so far
};

/// Where a state is read from: a byte source.
class io_read_i {
public:
    virtual ~io_read_i() = default;
    /// Exactly `size` bytes, or kvc::error(corrupt_data) naming the offset when the input ends first.
    virtual void read(void* dst, size_t size) = 0;
    virtual size_t n_bytes() const = 0;  ///< consumed so far
    /// The next `size` bytes without a copy where the reader can: readers over memory return a view of
    /// their source; others read into `scratch`. The span lives as long as the source and `scratch`.
    virtual std::span<const std::byte> read_span(size_t size, std::vector<std::byte>& scratch);
    /// Called by state_read once the state is parsed and checked, before the memory changes (composite
    /// memories call it once, after all their parts). Readers that hold exactly one state throw
    /// kvc::error(corrupt_data) here when bytes remain, so trailing garbage is refused without a second
    /// pass.
    virtual void end_of_state() {}
};

}  // namespace kvc
