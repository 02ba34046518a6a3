#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>

#include <fmt/format.h>
#include <kvcache/tensor.h>
#include <kvcache/types.h>

namespace kvc {

// -- host allocator --

namespace {

std::atomic<size_t> g_in_use{0};
std::atomic<size_t> g_peak{0};

class host_allocator final : public buffer_allocator {
public:
    void* allocate(size_t size, size_t alignment) override {
        // aligned_alloc wants a size that is a multiple of the alignment
        const size_t rounded = (size + alignment - 1) / alignment * alignment;
        if (rounded < size) throw error(errc::out_of_memory, fmt::format("buffer: size {} overflows", size));
        void* p = std::aligned_alloc(alignment, rounded);
        if (!p) throw error(errc::out_of_memory, fmt::format("buffer: cannot allocate {} bytes", size));
        const size_t now = g_in_use.fetch_add(size, std::memory_order_relaxed) + size;
        size_t peak = g_peak.load(std::memory_order_relaxed);
        while (now > peak && !g_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {}
        return p;
    }
    void deallocate(void* ptr, size_t size, size_t /*alignment*/) noexcept override {
        std::free(ptr);
        g_in_use.fetch_sub(size, std::memory_order_relaxed);
    }
    const char* name() const override { return "host"; }
    bool is_host() const override { return true; }
};

}  // namespace

buffer_allocator& buffer_allocator::host() {
    static host_allocator a;
    return a;
}

size_t host_bytes_in_use() {
    return g_in_use.load(std::memory_order_relaxed);
}
size_t host_bytes_peak() {
    return g_peak.load(std::memory_order_relaxed);
}

// -- buffer --

buffer::buffer(size_t size, bool zero, buffer_allocator& alloc) : size_(size), alloc_(&alloc) {
    if (size == 0) return;
    data_ = static_cast<std::byte*>(alloc.allocate(size, alignment));
    if (zero) clear_bytes();
}

buffer::buffer(buffer&& other) noexcept : data_(other.data_), size_(other.size_), alloc_(other.alloc_) {
    other.data_ = nullptr;
    other.size_ = 0;
}

buffer& buffer::operator=(buffer&& other) noexcept {
    if (this != &other) {
        if (data_) alloc_->deallocate(data_, size_, alignment);
        data_ = other.data_;
        size_ = other.size_;
        alloc_ = other.alloc_;
        other.data_ = nullptr;
        other.size_ = 0;
    }
    return *this;
}

buffer::~buffer() {
    if (data_) alloc_->deallocate(data_, size_, alignment);
}

void buffer::clear_bytes() {
    if (!data_) return;
    if (!alloc_->is_host())
        throw error(errc::unsupported,
                    fmt::format("buffer: cannot clear {} memory from the host", alloc_->name()));
    std::memset(data_, 0, size_);
}

// -- tensor_view --

template <class Byte>
basic_tensor_view<Byte> basic_tensor_view<Byte>::contiguous(dtype type, Byte* data, int64_t ne0, int64_t ne1,
                                                            int64_t ne2, int64_t ne3) {
    if (ne1 < 0 || ne2 < 0 || ne3 < 0)
        throw error(errc::invalid_argument,
                    fmt::format("tensor_view: negative dimension in [{}, {}, {}, {}]", ne0, ne1, ne2, ne3));
    basic_tensor_view v;
    v.type = type;
    v.data = data;
    v.ne[0] = ne0;
    v.ne[1] = ne1;
    v.ne[2] = ne2;
    v.ne[3] = ne3;
    v.nb[0] = type_size(type);
    v.nb[1] = row_size(type, ne0);  // validates ne0 and type
    v.nb[2] = v.nb[1] * static_cast<size_t>(ne1);
    v.nb[3] = v.nb[2] * static_cast<size_t>(ne2);
    return v;
}

template <class Byte>
bool basic_tensor_view<Byte>::is_contiguous() const {
    return nb[0] == type_size(type) && nb[1] == row_bytes() && nb[2] == nb[1] * static_cast<size_t>(ne[1]) &&
           nb[3] == nb[2] * static_cast<size_t>(ne[2]);
}

template <class Byte>
Byte* basic_tensor_view<Byte>::row(int64_t i1, int64_t i2, int64_t i3) const {
    if (i1 < 0 || i1 >= ne[1] || i2 < 0 || i2 >= ne[2] || i3 < 0 || i3 >= ne[3])
        throw error(errc::out_of_range,
                    fmt::format("tensor_view::row: index ({}, {}, {}) outside [{}, {}, {}]", i1, i2, i3,
                                ne[1], ne[2], ne[3]));
    return data + static_cast<size_t>(i1) * nb[1] + static_cast<size_t>(i2) * nb[2] +
           static_cast<size_t>(i3) * nb[3];
}

template <class Byte>
void basic_tensor_view<Byte>::row_to_f32(std::span<float> out, int64_t i1, int64_t i2, int64_t i3) const {
    if (out.size() < static_cast<size_t>(ne[0]))
        throw error(errc::invalid_argument,
                    fmt::format("tensor_view::row_to_f32: output holds {} values, the row has {}", out.size(),
                                ne[0]));
    if (nb[0] != type_size(type))
        throw error(errc::unsupported, "tensor_view::row_to_f32: row elements are not contiguous");
    to_f32(type, row(i1, i2, i3), out.data(), ne[0]);
}

template <class Byte>
basic_tensor_view<Byte> basic_tensor_view<Byte>::slice(int dim, int64_t begin, int64_t end) const {
    if (dim < 0 || dim > 3)
        throw error(errc::invalid_argument, fmt::format("tensor_view::slice: dimension {}", dim));
    if (begin < 0 || end > ne[dim] || begin > end)
        throw error(errc::out_of_range,
                    fmt::format("tensor_view::slice: [{}, {}) outside [0, {}) of dimension {}", begin, end,
                                ne[dim], dim));
    const int64_t bs = block_size(type);
    if (dim == 0 && (begin % bs != 0 || end % bs != 0))
        throw error(errc::invalid_argument,
                    fmt::format("tensor_view::slice: [{}, {}) of a {} row splits a block of {} values", begin,
                                end, to_string(type), bs));
    basic_tensor_view v = *this;
    v.ne[dim] = end - begin;
    const size_t step =
        dim == 0 ? nb[0] * static_cast<size_t>(begin / bs) : nb[dim] * static_cast<size_t>(begin);
    v.data = data + step;
    return v;
}

template <class Byte>
std::string basic_tensor_view<Byte>::describe() const {
    return fmt::format("{} [{}, {}, {}, {}] nb [{}, {}, {}, {}]", to_string(type), ne[0], ne[1], ne[2], ne[3],
                       nb[0], nb[1], nb[2], nb[3]);
}

template struct basic_tensor_view<std::byte>;
template struct basic_tensor_view<const std::byte>;

}  // namespace kvc
