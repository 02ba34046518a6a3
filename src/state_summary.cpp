#include <algorithm>
#include <charconv>
#include <map>
#include <optional>

#include <fmt/format.h>
#include <kvcache/state.h>
#include <kvcache/state_summary.h>
#include "detail/state_io.h"

namespace kvc {

using detail::bad;
using detail::get;

namespace {

dtype type_at(io_read_i& io, const char* what, uint32_t il) {
    const auto id = get<int32_t>(io);
    const auto t = dtype_from_ggml(id);
    if (!t) bad(io, fmt::format("layer {} {} type {} is not a kvcache element type", il, what, id));
    return *t;
}

// What the parsers read: a payload of known length, held in memory or coming from a stream. They only
// look at its fields; tensor data is skipped.
class payload_reader : public io_read_i {
public:
    virtual uint64_t remaining() const = 0;  // bytes of the payload not read yet
    virtual void skip(uint64_t n) = 0;       // n <= remaining()
};

// A payload in memory: skipping moves past bytes without touching them.
class span_payload final : public payload_reader {
public:
    explicit span_payload(std::span<const uint8_t> payload) : r_(payload) {}
    void read(void* dst, size_t size) override { r_.read(dst, size); }
    size_t n_bytes() const override { return r_.n_bytes(); }
    uint64_t remaining() const override { return r_.remaining(); }
    void skip(uint64_t n) override {
        std::vector<std::byte> unused;  // stays empty: io_span_reader lends its bytes
        r_.read_span(static_cast<size_t>(n), unused);
    }

private:
    io_span_reader r_;
};

// A payload of `size` bytes read from a stream as it comes (a zstd frame inflated a piece at a time):
// skipped data goes through one small buffer, so that what is held stays a constant whatever the size.
class stream_payload final : public payload_reader {
public:
    stream_payload(io_read_i& in, uint64_t size) : in_(&in), size_(size) {}
    void read(void* dst, size_t size) override {
        if (size > remaining())
            throw error(
                errc::corrupt_data,
                fmt::format("state: truncated at byte {}: {} bytes needed, {} left", n_, size, remaining()));
        in_->read(dst, size);
        n_ += size;
    }
    size_t n_bytes() const override { return static_cast<size_t>(n_); }
    uint64_t remaining() const override { return size_ - n_; }
    void skip(uint64_t n) override {
        if (buf_.empty()) buf_.resize(static_cast<size_t>(std::min<uint64_t>(n, 64 * 1024)));
        for (uint64_t done = 0; done < n;) {
            const auto k = static_cast<size_t>(std::min<uint64_t>(n - done, buf_.size()));
            read(buf_.data(), k);
            done += k;
        }
    }

private:
    io_read_i* in_;
    uint64_t size_ = 0, n_ = 0;
    std::vector<uint8_t> buf_;
};

// Skips the a * b bytes of a tensor's data (what: "layer 3 K"); returns a * b.
uint64_t skip(payload_reader& r, uint64_t a, uint64_t b, const std::string& what) {
    uint64_t n = 0;
    if (__builtin_mul_overflow(a, b, &n) || n > r.remaining())
        bad(r, fmt::format("{} data of {} x {} bytes, {} left", what, a, b, r.remaining()));
    r.skip(n);
    return n;
}

}  // namespace

std::vector<std::pair<dtype, uint64_t>> state_summary::bytes_per_type() const {
    std::vector<std::pair<dtype, uint64_t>> out;
    const auto add = [&](dtype t, uint64_t n) {
        for (auto& [type, sum] : out)
            if (type == t) {
                sum += n;
                return;
            }
        out.emplace_back(t, n);
    };
    for (const layer& l : layers) {
        add(l.type_k, l.k_bytes);
        add(l.type_v, l.v_bytes);
    }
    return out;
}

namespace {

// The trailing-bytes rule of the whole-payload parsers.
void expect_end(const payload_reader& r) {
    if (r.remaining() != 0) bad(r, fmt::format("{} trailing bytes after the state", r.remaining()));
}

// A KV payload from r's position on; s.bytes is what it consumed.
state_summary read_kv(payload_reader& r, bool mrope) {
    const size_t start = r.n_bytes(), avail = r.remaining();
    state_summary s;
    s.mrope = mrope;
    const auto n_stream = get<uint32_t>(r);
    if (n_stream == 0 || n_stream > avail / 4)
        bad(r, fmt::format("{} streams in a payload of {} bytes", n_stream, avail));
    bool have_layers = false;
    for (uint32_t st = 0; st < n_stream; ++st) {
        state_summary::stream& out = s.streams.emplace_back();
        const auto count = get<uint32_t>(r);
        out.n_cells = count;
        if (count == 0) continue;
        std::map<seq_id_t, state_summary::sequence> seqs;
        for (uint32_t j = 0; j < count; ++j) {
            const auto pos = get<int32_t>(r);
            if (pos < 0) bad(r, fmt::format("cell {} of stream {} has position {}", j, st, pos));
            const auto n_ids = get<uint32_t>(r);
            if (mrope) {
                (void)get<int32_t>(r);
                (void)get<int32_t>(r);
            }
            if (n_ids > r.remaining() / 4) bad(r, fmt::format("cell {} lists {} sequence ids", j, n_ids));
            for (uint32_t q = 0; q < n_ids; ++q) {
                const auto id = get<int32_t>(r);
                if (id < 0) bad(r, fmt::format("cell {} holds seq_id {}", j, id));
                auto& seq = seqs[id];
                seq.seq = id;
                seq.pos_min = seq.n_cells == 0 ? pos : std::min(seq.pos_min, pos);
                seq.pos_max = seq.n_cells == 0 ? pos : std::max(seq.pos_max, pos);
                ++seq.n_cells;
            }
        }
        for (const auto& [id, seq] : seqs) out.seqs.push_back(seq);

        const auto v_trans = get<uint32_t>(r);
        if (v_trans > 1) bad(r, fmt::format("v_trans is {}", v_trans));
        if (have_layers && (v_trans != 0) != s.v_trans) bad(r, "streams disagree on v_trans");
        s.v_trans = v_trans != 0;
        const auto n_layer = get<uint32_t>(r);
        if (have_layers && n_layer != s.layers.size())
            bad(r, fmt::format("stream {} has {} layers, an earlier one {}", st, n_layer, s.layers.size()));
        if (!have_layers) {
            if (n_layer > r.remaining() / 12) bad(r, fmt::format("{} layers", n_layer));
            s.layers.resize(n_layer);
        }
        for (uint32_t il = 0; il < n_layer; ++il) {
            auto& l = s.layers[il];
            const dtype t = type_at(r, "K", il);
            if (have_layers && t != l.type_k)
                bad(r, fmt::format("layer {} K type differs between streams", il));
            l.type_k = t;
            l.k_bytes += skip(r, get<uint64_t>(r), count, fmt::format("layer {} K", il));
        }
        for (uint32_t il = 0; il < n_layer; ++il) {
            auto& l = s.layers[il];
            const dtype t = type_at(r, "V", il);
            if (have_layers && t != l.type_v)
                bad(r, fmt::format("layer {} V type differs between streams", il));
            l.type_v = t;
            if (!s.v_trans) {
                l.v_bytes += skip(r, get<uint64_t>(r), count, fmt::format("layer {} V", il));
            } else {
                const auto elem = get<uint32_t>(r);
                const auto e_v = get<uint32_t>(r);
                l.v_bytes += skip(r, uint64_t{elem} * e_v, count, fmt::format("layer {} V", il));
            }
        }
        have_layers = true;
    }
    s.bytes = r.n_bytes() - start;
    return s;
}

}  // namespace

state_summary summarize_kv_state(std::span<const uint8_t> payload, bool mrope) {
    span_payload r(payload);
    state_summary s = read_kv(r, mrope);
    expect_end(r);
    return s;
}

state_summary summarize_kv_state_prefix(std::span<const uint8_t> bytes, bool mrope) {
    span_payload r(bytes);
    return read_kv(r, mrope);
}

state_summary summarize_kv_state_any(std::span<const uint8_t> payload) {
    try {
        return summarize_kv_state(payload, false);
    } catch (const error& first) {
        try {
            return summarize_kv_state(payload, true);
        } catch (const error&) {
            throw first;
        }
    }
}

// -- recurrent payloads --

namespace {

using rs_kind = recurrent_state_summary::kind;

// Removes prefix from the front of s; false (s unchanged) when s does not start with it.
bool take(std::string_view& s, std::string_view prefix) {
    if (!s.starts_with(prefix)) return false;
    s.remove_prefix(prefix.size());
    return true;
}

bool take_number(std::string_view& s, uint32_t& v) {
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec != std::errc{}) return false;
    s.remove_prefix(static_cast<size_t>(end - s.data()));
    return true;
}

// Runs of consecutive layers whose r (or s) tensors have one shape, from a state_layout() line of
// memory_recurrent: "recurrent n_layer=3 layers=0-1:r=f32x6,s=f32x10;2:s=f16x4". In payload order: the r
// runs, then the s runs. Runs, not tensors: the line's numbers are not trusted to size anything.
struct layout_run {
    rs_kind k = rs_kind::r;
    uint32_t first = 0, last = 0;  // model layers
    dtype type = dtype::f32;
    uint64_t row_bytes = 0;
};

std::vector<layout_run> layout_runs(std::string_view text, uint32_t& n_layer) {
    const auto fail = [&](std::string_view why) {
        throw error(errc::corrupt_data, fmt::format("state: layout \"{}\": {}", text, why));
    };
    std::string_view s = text;
    if (!take(s, "recurrent n_layer=") || !take_number(s, n_layer) || !take(s, " layers="))
        fail("not a recurrent memory's");
    std::vector<layout_run> r, st;
    if (s == "none") s = {};
    while (!s.empty()) {
        uint32_t a = 0, b = 0;
        if (!take_number(s, a)) fail("a layer run without a first layer");
        b = a;
        if (take(s, "-") && !take_number(s, b)) fail("a layer run without a last layer");
        if (b < a || b >= n_layer) fail(fmt::format("layers {}-{} of {}", a, b, n_layer));
        if (!take(s, ":")) fail("a layer run without a shape");
        do {  // r=f32x6 or s=f16x10
            const bool is_r = take(s, "r=");
            if (!is_r && !take(s, "s=")) fail("a shape that is neither r= nor s=");
            const size_t x = s.find('x');
            const auto type = dtype_from_name(s.substr(0, x));
            uint32_t n_embd = 0;
            if (!type || x == std::string_view::npos) fail("a shape without an element type");
            s.remove_prefix(x + 1);
            if (!take_number(s, n_embd) || n_embd % block_size(*type) != 0) fail("a shape without a width");
            auto& runs = is_r ? r : st;
            runs.push_back({.k = is_r ? rs_kind::r : rs_kind::s,
                            .first = a,
                            .last = b,
                            .type = *type,
                            .row_bytes = row_size(*type, n_embd)});
        } while (take(s, ","));
        if (!s.empty() && !take(s, ";")) fail("text after a layer run");
    }
    r.insert(r.end(), st.begin(), st.end());
    return r;
}

}  // namespace

std::vector<std::pair<dtype, uint64_t>> recurrent_state_summary::bytes_per_type() const {
    std::vector<std::pair<dtype, uint64_t>> out;
    for (const tensor& t : tensors) {
        auto it = std::find_if(out.begin(), out.end(), [&](const auto& p) { return p.first == t.type; });
        if (it == out.end()) {
            out.emplace_back(t.type, 0);
            it = std::prev(out.end());
        }
        it->second += t.bytes;
    }
    return out;
}

namespace {

// A recurrent payload from r's position on; s.bytes is what it consumed. Without a layout it takes tensors
// while bytes remain (at most an r and an s per layer).
recurrent_state_summary read_recurrent(payload_reader& r, std::string_view layout) {
    const size_t start = r.n_bytes(), avail = r.remaining();
    recurrent_state_summary s;
    const auto count = get<uint32_t>(r);
    if (count > r.remaining() / 8) bad(r, fmt::format("{} cells in a payload of {} bytes", count, avail));
    std::map<seq_id_t, uint32_t> cell_of;
    for (uint32_t j = 0; j < count; ++j) {
        auto& cell = s.cells.emplace_back();
        cell.pos = get<int32_t>(r);
        const auto n_ids = get<uint32_t>(r);
        // no ids: a sequence's own state, which holds one cell (memory_recurrent::state_write)
        if (n_ids == 0 && count > 1) bad(r, fmt::format("cell {} of {} belongs to no sequence", j, count));
        if (n_ids > r.remaining() / 4) bad(r, fmt::format("cell {} lists {} sequence ids", j, n_ids));
        for (uint32_t q = 0; q < n_ids; ++q) {
            const auto id = get<int32_t>(r);
            if (id < 0) bad(r, fmt::format("cell {} holds seq_id {}", j, id));
            if (!cell_of.emplace(id, j).second)
                bad(r, fmt::format("seq_id {} has a state in two cells (or twice in cell {})", id, j));
            cell.seqs.push_back(id);
        }
    }
    for (const auto& [id, j] : cell_of) s.seqs.push_back({.seq = id, .cell = j, .pos = s.cells[j].pos});

    const auto s_trans = get<uint32_t>(r);
    if (s_trans != 0) bad(r, fmt::format("transposed s rows (s_trans = {}) are not read", s_trans));
    s.n_layer = get<uint32_t>(r);
    std::optional<std::vector<recurrent_state_summary::tensor>> want;  // what the layout promises
    if (!layout.empty()) {
        uint32_t n_layer = 0;
        const std::vector<layout_run> runs = layout_runs(layout, n_layer);
        if (n_layer != s.n_layer)
            bad(r, fmt::format("the payload has {} layers, its layout {}", s.n_layer, n_layer));
        uint64_t n = 0;
        for (const layout_run& run : runs) n += uint64_t{run.last} - run.first + 1;
        if (n > r.remaining() / 12)
            bad(r, fmt::format("the layout has {} tensors, {} bytes are left", n, r.remaining()));
        want.emplace();
        for (const layout_run& run : runs)
            for (uint64_t il = run.first; il <= run.last; ++il)
                want->push_back({.k = run.k,
                                 .il = static_cast<int32_t>(il),
                                 .type = run.type,
                                 .row_bytes = run.row_bytes});
        s.rs_split = recurrent_state_summary::split::layout;
    }
    // each tensor: i32 type, u64 row bytes, the rows of every cell; at most an r and an s per layer
    const uint64_t max_tensors = want ? want->size() : uint64_t{2} * s.n_layer;
    while (r.remaining() != 0 && s.tensors.size() < max_tensors) {
        const auto i = s.tensors.size();
        auto& t = s.tensors.emplace_back(want ? (*want)[i] : recurrent_state_summary::tensor{});
        const auto id = get<int32_t>(r);
        const auto type = dtype_from_ggml(id);
        if (!type) bad(r, fmt::format("tensor {} type {} is not a kvcache element type", i, id));
        const auto row_bytes = get<uint64_t>(r);
        if (want && (*type != t.type || row_bytes != t.row_bytes))
            bad(r, fmt::format(
                       "tensor {} ({} of layer {}) has {} rows of {} bytes, the layout says {} rows of {} "
                       "bytes",
                       i, t.k == rs_kind::r ? "r" : "s", t.il, to_string(*type), row_bytes, to_string(t.type),
                       t.row_bytes));
        t.type = *type;
        t.row_bytes = row_bytes;
        t.bytes = skip(r, row_bytes, count, fmt::format("tensor {}", i));
    }
    if (want && s.tensors.size() != want->size())
        bad(r, fmt::format("the payload ends after {} tensors, its layout has {}", s.tensors.size(),
                           want->size()));
    if (!want && s.tensors.size() == max_tensors) {
        s.rs_split = recurrent_state_summary::split::all_layers;
        for (size_t i = 0; i < s.tensors.size(); ++i) {
            s.tensors[i].k = i < s.n_layer ? rs_kind::r : rs_kind::s;
            s.tensors[i].il = static_cast<int32_t>(i % s.n_layer);
        }
    }
    s.bytes = r.n_bytes() - start;
    return s;
}

}  // namespace

recurrent_state_summary summarize_recurrent_state(std::span<const uint8_t> payload, std::string_view layout) {
    span_payload r(payload);
    recurrent_state_summary s = read_recurrent(r, layout);
    expect_end(r);
    return s;
}

recurrent_state_summary summarize_recurrent_state_prefix(std::span<const uint8_t> bytes,
                                                         std::string_view layout) {
    span_payload r(bytes);
    return read_recurrent(r, layout);
}

// -- composite payloads --

namespace {

using memory_kind = memory_state_summary::memory;

// One part to read: a KV payload (with or without M-RoPE cells) or a recurrent one (with its layout).
struct part_plan {
    const char* name = "";
    bool kv = true;
    bool mrope = false;
    std::string_view layout{};  // recurrent parts; empty: none
};

// Reads the parts back to back, then refuses trailing bytes. A part's error names the part when there
// are several; *failed_at (when given) is set to the byte reached on failure.
memory_state_summary read_parts(payload_reader& r, memory_kind kind, std::span<const part_plan> plan,
                                uint64_t* failed_at = nullptr) {
    memory_state_summary out;
    out.kind = kind;
    out.bytes = r.remaining();
    const part_plan* current = nullptr;
    try {
        for (const part_plan& p : plan) {
            current = &p;
            const uint64_t at = r.n_bytes();
            if (p.kv)
                out.parts.push_back({.name = p.name, .offset = at, .summary = read_kv(r, p.mrope)});
            else
                out.parts.push_back({.name = p.name, .offset = at, .summary = read_recurrent(r, p.layout)});
        }
        current = nullptr;
        expect_end(r);
    } catch (const error& e) {
        if (failed_at) *failed_at = r.n_bytes();
        if (current == nullptr || plan.size() == 1) throw;
        throw error(e.code(), fmt::format("{} part: {}", current->name, e.what()));
    }
    return out;
}

[[noreturn]] void bad_layout(std::string_view layout, std::string_view why) {
    throw error(errc::corrupt_data, fmt::format("state: layout \"{}\": {}", layout, why));
}

// A KV part from a kv_cache's layout line ("kv streams=1 v_trans=0 n_pos=1 ..."): n_pos > 1 means M-RoPE
// cells.
part_plan kv_part(const char* name, std::string_view layout) {
    std::string_view s = layout;
    uint32_t n_pos = 0;
    const size_t at = s.find(" n_pos=");
    if (!s.starts_with("kv ") || at == std::string_view::npos) bad_layout(layout, "not a KV cache's");
    s.remove_prefix(at + 7);
    if (!take_number(s, n_pos) || n_pos == 0) bad_layout(layout, "n_pos is not a count");
    return {.name = name, .kv = true, .mrope = n_pos > 1, .layout = {}};
}

// Splits "<head><a><sep><b>" into a and b; false when text does not have that form.
bool split_layout(std::string_view text, std::string_view head, std::string_view sep, std::string_view& a,
                  std::string_view& b) {
    if (!take(text, head)) return false;
    const size_t at = text.find(sep);
    if (at == std::string_view::npos) return false;
    a = text.substr(0, at);
    b = text.substr(at + sep.size());
    return true;
}

memory_state_summary summarize_with_layout(payload_reader& payload, std::string_view layout, bool partial) {
    std::vector<part_plan> plan;
    memory_kind kind = memory_kind::kv;
    std::string_view a, b, base, swa;
    if (layout.starts_with("kv ")) {
        plan.push_back(kv_part("kv", layout));
    } else if (layout.starts_with("recurrent ")) {
        kind = memory_kind::recurrent;
        plan.push_back({.name = "recurrent", .kv = false, .mrope = false, .layout = layout});
    } else if (layout.starts_with("iswa ")) {
        kind = memory_kind::iswa;
        if (!split_layout(layout, "iswa base=", " swa=", base, swa))
            bad_layout(layout, "not a kv_cache_iswa's");
        if (!partial) plan.push_back(kv_part("base", base));
        plan.push_back(kv_part("swa", swa));
    } else if (layout.starts_with("hybrid ")) {
        if (!split_layout(layout, "hybrid attn=", " recr=", a, b))
            bad_layout(layout, "not a memory_hybrid's");
        kind = memory_kind::hybrid;
        if (a.starts_with("iswa ")) {
            kind = memory_kind::hybrid_iswa;
            if (!split_layout(a, "iswa base=", " swa=", base, swa))
                bad_layout(layout, "not a memory_hybrid's");
            if (!partial) {
                plan.push_back(kv_part("base", base));
                plan.push_back(kv_part("swa", swa));
            }
        } else if (!partial) {
            plan.push_back(kv_part("attn", a));
        }
        plan.push_back({.name = "recr", .kv = false, .mrope = false, .layout = b});
    } else {
        throw error(errc::unsupported,
                    fmt::format("state: layout \"{}\" is none of kv, recurrent, iswa, hybrid", layout));
    }
    memory_state_summary s = read_parts(payload, kind, plan);
    s.partial_only = partial && kind != memory_kind::kv && kind != memory_kind::recurrent;
    return s;
}

// Without a layout: the compositions in order, each without and then with M-RoPE cells in its KV parts;
// the first that reads every byte wins.
memory_state_summary guess(std::span<const uint8_t> payload) {
    static constexpr part_plan kv{.name = "kv"}, recurrent{.name = "recurrent", .kv = false},
        attn{.name = "attn"}, base{.name = "base"}, swa{.name = "swa"}, recr{.name = "recr", .kv = false};
    struct composition {
        memory_kind kind;
        std::vector<part_plan> parts;
    };
    const composition order[] = {{memory_kind::kv, {kv}},
                                 {memory_kind::recurrent, {recurrent}},
                                 {memory_kind::iswa, {base, swa}},
                                 {memory_kind::hybrid, {attn, recr}},
                                 {memory_kind::hybrid_iswa, {base, swa, recr}}};
    std::optional<error> best;
    uint64_t best_at = 0;
    for (const composition& c : order) {
        std::optional<error> first;  // without M-RoPE
        uint64_t first_at = 0;
        for (const bool mrope : {false, true}) {
            std::vector<part_plan> parts = c.parts;
            bool has_kv = false;
            for (part_plan& p : parts) {
                p.mrope = mrope;
                has_kv = has_kv || p.kv;
            }
            if (mrope && !has_kv) break;
            uint64_t at = 0;
            try {
                span_payload r(payload);
                memory_state_summary s = read_parts(r, c.kind, parts, &at);
                s.guessed = true;
                return s;
            } catch (const error& e) {
                if (!first) {
                    first.emplace(e.code(), c.parts.size() == 1
                                                ? std::string(e.what())
                                                : fmt::format("read as {}: {}", to_string(c.kind), e.what()));
                    first_at = at;
                }
            }
        }
        if (!best || first_at > best_at) {
            best = first;
            best_at = first_at;
        }
    }
    throw *best;
}

}  // namespace

std::string_view to_string(memory_state_summary::memory kind) {
    switch (kind) {
        case memory_kind::kv:
            return "kv";
        case memory_kind::recurrent:
            return "recurrent";
        case memory_kind::iswa:
            return "iswa";
        case memory_kind::hybrid:
            return "hybrid";
        case memory_kind::hybrid_iswa:
            return "hybrid_iswa";
    }
    return "?";
}

memory_state_summary summarize_memory_state(std::span<const uint8_t> payload, std::string_view layout,
                                            state_seq_flags flags) {
    if (layout.empty()) return guess(payload);
    span_payload r(payload);
    return summarize_with_layout(r, layout, (flags & state_seq_flag_partial_only) != 0);
}

memory_state_summary summarize_memory_state(io_read_i& payload, uint64_t size, std::string_view layout,
                                            state_seq_flags flags) {
    if (layout.empty())
        throw error(errc::invalid_argument, "summarize_memory_state: a streamed payload needs its layout");
    stream_payload r(payload, size);
    return summarize_with_layout(r, layout, (flags & state_seq_flag_partial_only) != 0);
}

}  // namespace kvc
