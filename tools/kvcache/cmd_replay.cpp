// kvcache replay SCRIPT: runs an op script (docs/op-scripts.md, format v1) against a fresh memory and
// prints one canonical result line per operation. Script errors: `error line N: ...` on stderr, exit 2.
// The memory comes from replay_memory (the `memory` line), what an engine writes from replay_engine (or
// the runtime with model=); this file holds the op table and the decode, sequence and inspection ops;
// the state ops are in replay_state_ops.cpp.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <kvcache/batch.h>
#include <kvcache/limits.h>

#include "commands.h"
#include "files.h"
#include "replay_engine.h"
#include "replay_memory.h"
#include "replay_ops.h"
#include "replay_script.h"

namespace kvc::cli {
namespace {

void op_memory(replay_memory& m, const words& w) {
    if (m.mem) fail("'memory' given twice");
    m = make_replay_memory(w);
}

// kvc::limits for the rest of the script (any line; the keys not given keep their value)
void op_limits(replay_memory&, const words& w) {
    const keys k(w, 1, {"file_bytes", "metadata_bytes", "batch_tokens", "sequences", "memory_bytes"},
                 "limits");
    limits l = get_limits();
    const auto value = [&](const char* name, uint64_t def) {
        const int64_t v = k.get_int(name, static_cast<int64_t>(def));
        if (v < 0) fail(fmt::format("limits: {} must not be negative, got {}", name, v));
        return static_cast<uint64_t>(v);
    };
    const auto narrow = [&](const char* name, uint32_t def) {
        const uint64_t v = value(name, def);
        if (v > UINT32_MAX) fail(fmt::format("limits: {} {} does not fit 32 bits", name, v));
        return static_cast<uint32_t>(v);
    };
    l.file_bytes = value("file_bytes", l.file_bytes);
    l.metadata_bytes = value("metadata_bytes", l.metadata_bytes);
    l.batch_tokens = narrow("batch_tokens", l.batch_tokens);
    l.sequences = narrow("sequences", l.sequences);
    l.memory_bytes = value("memory_bytes", l.memory_bytes);
    try {
        set_limits(l);
        fmt::print("limits ok\n");
    } catch (const error& e) {
        fmt::print("limits failed: {}\n", e.what());
    }
}

// -- decode --

struct group {  // SEQS@POS:TOKENS of a decode line
    std::vector<seq_id_t> seqs;
    std::optional<pos_t> pos;
    std::vector<token_t> tokens;
};

// decode with a model: the real forward pass, then one `out` line per output row in batch order
void decode_model(replay_memory& m, const batch& b) {
    decode_result res;
    try {
        res = m.rt->decode(b);
    } catch (const error& e) {
        fmt::print("decode failed invalid-batch: {}\n", e.what());
        return;
    }
    if (is_fail(res.status)) {
        fmt::print("decode failed no-slot\n");
        return;
    }
    fmt::print("decode ok ubatches={}\n", res.n_ubatches);
    const uint32_t n_vocab = m.mdl->hparams().n_vocab;
    for (size_t i = 0; i < res.output_ids.size(); ++i) {
        const auto idx = static_cast<size_t>(res.output_ids[i]);
        const auto l = res.row(i, n_vocab);
        double sum = 0;
        for (float x : l) sum += x;
        fmt::print("out seq={} pos={} sum={:.6f} argmax={} first4=[{:.6f} {:.6f} {:.6f} {:.6f}]\n",
                   b.seq_id[idx][0], b.pos[idx], sum, std::max_element(l.begin(), l.end()) - l.begin(), l[0],
                   l[1], l[2], l[3]);
    }
}

void op_decode(replay_memory& m, const words& w) {
    std::string out = "last";
    std::vector<group> groups;
    for (size_t i = 1; i < w.size(); ++i) {
        if (w[i].substr(0, 4) == "out=") {
            out = std::string(w[i].substr(4));
            if (out != "last" && out != "all" && out != "none")
                fail(fmt::format("decode: out={} unknown", out));
            if (i + 1 != w.size()) fail("decode: out= must come last");
            continue;
        }
        const size_t at = w[i].find('@'), colon = w[i].find(':');
        if (at == std::string_view::npos || colon == std::string_view::npos || colon < at)
            fail(fmt::format("decode: group '{}' is not SEQS@POS:TOKENS", w[i]));
        group g;
        for (std::string_view s : split(w[i].substr(0, at), '+'))
            g.seqs.push_back(parse_i32(s, "decode seq"));
        const std::string_view pos = w[i].substr(at + 1, colon - at - 1);
        if (pos != "auto") g.pos = parse_i32(pos, "decode pos");
        for (std::string_view t : split(w[i].substr(colon + 1), ','))
            g.tokens.push_back(parse_i32(t, "decode token"));
        groups.push_back(std::move(g));
    }
    if (groups.empty()) fail("decode: no group");

    // the memory's pending work first, as an engine's decode does
    if (auto up = m.mem->init_update(/*optimize=*/false); up->get_status() == memory_status::success)
        up->apply();

    size_t n = 0, max_seqs = m.n_seq_max;
    for (const group& g : groups) {
        n += g.tokens.size();
        max_seqs = std::max(max_seqs, g.seqs.size());
    }
    std::optional<batch_storage> made;
    try {  // a batch over kvc::limits (batch_tokens, sequences) is refused like any invalid batch
        made.emplace(batch::init(static_cast<int32_t>(std::min<size_t>(n, INT32_MAX)), 0,
                                 static_cast<int32_t>(std::min<size_t>(max_seqs, INT32_MAX))));
    } catch (const error& e) {
        fmt::print("decode failed invalid-batch: {}\n", e.what());
        return;
    }
    batch_storage& b = *made;
    std::vector<uint64_t> seq_key;  // per token: its sequence set, for the synthetic rows
    try {
        for (const group& g : groups) {
            const bool known = g.seqs[0] >= 0 && static_cast<uint32_t>(g.seqs[0]) < m.n_seq_max;
            int64_t p = g.pos ? *g.pos : known ? int64_t{m.mem->seq_pos_max(g.seqs[0])} + 1 : 0;
            // positions are int32: say so rather than wrap around
            const int64_t last = p + static_cast<int64_t>(g.tokens.size()) - 1;
            if (last > std::numeric_limits<pos_t>::max())
                throw error(errc::out_of_range,
                            fmt::format("seq {}: positions {} to {} go beyond {}", g.seqs[0], p, last,
                                        std::numeric_limits<pos_t>::max()));
            const uint64_t key = seq_set_key(g.seqs);
            for (token_t t : g.tokens) {
                b.add(t, static_cast<pos_t>(p++), g.seqs, out == "all");
                seq_key.push_back(key);
            }
        }
    } catch (const error& e) {
        fmt::print("decode failed invalid-batch: {}\n", e.what());
        return;
    }
    if (out == "last") b.set_output(static_cast<int32_t>(n) - 1, true);
    if (m.rt) return decode_model(m, b.view());
    batch_allocr a;
    try {
        a.init(b.view(), positions_of(m.mem.get()), {.n_seq_max = m.n_seq_max});
    } catch (const error& e) {
        fmt::print("decode failed invalid-batch: {}\n", e.what());
        return;
    }
    auto ctx = m.mem->init_batch(a, m.n_ubatch, /*embd_all=*/false);
    if (is_fail(ctx->get_status())) {
        fmt::print("decode failed no-slot\n");
        return;
    }
    size_t n_ub = 0;
    do {
        ctx->apply();
        ++n_ub;
        run_synthetic_ubatch(*ctx, m.n_layer, seq_key);
    } while (ctx->next());
    fmt::print("decode ok ubatches={}\n", n_ub);
}

// -- sequences --

void op_rm(replay_memory& m, const words& w) {
    const seq_id_t s = parse_i32(w[1], "rm seq");
    const pos_t p0 = parse_i32(w[2], "rm p0"), p1 = parse_i32(w[3], "rm p1");
    guarded("rm", [&] { fmt::print("rm -> {}\n", m.mem->seq_rm(s, p0, p1) ? "true" : "false"); });
}

void op_cp(replay_memory& m, const words& w) {
    const seq_id_t a = parse_i32(w[1], "cp src"), b = parse_i32(w[2], "cp dst");
    const pos_t p0 = parse_i32(w[3], "cp p0"), p1 = parse_i32(w[4], "cp p1");
    guarded("cp", [&] {
        m.mem->seq_cp(a, b, p0, p1);
        fmt::print("cp ok\n");
    });
}

void op_keep(replay_memory& m, const words& w) {
    const seq_id_t s = parse_i32(w[1], "keep seq");
    guarded("keep", [&] {
        m.mem->seq_keep(s);
        fmt::print("keep ok\n");
    });
}

void op_add(replay_memory& m, const words& w) {
    const seq_id_t s = parse_i32(w[1], "add seq");
    const pos_t p0 = parse_i32(w[2], "add p0"), p1 = parse_i32(w[3], "add p1"),
                d = parse_i32(w[4], "add delta");
    guarded("add", [&] {
        m.mem->seq_add(s, p0, p1, d);
        fmt::print("add ok\n");
    });
}

void op_div(replay_memory& m, const words& w) {
    const seq_id_t s = parse_i32(w[1], "div seq");
    const pos_t p0 = parse_i32(w[2], "div p0"), p1 = parse_i32(w[3], "div p1");
    const int d = parse_i32(w[4], "div d");
    guarded("div", [&] {
        m.mem->seq_div(s, p0, p1, d);
        fmt::print("div ok\n");
    });
}

void op_clear(replay_memory& m, const words& w) {
    const keys k(w, 1, {"data"}, "clear");
    m.mem->clear(k.get_bool("data", false));
    fmt::print("clear ok\n");
}

void op_update(replay_memory& m, const words&) {
    auto up = m.mem->init_update(/*optimize=*/false);
    if (up->get_status() != memory_status::success) {
        fmt::print("update none\n");
        return;
    }
    guarded("update", [&] {
        up->apply();
        fmt::print("update ok\n");
    });
}

// -- inspection --

void op_show(replay_memory& m, const words&) {
    std::string line = "pos";
    for (seq_id_t s = 0; s < static_cast<seq_id_t>(m.n_seq_max); ++s)
        line += fmt::format(" {}:[{},{}]", s, m.mem->seq_pos_min(s), m.mem->seq_pos_max(s));
    for (const replay_part& p : m.parts)
        if (!p.used_label.empty()) line += fmt::format(" {}={}", p.used_label, p.used());
    fmt::print("{}\n", line);
}

// bytes: where the memory's bytes are (memory_breakdown), then each sequence that holds any, as SEQ:BYTES
void op_bytes(replay_memory& m, const words&) {
    const memory_breakdown b = m.mem->get_memory_breakdown();
    std::string line = fmt::format("bytes reserved={} committed={} used={} cached={} pinned={} free={}",
                                   b.reserved, b.committed, b.used, b.cached, b.pinned, b.free);
    for (size_t s = 0; s < b.seq.size(); ++s)
        if (b.seq[s] > 0) line += fmt::format(" {}:{}", s, b.seq[s]);
    fmt::print("{}\n", line);
}

// cells of a recurrent memory: `<idx> pos=<p> seqs=<a+b> hist=<states kept> rollback=<pending plane>`
void recurrent_cells(const words& w, const memory_recurrent& rec) {
    if (w.size() != 1) fail("cells: a recurrent memory has one stream");
    fmt::print("cells n={}\n", rec.get_used());
    for (uint32_t i = 0; i < rec.get_size(); ++i) {
        const auto c = rec.cell(i);
        if (c.seqs.empty()) continue;
        std::string seqs;
        for (seq_id_t s : c.seqs) seqs += (seqs.empty() ? "" : "+") + std::to_string(s);
        fmt::print("{} pos={} seqs={} hist={} rollback={}\n", i, c.pos, seqs, c.depth, c.rs_idx);
    }
}

// cells [STREAM] [part=NAME]: part= chooses a part of a memory that has several (iswa: base, swa;
// hybrid: kv, rs)
void op_cells(replay_memory& m, const words& w) {
    words args(w.begin(), w.end());
    const replay_part* part = &m.parts[0];
    if (args.size() > 1 && args.back().substr(0, 5) == "part=") {
        const std::string_view name = args.back().substr(5);
        args.pop_back();
        const auto it = std::find_if(m.parts.begin(), m.parts.end(),
                                     [&](const replay_part& p) { return p.name == name; });
        if (m.parts.size() < 2 || it == m.parts.end())
            fail(fmt::format("cells: part={} is not a part of this memory", name));
        part = &*it;
    }
    if (args.size() > 2) fail("usage: cells [STREAM] [part=base|swa|kv|rs]");
    if (part->recr) return recurrent_cells(args, *part->recr);
    const kv_cache& cache = *part->kv;
    const int64_t stream = args.size() == 2 ? parse_int(args[1], "cells stream") : 0;
    if (stream < 0 || stream >= cache.get_n_stream())
        fail(fmt::format("cells: stream {} not in [0, {})", stream, cache.get_n_stream()));
    const kv_cells& c = cache.cells(static_cast<uint32_t>(stream));
    fmt::print("cells n={}\n", c.get_used());
    std::vector<uint32_t> used;
    c.used_cells(used);
    for (uint32_t i : used) {
        std::string seqs;
        for (seq_id_t s : c.seqs(i)) {
            if (!seqs.empty()) seqs += '+';
            seqs += std::to_string(s);
        }
        fmt::print("{} pos={} seqs={} shift={}\n", i, c.pos_get(i), seqs, c.get_shift(i));
    }
}

// One operation: its name, usage and word counts (checked before the handler runs; ops with optional
// words of their own check them in the handler).
struct op {
    std::string_view name;
    const char* usage;
    size_t min_words;
    size_t max_words;
    void (*handler)(replay_memory&, const words&);
    bool needs_memory = true;
};

constexpr size_t any = SIZE_MAX;

// The op table: docs/op-scripts.md describes each op.
const op ops[] = {
    {"memory", "memory [type=kv|iswa|hybrid|recurrent] [KEY=VALUE...]", 1, any, op_memory, false},
    {"limits", "limits [file_bytes=N] [metadata_bytes=N] [batch_tokens=N] [sequences=N] [memory_bytes=N]", 1,
     6, op_limits, false},
    {"decode", "decode SEQS@POS:TOKENS [...] [out=last|all|none]", 2, any, op_decode},
    {"rm", "rm SEQ P0 P1", 4, 4, op_rm},
    {"cp", "cp SRC DST P0 P1", 5, 5, op_cp},
    {"keep", "keep SEQ", 2, 2, op_keep},
    {"add", "add SEQ P0 P1 DELTA", 5, 5, op_add},
    {"div", "div SEQ P0 P1 D", 5, 5, op_div},
    {"clear", "clear [data=0|1]", 1, any, op_clear},
    {"update", "update", 1, 1, op_update},
    {"show", "show", 1, 1, op_show},
    {"bytes", "bytes", 1, 1, op_bytes},
    {"cells", "cells [STREAM] [part=base|swa|kv|rs]", 1, any, op_cells},
    {"size", "size SEQ [partial=0|1]", 2, 3, op_size},
    {"save", "save SEQ FILE [format=buffer|session|zstd|ggsq] [partial=0|1]", 3, 5, op_save},
    {"load", "load SEQ FILE [partial=0|1]", 3, 4, op_load},
    {"digest", "digest SEQ", 2, 2, op_digest},
    {"lookup", "lookup TOKENS [key=K]", 2, 3, op_lookup},
    {"attach", "attach SEQ TOKENS [key=K] [priority=P]", 3, 5, op_attach},
    {"pin", "pin TOKENS [key=K]", 2, 3, op_pin},
    {"unpin", "unpin TOKENS [key=K]", 2, 3, op_pin},
    {"publish", "publish", 1, 1, op_publish},
    {"pstats", "pstats", 1, 1, op_pstats},
};

// Runs one line of the script; a script error throws script_error.
void run_line(replay_memory& m, std::string_view text) {
    const size_t hash = text.find('#');
    if (hash != std::string_view::npos) text = text.substr(0, hash);
    words w;
    for (std::string_view piece : split(text, ' '))
        for (std::string_view t : split(piece, '\t'))
            if (!t.empty()) w.push_back(t);
    if (w.empty()) return;
    const auto it = std::find_if(std::begin(ops), std::end(ops), [&](const op& o) { return o.name == w[0]; });
    if (it != std::end(ops) && !it->needs_memory) return it->handler(m, w);
    if (!m.mem) fail(fmt::format("'{}' before 'memory'", w[0]));
    if (it == std::end(ops)) fail(fmt::format("unknown operation '{}'", w[0]));
    if (w.size() < it->min_words || w.size() > it->max_words) fail(fmt::format("usage: {}", it->usage));
    it->handler(m, w);
}

int run_replay(const std::string& path) {
    std::ifstream file;
    std::istream* in = &std::cin;
    if (path != "-") {
        file = open_read(path, "op script");
        in = &file;
    }
    replay_memory m;
    std::string text;
    for (size_t line_no = 1; std::getline(*in, text); ++line_no) {
        try {
            run_line(m, text);
        } catch (const script_error& e) {
            std::fflush(stdout);
            std::fprintf(stderr, "error line %zu: %s\n", line_no, e.what.c_str());
            return 2;
        }
    }
    return 0;
}

}  // namespace

void add_replay_command(CLI::App& app, int& exit_code) {
    auto path = std::make_shared<std::string>();
    CLI::App* cmd =
        app.add_subcommand("replay", "Run an op script (docs/op-scripts.md) against a fresh memory");
    cmd->add_option("script", *path, "op script file, or - for standard input")->required();
    cmd->callback([path, &exit_code] { exit_code = run_replay(*path); });
}

}  // namespace kvc::cli
