/// @file
/// limits: the largest inputs kvcache accepts, for the whole process (in the spirit of sqlite3_limit).
///
/// What an input declares (the size of a file to load, the metadata of a GGUF, the capacity of a batch,
/// a number of sequences) is checked against these limits before anything is allocated for it. A
/// refusal is kvc::error(out_of_range) naming the limit and both values. The bytes a memory may grow to
/// are bounded by its params' `memory_budget`; a budget of 0 takes `memory_bytes` from here.
///
/// The limits are process-wide: set them once at start-up (set_limits). Each field is read and written
/// atomically, so a call running while they change sees each limit either before or after.
#pragma once

#include <cstdint>
#include <string_view>

namespace kvc {

/// The largest inputs accepted (see the file comment). A field of 0 where noted means "the machine's
/// physical memory".
struct limits {
    /// Largest file a state, session or 'ggsq' load reads, in bytes (0: physical memory).
    uint64_t file_bytes = 0;
    /// Largest metadata section (keys and values) of a GGUF file a model load reads, in bytes.
    uint64_t metadata_bytes = uint64_t{1} << 30;
    /// Largest capacity of a batch in tokens (batch::init, kvc_batch_init).
    uint32_t batch_tokens = uint32_t{1} << 20;
    /// Largest n_seq_max of a memory or of a batch (sequence ids per token).
    uint32_t sequences = 65536;
    /// The memory budget of a memory whose params leave `memory_budget` at 0, and the most bytes one
    /// batch may take (0: physical memory).
    uint64_t memory_bytes = 0;
};

/// The limits in force.
limits get_limits();

/// Replaces every limit; returns the previous ones. Throws kvc::error(invalid_argument), changing
/// nothing, when batch_tokens or sequences is 0.
limits set_limits(const limits& l);

/// Throws kvc::error(out_of_range) "WHAT: VALUE, over the limit NAME of MAX (kvc::limits)" when value >
/// max. For the places that read input.
void check_limit(std::string_view what, std::string_view name, uint64_t value, uint64_t max);

/// limits::file_bytes, with 0 resolved to the machine's physical memory.
uint64_t file_bytes_limit();

}  // namespace kvc
