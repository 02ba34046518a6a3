// libFuzzer target: session files forged from their documented layout (docs/state-format.md), as anyone
// can: the fuzzer mutates the payload, and the target wraps it in an envelope whose sizes, layout,
// fingerprint and checksums are all valid, so that every input gets past the checksums (which protect
// against accidents, not forgery) and exercises the checks behind them: zstd frames and their declared
// sizes, the payload's structure. A refused file must leave the cache byte for byte as it was; an accepted
// one must restore again into a fresh cache.
//
// Input: one byte of options, then the payload. Options: bits 0-1 the cache variant (fuzz_caches.h),
// bits 2-3 the destination (0, 1 or the whole memory), bit 4 zstd, bit 5 the bytes are the stored zstd
// frame itself after a u32 declared payload size (hostile frames; else the target compresses the payload),
// bit 6 the partial-only state flag, bit 7 tokens beside the state.
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>

#include <xxhash.h>
#include <zstd.h>

#include <kvcache/session.h>
#include <kvcache/state_summary.h>

#include "fuzz_caches.h"

using namespace kvc;
using namespace kvc::fuzz;

namespace {

template <class T>
void put(std::vector<uint8_t>& f, size_t at, T v) {
    std::memcpy(f.data() + at, &v, sizeof v);
}

// A session file around `stored` (zstd or not), every length and checksum valid.
std::vector<uint8_t> forge(const std::string& layout, std::span<const uint8_t> stored, uint64_t payload_bytes,
                           bool zstd, uint32_t state_flags, std::span<const token_t> tokens) {
    std::vector<uint8_t> f(session_header_size);
    f.insert(f.end(), layout.begin(), layout.end());
    const auto* t = reinterpret_cast<const uint8_t*>(tokens.data());
    f.insert(f.end(), t, t + tokens.size_bytes());
    f.insert(f.end(), stored.begin(), stored.end());
    put<uint32_t>(f, 0, session_magic);
    put<uint32_t>(f, 4, session_version);
    put<uint32_t>(f, 8, zstd ? session_flag_zstd : 0);
    put<int32_t>(f, 12, seq_all);
    put<uint32_t>(f, 16, state_flags);
    put<uint32_t>(f, 20, static_cast<uint32_t>(tokens.size()));
    put<uint32_t>(f, 24, static_cast<uint32_t>(layout.size()));
    put<uint64_t>(f, 32, payload_bytes);
    put<uint64_t>(f, 40, stored.size());
    put<uint64_t>(f, 48, XXH3_64bits(layout.data(), layout.size()));
    put<uint64_t>(f, 56, XXH3_64bits(f.data() + session_header_size, f.size() - session_header_size));
    put<uint64_t>(f, 64, XXH3_64bits(f.data(), 64));
    return f;
}

std::string file_path() {
    const char* dir = std::getenv("TMPDIR");
    return std::string(dir ? dir : "/tmp") + "/kvc-fuzz-forged-" + std::to_string(::getpid()) + ".kvc";
}

void put_file(const std::string& path, const std::vector<uint8_t>& bytes) {
    FILE* f = std::fopen(path.c_str(), "wb");
    check(f != nullptr);
    check(std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size());
    check(std::fclose(f) == 0);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
    std::vector<std::vector<uint8_t>> seeds;
    for (int v = 0; v < n_variants; ++v) {
        const auto c = make(v, true);
        for (const seq_id_t s : {seq_id_t{0}, seq_all})
            for (const bool zstd : {false, true}) {
                const uint8_t dest = s == seq_all ? 2 : 1;
                std::vector<uint8_t> seed = {
                    static_cast<uint8_t>(v | dest << 2 | (zstd ? 1 << 4 : 0) | 1 << 7)};
                const auto buffer = state_seq_get_data(*c, s);
                seed.insert(seed.end(), buffer.begin() + 8, buffer.end());  // the payload
                seeds.push_back(std::move(seed));
            }
    }
    write_seeds(seeds);
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size < 1) return 0;
    const uint8_t opt = data[0];
    const int variant = opt & 3;
    const seq_id_t dest = (opt >> 2 & 3) == 2 ? seq_all : (opt >> 2 & 3) % 2;
    const bool zstd = opt & 16, raw_frame = zstd && (opt & 32);
    const uint32_t state_flags = opt & 64 ? state_seq_flag_partial_only : 0;
    const token_t tokens[3] = {7, 8, 9};
    const std::span<const token_t> toks =
        opt & 128 ? std::span<const token_t>(tokens) : std::span<const token_t>();
    std::span<const uint8_t> in(data + 1, size - 1);

    auto c = make(variant);
    std::vector<uint8_t> stored;
    uint64_t payload_bytes = in.size();
    if (raw_frame) {
        if (in.size() < 4) return 0;
        uint32_t declared = 0;
        std::memcpy(&declared, in.data(), 4);
        payload_bytes = declared;
        stored.assign(in.begin() + 4, in.end());
    } else if (zstd) {
        stored.resize(ZSTD_compressBound(in.size()));
        const size_t n = ZSTD_compress(stored.data(), stored.size(), in.data(), in.size(), 1);
        check(!ZSTD_isError(n));
        stored.resize(n);
    } else {
        stored.assign(in.begin(), in.end());
    }
    const auto file = forge(c->state_layout(), stored, payload_bytes, zstd, state_flags, toks);

    // the envelope always checks out: what is refused is refused for what the payload holds
    std::vector<uint8_t> payload;
    try {
        const session_info info = read_session(file, &payload);
        check(info.layout == c->state_layout() && payload.size() == payload_bytes);
        check(raw_frame || std::equal(payload.begin(), payload.end(), in.begin(), in.end()));
    } catch (const error&) {
        check(raw_frame);  // only a hostile frame can fail here
        return 0;
    }
    try {  // inspect's parser: any outcome but a crash
        (void)summarize_kv_state_any(payload);
    } catch (const error&) {}

    static const std::string path = file_path();
    put_file(path, file);
    const std::vector<uint8_t> before = state_seq_get_data(*c, seq_all);
    try {
        const session_info info = load_file(*c, path, dest);
        check(std::equal(info.tokens.begin(), info.tokens.end(), toks.begin(), toks.end()));
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
