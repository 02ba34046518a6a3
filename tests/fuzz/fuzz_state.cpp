// libFuzzer target: arbitrary bytes as state buffers restored into small caches (whole memory and one
// sequence, unified and per-sequence streams, transposed V and quantised types). A rejected buffer must
// leave the cache byte for byte as it was; an accepted one must save back to a buffer that restores.
// Input: one byte choosing the cache and the destination, then the payload (after the buffer's header).
#include "fuzz_caches.h"

using namespace kvc;
using namespace kvc::fuzz;

extern "C" int LLVMFuzzerInitialize(int*, char***) {
    std::vector<std::vector<uint8_t>> seeds;
    for (int v = 0; v < n_variants; ++v) {
        const auto c = make(v, true);
        for (const seq_id_t s : {seq_id_t{0}, seq_id_t{1}, seq_all}) {
            std::vector<uint8_t> seed = {static_cast<uint8_t>(v | (s == seq_all ? 2 : s) << 2)};
            const auto buf = state_seq_get_data(*c, s);
            seed.insert(seed.end(), buf.begin() + 8, buf.end());
            seeds.push_back(std::move(seed));
        }
    }
    write_seeds(seeds);
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size < 1) return 0;
    const int variant = data[0] % n_variants;
    const seq_id_t dest = (data[0] >> 2) % 3 == 2 ? seq_all : (data[0] >> 2) % 3;
    std::vector<uint8_t> buf = {0xd8, 0x3c, 0x14, 0xaf, 0, 0, 0, 0};  // magic + source id: reach the payload
    buf.insert(buf.end(), data + 1, data + size);
    auto c = make(variant);
    const std::vector<uint8_t> before = state_seq_get_data(*c, seq_all);
    try {
        state_seq_set_data(*c, buf, dest);
    } catch (const error&) {
        check(state_seq_get_data(*c, seq_all) == before);
        return 0;
    }
    const std::vector<uint8_t> saved = state_seq_get_data(*c, seq_all);
    auto fresh = make(variant);
    state_seq_set_data(*fresh, saved, seq_all);  // must not throw
    check(state_seq_get_data(*fresh, seq_all) == saved);
    return 0;
}
