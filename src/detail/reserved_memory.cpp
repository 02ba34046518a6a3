#include "detail/reserved_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <utility>

#include <fmt/format.h>
#include <kvcache/types.h>

namespace kvc::detail {

reserved_memory::reserved_memory(size_t size) : size_(size) {
    if (size == 0) return;
    // MAP_NORESERVE: the kernel charges pages when they are touched, not the whole reservation now
    void* p =
        ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
        throw error(errc::out_of_memory, fmt::format("cannot reserve {} bytes of address space", size));
    data_ = static_cast<std::byte*>(p);
}

reserved_memory::reserved_memory(reserved_memory&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

reserved_memory& reserved_memory::operator=(reserved_memory&& other) noexcept {
    if (this != &other) {
        if (data_) ::munmap(data_, size_);
        data_ = std::exchange(other.data_, nullptr);
        size_ = std::exchange(other.size_, 0);
    }
    return *this;
}

reserved_memory::~reserved_memory() {
    if (data_) ::munmap(data_, size_);
}

void reserved_memory::release(size_t offset, size_t n) noexcept {
    const size_t page = page_size();
    const size_t begin = (offset + page - 1) / page * page;
    // the mapping's last page is ours whole: a range reaching the end may take it
    const size_t stop = std::min(offset + n, size_);
    const size_t end = stop == size_ ? (stop + page - 1) / page * page : stop / page * page;
    // MADV_DONTNEED on private anonymous memory drops the pages: the next read sees zeros
    if (begin < end) ::madvise(data_ + begin, end - begin, MADV_DONTNEED);
}

size_t reserved_memory::page_size() {
    static const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    return page;
}

}  // namespace kvc::detail
