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

// Skips the a * b bytes of a tensor's data (what: "layer 3 K"); returns a * b.
uint64_t skip(io_span_reader& r, uint64_t a, uint64_t b, const std::string& what) {
    uint64_t n = 0;
    if (__builtin_mul_overflow(a, b, &n) || n > r.remaining())
        bad(r, fmt::format("{} data of {} x {} bytes, {} left", what, a, b, r.remaining()));
    std::vector<std::byte> unused;
    r.read_span(static_cast<size_t>(n), unused);
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

state_summary summarize_kv_state(std::span<const uint8_t> payload, bool mrope) {
    io_span_reader r(payload);
    state_summary s;
    s.mrope = mrope;
    s.bytes = payload.size();
    const auto n_stream = get<uint32_t>(r);
    if (n_stream == 0 || n_stream > payload.size() / 4)
        bad(r, fmt::format("{} streams in a payload of {} bytes", n_stream, payload.size()));
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
    if (r.remaining() != 0) bad(r, fmt::format("{} trailing bytes after the state", r.remaining()));
    return s;
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

recurrent_state_summary summarize_recurrent_state(std::span<const uint8_t> payload, std::string_view layout) {
    io_span_reader r(payload);
    recurrent_state_summary s;
    s.bytes = payload.size();
    const auto count = get<uint32_t>(r);
    if (count > r.remaining() / 8)
        bad(r, fmt::format("{} cells in a payload of {} bytes", count, payload.size()));
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
    if (r.remaining() != 0) bad(r, fmt::format("{} trailing bytes after the state", r.remaining()));
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
    return s;
}

}  // namespace kvc
