/// @file kvcache_state.h
/// @brief The C API, second half: what a memory holds per sequence, edited (llama_memory_seq_*), saved
/// and restored (llama_state_seq_*, byte-compatible with llama.cpp). Included by kvcache.h, whose
/// conventions apply; include kvcache.h.
#ifndef KVCACHE_KVCACHE_STATE_H
#define KVCACHE_KVCACHE_STATE_H

#include <kvcache/kvcache.h>

#ifdef __cplusplus
extern "C" {
#endif

// ---------------------------------------------------------------------------------------------------------
// Sequences (llama_memory_*)
// ---------------------------------------------------------------------------------------------------------

/// @brief Empties the memory (every sequence).
/// @param mem The memory.
/// @param data Also zero the stored rows (K/V, recurrent state).
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL.
KVC_API kvc_status kvc_memory_clear(kvc_memory* mem, bool data) KVC_NOEXCEPT;

/// @brief Removes positions [p0, p1) of a sequence (llama_memory_seq_rm).
/// @param mem The memory.
/// @param seq_id The sequence, or #KVC_SEQ_ALL for every sequence.
/// @param p0 First position (< 0: 0).
/// @param p1 End position, excluded (< 0: no bound).
/// @param removed Receives false when the memory cannot remove part of a sequence (recurrent or hybrid
/// memory: the last tokens of a sequence beyond what its rollback history keeps; never for a KV cache), in
/// which case nothing changed; may be NULL.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL mem; #KVC_ERR_OUT_OF_RANGE for a bad sequence id.
KVC_API kvc_status kvc_memory_seq_rm(kvc_memory* mem, int32_t seq_id, int32_t p0, int32_t p1,
                                     bool* removed) KVC_NOEXCEPT;

/// @brief Makes dst also hold src's positions [p0, p1) (llama_memory_seq_cp): shared cells in a unified
/// cache, copied cells (and rows) across streams; recurrent state is shared whole, whatever the range.
/// @param mem The memory.
/// @param src Source sequence.
/// @param dst Destination sequence.
/// @param p0 First position (< 0: 0).
/// @param p1 End position, excluded (< 0: no bound).
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL mem; #KVC_ERR_OUT_OF_RANGE for a bad sequence id;
/// #KVC_ERR_INVALID_STATE when dst's stream has too few free cells.
KVC_API kvc_status kvc_memory_seq_cp(kvc_memory* mem, int32_t src, int32_t dst, int32_t p0,
                                     int32_t p1) KVC_NOEXCEPT;

/// @brief Drops every sequence but one (llama_memory_seq_keep).
/// @param mem The memory.
/// @param seq_id The sequence to keep.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL mem; #KVC_ERR_OUT_OF_RANGE for a bad sequence id.
KVC_API kvc_status kvc_memory_seq_keep(kvc_memory* mem, int32_t seq_id) KVC_NOEXCEPT;

/// @brief Adds shift to the positions [p0, p1) of a sequence (llama_memory_seq_add); keys are re-rotated
/// by the next update (kvc_memory_init_update() / kvc_memory_update()). Cells moved below 0 are removed.
/// @param mem The memory.
/// @param seq_id The sequence.
/// @param p0 First position (< 0: 0).
/// @param p1 End position, excluded (< 0: no bound).
/// @param shift Added to each position.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL mem; #KVC_ERR_OUT_OF_RANGE for a bad sequence id;
/// #KVC_ERR_UNSUPPORTED for an M-RoPE cache.
KVC_API kvc_status kvc_memory_seq_add(kvc_memory* mem, int32_t seq_id, int32_t p0, int32_t p1,
                                      int32_t shift) KVC_NOEXCEPT;

/// @brief Divides the positions [p0, p1) of a sequence by d (llama_memory_seq_div; self-extend).
/// @param mem The memory.
/// @param seq_id The sequence.
/// @param p0 First position (< 0: 0).
/// @param p1 End position, excluded (< 0: no bound).
/// @param d Divisor (>= 1).
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL mem or d < 1; #KVC_ERR_OUT_OF_RANGE for a bad
/// sequence id; #KVC_ERR_UNSUPPORTED for an M-RoPE cache.
KVC_API kvc_status kvc_memory_seq_div(kvc_memory* mem, int32_t seq_id, int32_t p0, int32_t p1,
                                      int d) KVC_NOEXCEPT;

/// @brief Smallest position of a sequence (llama_memory_seq_pos_min).
/// @param mem The memory.
/// @param seq_id The sequence.
/// @param out Receives the position, -1 when the sequence is empty.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL pointers; #KVC_ERR_OUT_OF_RANGE for a bad sequence
/// id.
KVC_API kvc_status kvc_memory_seq_pos_min(const kvc_memory* mem, int32_t seq_id, int32_t* out) KVC_NOEXCEPT;

/// @brief Largest position of a sequence (llama_memory_seq_pos_max).
/// @param mem The memory.
/// @param seq_id The sequence.
/// @param out Receives the position, -1 when the sequence is empty.
/// @return As kvc_memory_seq_pos_min().
KVC_API kvc_status kvc_memory_seq_pos_max(const kvc_memory* mem, int32_t seq_id, int32_t* out) KVC_NOEXCEPT;

/// @brief Whether positions can be shifted (kvc_memory_seq_add / seq_div); false for M-RoPE caches and for
/// iSWA memories whose sliding-window cache is smaller than the full one (swa_full false).
/// @param mem The memory.
/// @param out Receives the answer.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL pointers.
KVC_API kvc_status kvc_memory_can_shift(const kvc_memory* mem, bool* out) KVC_NOEXCEPT;

// ---------------------------------------------------------------------------------------------------------
// State: buffers and files (llama_state_seq_*), byte-compatible with llama.cpp
// ---------------------------------------------------------------------------------------------------------

/// @brief Bytes of the state buffer of a sequence (8-byte header + payload).
/// @param mem The memory.
/// @param seq_id The sequence, or #KVC_SEQ_ALL for the whole memory.
/// @param flags State flags (#KVC_STATE_SEQ_FLAG_PARTIAL_ONLY or 0).
/// @param out Receives the size.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL pointers; #KVC_ERR_OUT_OF_RANGE for a bad sequence id.
KVC_API kvc_status kvc_state_seq_get_size(const kvc_memory* mem, int32_t seq_id, uint32_t flags,
                                          size_t* out) KVC_NOEXCEPT;

/// @brief The most bytes a state payload this memory can read may hold (a whole-memory state with every
/// cell used): what a file's declared payload is checked against before it is read
/// (memory_i::state_max_bytes).
/// @param mem The memory.
/// @param out Receives the bytes.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL pointers.
KVC_API kvc_status kvc_memory_state_max_bytes(const kvc_memory* mem, uint64_t* out) KVC_NOEXCEPT;

/// @brief Writes the state buffer of a sequence: u32 magic 0xaf143cd8, i32 seq_id, then the payload of
/// llama.cpp's layout (the payload alone starts at byte 8; see kvc_state_set_payload()).
/// @param mem The memory.
/// @param seq_id The sequence, or #KVC_SEQ_ALL for the whole memory.
/// @param dst Destination buffer.
/// @param capacity Bytes of dst (at least kvc_state_seq_get_size()).
/// @param written Receives the bytes written; may be NULL.
/// @param flags State flags.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL pointers; #KVC_ERR_OUT_OF_RANGE for a bad sequence id
/// or a buffer too small (dst then holds unspecified bytes).
KVC_API kvc_status kvc_state_seq_get_data(const kvc_memory* mem, int32_t seq_id, uint8_t* dst,
                                          size_t capacity, size_t* written, uint32_t flags) KVC_NOEXCEPT;

/// @brief Restores a state buffer into a sequence (the stored source id is not used, so a sequence
/// restores into any destination). Everything is parsed and checked before the memory changes, and every
/// byte must be consumed.
/// @param mem The memory.
/// @param src [size] the buffer.
/// @param size Bytes of src.
/// @param dest Destination sequence, or #KVC_SEQ_ALL for the whole memory (which is replaced).
/// @param flags State flags (as when the buffer was written).
/// @param read Receives the bytes read (== size); may be NULL.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL pointers; #KVC_ERR_OUT_OF_RANGE for a bad sequence
/// id; #KVC_ERR_CORRUPT_DATA for bytes that are not a valid state for this memory (truncated, damaged,
/// or other layer shapes or types; the message names the byte); #KVC_ERR_INVALID_STATE when the
/// destination has no room for the cells. The memory is unchanged on failure.
KVC_API kvc_status kvc_state_seq_set_data(kvc_memory* mem, const uint8_t* src, size_t size, int32_t dest,
                                          uint32_t flags, size_t* read) KVC_NOEXCEPT;

/// @brief Restores a raw payload (a state without its 8-byte header, as llama.cpp's memory writes it).
/// @param mem The memory.
/// @param payload [size] the payload; it must end exactly there.
/// @param size Bytes of payload.
/// @param dest Destination sequence, or #KVC_SEQ_ALL for the whole memory.
/// @param flags State flags.
/// @param read Receives the bytes read (== size); may be NULL.
/// @return As kvc_state_seq_set_data(). The memory is unchanged on failure.
KVC_API kvc_status kvc_state_set_payload(kvc_memory* mem, const uint8_t* payload, size_t size, int32_t dest,
                                         uint32_t flags, size_t* read) KVC_NOEXCEPT;

/// @brief Saves a sequence (or the whole memory) to a kvcache session file: checksummed, optionally zstd
/// compressed, with the memory's layout and the tokens it was computed from; written to a temporary file
/// that replaces path atomically.
/// @param mem The memory.
/// @param path Destination file.
/// @param seq_id The sequence, or #KVC_SEQ_ALL for the whole memory.
/// @param tokens [n_tokens] tokens stored beside the state; may be NULL when n_tokens is 0.
/// @param n_tokens Entries of tokens.
/// @param compress Compress the payload (zstd level 3).
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL pointers; #KVC_ERR_OUT_OF_RANGE for a bad sequence
/// id; #KVC_ERR_IO when the file cannot be written (path is then untouched).
KVC_API kvc_status kvc_state_seq_save_file(const kvc_memory* mem, const char* path, int32_t seq_id,
                                           const int32_t* tokens, size_t n_tokens,
                                           bool compress) KVC_NOEXCEPT;

/// @brief Loads a kvcache session file into a sequence (any destination) or the whole memory.
/// @param mem The memory.
/// @param path The file.
/// @param dest Destination sequence, or #KVC_SEQ_ALL for the whole memory.
/// @param tokens_out [capacity] receives the file's tokens; may be NULL (tokens not wanted).
/// @param capacity Entries of tokens_out; the call fails before loading anything when the file holds more
/// tokens (ignored when tokens_out is NULL).
/// @param n_tokens_out Receives the number of tokens in the file; may be NULL.
/// @return #KVC_OK; #KVC_ERR_INVALID_ARGUMENT for NULL pointers; #KVC_ERR_OUT_OF_RANGE for a bad sequence
/// id or too many tokens; #KVC_ERR_IO when the file cannot be read; #KVC_ERR_CORRUPT_DATA for a damaged
/// or foreign file; #KVC_ERR_UNSUPPORTED for an unknown format version; #KVC_ERR_INVALID_STATE for a
/// layout mismatch (both layouts are in the message). The memory is unchanged on failure.
KVC_API kvc_status kvc_state_seq_load_file(kvc_memory* mem, const char* path, int32_t dest,
                                           int32_t* tokens_out, size_t capacity,
                                           size_t* n_tokens_out) KVC_NOEXCEPT;

/// @brief Saves a sequence to a llama.cpp sequence file ('ggsq' version 2, llama_state_seq_save_file).
/// @param mem The memory.
/// @param path Destination file (replaced atomically).
/// @param seq_id The sequence (#KVC_SEQ_ALL: the whole memory, which llama.cpp cannot read back).
/// @param tokens [n_tokens] tokens stored in the file; may be NULL when n_tokens is 0.
/// @param n_tokens Entries of tokens.
/// @return As kvc_state_seq_save_file().
KVC_API kvc_status kvc_state_seq_save_llama_file(const kvc_memory* mem, const char* path, int32_t seq_id,
                                                 const int32_t* tokens, size_t n_tokens) KVC_NOEXCEPT;

/// @brief Loads a llama.cpp sequence file ('ggsq' version 2) into a sequence (llama_state_seq_load_file).
/// Unlike llama.cpp, trailing bytes are an error.
/// @param mem The memory.
/// @param path The file.
/// @param dest Destination sequence.
/// @param tokens_out [capacity] receives the file's tokens; may be NULL (tokens not wanted).
/// @param capacity Entries of tokens_out; the call fails before loading anything when the file holds more.
/// @param n_tokens_out Receives the number of tokens in the file; may be NULL.
/// @return As kvc_state_seq_load_file(). The memory is unchanged on failure.
KVC_API kvc_status kvc_state_seq_load_llama_file(kvc_memory* mem, const char* path, int32_t dest,
                                                 int32_t* tokens_out, size_t capacity,
                                                 size_t* n_tokens_out) KVC_NOEXCEPT;

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // KVCACHE_KVCACHE_STATE_H
