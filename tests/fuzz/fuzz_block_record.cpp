// libFuzzer target: arbitrary bytes as block records (include/kvcache/block_record.h), the values a tier
// returns. The first byte chooses whether the target recomputes the checksum, so that mutations reach the
// checks behind it (sizes, fingerprint, tokens against the hash, a root's key). A rejected value must end in
// kvc::error; an accepted one must encode back to the same bytes and pass the stores' value check under
// its own key.
#include <cstring>

#include <xxhash.h>

#include <kvcache/block_record.h>

#include "fuzz_caches.h"

using namespace kvc;

namespace {

block_layout fuzz_layout() {
    block_layout l;
    l.model_id = 3;
    l.block_size = 4;
    l.layers = {{.il = 0, .n_k = 8, .n_v = 8}, {.il = 1, .n_k = 8, .n_v = 8}};
    return l;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
    const block_layout l = fuzz_layout();
    std::vector<std::vector<uint8_t>> seeds;
    for (const uint32_t depth : {0u, 3u}) {
        const std::vector<token_t> t{1, 2, 3, static_cast<token_t>(depth)};
        const uint64_t parent = depth == 0 ? 5 : 0x1234;
        const block_id id{
            .key = 5, .hash = block_chain_hash(parent, t), .parent_hash = parent, .depth = depth};
        std::vector<uint8_t> v{1};  // reseal
        const auto rec = encode_block(l, id, t, std::vector<uint8_t>(l.row_bytes(), 0x3c));
        v.insert(v.end(), rec.begin(), rec.end());
        seeds.push_back(v);
    }
    kvc::fuzz::write_seeds(seeds);
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size == 0) return 0;
    static const block_layout layout = fuzz_layout();
    const bool reseal = data[0] & 1;
    std::vector<uint8_t> v(data + 1, data + size);  // a vector: aligned, as every store's buffer is
    if (reseal && v.size() >= 72) {
        const uint64_t sum = XXH3_64bits(v.data(), v.size() - 8);
        std::memcpy(v.data() + v.size() - 8, &sum, 8);
    }
    block_view view;
    try {
        view = decode_block(v, layout);
    } catch (const error&) {
        return 0;
    }
    const auto again = encode_block(layout, view.id, view.tokens, view.rows);
    if (again != v) __builtin_trap();
    if (!block_value_check(layout)(block_key(layout.fingerprint(), view.id.key, view.id.hash), v))
        __builtin_trap();
    return 0;
}
