// kvcache inspect FILE [--json]: what a saved state holds. Reads kvcache session files, llama.cpp
// per-sequence files ('ggsq'), per-sequence state buffers (state_seq_get_data) and raw payloads, of KV
// caches, recurrent memories and the composite memories made of them (kv_cache_iswa, memory_hybrid), part
// by part. Exit status 0 for a valid file, 1 (with the reason) for anything else.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <kvcache/limits.h>
#include <kvcache/session.h>
#include <kvcache/state.h>
#include <kvcache/state_summary.h>

#include "commands.h"

namespace kvc::cli {
namespace {

using json = nlohmann::ordered_json;

struct inspect_options {
    std::string path;
    bool json = false;
};

// What the file is, whatever its kind; the payload summary (its parts) when there is one.
struct report {
    std::string format;  // kvcache-session, llama-seq-file, state-seq-buffer, <memory>-payload
    uint64_t file_bytes = 0;
    std::optional<session_info> session;
    std::optional<seq_id_t> source_seq;
    std::optional<size_t> n_tokens;
    std::optional<memory_state_summary> memory;
    std::string payload_note;  // why there is no summary
};

using memory_kind = memory_state_summary::memory;

// One part of a plain memory: printed as before composite memories existed.
bool single(const memory_state_summary& m) {
    return m.kind == memory_kind::kv || m.kind == memory_kind::recurrent;
}

template <class T>
T load_at(std::span<const uint8_t> b, size_t at) {
    T v;
    std::memcpy(&v, b.data() + at, sizeof v);
    return v;
}

// A file mapped read-only: its bytes without a copy in the process's memory (issue 20: inspect read whole
// files). Its size is checked against kvc::limits::file_bytes first.
class mapped_file {
public:
    explicit mapped_file(const std::string& path) {
        const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0) throw error(errc::io, fmt::format("cannot open '{}': {}", path, std::strerror(errno)));
        struct stat st {};
        const int rc = ::fstat(fd, &st);
        const int e = errno;
        size_ = rc == 0 ? static_cast<size_t>(st.st_size) : 0;
        void* m = nullptr;
        try {
            if (rc != 0) throw error(errc::io, fmt::format("cannot stat '{}': {}", path, std::strerror(e)));
            check_limit("bytes in the file", "file_bytes", size_, file_bytes_limit());
            if (size_ > 0 && (m = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0)) == MAP_FAILED)
                throw error(errc::io, fmt::format("cannot map '{}': {}", path, std::strerror(errno)));
        } catch (...) {
            ::close(fd);
            throw;
        }
        ::close(fd);
        data_ = static_cast<const uint8_t*>(m);
    }
    ~mapped_file() {
        if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
    }
    mapped_file(const mapped_file&) = delete;
    mapped_file& operator=(const mapped_file&) = delete;
    std::span<const uint8_t> bytes() const { return {data_, data_ ? size_ : 0}; }

private:
    const uint8_t* data_ = nullptr;
    size_t size_ = 0;
};

report examine(const std::string& path) {
    const mapped_file mapped(path);
    const std::span<const uint8_t> file = mapped.bytes();
    report r;
    r.file_bytes = file.size();
    const uint32_t magic = file.size() >= 4 ? load_at<uint32_t>(file, 0) : 0;
    std::span<const uint8_t> payload;
    if (magic == session_magic) {
        r.format = "kvcache-session";
        const auto unknown = [&](const error& e) {
            if (e.code() != errc::unsupported) throw e;
            r.payload_note = "not the payload of a memory kvcache knows (kv, recurrent, iswa, hybrid)";
        };
        // a plain payload is read in place; a zstd one is inflated a piece at a time as the summary reads
        // it, never whole (issue 21: the memory held was the payload's size, ~1.125x)
        const bool zstd = file.size() >= 12 && (load_at<uint32_t>(file, 8) & session_flag_zstd);
        if (!zstd) {
            r.session = read_session(file);
            try {
                r.memory = summarize_memory_state(file.last(static_cast<size_t>(r.session->stored_bytes)),
                                                  r.session->layout, r.session->state_flags);
            } catch (const error& e) {
                unknown(e);
            }
        } else {
            r.session = read_session_stream(file, [&](io_read_i& in, const session_info& info) {
                try {
                    // a stream is read once: without a layout (kvcache writes one always) nothing is guessed
                    if (info.layout.empty()) throw error(errc::unsupported, "no layout");
                    r.memory = summarize_memory_state(in, info.payload_bytes, info.layout, info.state_flags);
                } catch (const error& e) {
                    unknown(e);  // refused before a byte was read: the frame is still checked to its end
                    std::vector<uint8_t> buf(64 * 1024);
                    for (uint64_t left = info.payload_bytes - in.n_bytes(); left > 0;) {
                        const auto k = static_cast<size_t>(std::min<uint64_t>(left, buf.size()));
                        in.read(buf.data(), k);
                        left -= k;
                    }
                }
            });
        }
        r.source_seq = r.session->seq_id;
        r.n_tokens = r.session->tokens.size();
        return r;
    }
    if (magic == llama_seq_file_magic) {
        r.format = "llama-seq-file";
        if (file.size() < 12) throw error(errc::corrupt_data, "llama.cpp sequence file: truncated header");
        const auto version = load_at<uint32_t>(file, 4);
        if (version != llama_seq_file_version)
            throw error(errc::unsupported, fmt::format("llama.cpp sequence file version {}, expected {}",
                                                       version, llama_seq_file_version));
        const uint64_t n = load_at<uint32_t>(file, 8);
        if (n * 4 > file.size() - 12)
            throw error(errc::corrupt_data,
                        fmt::format("llama.cpp sequence file: {} tokens announced, {} bytes "
                                    "left",
                                    n, file.size() - 12));
        r.n_tokens = n;
        payload = std::span(file).subspan(12 + n * 4);
    } else if (magic == state_seq_magic) {
        r.format = "state-seq-buffer";
        if (file.size() < 8) throw error(errc::corrupt_data, "state buffer: truncated header");
        r.source_seq = load_at<int32_t>(file, 4);
        payload = std::span(file).subspan(8);
    } else {
        payload = file;
        try {
            r.memory = summarize_memory_state(payload);
            r.format = r.memory->kind == memory_kind::hybrid_iswa
                           ? std::string("hybrid-payload")
                           : fmt::format("{}-payload", to_string(r.memory->kind));
        } catch (const error& e) {
            throw error(e.code(), fmt::format("not a kvcache session file, llama.cpp sequence file, state "
                                              "buffer or memory payload ({})",
                                              e.what()));
        }
        return r;
    }
    r.memory = summarize_memory_state(payload);
    return r;
}

json to_json(const recurrent_state_summary& p) {
    static constexpr const char* kinds[] = {"r", "s", "unknown"};
    static constexpr const char* splits[] = {"layout", "all_layers", "unknown"};
    json cells = json::array();
    for (const auto& c : p.cells) cells.push_back({{"pos", c.pos}, {"seqs", c.seqs}});
    json seqs = json::array();
    for (const auto& q : p.seqs) seqs.push_back({{"seq", q.seq}, {"cell", q.cell}, {"pos", q.pos}});
    json tensors = json::array();
    for (const auto& t : p.tensors)
        tensors.push_back({{"kind", kinds[static_cast<int>(t.k)]},
                           {"layer", t.il},
                           {"type", to_string(t.type)},
                           {"row_bytes", t.row_bytes},
                           {"bytes", t.bytes}});
    json per_type = json::object();
    for (const auto& [t, n] : p.bytes_per_type()) per_type[to_string(t)] = n;
    return {{"memory", "recurrent"},         {"bytes", p.bytes},
            {"cells", std::move(cells)},     {"seqs", std::move(seqs)},
            {"n_layer", p.n_layer},          {"rs_split", splits[static_cast<int>(p.rs_split)]},
            {"tensors", std::move(tensors)}, {"bytes_per_type", per_type}};
}

json to_json(const state_summary& p) {
    json streams = json::array();
    for (const auto& st : p.streams) {
        json seqs = json::array();
        for (const auto& q : st.seqs)
            seqs.push_back(
                {{"seq", q.seq}, {"cells", q.n_cells}, {"pos_min", q.pos_min}, {"pos_max", q.pos_max}});
        streams.push_back({{"cells", st.n_cells}, {"seqs", std::move(seqs)}});
    }
    json layers = json::array();
    for (const auto& l : p.layers)
        layers.push_back({{"type_k", to_string(l.type_k)},
                          {"k_bytes", l.k_bytes},
                          {"type_v", to_string(l.type_v)},
                          {"v_bytes", l.v_bytes}});
    json per_type = json::object();
    for (const auto& [t, n] : p.bytes_per_type()) per_type[to_string(t)] = n;
    return {{"bytes", p.bytes},   {"v_trans", p.v_trans},        {"mrope", p.mrope},
            {"streams", streams}, {"layers", std::move(layers)}, {"bytes_per_type", per_type}};
}

json to_json(const memory_state_summary::part& part) {
    return part.kv() ? to_json(*part.kv()) : to_json(*part.recurrent());
}

json to_json(const std::string& path, const report& r) {
    json j;
    j["file"] = path;
    j["valid"] = true;
    j["format"] = r.format;
    j["file_bytes"] = r.file_bytes;
    if (r.session) {
        const session_info& s = *r.session;
        j["version"] = s.version;
        j["compression"] = s.file_flags & session_flag_zstd ? "zstd" : "none";
        j["stored_bytes"] = s.stored_bytes;
        j["checksum"] = {{"status", "ok"}, {"xxh3", fmt::format("{:016x}", s.checksum)}};
        j["layout"] = s.layout;
        j["layout_fingerprint"] = fmt::format("{:016x}", s.layout_fingerprint);
        j["state_flags"] = s.state_flags;
    }
    if (r.source_seq) j["source_seq"] = *r.source_seq;
    if (r.n_tokens) j["tokens"] = *r.n_tokens;
    if (!r.memory) {
        j["payload"] = {{"note", r.payload_note}};
        return j;
    }
    const memory_state_summary& m = *r.memory;
    if (single(m)) {
        j["payload"] = to_json(m.parts[0]);
        return j;
    }
    json parts = json::array();
    for (const auto& part : m.parts) {
        json one = {{"name", part.name}, {"offset", part.offset}};
        if (part.kv()) one["memory"] = "kv";
        one.update(to_json(part));  // ordered: the part's own keys follow
        parts.push_back(std::move(one));
    }
    j["payload"] = {{"memory", to_string(m.kind)},
                    {"bytes", m.bytes},
                    {"partial_only", m.partial_only},
                    {"guessed", m.guessed},
                    {"parts", std::move(parts)}};
    return j;
}

std::string human_bytes(uint64_t n) {
    if (n < 1024) return fmt::format("{} B", n);
    if (n < (uint64_t{1} << 20)) return fmt::format("{:.1f} KiB", static_cast<double>(n) / 1024);
    if (n < (uint64_t{1} << 30)) return fmt::format("{:.1f} MiB", static_cast<double>(n) / (1 << 20));
    return fmt::format("{:.2f} GiB", static_cast<double>(n) / (1 << 30));
}

// lead: the first line's start, "payload:  N bytes" or "part swa: N bytes at byte M".
void print_text(const std::string& lead, const recurrent_state_summary& p) {
    using kind = recurrent_state_summary::kind;
    fmt::print("{}, recurrent state\n", lead);
    fmt::print("cells:    {}\n", p.cells.size());
    for (size_t c = 0; c < p.cells.size(); ++c) {
        const auto& cell = p.cells[c];
        if (cell.seqs.empty())
            fmt::print("  cell {}: position {}, a sequence's state (no ids)\n", c, cell.pos);
        else
            fmt::print("  cell {}: position {}, seq{} {}\n", c, cell.pos, cell.seqs.size() == 1 ? "" : "s",
                       fmt::join(cell.seqs, " "));
    }
    if (p.rs_split == recurrent_state_summary::split::unknown) {
        fmt::print("layers:   {} ({} tensors; the payload does not say which are r and which s)\n", p.n_layer,
                   p.tensors.size());
        for (size_t i = 0; i < p.tensors.size(); ++i) {
            const auto& t = p.tensors[i];
            fmt::print("  tensor {}: {} {} ({} B/row)\n", i, to_string(t.type), human_bytes(t.bytes),
                       t.row_bytes);
        }
    } else {
        const auto n_r =
            std::count_if(p.tensors.begin(), p.tensors.end(), [](const auto& t) { return t.k == kind::r; });
        fmt::print("layers:   {} (r in {}, s in {})\n", p.n_layer, n_r,
                   p.tensors.size() - static_cast<size_t>(n_r));
        // one line per layer with state: its r and s tensors
        std::map<int32_t, std::string> lines;
        for (const auto& t : p.tensors) {
            std::string& line = lines[t.il];
            line += fmt::format("{}{} {} {} ({} B/row)", line.empty() ? "" : ", ", t.k == kind::r ? "r" : "s",
                                to_string(t.type), human_bytes(t.bytes), t.row_bytes);
        }
        for (const auto& [il, line] : lines) fmt::print("  {:3}: {}\n", il, line);
    }
    fmt::print("by type:");
    for (const auto& [t, n] : p.bytes_per_type()) fmt::print(" {} {}", to_string(t), human_bytes(n));
    fmt::print("\n");
}

void print_text(const std::string& lead, const memory_state_summary::part& part) {
    if (part.recurrent()) {
        print_text(lead, *part.recurrent());
        return;
    }
    const state_summary& p = *part.kv();
    fmt::print("{}, {} stream{}, V {}transposed{}\n", lead, p.streams.size(),
               p.streams.size() == 1 ? "" : "s", p.v_trans ? "" : "not ", p.mrope ? ", M-RoPE cells" : "");
    for (size_t s = 0; s < p.streams.size(); ++s) {
        const auto& st = p.streams[s];
        if (st.n_cells == 0 && p.streams.size() > 1) continue;
        fmt::print("stream {}: {} cells\n", s, st.n_cells);
        for (const auto& q : st.seqs)
            fmt::print("  seq {}: {} cells, positions [{}, {}]\n", q.seq, q.n_cells, q.pos_min, q.pos_max);
    }
    fmt::print("layers:   {}\n", p.layers.size());
    for (size_t il = 0; il < p.layers.size(); ++il) {
        const auto& l = p.layers[il];
        fmt::print("  {:3}: K {} {}, V {} {}\n", il, to_string(l.type_k), human_bytes(l.k_bytes),
                   to_string(l.type_v), human_bytes(l.v_bytes));
    }
    fmt::print("by type:");
    for (const auto& [t, n] : p.bytes_per_type()) fmt::print(" {} {}", to_string(t), human_bytes(n));
    fmt::print("\n");
}

void print_text(const std::string& path, const report& r) {
    fmt::print("file:     {} ({} bytes)\n", path, r.file_bytes);
    static constexpr const char* names[][2] = {
        {"kvcache-session", "kvcache session file"},
        {"llama-seq-file", "llama.cpp sequence file ('ggsq', version 2)"},
        {"state-seq-buffer", "per-sequence state buffer (magic 0xaf143cd8)"},
        {"kv-payload", "raw KV cache state payload"},
        {"recurrent-payload", "raw recurrent state payload"},
        {"iswa-payload", "raw kv_cache_iswa state payload"},
        {"hybrid-payload", "raw memory_hybrid state payload"}};
    for (const auto& [id, name] : names)
        if (r.format == id) fmt::print("format:   {}\n", name);
    if (r.session) {
        const session_info& s = *r.session;
        fmt::print("version:  {}\n", s.version);
        if (s.file_flags & session_flag_zstd)
            fmt::print("stored:   zstd, {} of {} payload bytes ({:.1f}%)\n", s.stored_bytes, s.payload_bytes,
                       s.payload_bytes ? 100.0 * static_cast<double>(s.stored_bytes) /
                                             static_cast<double>(s.payload_bytes)
                                       : 0.0);
        else
            fmt::print("stored:   uncompressed\n");
        fmt::print("checksum: ok (xxh3 {:016x})\n", s.checksum);
        fmt::print("layout:   {}\n", s.layout);
    }
    if (r.source_seq) {
        if (*r.source_seq < 0)
            fmt::print("source:   the whole memory\n");
        else
            fmt::print("source:   seq {}\n", *r.source_seq);
    }
    if (r.n_tokens) fmt::print("tokens:   {}\n", *r.n_tokens);
    if (!r.memory) {
        fmt::print("payload:  {}\n", r.payload_note);
        return;
    }
    const memory_state_summary& m = *r.memory;
    if (single(m)) {
        print_text(fmt::format("payload:  {} bytes", m.bytes), m.parts[0]);
        return;
    }
    const char* memory = m.kind == memory_kind::iswa     ? "kv_cache_iswa state"
                         : m.kind == memory_kind::hybrid ? "memory_hybrid state"
                                                         : "memory_hybrid state with iSWA attention";
    const char* only = !m.partial_only               ? ""
                       : m.kind == memory_kind::iswa ? ", the SWA part only (partial)"
                                                     : ", the recurrent part only (partial)";
    std::vector<std::string_view> part_names;
    for (const auto& part : m.parts) part_names.push_back(part.name);
    fmt::print("payload:  {} bytes, {}{}: {}{}\n", m.bytes, memory, only, fmt::join(part_names, " + "),
               m.guessed ? " (guessed: the file has no layout)" : "");
    for (const auto& part : m.parts)
        print_text(fmt::format("part {}: {} bytes at byte {}", part.name, part.bytes(), part.offset), part);
}

}  // namespace

void add_inspect_command(CLI::App& app, int& exit_code) {
    auto opt = std::make_shared<inspect_options>();
    CLI::App* cmd = app.add_subcommand(
        "inspect",
        "Summarise a saved state: session file, llama.cpp 'ggsq' file, state buffer or raw payload");
    cmd->add_option("FILE", opt->path, "the file")->required();
    cmd->add_flag("--json", opt->json, "print JSON");
    cmd->callback([opt, &exit_code] {
        try {
            const report r = examine(opt->path);
            if (opt->json)
                fmt::print("{}\n", to_json(opt->path, r).dump(2));
            else
                print_text(opt->path, r);
        } catch (const error& e) {
            exit_code = 1;
            if (opt->json) {
                json j;
                j["file"] = opt->path;
                j["valid"] = false;
                j["error"] = e.what();
                fmt::print("{}\n", j.dump(2));
            }
            std::fprintf(stderr, "kvcache inspect: %s: %s\n", opt->path.c_str(), e.what());
        }
    });
}

}  // namespace kvc::cli
