/// @file
/// Storage: owned aligned buffers and non-owning strided views over them.
///
/// A tensor_view describes data the way ggml does, so engines can hand views to their kernels as is:
/// @verbatim
///   ne[i]  number of elements along dimension i (ne[0] is the row length, in values)
///   nb[i]  stride of dimension i in bytes; nb[0] = type_size(type) (one block for block types),
///          nb[1] = row_size(type, ne[0]) for contiguous data, nb[2] = nb[1] * ne[1], ...
/// @endverbatim
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>

#include <kvcache/dtype.h>
#include <kvcache/types.h>

namespace kvc {

// -- allocation --

/// Where buffers get their memory. The host allocator is the default; an engine may provide another
/// (pinned or device memory) as long as it returns memory of the requested alignment.
class buffer_allocator {
public:
    virtual ~buffer_allocator() = default;
    /// Returns size bytes aligned to `alignment` (a power of two), or throws kvc::error(out_of_memory).
    virtual void* allocate(size_t size, size_t alignment) = 0;
    /// Returns memory from allocate() with the same size and alignment.
    virtual void deallocate(void* ptr, size_t size, size_t alignment) noexcept = 0;
    virtual const char* name() const = 0;  ///< for messages, e.g. "host"
    virtual bool is_host() const = 0;      ///< true when the CPU may read and write the memory directly

    static buffer_allocator& host();  ///< thread-safe, lives for the whole program
};

/// Bytes currently held and the peak since start by the host allocator (for size accounting).
size_t host_bytes_in_use();
size_t host_bytes_peak();  ///< the peak of host_bytes_in_use() since start

/// An owned, 64-byte aligned block of memory. Move-only.
class buffer {
public:
    static constexpr size_t alignment = 64;  ///< of data(), in bytes

    buffer() = default;
    /// size 0 gives an empty buffer with data() == nullptr.
    explicit buffer(size_t size, bool zero = true, buffer_allocator& alloc = buffer_allocator::host());
    buffer(buffer&& other) noexcept;             ///< takes other's memory; other is left empty
    buffer& operator=(buffer&& other) noexcept;  ///< frees this buffer's memory, then takes other's
    buffer(const buffer&) = delete;
    buffer& operator=(const buffer&) = delete;
    ~buffer();

    std::byte* data() { return data_; }              ///< the memory (nullptr when empty)
    const std::byte* data() const { return data_; }  ///< the memory (nullptr when empty)
    size_t size() const { return size_; }            ///< in bytes
    bool empty() const { return size_ == 0; }        ///< size() == 0
    /// Where the memory comes from (may be null when empty).
    buffer_allocator* allocator() const { return alloc_; }
    void clear_bytes();  ///< sets every byte to 0 (host buffers)

private:
    std::byte* data_ = nullptr;
    size_t size_ = 0;
    buffer_allocator* alloc_ = nullptr;  // borrowed; allocators outlive their buffers
};

// -- views --

/// A strided 4-D view. Byte is std::byte (writable) or const std::byte (read-only); a writable view
/// converts to a read-only one implicitly. Views do not own memory: they are valid while the memory
/// they view is.
template <class Byte>
struct basic_tensor_view {
    static_assert(std::is_same_v<std::remove_const_t<Byte>, std::byte>);

    dtype type = dtype::f32;       ///< element type
    int64_t ne[4] = {0, 1, 1, 1};  ///< number of elements along each dimension (ne[0]: row length, in values)
    size_t nb[4] = {0, 0, 0, 0};   ///< stride of each dimension in bytes
    Byte* data = nullptr;          ///< the first element

    basic_tensor_view() = default;  ///< an empty view

    /// A contiguous view of ne0 x ne1 x ne2 x ne3 values at data. Throws kvc::error when ne0 is not a
    /// whole number of blocks or a dimension is negative.
    static basic_tensor_view contiguous(dtype type, Byte* data, int64_t ne0, int64_t ne1 = 1, int64_t ne2 = 1,
                                        int64_t ne3 = 1);

    /// A read-only view of a writable one (implicit).
    template <class B = Byte, class = std::enable_if_t<std::is_const_v<B>>>
    basic_tensor_view(const basic_tensor_view<std::byte>& v)
        : type(v.type), data(v.data) {  // NOLINT: implicit
        for (int i = 0; i < 4; ++i) {
            ne[i] = v.ne[i];
            nb[i] = v.nb[i];
        }
    }

    int64_t nelements() const { return ne[0] * ne[1] * ne[2] * ne[3]; }  ///< elements in all
    int64_t nrows() const { return ne[1] * ne[2] * ne[3]; }              ///< rows in all
    size_t row_bytes() const { return row_size(type, ne[0]); }           ///< bytes of one row's data
    bool is_contiguous() const;                      ///< rows packed back to back with no gaps
    bool empty() const { return nelements() == 0; }  ///< no element

    /// Start of row (i1, i2, i3). Throws kvc::error when an index is out of range.
    Byte* row(int64_t i1, int64_t i2 = 0, int64_t i3 = 0) const;

    /// The row converted to f32 into out (ne[0] values). Throws kvc::error if out is too small.
    void row_to_f32(std::span<float> out, int64_t i1, int64_t i2 = 0, int64_t i3 = 0) const;

    /// Elements [begin, end) of dimension dim, same strides (begin == end gives an empty view).
    /// Dimension 0 must stay whole blocks. Throws kvc::error on an out-of-range interval.
    basic_tensor_view slice(int dim, int64_t begin, int64_t end) const;

    /// "q8_0 [128, 8, 256, 1] nb [34, 136, 1088, 278528]"
    std::string describe() const;
};

using tensor_view = basic_tensor_view<std::byte>;              ///< a writable view
using const_tensor_view = basic_tensor_view<const std::byte>;  ///< a read-only view

extern template struct basic_tensor_view<std::byte>;
extern template struct basic_tensor_view<const std::byte>;

}  // namespace kvc
