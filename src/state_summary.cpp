#include <map>

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

// Skips the a * b bytes of a layer's data; returns a * b.
uint64_t skip(io_span_reader& r, uint64_t a, uint64_t b, const char* what, uint32_t il) {
    uint64_t n = 0;
    if (__builtin_mul_overflow(a, b, &n) || n > r.remaining())
        bad(r, fmt::format("layer {} {} data of {} x {} bytes, {} left", il, what, a, b, r.remaining()));
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
            l.k_bytes += skip(r, get<uint64_t>(r), count, "K", il);
        }
        for (uint32_t il = 0; il < n_layer; ++il) {
            auto& l = s.layers[il];
            const dtype t = type_at(r, "V", il);
            if (have_layers && t != l.type_v)
                bad(r, fmt::format("layer {} V type differs between streams", il));
            l.type_v = t;
            if (!s.v_trans) {
                l.v_bytes += skip(r, get<uint64_t>(r), count, "V", il);
            } else {
                const auto elem = get<uint32_t>(r);
                const auto e_v = get<uint32_t>(r);
                l.v_bytes += skip(r, uint64_t{elem} * e_v, count, "V", il);
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

}  // namespace kvc
