/// @file
/// Session files: a memory's state (one sequence or all of it) on disk, safely (design D11).
///
/// A kvcache session file is an envelope around the llama.cpp-compatible payload of state.h:
/// @verbatim
///   header (72 bytes): "KVCS", format version, flags (zstd), source seq id, state flags, token count,
///                      layout length, payload and stored sizes, layout fingerprint, body checksum,
///                      header checksum (XXH3-64)
///   body:              the memory's state_layout() text, the tokens, the payload (zstd-compressed or not)
/// @endverbatim
/// Files are written to a temporary name beside the target, synced and renamed over it, so a crash
/// never leaves a torn file. Loading checks everything before the memory changes and says precisely what
/// is wrong: not a session file, unsupported version, truncated, checksum mismatch, layout mismatch
/// (both layouts printed), or the payload's own error. docs/state-format.md has the byte layout.
///
/// llama.cpp's per-sequence files ('ggsq', version 2) are read and written too, for engines that share
/// files with llama.cpp.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include <kvcache/io.h>
#include <kvcache/memory.h>
#include <kvcache/types.h>

namespace kvc {

inline constexpr uint32_t session_magic = 0x5343564bu;  ///< "KVCS" in file order
inline constexpr uint32_t session_version = 1;          ///< the format version this build writes and reads
inline constexpr size_t session_header_size = 72;       ///< bytes of the header
inline constexpr uint32_t session_flag_zstd = 1;        ///< the payload is one zstd frame

/// How save_file writes a session file.
struct session_save_options {
    state_seq_flags flags = 0;  ///< passed to state_write (and used again on load)
    bool compress = false;      ///< zstd the payload (K/V of a cleared or quantised cache shrink well)
    int zstd_level = 3;         ///< 1 (fast) .. 22 (small; 20-22 with the window capped at 8 MiB)
    std::span<const token_t> tokens{};  ///< stored beside the state: the tokens it was computed from
};

/// Saves seq_id (-1: the whole memory) to path. Returns the file's size. Throws kvc::error (the target
/// is untouched then; the temporary file is removed).
uint64_t save_file(const memory_i& mem, const std::string& path, seq_id_t seq_id,
                   const session_save_options& options = {});

/// What a session file says about itself.
struct session_info {
    uint32_t version = 0;             ///< format version
    uint32_t file_flags = 0;          ///< session_flag_*
    seq_id_t seq_id = seq_all;        ///< the source: -1 for a whole memory
    state_seq_flags state_flags = 0;  ///< the flags the state was written with
    std::string layout;               ///< state_layout() of the memory that wrote it
    uint64_t layout_fingerprint = 0;  ///< XXH3-64 of layout
    uint64_t payload_bytes = 0;       ///< uncompressed
    uint64_t stored_bytes = 0;        ///< as stored
    uint64_t checksum = 0;            ///< of the body
    std::vector<token_t> tokens;      ///< the tokens stored beside the state
};

/// Loads a session file into dest (-1: the whole memory; a sequence loads into any destination).
/// Returns what the file held (its tokens included). Throws kvc::error, memory unchanged, on any problem;
/// a verified file holding more than max_tokens tokens is kvc::error(out_of_range), a file larger than
/// kvc::limits::file_bytes likewise, from its size alone; a payload declaring more than
/// mem.state_max_bytes() is kvc::error(corrupt_data) before a byte of it is read or inflated. The file
/// is read in pieces, twice (verified, then streamed into the memory's stage of the state): no copy of it
/// is held.
session_info load_file(memory_i& mem, const std::string& path, seq_id_t dest, size_t max_tokens = SIZE_MAX);

/// Parses and verifies a session file held in memory (envelope, checksums, decompression), without a
/// memory; payload (if not null) receives the uncompressed payload. Throws kvc::error on any problem. A
/// compressed payload is inflated only up to max_payload bytes (0: kvc::limits::memory_bytes, 0 there:
/// physical memory): with no memory to bound it, the caller says what it accepts (a larger declared
/// size is kvc::error(out_of_range) naming both, before anything is inflated).
session_info read_session(std::span<const uint8_t> file, std::vector<uint8_t>* payload = nullptr,
                          uint64_t max_payload = 0);

/// Verifies a session file held in memory as read_session does, then hands its payload to `read` as a
/// stream of session_info::payload_bytes bytes: a zstd payload is inflated a piece at a time as `read`
/// asks for it, never whole, so what is held beyond the file is zstd's window and a buffer of at most
/// 1 MiB (read_session holds the whole inflated payload). After `read` returns, the payload must have been
/// read to its end and the zstd frame must end there (kvc::error(corrupt_data) otherwise). For tools
/// reading big files (`kvcache inspect`); the session_info is what read_session returns.
session_info read_session_stream(
    std::span<const uint8_t> file,
    const std::function<void(io_read_i& payload, const session_info& info)>& read);

// -- llama.cpp's per-sequence files (llama_state_seq_save_file / load_file) --

inline constexpr uint32_t llama_seq_file_magic = 0x67677371u;      ///< 'ggsq'
inline constexpr uint32_t llama_seq_file_version = 2;              ///< the version read and written
inline constexpr uint32_t llama_session_file_magic = 0x6767736eu;  ///< 'ggsn' (whole contexts; not read)

// -- either format --

/// The two formats a session file can have.
enum class session_file_format : uint8_t {
    kvcache,    ///< a kvcache session file ("KVCS": save_file / load_file)
    llama_seq,  ///< a llama.cpp sequence file ('ggsq': save_llama_seq_file / load_llama_seq_file)
};

/// What the fixed header of a session file says, read without the rest of the file.
struct session_header {
    session_file_format format = session_file_format::kvcache;  ///< which of the two formats
    uint32_t version = 0;                                       ///< its format version
    uint32_t n_tokens = 0;                                      ///< tokens stored beside the state
};

/// Reads the header of a kvcache session file (72 bytes, whose own checksum is verified) or of a
/// llama.cpp sequence file (12 bytes), e.g. to size a token buffer before load_file or
/// load_llama_seq_file. Only the header is read and checked (magic, version, header checksum, and that
/// the file is long enough for the header and, for 'ggsq', its tokens): a file whose header reads well
/// can still fail to load. Throws kvc::error: io when the file cannot be read, corrupt_data for a file in
/// neither format or with a truncated or damaged header, unsupported for a version this build does not
/// read.
session_header read_session_header(const std::string& path);

/// u32 magic, u32 version, u32 n_tokens, tokens, then state_write(seq_id) with no prefix. Returns bytes.
uint64_t save_llama_seq_file(const memory_i& mem, const std::string& path, seq_id_t seq_id,
                             std::span<const token_t> tokens);
/// Restores such a file into dest; returns its tokens. Unlike llama.cpp, trailing bytes are an error; a
/// file whose state checks out but that holds more than max_tokens tokens is kvc::error(out_of_range).
/// Read in pieces, once, straight into the memory's stage of the state; a payload (the bytes after the
/// tokens) longer than mem.state_max_bytes() is kvc::error(corrupt_data) before it is read.
/// The format has no checksum: only its structure is checked (header, token count and ids, the payload's
/// checks), so a changed token, position or K/V byte loads as data. Prefer save_file / load_file.
std::vector<token_t> load_llama_seq_file(memory_i& mem, const std::string& path, seq_id_t dest,
                                         size_t max_tokens = SIZE_MAX);

}  // namespace kvc
