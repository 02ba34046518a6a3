// What structures cost in memory, measured by counting every allocation (counting_new.h): the bookkeeping
// of a cache follows its cells and the sequences it holds, not n_seq_max, and GGUF metadata costs what the
// file holds (issue 21).
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <kvcache/kv_cache.h>
#include <kvcache/kv_cells.h>
#include <kvcache/runtime/gguf.h>
#include <kvcache/session.h>
#include <kvcache/state.h>
#include <kvcache/state_summary.h>

#include "counting_new.h"
#include "memory_test_util.h"

namespace kvc {
namespace {

// One layer of 32 + 32 f16 values per cell: 128 bytes of K/V per cell.
kv_cache_params split_params(uint32_t kv_size, uint32_t n_seq_max) {
    kv_cache_params p;
    p.layers = {layer_desc{.n_head_kv = 1, .n_embd_head_k = 32, .n_embd_head_v = 32}};
    p.kv_size = kv_size;
    p.n_seq_max = n_seq_max;
    p.unified = false;
    return p;
}

// Regression: each stream kept a position index for every possible sequence (n_seq_max x 32 bytes per
// stream: 128 GiB for 65536 streams), and a cell of sequence 60000 a bit for every id below it (7.5 KB).
TEST(footprint, one_stream_per_sequence_costs_in_proportion_to_its_cells) {
    const uint64_t before = g_live_bytes;
    reset_peak_bytes();
    auto c = std::make_unique<kv_cache>(split_params(16, 65536));
    const uint64_t created = g_peak_bytes - before;
    const uint64_t kv = c->size_bytes();  // reserved address space, not counted by operator new
    std::printf("65536 streams x 16 cells: %llu bytes of bookkeeping at creation, %.2f per byte of K/V\n",
                static_cast<unsigned long long>(created),
                static_cast<double>(created) / static_cast<double>(kv));
    EXPECT_LT(created, kv) << "bookkeeping at creation";  // 0.5x measured (pos, shift, ext, seq_set per cell)

    // one token in each of 1000 high sequences, each in its own stream
    std::vector<test::run> runs;
    for (seq_id_t s = 60000; s < 61000; ++s) runs.emplace_back(s, 0, 1);
    const uint64_t placed_before = g_live_bytes;
    {
        memory_context_ptr ctx = test::init_runs(*c, 65536, runs, 1024);
        ASSERT_EQ(ctx->get_status(), memory_status::success);
        do ctx->apply();
        while (ctx->next());
    }
    const uint64_t per_token = (g_live_bytes - placed_before) / runs.size();
    std::printf("a token of a sequence >= 60000 in its stream: %llu bytes\n",
                static_cast<unsigned long long>(per_token));
    EXPECT_LT(per_token, 256u) << "bytes kept per placed token";
    EXPECT_EQ(c->seq_pos_max(60999), 0);
    EXPECT_EQ(c->cells(60999).seqs(0).to_string(), "{60999}") << "cells report global sequence ids";
}

// The same for one stream's cells on their own: one sequence among 65536, as a stream of a split cache.
TEST(footprint, cells_of_one_high_sequence) {
    const uint64_t before = g_live_bytes;
    kv_cells cells(16, 65536);
    for (uint32_t i = 0; i < 16; ++i) {
        cells.pos_set(i, static_cast<pos_t>(i));
        cells.seq_add(i, 65535);
    }
    const uint64_t bytes = g_live_bytes - before;
    std::printf("16 cells of sequence 65535 among 65536: %llu bytes\n",
                static_cast<unsigned long long>(bytes));
    EXPECT_LT(bytes, 2048u);
    EXPECT_EQ(cells.seq_pos_max(65535), 15);
    EXPECT_EQ(cells.seq_n_cells(0), 0u);
    cells.validate();
}

// Regression (issue 20: a 1 GiB session took 2.1 GB): loading a file holds no copy of it. Peak bytes
// allocated while loading 16 MiB of K/V from a session file (plain and zstd) and a 'ggsq' file: the
// memory's stage of the state (the payload) plus read buffers, never the file and the payload both.
TEST(footprint, loading_a_file_holds_the_state_not_the_file) {
    kv_cache_params p;
    p.layers = {layer_desc{.n_head_kv = 4, .n_embd_head_k = 128, .n_embd_head_v = 128}};  // 2 KiB per cell
    p.kv_size = 8192;
    kv_cache src(p);
    {
        std::vector<test::run> runs = {{0, 0, 8192}};
        memory_context_ptr ctx = test::init_runs(src, 1, runs, 8192);
        ASSERT_EQ(ctx->get_status(), memory_status::success);
        do ctx->apply();
        while (ctx->next());
    }
    const auto dir = std::filesystem::temp_directory_path();
    const std::string plain = (dir / fmt::format("kvc-footprint-{}.session", ::getpid())).string(),
                      packed = (dir / fmt::format("kvc-footprint-{}.zstd", ::getpid())).string(),
                      ggsq = (dir / fmt::format("kvc-footprint-{}.ggsq", ::getpid())).string();
    save_file(src, plain, 0);
    save_file(src, packed, 0, {.compress = true});
    save_llama_seq_file(src, ggsq, 0, {});
    const uint64_t payload = state_seq_get_size(src, 0) - 8;
    for (const std::string& path : {plain, packed, ggsq}) {
        kv_cache dst(p);
        const uint64_t file = std::filesystem::file_size(path);
        const uint64_t before = g_live_bytes;
        reset_peak_bytes();
        if (path == ggsq)
            load_llama_seq_file(dst, path, 0);
        else
            load_file(dst, path, 0);
        const uint64_t peak = g_peak_bytes - before;
        std::printf("load of %s (%llu bytes, payload %llu): %.3f bytes allocated per payload byte at peak\n",
                    path.c_str(), static_cast<unsigned long long>(file),
                    static_cast<unsigned long long>(payload),
                    static_cast<double>(peak) / static_cast<double>(payload));
        EXPECT_LT(peak, std::max(file, payload) + (uint64_t{4} << 20)) << path;  // + read buffers
        EXPECT_EQ(dst.seq_pos_max(0), 8191);
        std::filesystem::remove(path);
    }
}

// Regression (issue 21): `kvcache inspect` inflated a zstd session file's payload whole (1.125x of it) to
// summarize it; read_session_stream hands it over a piece at a time, and the summary skips tensor data
// through a small buffer, so what is allocated is a constant (zstd's own window, allocated with malloc, is
// not counted here: at most the frame's window, 2 MiB at the default level, never the payload).
TEST(footprint, summarizing_a_zstd_session_file_holds_no_payload) {
    kv_cache_params p;
    p.layers = {layer_desc{.n_head_kv = 4, .n_embd_head_k = 128, .n_embd_head_v = 128}};  // 2 KiB per cell
    p.kv_size = 8192;
    kv_cache src(p);
    {
        std::vector<test::run> runs = {{0, 0, 8192}};
        memory_context_ptr ctx = test::init_runs(src, 1, runs, 8192);
        ASSERT_EQ(ctx->get_status(), memory_status::success);
        do ctx->apply();
        while (ctx->next());
    }
    const std::string path =
        (std::filesystem::temp_directory_path() / fmt::format("kvc-footprint-{}.inspect", ::getpid()))
            .string();
    save_file(src, path, 0, {.compress = true});
    const std::vector<uint8_t> file = read_file_bytes(path);
    std::filesystem::remove(path);
    const uint64_t payload = state_seq_get_size(src, 0) - 8;

    uint64_t before = g_live_bytes;
    reset_peak_bytes();
    std::vector<uint8_t> inflated;
    const session_info whole = read_session(file, &inflated);
    const memory_state_summary expected = summarize_memory_state(inflated, whole.layout, whole.state_flags);
    const uint64_t inflating = g_peak_bytes - before;
    inflated = {};

    before = g_live_bytes;
    reset_peak_bytes();
    memory_state_summary streamed;
    const session_info info = read_session_stream(file, [&](io_read_i& in, const session_info& i) {
        streamed = summarize_memory_state(in, i.payload_bytes, i.layout, i.state_flags);
    });
    const uint64_t streaming = g_peak_bytes - before;
    std::printf(
        "summary of a zstd session file (%zu bytes, payload %llu): %llu bytes allocated inflating it, "
        "%llu streaming it\n",
        file.size(), static_cast<unsigned long long>(payload), static_cast<unsigned long long>(inflating),
        static_cast<unsigned long long>(streaming));
    EXPECT_GE(inflating, payload);
    EXPECT_LT(streaming, uint64_t{2} << 20);  // the 1 MiB input buffer at most, and the summary
    EXPECT_EQ(info.payload_bytes, payload);
    ASSERT_EQ(streamed.parts.size(), expected.parts.size());
    EXPECT_EQ(streamed.kind, expected.kind);
    EXPECT_EQ(streamed.bytes, payload);
    const state_summary* a = streamed.parts[0].kv();
    const state_summary* b = expected.parts[0].kv();
    ASSERT_TRUE(a && b);
    EXPECT_EQ(a->bytes, b->bytes);
    ASSERT_EQ(a->streams.size(), b->streams.size());
    EXPECT_EQ(a->streams[0].n_cells, 8192u);
    EXPECT_EQ(a->streams[0].seqs.size(), b->streams[0].seqs.size());
    EXPECT_EQ(a->layers[0].k_bytes, b->layers[0].k_bytes);

    // sizes that disagree with the payload, and a payload left unread, are refused
    const auto refused = [&](uint64_t size) {
        try {
            read_session_stream(file, [&](io_read_i& in, const session_info& i) {
                (void)summarize_memory_state(in, size, i.layout, i.state_flags);
            });
            ADD_FAILURE() << "accepted with size " << size;
        } catch (const error& e) {
            EXPECT_EQ(e.code(), errc::corrupt_data) << e.what();
        }
    };
    refused(payload - 1);  // the summary finds the payload truncated
    refused(payload + 1);  // the summary finds a byte missing after the state
    try {
        read_session_stream(file, [](io_read_i&, const session_info&) {});  // nothing read
        ADD_FAILURE() << "a payload not read to its end was accepted";
    } catch (const error& e) {
        EXPECT_EQ(e.code(), errc::corrupt_data) << e.what();
    }
}

// Regression (issue 20: a 3 GiB sparse file was read for 20 s before being rejected): the header decides
// before the rest is read, and nothing of the file's size is allocated.
TEST(footprint, a_huge_file_is_refused_from_its_header) {
    const auto path =
        (std::filesystem::temp_directory_path() / fmt::format("kvc-footprint-{}.sparse", ::getpid()))
            .string();
    {
        std::FILE* f = std::fopen(path.c_str(), "wb");
        ASSERT_NE(f, nullptr);
        ASSERT_EQ(::ftruncate(::fileno(f), off_t{3} << 30), 0);  // 3 GiB of zeros, no disk
        std::fclose(f);
    }
    kv_cache c(split_params(16, 1));
    for (const bool ggsq : {false, true}) {
        const uint64_t before = g_live_bytes;
        reset_peak_bytes();
        try {
            if (ggsq)
                load_llama_seq_file(c, path, 0);
            else
                load_file(c, path, 0);
            ADD_FAILURE() << "loaded";
        } catch (const error& e) {
            EXPECT_EQ(e.code(), errc::corrupt_data) << e.what();
            EXPECT_NE(std::string(e.what()).find(ggsq ? "not a llama.cpp sequence file"
                                                      : "not a kvcache session file"),
                      std::string::npos)
                << e.what();
        }
        EXPECT_LT(g_peak_bytes - before, uint64_t{1} << 20) << (ggsq ? "ggsq" : "session");
    }
    std::filesystem::remove(path);
}

// Regression: GGUF metadata arrays were held widened to 8 bytes per element, so a 256 MiB array of u8
// peaked at 2.56 GB; now an opened (mapped) file's array costs its own bytes. 64 MiB here.
TEST(footprint, gguf_metadata_costs_what_the_file_holds) {
    constexpr uint64_t n = uint64_t{64} << 20;
    const auto path =
        (std::filesystem::temp_directory_path() / fmt::format("kvc-footprint-{}.gguf", ::getpid())).string();
    {
        std::FILE* f = std::fopen(path.c_str(), "wb");
        ASSERT_NE(f, nullptr);
        const auto put = [&](const void* p, size_t size) { ASSERT_EQ(std::fwrite(p, 1, size, f), size); };
        const uint32_t version = 3, u8_type = 0, array_type = 9;
        const uint64_t n_tensors = 0, n_kv = 1, key_len = 3;
        put("GGUF", 4);
        put(&version, 4);
        put(&n_tensors, 8);
        put(&n_kv, 8);
        put(&key_len, 8);
        put("big", 3);
        put(&array_type, 4);
        put(&u8_type, 4);
        put(&n, 8);
        const std::vector<uint8_t> chunk(1 << 20, 7);
        for (uint64_t k = 0; k < n / chunk.size(); ++k) put(chunk.data(), chunk.size());
        std::fclose(f);
    }
    const uint64_t before = g_live_bytes;
    reset_peak_bytes();
    {
        const gguf_file file = gguf_file::open(path);
        const auto& a = std::get<gguf_array>(file.find("big")->value);
        EXPECT_EQ(a.size(), n);
        EXPECT_EQ(a.bytes[n - 1], 7);
    }
    const uint64_t peak = g_peak_bytes - before;
    std::printf("a GGUF with a %llu-byte u8 array: %.3f bytes allocated per byte of the array at peak\n",
                static_cast<unsigned long long>(n), static_cast<double>(peak) / static_cast<double>(n));
    EXPECT_LT(peak, n + n / 16) << "peak bytes while opening";
    std::filesystem::remove(path);
}

}  // namespace
}  // namespace kvc
