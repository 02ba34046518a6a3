// GGUF reader and writer (include/kvcache/runtime/gguf.h). The reader never trusts a count, length or
// offset before checking it against the bytes that remain, so a malformed file costs at most a few small
// allocations bounded by the file size and ends in kvc::error.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <set>
#include <utility>

#include <fmt/format.h>
#include <kvcache/limits.h>
#include <kvcache/runtime/gguf.h>
#include <kvcache/state.h>

namespace kvc {

static_assert(std::endian::native == std::endian::little, "GGUF files are read and written little-endian");

namespace {

constexpr std::array<uint8_t, 4> gguf_magic = {'G', 'G', 'U', 'F'};
constexpr uint64_t default_alignment = 32;
constexpr uint32_t max_dims = 4;
constexpr uint32_t n_value_types = 13;

// Smallest encodings, to bound counts by the bytes that remain before anything is allocated.
constexpr uint64_t min_kv_bytes = 8 + 4 + 1;                   // empty key, type, one-byte value
constexpr uint64_t min_tensor_info_bytes = 8 + 4 + 8 + 4 + 8;  // empty name, n_dims, one ne, type, offset

bool is_valid_value_type(uint32_t t) {
    return t < n_value_types;
}

// Bytes of one value of a fixed-size type; 0 for string and array.
uint64_t fixed_size(gguf_type t) {
    switch (t) {
        case gguf_type::u8:
        case gguf_type::i8:
        case gguf_type::boolean:
            return 1;
        case gguf_type::u16:
        case gguf_type::i16:
            return 2;
        case gguf_type::u32:
        case gguf_type::i32:
        case gguf_type::f32:
            return 4;
        case gguf_type::u64:
        case gguf_type::i64:
        case gguf_type::f64:
            return 8;
        case gguf_type::string:
        case gguf_type::array:
            return 0;
    }
    return 0;
}

bool is_unsigned(gguf_type t) {
    return t == gguf_type::u8 || t == gguf_type::u16 || t == gguf_type::u32 || t == gguf_type::u64;
}
bool is_signed(gguf_type t) {
    return t == gguf_type::i8 || t == gguf_type::i16 || t == gguf_type::i32 || t == gguf_type::i64;
}
bool is_float(gguf_type t) {
    return t == gguf_type::f32 || t == gguf_type::f64;
}

// Walks the bytes; every failure names the byte where the offending field starts.
class cursor {
public:
    cursor(const uint8_t* data, uint64_t size, const std::string& prefix)
        : data_(data), size_(size), prefix_(prefix) {}

    uint64_t pos() const { return pos_; }
    uint64_t remaining() const { return size_ - pos_; }

    [[noreturn]] void fail(uint64_t at, const std::string& what, errc code = errc::corrupt_data) const {
        throw error(code, fmt::format("{}at byte {}: {}", prefix_, at, what));
    }

    // Until end_section(): the bytes from here on count against a limit of max bytes (the metadata).
    void begin_section(uint64_t max) {
        section_at_ = pos_;
        section_max_ = max;
    }
    void end_section() { section_max_ = UINT64_MAX; }
    // n more bytes from the current position stay within the section's limit; what: the field at `at`.
    // Checked before what they would allocate is allocated.
    void within_limit(uint64_t at, uint64_t n, const char* what) const {
        const uint64_t used = pos_ - section_at_;
        if (section_max_ != UINT64_MAX && n > section_max_ - std::min(used, section_max_))
            fail(at,
                 fmt::format("{}: metadata bytes: {}, over the limit metadata_bytes of {} (kvc::limits)",
                             what, used > UINT64_MAX - n ? UINT64_MAX : used + n, section_max_),
                 errc::out_of_range);
    }

    void need(uint64_t n, const char* what) const {
        if (n > remaining())
            fail(pos_, fmt::format("{} needs {} bytes, the file has {} left", what, n, remaining()));
        within_limit(pos_, n, what);
    }

    // n bytes, in place; advances past them.
    const uint8_t* take(uint64_t n, const char* what) {
        need(n, what);
        const uint8_t* p = data_ + pos_;
        pos_ += n;
        return p;
    }

    template <class T>
    T read(const char* what) {
        need(sizeof(T), what);
        T v;
        std::memcpy(&v, data_ + pos_, sizeof v);
        pos_ += sizeof v;
        return v;
    }

    std::string read_string(const char* what) {
        const uint64_t at = pos_;
        const auto len = read<uint64_t>(what);
        if (len > remaining())
            fail(at, fmt::format("{} of {} bytes is longer than the {} bytes left in the file", what, len,
                                 remaining()));
        within_limit(at, len, what);
        std::string s(reinterpret_cast<const char*>(data_ + pos_), static_cast<size_t>(len));
        pos_ += len;
        return s;
    }

private:
    const uint8_t* data_;
    uint64_t size_;
    const std::string& prefix_;
    uint64_t pos_ = 0;
    uint64_t section_at_ = 0;
    uint64_t section_max_ = UINT64_MAX;  // UINT64_MAX: no section
};

uint64_t read_unsigned(cursor& c, gguf_type t, const char* what) {
    switch (t) {
        case gguf_type::u8:
            return c.read<uint8_t>(what);
        case gguf_type::u16:
            return c.read<uint16_t>(what);
        case gguf_type::u32:
            return c.read<uint32_t>(what);
        default:
            return c.read<uint64_t>(what);
    }
}

int64_t read_signed(cursor& c, gguf_type t, const char* what) {
    switch (t) {
        case gguf_type::i8:
            return c.read<int8_t>(what);
        case gguf_type::i16:
            return c.read<int16_t>(what);
        case gguf_type::i32:
            return c.read<int32_t>(what);
        default:
            return c.read<int64_t>(what);
    }
}

double read_float(cursor& c, gguf_type t, const char* what) {
    if (t == gguf_type::f32) return c.read<float>(what);
    return c.read<double>(what);
}

bool read_bool(cursor& c, const char* what) {
    const uint64_t at = c.pos();
    const auto b = c.read<uint8_t>(what);
    if (b > 1) c.fail(at, fmt::format("{} is {}, not 0 or 1", what, b));
    return b != 0;
}

// The count of an array of elements of at least min_elem_bytes each, checked against the bytes left
// in the file and in the metadata's limit before anything is allocated for them.
void check_count(cursor& c, uint64_t at, uint64_t count, uint64_t min_elem_bytes) {
    if (count > c.remaining() / min_elem_bytes)
        c.fail(at, fmt::format("array of {} elements needs at least {} bytes each, the file has {} left",
                               count, min_elem_bytes, c.remaining()));
    c.within_limit(at, count * min_elem_bytes, "array");
}

gguf_value read_value(cursor& c, gguf_type type) {
    gguf_value out;
    out.type = type;
    if (is_unsigned(type)) {
        out.value = read_unsigned(c, type, "value");
    } else if (is_signed(type)) {
        out.value = read_signed(c, type, "value");
    } else if (is_float(type)) {
        out.value = read_float(c, type, "value");
    } else if (type == gguf_type::boolean) {
        out.value = read_bool(c, "bool value");
    } else if (type == gguf_type::string) {
        out.value = c.read_string("string value");
    } else {
        const uint64_t elem_at = c.pos();
        const auto raw_elem = c.read<uint32_t>("array element type");
        if (!is_valid_value_type(raw_elem))
            c.fail(elem_at, fmt::format("unknown array element type {} (known: 0..12)", raw_elem));
        const auto elem = static_cast<gguf_type>(raw_elem);
        if (elem == gguf_type::array)
            c.fail(elem_at, "arrays of arrays are not supported", errc::unsupported);
        out.elem_type = elem;
        const uint64_t count_at = c.pos();
        const auto count = c.read<uint64_t>("array length");
        const uint64_t min_bytes = elem == gguf_type::string ? 8 : fixed_size(elem);
        check_count(c, count_at, count, min_bytes);
        if (elem == gguf_type::string) {
            std::vector<std::string> v;
            v.reserve(static_cast<size_t>(count));
            for (uint64_t i = 0; i < count; ++i) v.push_back(c.read_string("string array element"));
            out.value = std::move(v);
        } else {  // the elements' bytes as they are: no widening (a u8 costs one byte)
            const uint64_t at = c.pos();
            const uint8_t* p = c.take(count * min_bytes, "array elements");
            if (elem == gguf_type::boolean)
                for (uint64_t i = 0; i < count; ++i)
                    if (p[i] > 1) c.fail(at + i, fmt::format("bool array element is {}, not 0 or 1", p[i]));
            out.value = gguf_array{elem, std::vector<uint8_t>(p, p + count * min_bytes)};
        }
    }
    return out;
}

constexpr bool is_pow2(uint64_t v) {
    return v != 0 && (v & (v - 1)) == 0;
}

uint64_t align_up(uint64_t v, uint64_t alignment) {
    return (v + alignment - 1) / alignment * alignment;
}

[[noreturn]] void bad_getter(std::string_view key, const gguf_value& v, const char* wanted) {
    const char* what = v.type == gguf_type::array ? "an array" : to_string(v.type);
    throw error(errc::corrupt_data,
                fmt::format("gguf: key '{}' holds {}{}, not {}", key,
                            v.type == gguf_type::array ? "" : "a value of type ", what, wanted));
}

}  // namespace

// -- arrays --

size_t gguf_array::size() const {
    const uint64_t w = fixed_size(elem_type);
    return w == 0 ? 0 : bytes.size() / static_cast<size_t>(w);
}

namespace {

template <class T, class F>
std::vector<T> widen(const gguf_array& a, bool kind, const char* wanted, F element) {
    if (!kind)
        throw error(errc::invalid_argument,
                    fmt::format("gguf: an array of {}, not of {}", to_string(a.elem_type), wanted));
    std::vector<T> out(a.size());
    for (size_t i = 0; i < out.size(); ++i) out[i] = element(a.bytes.data() + i * fixed_size(a.elem_type));
    return out;
}

template <class T>
T load(const uint8_t* p) {
    T v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

}  // namespace

std::vector<uint64_t> gguf_array::uints() const {
    return widen<uint64_t>(*this, is_unsigned(elem_type), "unsigned integers",
                           [&](const uint8_t* p) -> uint64_t {
                               switch (elem_type) {
                                   case gguf_type::u8:
                                       return *p;
                                   case gguf_type::u16:
                                       return load<uint16_t>(p);
                                   case gguf_type::u32:
                                       return load<uint32_t>(p);
                                   default:
                                       return load<uint64_t>(p);
                               }
                           });
}

std::vector<int64_t> gguf_array::ints() const {
    return widen<int64_t>(*this, is_signed(elem_type), "signed integers", [&](const uint8_t* p) -> int64_t {
        switch (elem_type) {
            case gguf_type::i8:
                return load<int8_t>(p);
            case gguf_type::i16:
                return load<int16_t>(p);
            case gguf_type::i32:
                return load<int32_t>(p);
            default:
                return load<int64_t>(p);
        }
    });
}

std::vector<double> gguf_array::floats() const {
    return widen<double>(*this, is_float(elem_type), "floats", [&](const uint8_t* p) -> double {
        return elem_type == gguf_type::f32 ? load<float>(p) : load<double>(p);
    });
}

std::vector<bool> gguf_array::bools() const {
    if (elem_type != gguf_type::boolean)
        throw error(errc::invalid_argument,
                    fmt::format("gguf: an array of {}, not of bools", to_string(elem_type)));
    std::vector<bool> out(bytes.size());
    for (size_t i = 0; i < out.size(); ++i) out[i] = bytes[i] != 0;
    return out;
}

int64_t gguf_tensor_info::n_elements() const {
    int64_t n = 1;
    for (const int64_t d : ne) n *= d;  // the reader checked that the product fits
    return n;
}

// -- reader --

struct gguf_file::impl {
    // the bytes: a private read-only mapping (open) or an owned copy (parse)
    void* map = nullptr;
    size_t map_size = 0;
    std::vector<uint8_t> copy;
    const uint8_t* base = nullptr;
    uint64_t size = 0;

    uint32_t version = 0;
    uint64_t alignment = default_alignment;
    uint64_t data_offset = 0;
    std::vector<gguf_kv> kv;
    std::vector<gguf_tensor_info> tensors;
    std::map<std::string, size_t, std::less<>> kv_index;
    std::map<std::string, size_t, std::less<>> tensor_index;

    impl() = default;
    impl(const impl&) = delete;
    impl& operator=(const impl&) = delete;
    ~impl() {
        if (map) ::munmap(map, map_size);
    }

    void parse(const std::string& prefix);
};

void gguf_file::impl::parse(const std::string& prefix) {
    cursor c(base, size, prefix);

    c.need(4, "the magic");
    if (std::memcmp(base, gguf_magic.data(), gguf_magic.size()) != 0)
        c.fail(0, fmt::format("bad magic {:02x} {:02x} {:02x} {:02x} (want 'GGUF')", base[0], base[1],
                              base[2], base[3]));
    c.read<uint32_t>("the magic");

    version = c.read<uint32_t>("the version");
    if (version == 1)
        c.fail(4, "version 1 is not supported (it used 32-bit counts; convert the file to version 3)",
               errc::unsupported);
    if (version != 2 && version != 3) {
        if (version != 0 && (version & 0xffff) == 0)
            c.fail(4,
                   fmt::format("version {:#x} looks like a big-endian file, which is not supported", version),
                   errc::unsupported);
        c.fail(4, fmt::format("version {} is not supported (only 2 and 3)", version), errc::unsupported);
    }

    const uint64_t n_tensors_at = c.pos();
    const auto n_tensors = c.read<uint64_t>("the tensor count");
    const uint64_t n_kv_at = c.pos();
    const auto n_kv = c.read<uint64_t>("the metadata count");
    if (n_tensors > c.remaining() / min_tensor_info_bytes)
        c.fail(n_tensors_at, fmt::format("tensor count {} cannot fit in the {} bytes left in the file",
                                         n_tensors, c.remaining()));
    if (n_kv > c.remaining() / min_kv_bytes)
        c.fail(n_kv_at, fmt::format("metadata count {} cannot fit in the {} bytes left in the file", n_kv,
                                    c.remaining()));

    // -- metadata --
    c.begin_section(get_limits().metadata_bytes);
    c.within_limit(n_kv_at, n_kv * min_kv_bytes, "the metadata count");
    kv.reserve(static_cast<size_t>(std::min<uint64_t>(n_kv, 4096)));  // grows with what the file holds
    for (uint64_t i = 0; i < n_kv; ++i) {
        const uint64_t key_at = c.pos();
        std::string key = c.read_string("metadata key");
        if (kv_index.count(key) != 0) c.fail(key_at, fmt::format("duplicate metadata key '{}'", key));
        const uint64_t type_at = c.pos();
        const auto raw_type = c.read<uint32_t>("metadata value type");
        if (!is_valid_value_type(raw_type))
            c.fail(type_at, fmt::format("key '{}': unknown value type {} (known: 0..12)", key, raw_type));
        const auto type = static_cast<gguf_type>(raw_type);
        gguf_value value;
        try {
            value = read_value(c, type);
        } catch (const error& e) {
            // name the key: the value's own message says where and what
            throw error(e.code(), fmt::format("{} (key '{}')", e.what(), key));
        }
        if (key == "general.alignment") {
            if (type != gguf_type::u32)
                c.fail(type_at, fmt::format("general.alignment must be a u32, not {}", to_string(type)));
            const uint64_t a = std::get<uint64_t>(value.value);
            if (!is_pow2(a))
                c.fail(type_at + 4, fmt::format("general.alignment {} is not a power of two", a));
            alignment = a;
        }
        kv_index.emplace(key, kv.size());
        kv.push_back(gguf_kv{std::move(key), std::move(value)});
    }
    c.end_section();

    // -- tensor infos --
    struct placed {
        uint64_t begin, end;
        uint64_t offset_at;  // of the info's offset field
        size_t index;
    };
    std::vector<placed> places;
    tensors.reserve(static_cast<size_t>(n_tensors));
    places.reserve(static_cast<size_t>(n_tensors));
    for (uint64_t i = 0; i < n_tensors; ++i) {
        gguf_tensor_info t;
        const uint64_t name_at = c.pos();
        t.name = c.read_string("tensor name");
        if (tensor_index.count(t.name) != 0)
            c.fail(name_at, fmt::format("duplicate tensor name '{}'", t.name));
        const uint64_t dims_at = c.pos();
        const auto n_dims = c.read<uint32_t>("tensor dimension count");
        if (n_dims < 1 || n_dims > max_dims)
            c.fail(dims_at,
                   fmt::format("tensor '{}': {} dimensions (must be 1..{})", t.name, n_dims, max_dims));
        uint64_t n_elements = 1;
        for (uint32_t d = 0; d < n_dims; ++d) {
            const uint64_t ne_at = c.pos();
            const auto ne = c.read<uint64_t>("tensor dimension");
            if (ne == 0 || ne > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
                c.fail(ne_at, fmt::format("tensor '{}': ne[{}] = {} (must be 1..2^63-1)", t.name, d,
                                          static_cast<int64_t>(ne)));
            if (n_elements > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) / ne)
                c.fail(ne_at,
                       fmt::format("tensor '{}': the element count overflows at ne[{}] = {}", t.name, d, ne));
            n_elements *= ne;
            t.ne.push_back(static_cast<int64_t>(ne));
        }
        const uint64_t type_at = c.pos();
        t.ggml_type = c.read<uint32_t>("tensor type");
        const auto traits = ggml_type_info(t.ggml_type);
        if (!traits) c.fail(type_at, fmt::format("tensor '{}': unknown ggml type {}", t.name, t.ggml_type));
        const auto block = static_cast<uint64_t>(traits->block_size);
        if (static_cast<uint64_t>(t.ne[0]) % block != 0)
            c.fail(type_at, fmt::format("tensor '{}': ne[0] = {} is not a multiple of {}'s block size {}",
                                        t.name, t.ne[0], traits->name, block));
        const uint64_t n_blocks = n_elements / block;
        if (n_blocks > std::numeric_limits<uint64_t>::max() / traits->type_size)
            c.fail(type_at, fmt::format("tensor '{}': the byte size overflows", t.name));
        t.n_bytes = n_blocks * traits->type_size;
        const uint64_t offset_at = c.pos();
        t.offset = c.read<uint64_t>("tensor offset");
        if (t.offset % alignment != 0)
            c.fail(offset_at, fmt::format("tensor '{}': offset {} is not a multiple of the alignment {}",
                                          t.name, t.offset, alignment));
        places.push_back(placed{t.offset, 0, offset_at, tensors.size()});
        tensor_index.emplace(t.name, tensors.size());
        tensors.push_back(std::move(t));
    }

    // -- data section --
    data_offset = align_up(c.pos(), alignment);
    if (tensors.empty()) return;  // no data: the padding after the infos may be missing
    if (data_offset > size)
        c.fail(c.pos(),
               fmt::format("the data section would start at byte {}, past the end of the {}-byte file",
                           data_offset, size));
    const uint64_t data_size = size - data_offset;
    for (auto& p : places) {
        const gguf_tensor_info& t = tensors[p.index];
        if (t.offset > data_size || t.n_bytes > data_size - t.offset)
            c.fail(p.offset_at,
                   fmt::format("tensor '{}': data [{}, {}) of the data section ends past its {} bytes "
                               "(the file ends at byte {})",
                               t.name, t.offset, t.offset + t.n_bytes, data_size, size));
        p.end = t.offset + t.n_bytes;
    }
    // stable: of two tensors at the same offset, the later one in the file is reported
    std::stable_sort(places.begin(), places.end(),
                     [](const placed& a, const placed& b) { return a.begin < b.begin; });
    for (size_t i = 1; i < places.size(); ++i)
        if (places[i].begin < places[i - 1].end)
            c.fail(places[i].offset_at,
                   fmt::format("tensor '{}': data [{}, {}) overlaps tensor '{}' at [{}, {})",
                               tensors[places[i].index].name, places[i].begin, places[i].end,
                               tensors[places[i - 1].index].name, places[i - 1].begin, places[i - 1].end));
    for (auto& t : tensors) t.data = reinterpret_cast<const std::byte*>(base + data_offset + t.offset);
}

gguf_file::gguf_file(std::unique_ptr<impl> p) : p_(std::move(p)) {}
gguf_file::gguf_file(gguf_file&&) noexcept = default;
gguf_file& gguf_file::operator=(gguf_file&&) noexcept = default;
gguf_file::~gguf_file() = default;

gguf_file gguf_file::open(const std::string& path) {
    auto p = std::make_unique<impl>();
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw error(errc::io, fmt::format("gguf: cannot open '{}': {}", path, std::strerror(errno)));
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
        const int e = errno;
        ::close(fd);
        throw error(errc::io, fmt::format("gguf: cannot stat '{}': {}", path, std::strerror(e)));
    }
    if (!S_ISREG(st.st_mode)) {
        ::close(fd);
        throw error(errc::io, fmt::format("gguf: '{}' is not a regular file", path));
    }
    const auto size = static_cast<uint64_t>(st.st_size);
    if (size > 0) {  // mmap refuses empty files; an empty file fails the parse below
        void* m = ::mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_PRIVATE, fd, 0);
        if (m == MAP_FAILED) {
            const int e = errno;
            ::close(fd);
            throw error(errc::io, fmt::format("gguf: cannot map '{}': {}", path, std::strerror(e)));
        }
        p->map = m;
        p->map_size = static_cast<size_t>(size);
        p->base = static_cast<const uint8_t*>(m);
    }
    ::close(fd);  // the mapping keeps the file's pages
    p->size = size;
    p->parse(fmt::format("gguf: '{}': ", path));
    return gguf_file(std::move(p));
}

gguf_file gguf_file::parse(std::span<const uint8_t> bytes) {
    auto p = std::make_unique<impl>();
    p->copy.assign(bytes.begin(), bytes.end());
    p->base = p->copy.data();
    p->size = p->copy.size();
    p->parse("gguf: ");
    return gguf_file(std::move(p));
}

uint32_t gguf_file::version() const {
    return p_->version;
}
uint64_t gguf_file::alignment() const {
    return p_->alignment;
}
uint64_t gguf_file::data_offset() const {
    return p_->data_offset;
}
uint64_t gguf_file::file_size() const {
    return p_->size;
}
std::span<const gguf_kv> gguf_file::metadata() const {
    return p_->kv;
}
std::span<const gguf_tensor_info> gguf_file::tensors() const {
    return p_->tensors;
}

const gguf_value* gguf_file::find(std::string_view key) const {
    const auto it = p_->kv_index.find(key);
    return it == p_->kv_index.end() ? nullptr : &p_->kv[it->second].value;
}

const gguf_tensor_info* gguf_file::find_tensor(std::string_view name) const {
    const auto it = p_->tensor_index.find(name);
    return it == p_->tensor_index.end() ? nullptr : &p_->tensors[it->second];
}

std::optional<uint64_t> gguf_file::get_uint(std::string_view key) const {
    const gguf_value* v = find(key);
    if (!v) return std::nullopt;
    if (is_unsigned(v->type)) return std::get<uint64_t>(v->value);
    if (is_signed(v->type)) {
        const int64_t i = std::get<int64_t>(v->value);
        if (i < 0)
            throw error(errc::corrupt_data, fmt::format("gguf: key '{}' is {} {}, not an unsigned integer",
                                                        key, to_string(v->type), i));
        return static_cast<uint64_t>(i);
    }
    bad_getter(key, *v, "an unsigned integer");
}

std::optional<int64_t> gguf_file::get_int(std::string_view key) const {
    const gguf_value* v = find(key);
    if (!v) return std::nullopt;
    if (is_signed(v->type)) return std::get<int64_t>(v->value);
    if (is_unsigned(v->type)) {
        const uint64_t u = std::get<uint64_t>(v->value);
        if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
            throw error(errc::corrupt_data,
                        fmt::format("gguf: key '{}' is {} {}, too large for a signed 64-bit integer", key,
                                    to_string(v->type), u));
        return static_cast<int64_t>(u);
    }
    bad_getter(key, *v, "an integer");
}

std::optional<double> gguf_file::get_float(std::string_view key) const {
    const gguf_value* v = find(key);
    if (!v) return std::nullopt;
    if (is_float(v->type)) return std::get<double>(v->value);
    if (is_unsigned(v->type)) return static_cast<double>(std::get<uint64_t>(v->value));
    if (is_signed(v->type)) return static_cast<double>(std::get<int64_t>(v->value));
    bad_getter(key, *v, "a number");
}

std::optional<bool> gguf_file::get_bool(std::string_view key) const {
    const gguf_value* v = find(key);
    if (!v) return std::nullopt;
    if (v->type == gguf_type::boolean) return std::get<bool>(v->value);
    bad_getter(key, *v, "a bool");
}

std::optional<std::string> gguf_file::get_string(std::string_view key) const {
    const gguf_value* v = find(key);
    if (!v) return std::nullopt;
    if (v->type == gguf_type::string) return std::get<std::string>(v->value);
    bad_getter(key, *v, "a string");
}

std::optional<std::vector<std::string>> gguf_file::get_string_array(std::string_view key) const {
    const gguf_value* v = find(key);
    if (!v) return std::nullopt;
    if (v->type == gguf_type::array && v->elem_type == gguf_type::string)
        return std::get<std::vector<std::string>>(v->value);
    if (v->type == gguf_type::array)
        throw error(errc::corrupt_data,
                    fmt::format("gguf: key '{}' holds an array of {}, not an array of strings", key,
                                to_string(v->elem_type)));
    bad_getter(key, *v, "an array of strings");
}

// -- writer --

namespace {

void put_bytes(std::vector<uint8_t>& out, const void* p, size_t n) {
    // resize and copy: g++ 12 at -O3 warns falsely (stringop-overflow) on inserts into a small vector
    const size_t at = out.size();
    out.resize(at + n);
    if (n > 0) std::memcpy(out.data() + at, p, n);
}

template <class T>
void put(std::vector<uint8_t>& out, T v) {
    put_bytes(out, &v, sizeof v);
}

void put_string(std::vector<uint8_t>& out, std::string_view s) {
    put<uint64_t>(out, s.size());
    put_bytes(out, s.data(), s.size());
}

void put_pad(std::vector<uint8_t>& out, uint64_t alignment) {
    out.resize(static_cast<size_t>(align_up(out.size(), alignment)), 0);
}

[[noreturn]] void bad_writer(const std::string& what) {
    throw error(errc::invalid_argument, fmt::format("gguf_writer: {}", what));
}

}  // namespace

gguf_writer::gguf_writer(uint64_t alignment) : alignment_(alignment) {
    if (!is_pow2(alignment) || alignment > std::numeric_limits<uint32_t>::max())
        bad_writer(fmt::format("alignment {} is not a power of two that fits 32 bits", alignment));
}

void gguf_writer::begin_kv(std::string_view key, gguf_type type) {
    if (key == "general.alignment" && type != gguf_type::u32)
        bad_writer(fmt::format("general.alignment must be a u32, not {}", to_string(type)));
    if (!keys_.emplace(key).second) bad_writer(fmt::format("duplicate metadata key '{}'", key));
    put_string(kv_, key);
    put<uint32_t>(kv_, static_cast<uint32_t>(type));
    ++n_kv_;
}

void gguf_writer::set_u32(std::string_view key, uint32_t v) {
    if (key == "general.alignment" && v != alignment_)
        bad_writer(fmt::format("general.alignment {} differs from the writer's alignment {}", v, alignment_));
    begin_kv(key, gguf_type::u32);
    put<uint32_t>(kv_, v);
}

void gguf_writer::set_i32(std::string_view key, int32_t v) {
    begin_kv(key, gguf_type::i32);
    put<int32_t>(kv_, v);
}

void gguf_writer::set_u64(std::string_view key, uint64_t v) {
    begin_kv(key, gguf_type::u64);
    put<uint64_t>(kv_, v);
}

void gguf_writer::set_f32(std::string_view key, float v) {
    begin_kv(key, gguf_type::f32);
    put<float>(kv_, v);
}

void gguf_writer::set_bool(std::string_view key, bool v) {
    begin_kv(key, gguf_type::boolean);
    put<uint8_t>(kv_, v ? 1 : 0);
}

void gguf_writer::set_string(std::string_view key, std::string_view v) {
    begin_kv(key, gguf_type::string);
    put_string(kv_, v);
}

void gguf_writer::set_string_array(std::string_view key, const std::vector<std::string>& v) {
    begin_kv(key, gguf_type::array);
    put<uint32_t>(kv_, static_cast<uint32_t>(gguf_type::string));
    put<uint64_t>(kv_, v.size());
    for (const auto& s : v) put_string(kv_, s);
}

void gguf_writer::set_f32_array(std::string_view key, const std::vector<float>& v) {
    begin_kv(key, gguf_type::array);
    put<uint32_t>(kv_, static_cast<uint32_t>(gguf_type::f32));
    put<uint64_t>(kv_, v.size());
    for (const float f : v) put<float>(kv_, f);
}

void gguf_writer::set_i32_array(std::string_view key, const std::vector<int32_t>& v) {
    begin_kv(key, gguf_type::array);
    put<uint32_t>(kv_, static_cast<uint32_t>(gguf_type::i32));
    put<uint64_t>(kv_, v.size());
    for (const int32_t i : v) put<int32_t>(kv_, i);
}

void gguf_writer::set_u32_array(std::string_view key, const std::vector<uint32_t>& v) {
    begin_kv(key, gguf_type::array);
    put<uint32_t>(kv_, static_cast<uint32_t>(gguf_type::u32));
    put<uint64_t>(kv_, v.size());
    for (const uint32_t i : v) put<uint32_t>(kv_, i);
}

void gguf_writer::add_tensor(std::string name, std::vector<int64_t> ne, uint32_t ggml_type,
                             std::vector<uint8_t> data) {
    for (const auto& t : tensors_)
        if (t.name == name) bad_writer(fmt::format("duplicate tensor name '{}'", name));
    if (ne.empty() || ne.size() > max_dims)
        bad_writer(fmt::format("tensor '{}': {} dimensions (must be 1..{})", name, ne.size(), max_dims));
    const auto traits = ggml_type_info(ggml_type);
    if (!traits) bad_writer(fmt::format("tensor '{}': unknown ggml type {}", name, ggml_type));
    int64_t n = 1;
    for (size_t d = 0; d < ne.size(); ++d) {
        if (ne[d] < 1) bad_writer(fmt::format("tensor '{}': ne[{}] = {} (must be positive)", name, d, ne[d]));
        if (n > std::numeric_limits<int64_t>::max() / ne[d])
            bad_writer(fmt::format("tensor '{}': the element count overflows", name));
        n *= ne[d];
    }
    if (ne[0] % traits->block_size != 0)
        bad_writer(fmt::format("tensor '{}': ne[0] = {} is not a multiple of {}'s block size {}", name, ne[0],
                               traits->name, traits->block_size));
    const auto n_blocks = static_cast<uint64_t>(n / traits->block_size);
    if (n_blocks > std::numeric_limits<uint64_t>::max() / traits->type_size ||
        n_blocks * traits->type_size != data.size())
        bad_writer(fmt::format("tensor '{}': {} bytes of data, its type and dimensions need {}", name,
                               data.size(), n_blocks * traits->type_size));
    tensors_.push_back(tensor{std::move(name), std::move(ne), ggml_type, std::move(data)});
}

std::vector<uint8_t> gguf_writer::bytes() const {
    if (alignment_ != default_alignment && keys_.count("general.alignment") == 0)
        bad_writer(fmt::format("alignment {} needs general.alignment = {} in the metadata (set_u32)",
                               alignment_, alignment_));
    std::vector<uint8_t> out;
    put_bytes(out, gguf_magic.data(), gguf_magic.size());
    put<uint32_t>(out, 3);
    put<uint64_t>(out, tensors_.size());
    put<uint64_t>(out, n_kv_);
    out.insert(out.end(), kv_.begin(), kv_.end());
    uint64_t offset = 0;
    for (const auto& t : tensors_) {
        put_string(out, t.name);
        put<uint32_t>(out, static_cast<uint32_t>(t.ne.size()));
        for (const int64_t d : t.ne) put<uint64_t>(out, static_cast<uint64_t>(d));
        put<uint32_t>(out, t.type);
        put<uint64_t>(out, offset);
        offset += align_up(t.data.size(), alignment_);
    }
    put_pad(out, alignment_);
    out.reserve(out.size() + static_cast<size_t>(offset));
    for (const auto& t : tensors_) {
        out.insert(out.end(), t.data.begin(), t.data.end());
        put_pad(out, alignment_);
    }
    return out;
}

uint64_t gguf_writer::write(const std::string& path) const {
    const std::vector<uint8_t> b = bytes();
    return write_file_atomically(path, [&](io_file_writer& f) { f.write(b.data(), b.size()); });
}

}  // namespace kvc
