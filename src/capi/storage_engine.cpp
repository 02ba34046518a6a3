// The C API of engine-owned storage (kvcache_engine.h): a C engine's callbacks behind the C++
// kv_storage_engine, and the row indices an engine writes a ubatch's K/V at.
#include <cstddef>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

#include "capi_impl.h"

using namespace kvc::capi;
using kvc::errc;

// Operations hand the engine the C++ arrays themselves: the structs must match.
static_assert(std::is_standard_layout_v<kvc_row_copy> && std::is_standard_layout_v<kvc::row_copy>);
static_assert(sizeof(kvc_row_copy) == sizeof(kvc::row_copy));
static_assert(alignof(kvc_row_copy) == alignof(kvc::row_copy));
static_assert(offsetof(kvc_row_copy, src) == offsetof(kvc::row_copy, src));
static_assert(offsetof(kvc_row_copy, dst) == offsetof(kvc::row_copy, dst));
static_assert(std::is_standard_layout_v<kvc_row_shift> && std::is_standard_layout_v<kvc::row_shift>);
static_assert(sizeof(kvc_row_shift) == sizeof(kvc::row_shift));
static_assert(alignof(kvc_row_shift) == alignof(kvc::row_shift));
static_assert(offsetof(kvc_row_shift, delta) == offsetof(kvc::row_shift, delta));
static_assert(offsetof(kvc_row_shift, row) == offsetof(kvc::row_shift, row));
static_assert(std::is_same_v<decltype(kvc_row_shift::delta), kvc::pos_t>);

namespace {

kvc_kv_part to_c(kvc::kv_part p) {
    return p == kvc::kv_part::k ? KVC_KV_PART_K : KVC_KV_PART_V;
}

class c_storage_engine final : public kvc::kv_storage_engine {
public:
    explicit c_storage_engine(const kvc_storage_engine& c) : c_(c) {}

    void allocate(const kvc::kv_storage& storage, std::span<const uint32_t> layers) override {
        const kvc::kv_storage_params& p = storage.params();
        std::vector<size_t> k_row, v_row;
        for (uint32_t li = 0; li < layers.size(); ++li) {
            k_row.push_back(storage.k_row_bytes(li));
            v_row.push_back(storage.v_row_bytes(li));
        }
        const kvc_storage_shape shape{.layers = layers.data(),
                                      .n_layers = layers.size(),
                                      .type_k = static_cast<kvc_type>(p.type_k),
                                      .type_v = static_cast<kvc_type>(p.type_v),
                                      .v_trans = p.v_trans,
                                      .kv_size = p.kv_size,
                                      .n_stream = p.n_stream,
                                      .e_vmax = storage.e_vmax(),
                                      .k_row_bytes = k_row.data(),
                                      .v_row_bytes = v_row.data()};
        if (!c_.allocate(&shape, c_.user_data))
            throw_error(errc::out_of_memory,
                        fmt::format("the engine's allocate refused the tensors of {} layers of {} rows",
                                    layers.size(), uint64_t{p.kv_size} * p.n_stream));
    }

    void run(const kvc::kv_op& op) override {
        const auto ptr = [](const auto& s) { return s.empty() ? nullptr : s.data(); };
        const kvc_storage_op c{.kind = static_cast<kvc_storage_op_kind>(op.kind),
                               .layers = ptr(op.layers),
                               .n_layers = op.layers.size(),
                               .copies = reinterpret_cast<const kvc_row_copy*>(ptr(op.copies)),
                               .n_copies = op.copies.size(),
                               .shifts = reinterpret_cast<const kvc_row_shift*>(ptr(op.shifts)),
                               .n_shifts = op.shifts.size()};
        c_.run(&c, c_.user_data);
    }

    void read_rows(uint32_t il, kvc::kv_part part, std::span<const uint64_t> rows, std::byte* dst) override {
        if (!c_.read_rows(il, to_c(part), rows.data(), rows.size(), dst, c_.user_data))
            throw_error(errc::io, fmt::format("the engine's read_rows failed for {} rows of layer {}'s {}",
                                              rows.size(), il, part == kvc::kv_part::k ? "K" : "V"));
    }

    void write_rows(uint32_t il, kvc::kv_part part, std::span<const uint64_t> rows,
                    const std::byte* src) override {
        c_.write_rows(il, to_c(part), rows.data(), rows.size(), src, c_.user_data);
    }

private:
    kvc_storage_engine c_;
};

void copy_idxs(const std::vector<int64_t>& idx, int64_t* dst, size_t n) {
    need_ptr(dst, "dst");
    if (n != idx.size())
        throw_error(errc::invalid_argument,
                    fmt::format("n = {}: the current ubatch has {} indices", n, idx.size()));
    std::copy(idx.begin(), idx.end(), dst);
}

}  // namespace

namespace kvc::capi {

std::unique_ptr<kv_storage_engine> to_cpp(const kvc_storage_engine* c, const char* name) {
    if (c == nullptr) return nullptr;
    const auto missing = [&](const char* field) {
        throw_error(errc::invalid_argument,
                    fmt::format("{}->{} is NULL (every callback is required)", name, field));
    };
    if (c->allocate == nullptr) missing("allocate");
    if (c->run == nullptr) missing("run");
    if (c->read_rows == nullptr) missing("read_rows");
    if (c->write_rows == nullptr) missing("write_rows");
    return std::make_unique<c_storage_engine>(*c);
}

}  // namespace kvc::capi

kvc_status kvc_memory_k_idxs(const kvc_memory_context* ctx, uint32_t il, int64_t* dst, size_t n) noexcept {
    return guarded(__func__, [&] { copy_idxs(attn_of(need(ctx, "ctx"), il).k_idxs(), dst, n); });
}

int64_t kvc_memory_v_idxs_elements(const kvc_memory_context* ctx, uint32_t il) noexcept {
    return guarded_count(__func__, [&] {
        const kvc::kv_cache_context& k = attn_of(need(ctx, "ctx"), il);
        const int64_t n_tokens = static_cast<int64_t>(k.k_idxs().size());
        return k.cache().params().v_trans ? n_tokens * k.cache().storage().e_vmax() : n_tokens;
    });
}

kvc_status kvc_memory_v_idxs(const kvc_memory_context* ctx, uint32_t il, int64_t* dst, size_t n) noexcept {
    return guarded(__func__, [&] { copy_idxs(attn_of(need(ctx, "ctx"), il).v_idxs(il), dst, n); });
}
