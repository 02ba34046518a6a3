// kv_tensors: the runtime as an engine that owns its K/V tensors (host memory, kv_storage.h's layout).
#include <cstring>

#include <fmt/format.h>
#include <kvcache/ops.h>
#include <kvcache/runtime/kv_tensors.h>

namespace kvc {

kv_tensors::layer& kv_tensors::at(uint32_t il) {
    if (!has_layer(il))
        throw error(errc::out_of_range, fmt::format("kv_tensors: no tensors for model layer {}", il));
    return layers_[il];
}

void kv_tensors::allocate(const kv_storage& storage, std::span<const uint32_t> layers) {
    const kv_storage_params& p = storage.params();
    for (uint32_t il : layers)
        if (has_layer(il))
            throw error(
                errc::invalid_state,
                fmt::format("kv_tensors: model layer {} already has tensors (one cache per layer)", il));
    for (uint32_t li = 0; li < layers.size(); ++li) {
        const uint32_t il = layers[li];
        if (il >= layers_.size()) layers_.resize(il + 1);
        layer& l = layers_[il];
        const kv_storage_layer& d = p.layers[li];
        l.rows = uint64_t{p.kv_size} * p.n_stream;
        l.kv_size = p.kv_size;
        l.e_k = storage.e_k(li);
        l.e_v = storage.e_v(li);
        l.e_vmax = storage.e_vmax();
        l.n_head_kv = d.n_head_kv;
        l.head_k = d.n_embd_head_k;
        l.head_v = d.n_embd_head_v;
        l.k_row = storage.k_row_bytes(li);
        l.v_row = storage.v_row_bytes(li);
        l.type_k = p.type_k;
        l.type_v = p.type_v;
        l.v_trans = p.v_trans;
        l.rope = d.rope;
        l.k = buffer(storage.bytes(kv_part::k, li), true);  // zeroed, as the host storage's
        l.v = buffer(storage.bytes(kv_part::v, li), true);
    }
}

void kv_tensors::run(const kv_op& op) {
    ++n_ops_[static_cast<size_t>(op.kind)];
    for (uint32_t il : op.layers) {
        layer& l = at(il);
        switch (op.kind) {
            case kv_op_kind::zero:
                l.k.clear_bytes();
                l.v.clear_bytes();
                break;
            case kv_op_kind::copy: {
                const size_t esz = type_size(l.type_v);
                for (const row_copy& c : op.copies) {
                    std::memcpy(l.k.data() + c.dst * l.k_row, l.k.data() + c.src * l.k_row, l.k_row);
                    if (!l.v_trans) {
                        std::memcpy(l.v.data() + c.dst * l.v_row, l.v.data() + c.src * l.v_row, l.v_row);
                        continue;
                    }
                    for (uint32_t e = 0; e < l.e_vmax; ++e)
                        std::memcpy(l.v.data() + v_trans_index(l, c.dst, e) * esz,
                                    l.v.data() + v_trans_index(l, c.src, e) * esz, esz);
                }
                break;
            }
            case kv_op_kind::shift: {
                std::vector<float> x(l.e_k);
                ops::rope_table table;
                pos_t table_for = 0;
                for (const row_shift& s : op.shifts) {
                    if (table.c.empty() || table_for != s.delta) {
                        table = ops::make_rope_table(l.head_k, s.delta, l.rope, false);
                        table_for = s.delta;
                    }
                    std::byte* p = l.k.data() + s.row * l.k_row;
                    to_f32(l.type_k, p, x.data(), l.e_k);
                    ops::apply_rope(x, l.n_head_kv, l.head_k, table);
                    from_f32(l.type_k, x.data(), p, l.e_k);
                }
                break;
            }
        }
    }
}

void kv_tensors::read_rows(uint32_t il, kv_part part, std::span<const uint64_t> rows, std::byte* dst) {
    layer& l = at(il);
    if (part == kv_part::k || !l.v_trans) {
        const size_t row = part == kv_part::k ? l.k_row : l.v_row;
        const std::byte* base = part == kv_part::k ? l.k.data() : l.v.data();
        for (size_t j = 0; j < rows.size(); ++j) std::memcpy(dst + j * row, base + rows[j] * row, row);
        return;
    }
    const size_t esz = type_size(l.type_v);
    for (uint32_t e = 0; e < l.e_v; ++e)
        for (size_t j = 0; j < rows.size(); ++j)
            std::memcpy(dst + (size_t{e} * rows.size() + j) * esz,
                        l.v.data() + v_trans_index(l, rows[j], e) * esz, esz);
}

void kv_tensors::write_rows(uint32_t il, kv_part part, std::span<const uint64_t> rows, const std::byte* src) {
    layer& l = at(il);
    if (part == kv_part::k || !l.v_trans) {
        const size_t row = part == kv_part::k ? l.k_row : l.v_row;
        std::byte* base = part == kv_part::k ? l.k.data() : l.v.data();
        for (size_t j = 0; j < rows.size(); ++j) std::memcpy(base + rows[j] * row, src + j * row, row);
        return;
    }
    const size_t esz = type_size(l.type_v);
    for (uint32_t e = 0; e < l.e_v; ++e)
        for (size_t j = 0; j < rows.size(); ++j)
            std::memcpy(l.v.data() + v_trans_index(l, rows[j], e) * esz,
                        src + (size_t{e} * rows.size() + j) * esz, esz);
}

void kv_tensors::set_rows(uint32_t il, kv_part part, std::span<const float> src,
                          std::span<const int64_t> idxs) {
    layer& l = at(il);
    const bool is_k = part == kv_part::k;
    const uint32_t e = is_k ? l.e_k : l.e_v;
    if (is_k || !l.v_trans) {
        if (src.size() != idxs.size() * e)
            throw error(
                errc::invalid_argument,
                fmt::format("kv_tensors::set_rows: {} values for {} rows of {}", src.size(), idxs.size(), e));
        const size_t row = is_k ? l.k_row : l.v_row;
        std::byte* base = is_k ? l.k.data() : l.v.data();
        for (size_t t = 0; t < idxs.size(); ++t)
            from_f32(is_k ? l.type_k : l.type_v, &src[t * e], base + static_cast<size_t>(idxs[t]) * row, e);
        return;
    }
    if (idxs.size() % l.e_vmax != 0 || src.size() != idxs.size() / l.e_vmax * e)
        throw error(errc::invalid_argument,
                    fmt::format("kv_tensors::set_rows: {} values for {} transposed V indices of {} channels",
                                src.size(), idxs.size(), l.e_vmax));
    const size_t esz = type_size(l.type_v);
    const float zero = 0.0f;
    for (size_t i = 0; i < idxs.size(); ++i) {
        const size_t t = i / l.e_vmax, c = i % l.e_vmax;
        from_f32(l.type_v, c < e ? &src[t * e + c] : &zero, l.v.data() + static_cast<size_t>(idxs[i]) * esz,
                 1);
    }
}

tensor_view kv_tensors::view(uint32_t il, kv_part part, uint32_t s0, uint32_t ns, uint32_t n_kv) {
    layer& l = at(il);
    const uint64_t first = uint64_t{s0} * l.kv_size;
    tensor_view v;
    if (part == kv_part::k || !l.v_trans) {
        const bool is_k = part == kv_part::k;
        const dtype type = is_k ? l.type_k : l.type_v;
        const uint32_t head = is_k ? l.head_k : l.head_v;
        const size_t row = is_k ? l.k_row : l.v_row;
        v.type = type;
        v.ne[0] = head;
        v.ne[1] = l.n_head_kv;
        v.ne[2] = n_kv;
        v.ne[3] = ns;
        v.nb[0] = type_size(type);
        v.nb[1] = row_size(type, head);
        v.nb[2] = row;
        v.nb[3] = row * l.kv_size;
        v.data = (is_k ? l.k.data() : l.v.data()) + first * row;
        return v;
    }
    const size_t kv = l.kv_size, esz = type_size(l.type_v);
    v.type = l.type_v;
    v.ne[0] = n_kv;  // cells fastest
    v.ne[1] = l.n_head_kv;
    v.ne[2] = l.head_v;
    v.ne[3] = ns;
    v.nb[0] = esz;
    v.nb[1] = kv * l.head_v * esz;
    v.nb[2] = kv * esz;
    v.nb[3] = kv * l.e_vmax * esz;
    v.data = l.v.data() + v_trans_index(l, first, 0) * esz;
    return v;
}

}  // namespace kvc
