#include <kvcache/block_record.h>

#include <bit>
#include <charconv>
#include <cstring>

#include <fmt/format.h>
#include <xxhash.h>

#include "detail/byte_fields.h"

namespace kvc {

static_assert(std::endian::native == std::endian::little, "block records are little-endian, as the host");
static_assert(sizeof(token_t) == 4);

namespace {

// header fields (block_record.h)
constexpr size_t field_magic = 0, field_version = 4, field_flags = 6, field_fingerprint = 8, field_key = 16,
                 field_hash = 24, field_parent = 32, field_depth = 40, field_block_size = 44,
                 field_layers = 48, field_zero = 52, field_row_bytes = 56;

using detail::load_at;
using detail::store_at;

[[noreturn]] void refuse(errc code, const std::string& what) {
    throw error(code, "block record: " + what);
}

// K and V bytes of one layer of a block.
uint64_t layer_bytes(dtype t, uint32_t n, uint32_t rows, bool may_be_empty, uint32_t il, const char* which) {
    if (n == 0 && may_be_empty) return 0;
    if (n == 0 || n % static_cast<uint64_t>(kvc::block_size(t)) != 0)
        throw error(errc::invalid_argument,
                    fmt::format("block layout: layer {} has {} {} values per row, not a positive multiple of "
                                "{}'s blocks of {}",
                                il, n, which, to_string(t), kvc::block_size(t)));
    return uint64_t{row_size(t, n)} * rows;
}

// Where each layer's K and V start in the rows, and their end.
std::vector<uint64_t> offsets_of(const block_layout& layout) {
    std::vector<uint64_t> off;
    off.reserve(2 * layout.layers.size() + 1);
    uint64_t at = 0;
    // K/V: a row per token; a snapshot: one state row per layer (r as K, s as V)
    const uint32_t rows = layout.per_block ? 1 : layout.block_size;
    for (const block_layer& l : layout.layers) {
        off.push_back(at);
        at += layer_bytes(layout.type_k, l.n_k, rows, layout.per_block, l.il, "K");
        off.push_back(at);
        at += layer_bytes(layout.type_v, l.n_v, rows, layout.per_block, l.il, "V");
        if (at > UINT64_MAX / 4)
            throw error(errc::invalid_argument, "block layout: the rows of a block exceed 2^62 bytes");
    }
    off.push_back(at);
    return off;
}

void check_layout(const block_layout& layout) {
    if (layout.block_size == 0 || layout.block_size > (1u << 20))
        throw error(errc::invalid_argument,
                    fmt::format("block layout: block_size {} is not in [1, 1048576]", layout.block_size));
    if (layout.layers.empty()) throw error(errc::invalid_argument, "block layout: no layers");
    if (layout.v_trans && layout.per_block)
        throw error(errc::invalid_argument, "block layout: a snapshot's states have no channel-major V");
    if (layout.v_trans && is_quantized(layout.type_v))
        throw error(errc::invalid_argument,
                    fmt::format("block layout: channel-major V needs a float type, not {}",
                                to_string(layout.type_v)));
}

std::string hex(uint64_t v) {
    return fmt::format("{:016x}", v);
}

}  // namespace

uint64_t block_layout::row_bytes() const {
    check_layout(*this);
    return offsets_of(*this).back();
}

uint64_t block_layout::record_bytes() const {
    return block_record_header_size + uint64_t{block_size} * sizeof(token_t) + row_bytes() +
           block_record_trailer_size;
}

uint64_t block_layout::fingerprint() const {
    // every field, each at a fixed width, so that no two layouts serialise alike
    std::vector<uint64_t> words{block_record_version,
                                model_id,
                                static_cast<uint64_t>(type_k),
                                static_cast<uint64_t>(type_v),
                                v_trans ? 1u : 0u,
                                block_size,
                                layers.size()};
    for (const block_layer& l : layers) {
        words.push_back(l.il);
        words.push_back(l.n_k);
        words.push_back(l.n_v);
    }
    if (per_block) words.push_back(0x534e4150);  // "SNAP": K/V layouts keep the fingerprints they had
    return XXH3_64bits(words.data(), words.size() * sizeof(uint64_t));
}

uint64_t block_chain_hash(uint64_t seed, std::span<const token_t> tokens) {
    return XXH3_64bits_withSeed(tokens.data(), tokens.size_bytes(), seed);
}

std::string block_key(uint64_t fingerprint, uint64_t key, uint64_t hash) {
    return fmt::format("kvcb1-{:016x}-{:016x}-{:016x}", fingerprint, key, hash);
}

std::optional<block_key_fields> parse_block_key(std::string_view name) {
    constexpr std::string_view prefix = "kvcb1-";
    if (name.size() != prefix.size() + 3 * 16 + 2 || name.substr(0, prefix.size()) != prefix)
        return std::nullopt;
    uint64_t v[3];
    for (int i = 0; i < 3; ++i) {
        const size_t at = prefix.size() + static_cast<size_t>(i) * 17;
        if (i < 2 && name[at + 16] != '-') return std::nullopt;
        for (size_t j = at; j < at + 16; ++j)  // from_chars takes upper case and signs; keys have neither
            if (!((name[j] >= '0' && name[j] <= '9') || (name[j] >= 'a' && name[j] <= 'f')))
                return std::nullopt;
        std::from_chars(name.data() + at, name.data() + at + 16, v[i], 16);
    }
    return block_key_fields{.fingerprint = v[0], .key = v[1], .hash = v[2]};
}

std::vector<uint8_t> encode_block(const block_layout& layout, const block_id& id,
                                  std::span<const token_t> tokens,
                                  const std::function<void(uint32_t, bool, std::span<uint8_t>)>& fill) {
    check_layout(layout);
    if (tokens.size() != layout.block_size)
        throw error(errc::invalid_argument, fmt::format("block record: {} tokens for a block of {}",
                                                        tokens.size(), layout.block_size));
    const uint64_t h = block_chain_hash(id.parent_hash, tokens);
    if (h != id.hash)
        throw error(errc::invalid_argument,
                    fmt::format("block record: hash {} given, the tokens seeded with parent {} hash to {}",
                                hex(id.hash), hex(id.parent_hash), hex(h)));
    if (id.depth == 0 && id.parent_hash != id.key)
        throw error(errc::invalid_argument,
                    fmt::format("block record: a root's parent hash {} is not its key {}",
                                hex(id.parent_hash), hex(id.key)));
    const std::vector<uint64_t> off = offsets_of(layout);
    const uint64_t rows = off.back();
    const size_t at_rows = block_record_header_size + tokens.size_bytes();
    std::vector<uint8_t> out(at_rows + rows + block_record_trailer_size);
    const std::span<uint8_t> b(out);
    store_at<uint32_t>(b, field_magic, block_record_magic);
    store_at<uint16_t>(b, field_version, block_record_version);
    store_at<uint16_t>(b, field_flags, 0);
    store_at<uint64_t>(b, field_fingerprint, layout.fingerprint());
    store_at<uint64_t>(b, field_key, id.key);
    store_at<uint64_t>(b, field_hash, id.hash);
    store_at<uint64_t>(b, field_parent, id.parent_hash);
    store_at<uint32_t>(b, field_depth, id.depth);
    store_at<uint32_t>(b, field_block_size, layout.block_size);
    store_at<uint32_t>(b, field_layers, static_cast<uint32_t>(layout.layers.size()));
    store_at<uint32_t>(b, field_zero, 0);
    store_at<uint64_t>(b, field_row_bytes, rows);
    std::memcpy(out.data() + block_record_header_size, tokens.data(), tokens.size_bytes());
    for (uint32_t l = 0; l < layout.layers.size(); ++l)
        for (const bool is_v : {false, true}) {
            const uint64_t from = off[2 * l + (is_v ? 1 : 0)], to = off[2 * l + (is_v ? 2 : 1)];
            fill(l, is_v, b.subspan(at_rows + from, to - from));
        }
    const size_t n = out.size() - block_record_trailer_size;
    store_at<uint64_t>(b, n, XXH3_64bits(out.data(), n));
    return out;
}

std::vector<uint8_t> encode_block(const block_layout& layout, const block_id& id,
                                  std::span<const token_t> tokens, std::span<const uint8_t> rows) {
    const uint64_t need = layout.row_bytes();
    if (rows.size() != need)
        throw error(errc::invalid_argument,
                    fmt::format("block record: {} row bytes given, the layout has {}", rows.size(), need));
    const std::vector<uint64_t> off = offsets_of(layout);
    return encode_block(layout, id, tokens, [&](uint32_t l, bool is_v, std::span<uint8_t> dst) {
        std::memcpy(dst.data(), rows.data() + off[2 * l + (is_v ? 1 : 0)], dst.size());
    });
}

block_view decode_block(std::span<const uint8_t> value, const block_layout& layout, const block_id* expect) {
    constexpr size_t least = block_record_header_size + block_record_trailer_size;
    if (value.size() < least)
        refuse(errc::corrupt_data,
               fmt::format("{} bytes, fewer than a header and a checksum ({})", value.size(), least));
    const uint32_t magic = load_at<uint32_t>(value, field_magic);
    if (magic != block_record_magic)
        refuse(errc::corrupt_data,
               fmt::format("magic {:#010x}, not \"KVCB\" ({:#010x})", magic, block_record_magic));
    const uint16_t version = load_at<uint16_t>(value, field_version);
    if (version != block_record_version)
        refuse(errc::unsupported,
               fmt::format("version {}, this build reads {}", version, block_record_version));
    const uint64_t fp = load_at<uint64_t>(value, field_fingerprint), want_fp = layout.fingerprint();
    if (fp != want_fp)
        refuse(errc::corrupt_data,
               fmt::format("layout fingerprint {}, this cache's is {}: written by another model or layout",
                           hex(fp), hex(want_fp)));
    if (load_at<uint16_t>(value, field_flags) != 0 || load_at<uint32_t>(value, field_zero) != 0)
        refuse(errc::corrupt_data, "reserved header fields are not zero");
    const uint32_t bs = load_at<uint32_t>(value, field_block_size),
                   n_layers = load_at<uint32_t>(value, field_layers);
    if (bs != layout.block_size || n_layers != layout.layers.size())
        refuse(errc::corrupt_data, fmt::format("block of {} tokens and {} layers, the layout has {} and {}",
                                               bs, n_layers, layout.block_size, layout.layers.size()));
    std::vector<uint64_t> off = offsets_of(layout);
    const uint64_t rows = load_at<uint64_t>(value, field_row_bytes);
    if (rows != off.back())
        refuse(errc::corrupt_data, fmt::format("{} row bytes, the layout has {}", rows, off.back()));
    const uint64_t size = layout.record_bytes();
    if (value.size() != size)
        refuse(errc::corrupt_data,
               fmt::format("{} bytes, a record of this layout has {}", value.size(), size));
    const size_t n = value.size() - block_record_trailer_size;
    const uint64_t stored = load_at<uint64_t>(value, n), sum = XXH3_64bits(value.data(), n);
    if (stored != sum)
        refuse(errc::corrupt_data,
               fmt::format("checksum mismatch (stored {}, computed {})", hex(stored), hex(sum)));
    if (reinterpret_cast<uintptr_t>(value.data()) % alignof(token_t) != 0)
        throw error(errc::invalid_argument, "block record: the value is not 4-byte aligned");
    block_view v;
    v.id = {.key = load_at<uint64_t>(value, field_key),
            .hash = load_at<uint64_t>(value, field_hash),
            .parent_hash = load_at<uint64_t>(value, field_parent),
            .depth = load_at<uint32_t>(value, field_depth)};
    v.tokens = {reinterpret_cast<const token_t*>(value.data() + block_record_header_size), bs};
    const uint64_t h = block_chain_hash(v.id.parent_hash, v.tokens);
    if (h != v.id.hash)
        refuse(errc::corrupt_data, fmt::format("hash {} stored, the tokens seeded with parent {} hash to {}",
                                               hex(v.id.hash), hex(v.id.parent_hash), hex(h)));
    if (v.id.depth == 0 && v.id.parent_hash != v.id.key)
        refuse(errc::corrupt_data, fmt::format("a root's parent hash {} is not its key {}",
                                               hex(v.id.parent_hash), hex(v.id.key)));
    if (expect) {
        const block_id& e = *expect;
        if (v.id.key != e.key || v.id.hash != e.hash || v.id.parent_hash != e.parent_hash ||
            v.id.depth != e.depth)
            refuse(errc::corrupt_data,
                   fmt::format(
                       "holds block key {} hash {} parent {} depth {}, expected key {} hash {} parent {} "
                       "depth {}",
                       hex(v.id.key), hex(v.id.hash), hex(v.id.parent_hash), v.id.depth, hex(e.key),
                       hex(e.hash), hex(e.parent_hash), e.depth));
    }
    v.rows = value.subspan(block_record_header_size + size_t{bs} * sizeof(token_t), rows);
    v.offsets = std::move(off);
    return v;
}

std::function<bool(std::string_view, std::span<const uint8_t>)> block_value_check(block_layout layout) {
    const uint64_t fp = layout.fingerprint();
    return [layout = std::move(layout), fp](std::string_view key, std::span<const uint8_t> value) {
        const std::optional<block_key_fields> k = parse_block_key(key);
        if (!k || k->fingerprint != fp) return false;
        try {
            const block_view v = decode_block(value, layout);
            return v.id.key == k->key && v.id.hash == k->hash;
        } catch (const error&) {
            return false;
        }
    };
}

}  // namespace kvc
