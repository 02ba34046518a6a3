// docs/examples/session_file.cpp: a sequence saved to a session file with its tokens and restored into
// another sequence of another cache (as after a restart), then decoding continues with the same logits.
// Also: what a refused load looks like (another layout, a damaged file), and the in-memory buffer of
// llama.cpp (state_seq_get_data / state_seq_set_data). Exit status 0 when every check passed.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <kvcache/runtime/runtime.h>
#include <kvcache/runtime/tiny_model.h>
#include <kvcache/session.h>
#include <kvcache/state.h>

namespace fs = std::filesystem;

namespace {

int failures = 0;
void check(bool ok, const char* what) {
    std::printf("  [%s] %s\n", ok ? "ok" : "FAILED", what);
    if (!ok) ++failures;
}

std::string temp_path(const char* name) {
    return (fs::temp_directory_path() / ("kvc-doc-" + std::to_string(::getpid()) + "-" + name)).string();
}

}  // namespace

int main() {
    const std::string model_path = temp_path("tiny.gguf"), file = temp_path("seq.kvc");
    kvc::write_tiny_model(model_path);
    const kvc::model m = kvc::model::load(model_path);
    fs::remove(model_path);

    // the first cache decodes a prompt in sequence 0
    kvc::kv_cache a(m.cache_params(/*kv_size=*/256, /*n_seq_max=*/2));
    kvc::runtime rt_a(m, a, {.n_threads = 2});
    const std::vector<kvc::token_t> prompt = {1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100};
    rt_a.decode(kvc::batch::get_one(prompt));

    // save sequence 0 with the tokens it was computed from, compressed
    kvc::session_save_options opt;
    opt.compress = true;
    opt.tokens = prompt;
    const uint64_t bytes = kvc::save_file(a, file, /*seq_id=*/0, opt);
    std::printf("saved sequence 0 (%zu tokens) in %llu bytes\n", prompt.size(),
                static_cast<unsigned long long>(bytes));

    // another cache of the same layout (capacity and sequence count may differ) loads it into sequence 3
    kvc::kv_cache b(m.cache_params(/*kv_size=*/1024, /*n_seq_max=*/4));
    kvc::runtime rt_b(m, b, {.n_threads = 2});
    const kvc::session_info info = kvc::load_file(b, file, /*dest=*/3);
    check(info.seq_id == 0 && info.tokens == prompt, "the file names its source and holds the tokens");
    check(b.seq_pos_min(3) == 0 && b.seq_pos_max(3) == 12, "sequence 3 holds positions 0-12");

    // the next token gives the same logits in both caches
    const kvc::token_t next[] = {33};
    const kvc::decode_result ra = rt_a.decode(kvc::batch::get_one(next));
    kvc::batch_storage nb = kvc::batch::init(1, 0, 1);
    const kvc::seq_id_t seq3[] = {3};
    nb.add(next[0], b.seq_pos_max(3) + 1, seq3, true);
    const kvc::decode_result rb = rt_b.decode(nb.view());
    check(kvc::max_abs_diff(ra.logits, rb.logits) == 0.0f, "restored sequence: identical logits");

    // a cache with another K type has another layout: refused, and the cache is unchanged
    kvc::kv_cache_params pc = m.cache_params(256, 2);
    pc.type_k = kvc::dtype::f32;
    kvc::kv_cache c(pc);
    try {
        kvc::load_file(c, file, 0);
        check(false, "a layout mismatch is refused");
    } catch (const kvc::error& e) {
        check(e.code() == kvc::errc::invalid_state, "a layout mismatch is refused (invalid_state)");
        std::printf("    %s\n", e.what());
        check(c.seq_pos_max(0) == -1, "the cache is unchanged");
    }

    // a damaged file: the checksum catches it before the memory changes
    {
        std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
        const auto at = static_cast<std::streamoff>(kvc::session_header_size) + 40;  // in the body
        f.seekg(at);
        const char byte = static_cast<char>(f.get() ^ 0x01);
        f.seekp(at);
        f.put(byte);
    }
    try {
        kvc::load_file(b, file, 1);
        check(false, "a damaged file is refused");
    } catch (const kvc::error& e) {
        check(e.code() == kvc::errc::corrupt_data, "a damaged file is refused (corrupt_data)");
        check(b.seq_pos_max(1) == -1 && b.seq_pos_max(3) == 13, "the cache is unchanged");
    }
    fs::remove(file);

    // without a file: llama.cpp's per-sequence buffer (magic 0xaf143cd8, source id, payload)
    const std::vector<uint8_t> buf = kvc::state_seq_get_data(b, 3);
    kvc::state_seq_set_data(b, buf, 0);
    check(b.seq_pos_max(0) == 13 && b.cells(0).get_used() == 28, "sequence 3 copied into sequence 0");

    std::printf("%s\n", failures == 0 ? "every check passed" : "FAILED");
    return failures == 0 ? 0 : 1;
}
