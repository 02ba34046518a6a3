// The state ops of `kvcache replay`: size, save, load and digest (docs/op-scripts.md).
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <kvcache/session.h>
#include <kvcache/state.h>

#include "replay_ops.h"

namespace kvc::cli {
namespace {

// FNV-1a of bytes: a short fingerprint for `digest`.
uint64_t fnv1a(std::span<const uint8_t> bytes) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (uint8_t b : bytes) h = (h ^ b) * 0x100000001b3ull;
    return h;
}

// partial=1: state_seq_flag_partial_only (the SWA part of an iswa memory, the recurrent part of a hybrid)
state_seq_flags flags_of(const keys& k) {
    return k.get_bool("partial", false) ? state_seq_flag_partial_only : 0;
}

}  // namespace

void op_size(replay_memory& m, const words& w) {
    const seq_id_t s = parse_i32(w[1], "size seq");
    const state_seq_flags flags = flags_of(keys(w, 2, {"partial"}, "size"));
    guarded("size", [&] { fmt::print("size {}\n", state_seq_get_size(*m.mem, s, flags)); });
}

// save SEQ FILE [format=buffer|session|zstd|ggsq]: llama.cpp's per-sequence buffer by default, else a
// session file (zstd: compressed) or llama.cpp's 'ggsq' file (no tokens).
void op_save(replay_memory& m, const words& w) {
    const seq_id_t s = parse_i32(w[1], "save seq");
    const std::string path(w[2]);
    const keys k(w, 3, {"format", "partial"}, "save");
    const state_seq_flags flags = flags_of(k);
    const std::string format = k.get("format").value_or("buffer");
    if (format != "buffer" && format != "session" && format != "zstd" && format != "ggsq")
        fail(fmt::format("save: format '{}' is not buffer, session, zstd or ggsq", format));
    guarded("save", [&] {
        if (format == "buffer") {
            const std::vector<uint8_t> bytes = state_seq_get_data(*m.mem, s, flags);
            io_file_writer out(path);
            out.write(bytes.data(), bytes.size());
            out.close();
            fmt::print("save {}\n", bytes.size());
        } else if (format == "ggsq") {
            if (flags) throw error(errc::unsupported, "save: 'ggsq' files hold states without flags");
            fmt::print("save {}\n", save_llama_seq_file(*m.mem, path, s, {}));
        } else {
            session_save_options o;
            o.flags = flags;
            o.compress = format == "zstd";
            fmt::print("save {}\n", save_file(*m.mem, path, s, o));
        }
    });
}

// load SEQ FILE [partial=0|1]: any file save writes, told apart by its magic (session files carry
// their flags; partial= applies to buffers).
void op_load(replay_memory& m, const words& w) {
    const seq_id_t s = parse_i32(w[1], "load seq");
    const std::string path(w[2]);
    const state_seq_flags flags = flags_of(keys(w, 3, {"partial"}, "load"));
    try {
        uint32_t magic = 0;
        uint64_t size = 0;
        {
            io_file_reader r(path);  // the magic only: session files load from the file in pieces
            size = r.size();
            if (size >= 4) r.read(&magic, 4);
        }
        if (magic == session_magic) {
            load_file(*m.mem, path, s);
        } else if (magic == llama_seq_file_magic) {
            load_llama_seq_file(*m.mem, path, s);
        } else {
            const std::vector<uint8_t> bytes = read_file_bytes(path);
            size = bytes.size();
            state_seq_set_data(*m.mem, bytes, s, flags);
        }
        fmt::print("load {}\n", size);
    } catch (const error& e) {
        fmt::print("load failed: {}\n", e.what());
    }
}

// digest SEQ: a fingerprint of the state `save SEQ` would write (its payload, without the header with
// the source id, so the same state held by two sequences has one digest)
void op_digest(replay_memory& m, const words& w) {
    const seq_id_t s = parse_i32(w[1], "digest seq");
    guarded("digest", [&] {
        const std::vector<uint8_t> bytes = state_seq_get_data(*m.mem, s);
        fmt::print("digest {:016x}\n", fnv1a(std::span(bytes).subspan(8)));
    });
}

}  // namespace kvc::cli
