// libFuzzer target: arbitrary bytes as session files (what load_file reads: envelope, checksums, zstd,
// payload), and as anything `kvcache inspect` summarises. Input: one byte of options, then the file.
// Option bit 0 recomputes the file's checksums first, so that mutations get past them and reach the
// parsing behind. A rejected file must leave the cache byte for byte as it was.
#include <cstring>

#include <xxhash.h>

#include <kvcache/session.h>
#include <kvcache/state_summary.h>

#include "fuzz_caches.h"

using namespace kvc;
using namespace kvc::fuzz;

namespace {

// Makes the checksums (and the layout fingerprint, when the layout length fits) agree with the bytes.
void fix_checksums(std::vector<uint8_t>& f) {
    if (f.size() < session_header_size) return;
    uint32_t layout_len = 0;
    std::memcpy(&layout_len, f.data() + 24, 4);
    if (layout_len <= f.size() - session_header_size) {
        const uint64_t fp = XXH3_64bits(f.data() + session_header_size, layout_len);
        std::memcpy(f.data() + 48, &fp, 8);
    }
    const uint64_t body = XXH3_64bits(f.data() + session_header_size, f.size() - session_header_size);
    std::memcpy(f.data() + 56, &body, 8);
    const uint64_t header = XXH3_64bits(f.data(), 64);
    std::memcpy(f.data() + 64, &header, 8);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
    const char* dir = std::getenv("KVC_FUZZ_SEEDS");
    if (!dir) return 0;
    std::vector<std::vector<uint8_t>> seeds;
    for (int v = 0; v < n_variants; ++v) {
        const auto c = make(v, true);
        for (const bool zstd : {false, true})
            for (const seq_id_t s : {seq_id_t{0}, seq_all}) {
                const std::string path = std::string(dir) + "/tmp.kvc";
                session_save_options o;
                o.compress = zstd;
                const token_t tokens[2] = {5, 6};
                o.tokens = tokens;
                save_file(*c, path, s, o);
                std::vector<uint8_t> seed = {static_cast<uint8_t>((v << 1) | (s == seq_all ? 2 : 0) << 3)};
                const auto file = read_file_bytes(path);
                std::remove(path.c_str());
                seed.insert(seed.end(), file.begin(), file.end());
                seeds.push_back(std::move(seed));
            }
    }
    write_seeds(seeds);
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size < 1) return 0;
    const int variant = (data[0] >> 1) % n_variants;
    const seq_id_t dest = (data[0] >> 3) % 3 == 2 ? seq_all : (data[0] >> 3) % 3;
    std::vector<uint8_t> file(data + 1, data + size);
    if (data[0] & 1) fix_checksums(file);
    try {  // inspect's parser: any outcome but a crash
        (void)summarize_kv_state_any(file);
    } catch (const error&) {}
    std::vector<uint8_t> payload;
    session_info info;
    try {
        info = read_session(file, &payload);
    } catch (const error&) {
        return 0;
    }
    check(payload.size() == info.payload_bytes);
    try {
        (void)summarize_kv_state_any(payload);
    } catch (const error&) {}
    if (!info.layout.empty()) {
        // kvcache inspect reads a zstd payload as a stream (read_session_stream): the same summary, or the
        // same error, as the payload inflated whole
        std::string whole_error, stream_error;
        memory_state_summary whole, streamed;
        try {
            whole = summarize_memory_state(payload, info.layout, info.state_flags);
        } catch (const error& e) {
            whole_error = e.what();
        }
        try {
            read_session_stream(file, [&](io_read_i& in, const session_info& i) {
                streamed = summarize_memory_state(in, i.payload_bytes, i.layout, i.state_flags);
            });
        } catch (const error& e) {
            stream_error = e.what();
        }
        check(whole_error == stream_error);
        check(whole.bytes == streamed.bytes && whole.parts.size() == streamed.parts.size());
        for (size_t i = 0; i < whole.parts.size(); ++i)
            check(whole.parts[i].bytes() == streamed.parts[i].bytes() &&
                  whole.parts[i].offset == streamed.parts[i].offset);
    }
    auto c = make(variant);
    if (info.layout != c->state_layout()) return 0;  // load_file refuses before reading the payload
    const std::vector<uint8_t> before = state_seq_get_data(*c, seq_all);
    try {
        state_set_payload(*c, payload, dest, info.state_flags);
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
