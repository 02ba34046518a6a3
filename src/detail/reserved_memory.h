// reserved_memory: address space reserved up front whose physical memory arrives on first touch and goes
// back to the system on request (the approach of vAttention: virtual contiguity, physical memory on
// demand). Storage laid out in it never moves, so views keep their base address as it grows.
#pragma once

#include <cstddef>

namespace kvc::detail {

class reserved_memory {
public:
    reserved_memory() = default;
    /// Reserves size bytes (nothing committed; every byte reads as zero). Throws kvc::error(out_of_memory)
    /// naming the size when the system refuses the reservation.
    explicit reserved_memory(size_t size);
    reserved_memory(reserved_memory&& other) noexcept;
    reserved_memory& operator=(reserved_memory&& other) noexcept;
    reserved_memory(const reserved_memory&) = delete;
    reserved_memory& operator=(const reserved_memory&) = delete;
    ~reserved_memory();

    std::byte* data() const { return data_; }
    size_t size() const { return size_; }

    /// Returns the whole pages inside [offset, offset + n) to the system; they read as zeros afterwards.
    /// Partial pages at either end are kept: they may hold bytes of a neighbour.
    void release(size_t offset, size_t n) noexcept;

    static size_t page_size();

private:
    std::byte* data_ = nullptr;
    size_t size_ = 0;
};

}  // namespace kvc::detail
