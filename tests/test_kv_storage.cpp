// Elastic host storage (kv_storage.h): memory arrives with the first write of a row and goes back to the
// system when a stream's used extent shrinks; mincore says which pages are resident.
#include <sys/mman.h>
#include <unistd.h>

#include <vector>

#include <gtest/gtest.h>
#include <kvcache/kv_cache.h>

#include "kv_cache_test_util.h"

namespace kvc {
namespace {

size_t resident_pages(const std::byte* p, size_t n) {
    const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    std::vector<unsigned char> in((n + page - 1) / page);
    if (::mincore(const_cast<std::byte*>(p), n, in.data()) != 0) ADD_FAILURE() << "mincore failed";
    size_t count = 0;
    for (unsigned char c : in) count += c & 1;
    return count;
}

// One layer whose K and V rows are a page each (1024 f32), V not transposed: a granule of 16 cells.
kv_cache_params page_rows(uint32_t kv_size) {
    kv_cache_params p = small_params(kv_size);
    p.layers[0].n_head_kv = 4;
    p.layers[0].n_embd_head_k = p.layers[0].n_embd_head_v = 256;
    p.v_trans = false;
    return p;
}

// Decodes n tokens into seq 0 with rows of ones; returns the K tensor's first byte.
const std::byte* decode(kv_cache& c, uint32_t n) {
    const pos_t p0 = c.seq_pos_max(0) + 1;
    std::vector<pos_t> pos;
    for (uint32_t i = 0; i < n; ++i) pos.push_back(p0 + static_cast<pos_t>(i));
    auto ctx = c.init_ubatches({make_ub(pos, std::vector<seq_id_t>(n, 0))}, {});
    EXPECT_EQ(ctx->get_status(), memory_status::success);
    ctx->apply();
    kv_cache_context& kc = *ctx->get_attn(0);
    const std::vector<float> rows(size_t{n} * 1024, 1.0f);
    const auto src =
        const_tensor_view::contiguous(dtype::f32, reinterpret_cast<const std::byte*>(rows.data()), 1024, n);
    kc.cpy_k(0, src);
    kc.cpy_v(0, src);
    return kc.get_k(0).data;
}

TEST(kv_storage, host_memory_follows_the_used_cells) {
    if (::sysconf(_SC_PAGESIZE) != 4096) GTEST_SKIP() << "rows are sized for 4 KiB pages";
    kv_cache c(page_rows(1024));
    ASSERT_EQ(c.storage().commit_granule(), 16u);
    const size_t k_bytes = c.size_bytes(kv_part::k), cell = 8192;
    EXPECT_EQ(c.get_memory_breakdown().committed, 0u);
    const std::byte* k = decode(c, 100);
    EXPECT_EQ(resident_pages(k, k_bytes), 100u);  // one page per written row, nothing else
    EXPECT_EQ(c.get_memory_breakdown().committed, 112 * cell);

    // growth keeps every row where it was
    EXPECT_EQ(decode(c, 20), k);
    EXPECT_EQ(resident_pages(k, k_bytes), 120u);

    c.seq_rm(0, 50, -1);  // extent 50: the mark drops to 64, the rows above go back
    EXPECT_EQ(resident_pages(k, k_bytes), 64u);
    memory_breakdown b = c.get_memory_breakdown();
    EXPECT_EQ(b.committed, 64 * cell);
    EXPECT_EQ(b.used, 50 * cell);
    EXPECT_EQ(b.free, 14 * cell);

    // holes below the extent stay until compaction moves the cells down
    c.seq_rm(0, 0, 40);
    EXPECT_EQ(resident_pages(k, k_bytes), 64u);
    auto up = c.init_update(/*optimize=*/true);
    ASSERT_EQ(up->get_status(), memory_status::success);
    up->apply();
    EXPECT_EQ(resident_pages(k, k_bytes), 16u);  // 10 cells at 0..9, one granule
    std::vector<float> row(1024);
    for (uint32_t i = 0; i < 10; ++i) {
        c.read_row(kv_part::v, 0, 0, i, row);
        EXPECT_EQ(row[0], 1.0f) << "cell " << i;
    }

    c.clear(false);
    EXPECT_EQ(resident_pages(k, k_bytes), 0u);
    EXPECT_EQ(c.get_memory_breakdown().committed, 0u);
}

// Split streams: each stream's mark is its own.
TEST(kv_storage, each_stream_commits_its_own_cells) {
    kv_cache_params p = page_rows(64);
    p.n_seq_max = 4;
    p.unified = false;
    kv_cache c(p);
    ubatch ub = make_ub({0, 1, 2}, {2, 2, 2});
    auto ctx = c.init_ubatches({ub}, {});
    ASSERT_EQ(ctx->get_status(), memory_status::success);
    ctx->apply();
    memory_breakdown b = c.get_memory_breakdown();
    EXPECT_EQ(b.committed, 16 * 8192u);
    EXPECT_EQ(b.reserved, 4 * 64 * 8192u);
    EXPECT_EQ(b.seq, (std::vector<uint64_t>{0, 0, 3 * 8192, 0}));
    c.seq_cp(2, 3, -1, -1);  // a copy into stream 3 commits its first granule
    EXPECT_EQ(c.get_memory_breakdown().committed, 32 * 8192u);
    c.seq_keep(3);
    EXPECT_EQ(c.get_memory_breakdown().committed, 16 * 8192u);
}

// An engine's allocator gets every byte at creation: nothing to commit or give back later.
TEST(kv_storage, an_allocator_gets_every_byte_up_front) {
    struct counting final : buffer_allocator {
        size_t bytes = 0;
        void* allocate(size_t size, size_t alignment) override {
            bytes += size;
            return buffer_allocator::host().allocate(size, alignment);
        }
        void deallocate(void* p, size_t size, size_t alignment) noexcept override {
            buffer_allocator::host().deallocate(p, size, alignment);
        }
        const char* name() const override { return "counting"; }
        bool is_host() const override { return true; }
    } alloc;
    kv_cache_params p = page_rows(64);
    p.allocator = &alloc;
    kv_cache c(p);
    EXPECT_EQ(alloc.bytes, c.size_bytes());
    EXPECT_EQ(c.storage().commit_granule(), 0u);
    decode(c, 3);
    c.seq_rm(0, -1, -1);
    const memory_breakdown b = c.get_memory_breakdown();
    EXPECT_EQ(b.committed, b.reserved);
    EXPECT_EQ(b.free, b.reserved);
}

}  // namespace
}  // namespace kvc
