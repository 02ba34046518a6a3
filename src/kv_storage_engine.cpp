// Engine-owned K/V storage: no bytes here; every row operation goes to the engine (kv_storage_engine.h).
#include <algorithm>
#include <cassert>
#include <vector>

#include <fmt/format.h>
#include <kvcache/kv_storage_engine.h>

namespace kvc {

namespace {

class engine_kv_storage final : public kv_storage {
public:
    engine_kv_storage(kv_storage_params p, std::vector<uint32_t> layer_ids, kv_storage_engine& engine)
        : kv_storage(std::move(p)), ids_(std::move(layer_ids)), engine_(engine) {
        assert(ids_.size() == params_.layers.size());
        for (uint32_t li = 0; li < params_.layers.size(); ++li)
            if (params_.layers[li].rope.type != rope_type::none) roped_.push_back(ids_[li]);
        engine_.allocate(*this, ids_);
    }

    void write(kv_part part, uint32_t, const_tensor_view, std::span<const uint64_t>) override {
        throw error(
            errc::unsupported,
            fmt::format("{}: the engine owns the K/V tensors (kv_cache_params::engine): it writes the "
                        "ubatch's rows at {} itself",
                        part == kv_part::k ? "cpy_k" : "cpy_v",
                        part == kv_part::k ? "k_idxs()" : "v_idxs()"));
    }

    void copy_rows(std::span<const row_copy> copies) override {
        if (!copies.empty())
            engine_.run({.kind = kv_op_kind::copy, .layers = ids_, .copies = copies, .shifts = {}});
    }

    void shift_k(std::span<const row_shift> shifts, const executor&) override {
        if (!shifts.empty() && !roped_.empty())
            engine_.run({.kind = kv_op_kind::shift, .layers = roped_, .copies = {}, .shifts = shifts});
    }

    void clear() override {
        engine_.run({.kind = kv_op_kind::zero, .layers = ids_, .copies = {}, .shifts = {}});
    }

    // The engine allocated every tensor in allocate(): nothing is committed or given back later.
    uint32_t commit_granule() const override { return 0; }
    void set_committed(uint32_t /*stream*/, uint32_t /*n_cells*/) override {}

    void save_k(io_write_i& io, uint32_t li, std::span<const uint64_t> rows,
                std::span<const pos_t> deltas) const override {
        const size_t row_bytes = k_row_[li];
        std::vector<std::byte> buf(rows.size() * row_bytes);
        engine_.read_rows(ids_[li], kv_part::k, rows, buf.data());
        // A row with a pending shift is saved rotated, as the host storage saves it (design D8): the same
        // decode, rotate, encode, so that the bytes are identical.
        const kv_storage_layer& l = params_.layers[li];
        if (l.rope.type != rope_type::none) {
            std::vector<float> x(e_k(li));
            ops::rope_table table;
            pos_t table_for = 0;
            for (size_t j = 0; j < deltas.size(); ++j) {
                const pos_t d = deltas[j];
                if (d == 0) continue;
                if (table.c.empty() || table_for != d) {
                    table = ops::make_rope_table(l.n_embd_head_k, d, l.rope, false);
                    table_for = d;
                }
                std::byte* p = buf.data() + j * row_bytes;
                to_f32(params_.type_k, p, x.data(), e_k(li));
                ops::apply_rope(x, l.n_head_kv, l.n_embd_head_k, table);
                from_f32(params_.type_k, x.data(), p, e_k(li));
            }
        }
        io.write(buf.data(), buf.size());
    }

    void save_v(io_write_i& io, uint32_t li, std::span<const uint64_t> rows) const override {
        std::vector<std::byte> buf(rows.size() * payload_v_row(li));
        engine_.read_rows(ids_[li], kv_part::v, rows, buf.data());
        io.write(buf.data(), buf.size());
    }

    void load(kv_part part, uint32_t li, std::span<const uint64_t> rows, const std::byte* src) override {
        engine_.write_rows(ids_[li], part, rows, src);
    }

    void read_row(kv_part part, uint32_t li, uint64_t row, std::span<float> out) const override {
        const bool is_k = part == kv_part::k;
        const uint32_t e = is_k ? e_k(li) : e_v(li);
        assert(out.size() >= e);
        // one row in the payload layout is the row itself (transposed V: its E_v channel values)
        std::vector<std::byte> buf(is_k ? k_row_[li] : payload_v_row(li));
        const uint64_t rows[1] = {row};
        engine_.read_rows(ids_[li], part, rows, buf.data());
        to_f32(is_k ? params_.type_k : params_.type_v, buf.data(), out.data(), e);
    }

    tensor_view view(kv_part part, uint32_t, uint32_t, uint32_t, uint32_t) override {
        throw error(errc::unsupported,
                    fmt::format("{}: the engine owns the K/V tensors (kv_cache_params::engine): attention "
                                "reads them there; kvcache has no view of them",
                                part == kv_part::k ? "get_k" : "get_v"));
    }

private:
    // Bytes of one V row in the state payload (transposed V: E_v elements, not the E_vmax of a cell).
    size_t payload_v_row(uint32_t li) const {
        return params_.v_trans ? type_size(params_.type_v) * e_v(li) : v_row_[li];
    }

    std::vector<uint32_t> ids_;    // model index of each layer
    std::vector<uint32_t> roped_;  // model indices of the layers whose keys carry RoPE
    kv_storage_engine& engine_;    // borrowed: outlives the storage
};

}  // namespace

std::unique_ptr<kv_storage> make_engine_kv_storage(kv_storage_params params, std::vector<uint32_t> layer_ids,
                                                   kv_storage_engine& engine) {
    if (layer_ids.size() != params.layers.size())
        throw error(errc::invalid_argument, fmt::format("make_engine_kv_storage: {} layer ids for {} layers",
                                                        layer_ids.size(), params.layers.size()));
    return std::make_unique<engine_kv_storage>(std::move(params), std::move(layer_ids), engine);
}

}  // namespace kvc
