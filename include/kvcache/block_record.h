/// @file
/// Block records: the value a lower tier (a block_store_i: a directory, Redis) keeps for one prefix block,
/// and the key it is kept under (docs/tiers.md).
///
/// A record carries everything needed to trust it without the process that wrote it: the layout
/// fingerprint of the rows, the namespace key, the block's chain hash, its parent's hash, its depth, its
/// tokens (a hit is verified on tokens), the K and V rows of every layer for the block's cells, and an
/// XXH3-64 checksum over all of it. Byte layout (little-endian; the header is 64 bytes):
/// @verbatim
///   0  u32 magic "KVCB"          4  u16 version (1)       6  u16 flags (0)
///   8  u64 layout fingerprint   16  u64 namespace key    24  u64 chain hash    32  u64 parent hash
///  40  u32 depth                44  u32 block_size       48  u32 layers        52  u32 zero
///  56  u64 row bytes (K and V of every layer)
///  64  tokens: block_size x i32
///      per layer, in layout order: K rows (block_size x row_size(type_k, E_k)), then V (block_size x
///      row_size(type_v, E_v); as rows, or channel-major when the layout says v_trans)
///  end - 8: u64 XXH3-64 of every byte before it
/// @endverbatim
/// Keys: `kvcb1-FFFFFFFFFFFFFFFF-KKKKKKKKKKKKKKKK-HHHHHHHHHHHHHHHH` (layout fingerprint, namespace key,
/// chain hash; 16 lower-case hex digits each): safe as a file name and as a Redis key; a store adds its
/// own prefix.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <kvcache/dtype.h>
#include <kvcache/types.h>

namespace kvc {

inline constexpr uint32_t block_record_magic = 0x4243564bu;  ///< "KVCB" in byte order
inline constexpr uint16_t block_record_version = 1;          ///< the version this build writes and reads
inline constexpr size_t block_record_header_size = 64;       ///< bytes before the tokens
inline constexpr size_t block_record_trailer_size = 8;       ///< the checksum after the rows

/// One cached layer of a block record: a model layer and the widths of its K and V rows.
struct block_layer {
    uint32_t il = 0;   ///< model layer index
    uint32_t n_k = 0;  ///< values per K row (n_head_kv x n_embd_head_k)
    uint32_t n_v = 0;  ///< values per V row (n_head_kv x n_embd_head_v)
};

/// What decides whether the rows of two caches are interchangeable: two caches whose layouts have the
/// same fingerprint may serve each other's blocks. model_id names everything the shapes do not: the
/// weights, the RoPE settings, a rotation of the keys; two different models with the same shapes must
/// differ there (e.g. XXH3-64 of the model file's name and revision, or of its tensor data).
struct block_layout {
    uint64_t model_id = 0;            ///< the model and how its keys were computed (the engine names it)
    dtype type_k = dtype::f16;        ///< element type of K rows
    dtype type_v = dtype::f16;        ///< element type of V rows
    bool v_trans = false;             ///< V bytes of a layer channel-major ([n_v][block_size]), not rows
    uint32_t block_size = 16;         ///< tokens (cells) per block
    std::vector<block_layer> layers;  ///< the cached layers, in the order their rows are stored
    /// A recurrent snapshot, not K/V rows: each layer's "K" part is its r state and its "V" part its s
    /// state after the block's last token, one row each for the whole block (a width may be 0: the layer
    /// has no such state).
    bool per_block = false;

    /// K and V bytes of one block over every layer. Throws kvc::error(invalid_argument) when a width is
    /// not whole blocks of its type, or the total exceeds UINT64_MAX / 2.
    uint64_t row_bytes() const;
    /// The whole record's size: header, tokens, rows and checksum.
    uint64_t record_bytes() const;
    /// XXH3-64 of every field (a stable serialisation, not the struct's bytes).
    uint64_t fingerprint() const;
};

/// Where a block sits: its namespace key, chain hash, parent's hash (a root's: its key) and depth.
struct block_id {
    uint64_t key = 0;          ///< the namespace key of its chain (prefix_attach's key)
    uint64_t hash = 0;         ///< its chain hash (block_chain_hash of its tokens, seeded with parent_hash)
    uint64_t parent_hash = 0;  ///< the previous block's hash; a root's is its key
    uint32_t depth = 0;        ///< it covers positions [depth * block_size, (depth + 1) * block_size)
};

/// The chain hash of a block: XXH3-64 of its tokens (int32, little-endian) seeded with seed (the parent's
/// hash, or the key for the first block): the prefix cache's and its events' hash.
uint64_t block_chain_hash(uint64_t seed, std::span<const token_t> tokens);

/// The store key of a block: `kvcb1-<fingerprint>-<key>-<hash>` (16 hex digits each).
std::string block_key(uint64_t fingerprint, uint64_t key, uint64_t hash);

/// What a key names (parse_block_key).
struct block_key_fields {
    uint64_t fingerprint = 0;  ///< the layout fingerprint
    uint64_t key = 0;          ///< the namespace key
    uint64_t hash = 0;         ///< the chain hash
};

/// The fields of a key made by block_key, or nothing when `name` is not one.
std::optional<block_key_fields> parse_block_key(std::string_view name);

/// Writes a record of `layout` for block `id` with `tokens` (block_size of them). fill(layer, is_v, dst)
/// writes layer `layer`'s K (is_v false) or V bytes of the block into dst (exactly their size), so rows
/// go from their storage into the value without another copy. Throws kvc::error(invalid_argument) when
/// the tokens are not block_size, their hash is not id.hash, or a root's parent hash is not its key.
std::vector<uint8_t> encode_block(
    const block_layout& layout, const block_id& id, std::span<const token_t> tokens,
    const std::function<void(uint32_t layer, bool is_v, std::span<uint8_t> dst)>& fill);

/// The same, with the rows given in record order (per layer K then V): exactly layout.row_bytes().
std::vector<uint8_t> encode_block(const block_layout& layout, const block_id& id,
                                  std::span<const token_t> tokens, std::span<const uint8_t> rows);

/// A verified record: views into the value it was decoded from (valid while that value lives).
struct block_view {
    block_id id;                      ///< where the block sits
    std::span<const token_t> tokens;  ///< its block_size tokens (aligned copies are not needed: int32
                                      ///< at offset 64 of a value whose storage is 8-byte aligned)
    std::span<const uint8_t> rows;    ///< K and V of every layer, in record order
    std::vector<uint64_t> offsets;    ///< [2 * layers + 1]: where layer l's K (2l) and V (2l + 1) start

    /// Layer l's K bytes (block_size rows).
    std::span<const uint8_t> k(uint32_t l) const {
        return rows.subspan(offsets[2 * l], offsets[2 * l + 1] - offsets[2 * l]);
    }
    /// Layer l's V bytes.
    std::span<const uint8_t> v(uint32_t l) const {
        return rows.subspan(offsets[2 * l + 1], offsets[2 * l + 2] - offsets[2 * l + 1]);
    }
};

/// Verifies a value and returns its view. Checks, in this order: the size is at least a header and a
/// checksum, the magic, the version, the layout fingerprint (a foreign layout), block size and layer
/// count against the layout, the row bytes, the exact size, the checksum, the tokens against the chain
/// hash, a root's parent hash against its key, and (when `expect` is given) the key, hash, parent hash
/// and depth. Throws kvc::error(corrupt_data) naming what was wrong, with both values (unsupported for
/// another version). Allocates nothing the value declares: only the layout's offsets. The value must be
/// 4-byte aligned (any vector's data is).
block_view decode_block(std::span<const uint8_t> value, const block_layout& layout,
                        const block_id* expect = nullptr);

/// A check for block_store_i values (disk_store_params::check, redis_store_params::check): true when
/// `value` decodes under `layout` and is the block its key names (fingerprint, key and hash).
std::function<bool(std::string_view key, std::span<const uint8_t> value)> block_value_check(
    block_layout layout);

}  // namespace kvc
