// The tiny models against the llama.cpp peer's own files, built only when KVC_PEER_DIR names the peer's
// folder (e.g. cmake -DKVC_PEER_DIR=../shared/tools/llama-peer after its setup.sh). Without the peer, the
// committed checksums in test_tiny_model.cpp stand for these files.
#include <filesystem>
#include <string>

#include <gtest/gtest.h>
#include <kvcache/runtime/tiny_model.h>
#include <kvcache/state.h>

namespace kvc {
namespace {

std::string peer_file(const char* name) {
    return std::string(KVC_PEER_DIR) + "/" + name;
}

TEST(tiny_model_peer, default_bytes_equal_the_peer_file) {
    const std::string path = peer_file("tiny_llama.gguf");
    ASSERT_TRUE(std::filesystem::exists(path)) << path << " is missing: run the peer's setup.sh";
    EXPECT_EQ(tiny_model_bytes(), read_file_bytes(path));
}

TEST(tiny_model_peer, mamba_and_jamba_bytes_equal_the_peer_files) {
    for (const auto& [file, o] : {std::pair{"tiny_mamba.gguf", tiny_model_options::mamba()},
                                  {"tiny_jamba.gguf", tiny_model_options::jamba()}}) {
        const std::string path = peer_file(file);
        ASSERT_TRUE(std::filesystem::exists(path)) << path << " is missing: run the peer's setup.sh";
        EXPECT_EQ(tiny_model_bytes(o), read_file_bytes(path)) << file;
    }
}

}  // namespace
}  // namespace kvc
