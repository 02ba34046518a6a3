#include <cstdint>
#include <cstring>
#include <vector>

#include <gtest/gtest.h>
#include <kvcache/tensor.h>

namespace kvc {
namespace {

TEST(buffer, is_aligned_zeroed_and_accounted) {
    const size_t before = host_bytes_in_use();
    {
        buffer b(1000);
        EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % buffer::alignment, 0u);
        EXPECT_EQ(b.size(), 1000u);
        for (size_t i = 0; i < b.size(); ++i) ASSERT_EQ(b.data()[i], std::byte{0});
        EXPECT_EQ(host_bytes_in_use(), before + 1000);
        EXPECT_GE(host_bytes_peak(), before + 1000);
        buffer moved = std::move(b);
        EXPECT_EQ(b.data(), nullptr);  // NOLINT(bugprone-use-after-move): moved-from state is documented
        EXPECT_EQ(moved.size(), 1000u);
        EXPECT_EQ(host_bytes_in_use(), before + 1000);
    }
    EXPECT_EQ(host_bytes_in_use(), before);
}

TEST(buffer, empty_and_move_assignment_release_memory) {
    buffer e(0);
    EXPECT_TRUE(e.empty());
    EXPECT_EQ(e.data(), nullptr);
    const size_t before = host_bytes_in_use();
    buffer a(64), b(128);
    a = std::move(b);
    EXPECT_EQ(a.size(), 128u);
    EXPECT_EQ(host_bytes_in_use(), before + 128);
}

TEST(tensor_view, contiguous_strides_follow_ggml) {
    std::vector<std::byte> mem(row_size(dtype::q8_0, 128) * 8 * 4);
    const tensor_view v = tensor_view::contiguous(dtype::q8_0, mem.data(), 128, 8, 4);
    EXPECT_EQ(v.nb[0], 34u);
    EXPECT_EQ(v.nb[1], 4u * 34u);
    EXPECT_EQ(v.nb[2], 8u * 4u * 34u);
    EXPECT_EQ(v.nb[3], 4u * 8u * 4u * 34u);
    EXPECT_EQ(v.nelements(), 128 * 8 * 4);
    EXPECT_EQ(v.nrows(), 32);
    EXPECT_TRUE(v.is_contiguous());
    EXPECT_EQ(v.row(3, 2), mem.data() + (2 * 8 + 3) * 136);
    EXPECT_EQ(v.describe(), "q8_0 [128, 8, 4, 1] nb [34, 136, 1088, 4352]");
    EXPECT_THROW((void)tensor_view::contiguous(dtype::q4_0, mem.data(), 100), error);
}

TEST(tensor_view, slices_share_strides_and_offset_data) {
    std::vector<float> mem(16 * 10 * 3);
    for (size_t i = 0; i < mem.size(); ++i) mem[i] = static_cast<float>(i);
    auto* base = reinterpret_cast<std::byte*>(mem.data());
    const tensor_view v = tensor_view::contiguous(dtype::f32, base, 16, 10, 3);
    const tensor_view rows = v.slice(1, 2, 5);  // rows 2..4 of every plane
    EXPECT_EQ(rows.ne[1], 3);
    EXPECT_FALSE(rows.is_contiguous());
    std::vector<float> out(16);
    rows.row_to_f32(out, 1, 2);  // row 3 of plane 2
    EXPECT_EQ(out[0], static_cast<float>((2 * 10 + 3) * 16));
    const tensor_view cols = v.slice(0, 4, 8);
    EXPECT_EQ(cols.ne[0], 4);
    EXPECT_EQ(reinterpret_cast<const float*>(cols.row(0))[0], 4.0f);
    const const_tensor_view ro = cols;  // writable -> read-only
    EXPECT_EQ(ro.data, cols.data);
    EXPECT_EQ(v.slice(2, 1, 1).nelements(), 0);
}

TEST(tensor_view, bad_indices_and_slices_are_errors) {
    std::vector<std::byte> mem(row_size(dtype::q4_0, 64) * 2);
    const tensor_view v = tensor_view::contiguous(dtype::q4_0, mem.data(), 64, 2);
    EXPECT_THROW((void)v.row(2), error);
    EXPECT_THROW((void)v.row(0, 1), error);
    EXPECT_THROW((void)v.row(-1), error);
    EXPECT_THROW((void)v.slice(1, 1, 3), error);
    EXPECT_THROW((void)v.slice(4, 0, 1), error);
    try {
        (void)v.slice(0, 16, 48);
        FAIL() << "no error";
    } catch (const error& e) {
        EXPECT_NE(std::string(e.what()).find("splits a block"), std::string::npos) << e.what();
    }
    EXPECT_EQ(v.slice(0, 32, 64).data, mem.data() + 18);
    std::vector<float> small(10);
    EXPECT_THROW(v.row_to_f32(small, 0), error);
}

}  // namespace
}  // namespace kvc
