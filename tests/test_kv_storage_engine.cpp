// Engine-owned storage (kv_storage_engine.h): the operations reach the engine in order and complete, and a
// cache whose engine applies them holds exactly the rows and state bytes of a cache with host storage.
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>
#include <kvcache/kv_cache.h>
#include <kvcache/kv_cache_iswa.h>
#include <kvcache/kv_storage_engine.h>
#include <kvcache/state.h>

namespace kvc {
namespace {

// An engine whose tensors are host storages (the layout of kv_storage.h, the reference of every
// operation); it records every operation it runs.
class host_backed_engine final : public kv_storage_engine {
public:
    struct recorded {
        kv_op_kind kind;
        std::vector<uint32_t> layers;
        std::vector<row_copy> copies;
        std::vector<row_shift> shifts;
    };

    void allocate(const kv_storage& storage, std::span<const uint32_t> layers) override {
        parts_.push_back({make_host_kv_storage(storage.params()), {layers.begin(), layers.end()}});
    }
    void run(const kv_op& op) override {
        log.push_back({op.kind,
                       {op.layers.begin(), op.layers.end()},
                       {op.copies.begin(), op.copies.end()},
                       {op.shifts.begin(), op.shifts.end()}});
        kv_storage& st = *part_of(op.layers.front()).st;
        switch (op.kind) {
            case kv_op_kind::zero:
                st.clear();
                break;
            case kv_op_kind::copy:
                st.copy_rows(op.copies);
                break;
            case kv_op_kind::shift:
                st.shift_k(op.shifts, {});
                break;
        }
    }
    void read_rows(uint32_t il, kv_part part, std::span<const uint64_t> rows, std::byte* dst) override {
        struct to_memory final : io_write_i {
            std::byte* p;
            size_t n = 0;
            explicit to_memory(std::byte* d) : p(d) {}
            void write(const void* src, size_t size) override {
                std::memcpy(p + n, src, size);
                n += size;
            }
            size_t n_bytes() const override { return n; }
        } io(dst);
        const tensors& pt = part_of(il);
        if (part == kv_part::k)
            pt.st->save_k(io, li_of(pt, il), rows, {});
        else
            pt.st->save_v(io, li_of(pt, il), rows);
    }
    void write_rows(uint32_t il, kv_part part, std::span<const uint64_t> rows,
                    const std::byte* src) override {
        const tensors& pt = part_of(il);
        pt.st->load(part, li_of(pt, il), rows, src);
    }

    // The engine's ubatch write: the context's rows, into its tensors.
    void write_ubatch(const kv_cache_context& ctx, uint32_t il, const std::vector<float>& k,
                      const std::vector<float>& v) {
        const tensors& pt = part_of(il);
        const std::vector<int64_t> idx = ctx.k_idxs();
        const std::vector<uint64_t> rows(idx.begin(), idx.end());
        const auto n = static_cast<int64_t>(rows.size());
        const uint32_t li = li_of(pt, il);
        pt.st->write(kv_part::k, li, const_tensor_view::contiguous(dtype::f32, bytes(k), pt.st->e_k(li), n),
                     rows);
        pt.st->write(kv_part::v, li, const_tensor_view::contiguous(dtype::f32, bytes(v), pt.st->e_v(li), n),
                     rows);
    }
    size_t n_allocations() const { return parts_.size(); }
    std::vector<uint32_t> layers_of(size_t i) const { return parts_[i].layers; }

    std::vector<recorded> log;

private:
    struct tensors {
        std::unique_ptr<kv_storage> st;
        std::vector<uint32_t> layers;
    };
    static const std::byte* bytes(const std::vector<float>& x) {
        return reinterpret_cast<const std::byte*>(x.data());
    }
    const tensors& part_of(uint32_t il) const {
        for (const tensors& p : parts_)
            for (uint32_t x : p.layers)
                if (x == il) return p;
        throw error(errc::out_of_range, "host_backed_engine: no such layer");
    }
    tensors& part_of(uint32_t il) { return const_cast<tensors&>(std::as_const(*this).part_of(il)); }
    static uint32_t li_of(const tensors& p, uint32_t il) {
        return static_cast<uint32_t>(std::find(p.layers.begin(), p.layers.end(), il) - p.layers.begin());
    }

    std::vector<tensors> parts_;
};

// Two layers (the second one without K/V: model index 2 is the other kept layer), f16 transposed V, one
// stream per sequence.
kv_cache_params params() {
    kv_cache_params p;
    layer_desc d{.n_head_kv = 2, .n_embd_head_k = 8, .n_embd_head_v = 8};
    d.rope.type = rope_type::neox;
    p.layers = {d, layer_desc{.n_head_kv = 1, .n_embd_head_k = 8, .n_embd_head_v = 8, .has_kv = false}, d};
    p.layers[2].n_embd_head_v = 4;  // V rows narrower than the widest: transposed V pads them
    p.kv_size = 32;
    p.n_seq_max = 3;
    p.unified = false;
    p.n_kv_pad = 8;
    return p;
}

// A host cache and an engine cache driven alike; everything they hold is compared through state bytes.
struct twin {
    host_backed_engine engine;
    kv_cache host{params()};
    kv_cache owned{[this] {
        kv_cache_params p = params();
        p.engine = &engine;
        return p;
    }()};
    std::mt19937 rng{3};

    template <class F>
    void both(F&& f) {
        f(host);
        f(owned);
    }
    // n tokens of seq s continuing it, with the same random K/V in both caches.
    void decode(seq_id_t s, uint32_t n) {
        batch_storage b = batch::init(static_cast<int32_t>(n), 0, 1);
        const seq_id_t ids[1] = {s};
        for (uint32_t i = 0; i < n; ++i)
            b.add(1, host.seq_pos_max(s) + 1 + static_cast<pos_t>(i), ids, false);
        std::uniform_real_distribution<float> u(-1, 1);
        std::vector<std::vector<float>> kv(4);  // K, V of layers 0 and 2
        for (size_t j = 0; j < kv.size(); ++j) {
            kv[j].resize(size_t{n} * (j == 3 ? 8 : 16));
            for (float& x : kv[j]) x = u(rng);
        }
        for (kv_cache* c : {&host, &owned}) {
            if (auto up = c->init_update(false); up->get_status() == memory_status::success) up->apply();
            batch_allocr balloc;
            balloc.init(b.view(), positions_of(c), {.n_seq_max = 3});
            auto ctx = c->init_batch(balloc, 64, false);
            ASSERT_EQ(ctx->get_status(), memory_status::success);
            ctx->apply();
            kv_cache_context& kc = *ctx->get_attn(0);
            for (uint32_t il : {0u, 2u}) {
                const std::vector<float>& k = kv[il == 0 ? 0 : 2];
                const std::vector<float>& v = kv[il == 0 ? 1 : 3];
                if (c == &owned) {
                    engine.write_ubatch(kc, il, k, v);
                    continue;
                }
                kc.cpy_k(il, const_tensor_view::contiguous(
                                 dtype::f32, reinterpret_cast<const std::byte*>(k.data()), 16, n));
                kc.cpy_v(il,
                         const_tensor_view::contiguous(
                             dtype::f32, reinterpret_cast<const std::byte*>(v.data()), il == 0 ? 16 : 8, n));
            }
        }
    }
    void expect_same(const char* when) {
        EXPECT_EQ(state_seq_get_data(host, seq_all), state_seq_get_data(owned, seq_all)) << when;
        for (seq_id_t s = 0; s < 3; ++s)
            EXPECT_EQ(state_seq_get_data(host, s), state_seq_get_data(owned, s)) << when << ", seq " << s;
    }
};

TEST(kv_storage_engine, every_operation_reaches_the_engine_in_order_and_the_results_match_host_storage) {
    twin t;
    ASSERT_EQ(t.engine.n_allocations(), 1u);
    EXPECT_EQ(t.engine.layers_of(0), (std::vector<uint32_t>{0, 2}));
    t.decode(0, 7);
    t.decode(1, 3);
    EXPECT_TRUE(t.engine.log.empty()) << "ubatch rows are the engine's writes, not operations";
    t.expect_same("after decoding");

    // a copy into another stream: one copy op, stream 0's rows into stream 2's
    t.both([](kv_cache& c) { c.seq_cp(0, 2, 2, 6); });
    ASSERT_EQ(t.engine.log.size(), 1u);
    EXPECT_EQ(t.engine.log[0].kind, kv_op_kind::copy);
    EXPECT_EQ(t.engine.log[0].layers, (std::vector<uint32_t>{0, 2}));
    ASSERT_EQ(t.engine.log[0].copies.size(), 4u);
    for (const row_copy& c : t.engine.log[0].copies) {
        EXPECT_LT(c.src, 32u);
        EXPECT_GE(c.dst, 64u);
    }
    t.expect_same("after seq_cp");

    // a context shift: saved rotated while pending (the engine's raw rows, rotated by kvcache), then one
    // shift op per update
    t.both([](kv_cache& c) {
        c.seq_rm(0, 1, 3);
        c.seq_add(0, 3, -1, -2);
    });
    t.expect_same("with a pending shift");
    t.both([](kv_cache& c) { c.init_update(false)->apply(); });
    ASSERT_EQ(t.engine.log.size(), 2u);
    const host_backed_engine::recorded& shift = t.engine.log[1];
    EXPECT_EQ(shift.kind, kv_op_kind::shift);
    ASSERT_EQ(shift.shifts.size(), 4u);  // positions 3..6 of seq 0
    for (const row_shift& s : shift.shifts) EXPECT_EQ(s.delta, -2);
    t.expect_same("after the K-shift");

    // compaction moves seq 0's rows down over the hole
    t.both([](kv_cache& c) { c.init_update(true)->apply(); });
    ASSERT_EQ(t.engine.log.size(), 3u);
    EXPECT_EQ(t.engine.log[2].kind, kv_op_kind::copy);
    EXPECT_EQ(t.engine.log[2].copies.size(), 2u);
    t.expect_same("after compaction");
    t.decode(0, 2);
    t.expect_same("after decoding again");

    // state restores go through write_rows; then clear(true) is a zero op
    const auto saved = state_seq_get_data(t.host, 0);
    t.both([&](kv_cache& c) { state_seq_set_data(c, saved, 1); });
    t.expect_same("after a restore into another sequence");
    const auto whole = state_seq_get_data(t.host, seq_all);
    t.both([](kv_cache& c) { c.clear(true); });
    EXPECT_EQ(t.engine.log.back().kind, kv_op_kind::zero);
    t.both([&](kv_cache& c) { state_seq_set_data(c, whole, seq_all); });
    t.expect_same("after clear and a whole restore");

    // inspection reads rows through the engine
    std::vector<float> a(16), b(16);
    for (uint32_t cell = 0; cell < 8; ++cell) {
        t.host.read_row(kv_part::v, 2, 0, cell, a);
        t.owned.read_row(kv_part::v, 2, 0, cell, b);
        EXPECT_EQ(a, b) << "cell " << cell;
        t.host.read_row(kv_part::k, 0, 1, cell, a);
        t.owned.read_row(kv_part::k, 0, 1, cell, b);
        EXPECT_EQ(a, b) << "cell " << cell;
    }
}

TEST(kv_storage_engine, the_engine_writes_and_views_rows_itself) {
    twin t;
    t.decode(0, 3);
    batch_storage b = batch::init(1, 0, 1);
    const seq_id_t ids[1] = {0};
    b.add(1, 3, ids, false);
    batch_allocr balloc;
    balloc.init(b.view(), positions_of(&t.owned), {.n_seq_max = 3});
    auto ctx = t.owned.init_batch(balloc, 8, false);
    ctx->apply();
    kv_cache_context& kc = *ctx->get_attn(0);
    const std::vector<float> row(16, 1.0f);
    try {
        kc.cpy_k(0, const_tensor_view::contiguous(dtype::f32, reinterpret_cast<const std::byte*>(row.data()),
                                                  16, 1));
        ADD_FAILURE() << "cpy_k wrote into engine-owned storage";
    } catch (const error& e) {
        EXPECT_EQ(e.code(), errc::unsupported);
        EXPECT_NE(std::string(e.what()).find("k_idxs"), std::string::npos) << e.what();
    }
    EXPECT_THROW((void)kc.get_v(2), error);
    EXPECT_EQ(kc.k_idxs(), (std::vector<int64_t>{3}));
    EXPECT_EQ(kc.v_idxs(2).size(), 16u) << "transposed V: a row per channel of the widest layer";
    EXPECT_TRUE(t.engine.log.empty());
}

TEST(kv_storage_engine, an_engine_with_an_allocator_is_refused) {
    host_backed_engine engine;
    kv_cache_params p = params();
    p.engine = &engine;
    p.allocator = &buffer_allocator::host();
    try {
        kv_cache c(p);
        ADD_FAILURE() << "made";
    } catch (const error& e) {
        EXPECT_EQ(e.code(), errc::invalid_argument);
        EXPECT_NE(std::string(e.what()).find("allocator"), std::string::npos) << e.what();
    }
    EXPECT_EQ(engine.n_allocations(), 0u);
}

TEST(kv_storage_engine, an_iswa_memory_allocates_each_cache_for_its_layers) {
    host_backed_engine engine;
    kv_cache_iswa_params p;
    p.kv = params();
    p.kv.layers[0].is_swa = true;
    p.kv.n_swa = 4;
    p.kv.swa = swa_type::standard;
    p.kv.engine = &engine;
    kv_cache_iswa mem(p);
    ASSERT_EQ(engine.n_allocations(), 2u);
    EXPECT_EQ(engine.layers_of(0), (std::vector<uint32_t>{2}));  // the base cache
    EXPECT_EQ(engine.layers_of(1), (std::vector<uint32_t>{0}));  // the SWA cache
    mem.clear(true);
    ASSERT_EQ(engine.log.size(), 2u);
    EXPECT_EQ(engine.log[0].layers, (std::vector<uint32_t>{2}));
    EXPECT_EQ(engine.log[1].layers, (std::vector<uint32_t>{0}));
}

}  // namespace
}  // namespace kvc
