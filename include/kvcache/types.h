/// @file
/// Core scalar types, memory statuses, errors and logging shared by every layer of kvcache.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

/// The C++ API of kvcache: the sequence memory (KV cache, recurrent state) of LLM inference engines.
namespace kvc {

// -- scalars (int32 like llama.cpp, so positions and ids cross the C API unchanged) --

using pos_t = int32_t;     ///< token position; inside cells -1 means "empty"; as an API bound < 0 means open
using seq_id_t = int32_t;  ///< sequence id, valid in [0, n_seq_max); -1 in an API means "all sequences"
using token_t = int32_t;   ///< token id

inline constexpr pos_t pos_none = -1;    ///< the position of an empty cell
inline constexpr seq_id_t seq_all = -1;  ///< "all sequences" (or the whole memory) where an API accepts it

// -- memory status (design/kv-cache.md §1.4) --

/// The outcome of creating a memory context (memory_context_i::get_status()).
enum class memory_status : uint8_t {
    success = 0,         ///< the context has work to apply
    no_update = 1,       ///< nothing to do (update contexts only)
    failed_prepare = 2,  ///< the batch could not be placed; the memory is unchanged
    failed_compute = 3,  ///< reserved for memories whose apply() can fail
};

/// True for failed_prepare and failed_compute.
constexpr bool is_fail(memory_status s) {
    return s == memory_status::failed_prepare || s == memory_status::failed_compute;
}

/// Status of two memories driven together (iSWA, hybrid): the first failure wins, else success if either
/// has work, else no_update.
constexpr memory_status combine(memory_status s0, memory_status s1) {
    if (is_fail(s0)) return s0;
    if (is_fail(s1)) return s1;
    if (s0 == memory_status::success || s1 == memory_status::success) return memory_status::success;
    return memory_status::no_update;
}

/// "success", "no_update", "failed_prepare" or "failed_compute".
const char* to_string(memory_status s);

// -- errors --

/// What kind of mistake an error reports; the most specific code applies.
enum class errc : uint8_t {
    invalid_argument = 1,  ///< a value is malformed whatever the memory holds (negative count, bad name)
    out_of_range = 2,      ///< a value is well-formed but outside what this memory accepts (seq id, position)
    invalid_state = 3,     ///< the request conflicts with the current contents (sequence not present, ...)
    corrupt_data = 4,      ///< bytes read from a state, file or model do not follow the format
    unsupported = 5,       ///< valid request this build or configuration cannot serve
    io = 6,                ///< the operating system refused a read or write
    out_of_memory = 7,     ///< an allocation failed
};

/// The name of an error code ("invalid_argument", ...).
const char* to_string(errc code);

/// Every error kvcache reports on caller input. what() names the operation and the offending value.
class error : public std::runtime_error {
public:
    /// An error of kind `code`; `message` is what what() returns.
    error(errc code, const std::string& message) : std::runtime_error(message), code_(code) {}
    /// What kind of mistake this error reports.
    errc code() const noexcept { return code_; }

private:
    errc code_;
};

// -- logging --

/// Severity of a log message.
enum class log_level : uint8_t { debug = 0, info = 1, warn = 2, error = 3 };

/// Receives every message kvcache logs. `message` has no trailing newline and is valid during the call.
/// May be called from any thread that calls into kvcache.
using log_callback = void (*)(log_level level, const char* message, void* user_data);

/// Installs `callback` (nullptr restores the default: warnings and errors to stderr). Thread-safe.
void set_log_callback(log_callback callback, void* user_data = nullptr);

/// Sends one message to the installed callback.
void log(log_level level, std::string_view message);

// -- version --

/// The version of the library binary (compare with KVC_VERSION_STRING from <kvcache/version.h>).
const char* version_string();

}  // namespace kvc
