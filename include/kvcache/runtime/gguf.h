/// @file
/// GGUF files (versions 2 and 3): a validating, memory-mapped reader and a writer.
///
/// The reader checks everything before anything is used: magic, version, counts against the file size,
/// string and array lengths, value types, tensor dimensions (positive, no overflow), types, offsets
/// (aligned, inside the data section, not overlapping) and that the data section fits the file. Every
/// problem is a kvc::error(corrupt_data) naming the byte offset and the field (errc::unsupported for
/// versions other than 2 and 3 and for arrays of arrays); a malformed file never crashes the reader.
#pragma once

// Layer guard: this header belongs to the runtime library (kvcache_runtime). The core library and the C
// API are built with KVC_LAYER_CORE / KVC_LAYER_CAPI and must not depend on the runtime.
#if defined(KVC_LAYER_CORE) || defined(KVC_LAYER_CAPI)
#error "kvcache layers: a runtime header (<kvcache/runtime/...>) included from the core library or the C API"
#endif

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <kvcache/types.h>

namespace kvc {

/// GGUF metadata value types (their ids in the file).
enum class gguf_type : uint32_t {
    u8 = 0,
    i8 = 1,
    u16 = 2,
    i16 = 3,
    u32 = 4,
    i32 = 5,
    f32 = 6,
    boolean = 7,
    string = 8,
    array = 9,
    u64 = 10,
    i64 = 11,
    f64 = 12,
};
const char* to_string(gguf_type t);  ///< "u8", "i8", ..., "string", "array", ...

/// An array of numbers or booleans as the file stores it: the elements' bytes in file order
/// (little-endian, of the width of elem_type; one byte, 0 or 1, per bool). It costs what it costs in the
/// file (issue 21: elements held widened to 8 bytes made a 256 MiB array of u8 cost 2.56 GB).
struct gguf_array {
    gguf_type elem_type = gguf_type::u8;  ///< an integer, float or boolean type
    std::vector<uint8_t> bytes;           ///< size() elements of fixed width

    size_t size() const;  ///< number of elements
    /// The elements widened, for arrays of the matching kind; kvc::error(invalid_argument) otherwise.
    std::vector<uint64_t> uints() const;                 ///< u8, u16, u32, u64
    std::vector<int64_t> ints() const;                   ///< i8, i16, i32, i64
    std::vector<double> floats() const;                  ///< f32, f64
    std::vector<bool> bools() const;                     ///< bool
    bool operator==(const gguf_array&) const = default;  ///< same type and bytes
};

/// One metadata value. Scalar integers of every width are held widened (signed in i64, unsigned in u64);
/// `type` says what the file stored.
struct gguf_value {
    gguf_type type = gguf_type::u32;       ///< what the file stored
    gguf_type elem_type = gguf_type::u32;  ///< arrays: the type of the elements
    std::variant<uint64_t, int64_t, double, bool, std::string, gguf_array, std::vector<std::string>>
        value;  ///< the value (arrays of strings as strings, other arrays as gguf_array)
};

/// One metadata entry.
struct gguf_kv {
    std::string key;   ///< e.g. "general.architecture"
    gguf_value value;  ///< its value
};

/// A tensor as the file describes it; data points into the mapped file.
struct gguf_tensor_info {
    std::string name;         ///< e.g. "blk.0.attn_q.weight"
    std::vector<int64_t> ne;  ///< dimensions, ne[0] first (the contiguous one), 1..4 of them
    uint32_t ggml_type = 0;   ///< ggml type id (0 f32, 1 f16, 2 q4_0, 8 q8_0, 30 bf16, ... any known id)
    uint64_t offset = 0;      ///< from the start of the data section
    uint64_t n_bytes = 0;     ///< of its data
    const std::byte* data = nullptr;  ///< its data in the mapped file
    int64_t n_elements() const;       ///< product of ne
};

/// Bytes of one block and values per block of a ggml type id; nullopt for ids the reader does not know.
struct ggml_type_traits {
    const char* name;    ///< ggml's name, e.g. "q8_0"
    int64_t block_size;  ///< values per block
    size_t type_size;    ///< bytes per block
};
std::optional<ggml_type_traits> ggml_type_info(uint32_t ggml_type);  ///< see ggml_type_traits

/// A GGUF file, validated: its metadata and tensor infos, with tensor data in the mapped file. The
/// metadata section may not exceed kvc::limits::metadata_bytes (kvc::error(out_of_range) naming it,
/// before the value that would pass it is allocated); held in memory, it costs about what it does in the
/// file (strings of arrays up to 32 bytes each more).
class gguf_file {
public:
    /// Maps and validates a file (kvc::error(io) when it cannot be opened or mapped).
    static gguf_file open(const std::string& path);
    /// Validates bytes in memory (copied; for tests and fuzzing).
    static gguf_file parse(std::span<const uint8_t> bytes);

    gguf_file(gguf_file&&) noexcept;             ///< takes the other's mapping
    gguf_file& operator=(gguf_file&&) noexcept;  ///< takes the other's mapping
    ~gguf_file();                                ///< unmaps the file

    uint32_t version() const;      ///< 2 or 3
    uint64_t alignment() const;    ///< general.alignment, 32 by default
    uint64_t data_offset() const;  ///< of the data section in the file
    uint64_t file_size() const;    ///< in bytes

    std::span<const gguf_kv> metadata() const;           ///< every entry, in file order
    const gguf_value* find(std::string_view key) const;  ///< null when absent
    /// Typed getters: nullopt when absent; kvc::error(corrupt_data) naming the key when present with
    /// a type that does not convert (integers convert between widths when the value fits).
    std::optional<uint64_t> get_uint(std::string_view key) const;
    std::optional<int64_t> get_int(std::string_view key) const;         ///< signed integers
    std::optional<double> get_float(std::string_view key) const;        ///< f32, f64 (and integers)
    std::optional<bool> get_bool(std::string_view key) const;           ///< booleans
    std::optional<std::string> get_string(std::string_view key) const;  ///< strings
    /// Arrays of strings.
    std::optional<std::vector<std::string>> get_string_array(std::string_view key) const;

    std::span<const gguf_tensor_info> tensors() const;                 ///< every tensor, in file order
    const gguf_tensor_info* find_tensor(std::string_view name) const;  ///< null when absent

private:
    struct impl;
    explicit gguf_file(std::unique_ptr<impl> p);
    std::unique_ptr<impl> p_;
};

/// Builds a GGUF (version 3) file: metadata in the order added, then tensor infos and aligned data.
/// Duplicate keys or tensor names, bad dimensions or data sizes and an alignment that general.alignment
/// does not state throw kvc::error(invalid_argument).
class gguf_writer {
public:
    explicit gguf_writer(uint64_t alignment = 32);  ///< tensor data aligned to `alignment` bytes

    void set_u32(std::string_view key, uint32_t v);                                  ///< adds a u32 entry
    void set_i32(std::string_view key, int32_t v);                                   ///< adds an i32 entry
    void set_u64(std::string_view key, uint64_t v);                                  ///< adds a u64 entry
    void set_f32(std::string_view key, float v);                                     ///< adds an f32 entry
    void set_bool(std::string_view key, bool v);                                     ///< adds a bool entry
    void set_string(std::string_view key, std::string_view v);                       ///< adds a string entry
    void set_string_array(std::string_view key, const std::vector<std::string>& v);  ///< adds a string array
    void set_f32_array(std::string_view key, const std::vector<float>& v);           ///< adds an f32 array
    void set_i32_array(std::string_view key, const std::vector<int32_t>& v);         ///< adds an i32 array
    void set_u32_array(std::string_view key, const std::vector<uint32_t>& v);        ///< adds a u32 array
    /// data must be exactly the tensor's bytes for its type and dimensions (ne[0] first).
    void add_tensor(std::string name, std::vector<int64_t> ne, uint32_t ggml_type, std::vector<uint8_t> data);

    std::vector<uint8_t> bytes() const;  ///< the whole file
    /// Writes the file atomically (temporary name, sync, rename); returns its size.
    uint64_t write(const std::string& path) const;

private:
    void begin_kv(std::string_view key, gguf_type type);  // refuses duplicate keys

    uint64_t alignment_;
    std::vector<uint8_t> kv_;  // serialised metadata
    uint64_t n_kv_ = 0;
    std::set<std::string, std::less<>> keys_;
    struct tensor {
        std::string name;
        std::vector<int64_t> ne;
        uint32_t type;
        std::vector<uint8_t> data;
    };
    std::vector<tensor> tensors_;
};

}  // namespace kvc
