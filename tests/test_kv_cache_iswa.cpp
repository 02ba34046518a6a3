// kv_cache_iswa: spec kv-core §8 (split by layer, SWA size, batches in both caches, combined context,
// positions and shifting from the SWA cache, state of both parts).
#include <gtest/gtest.h>
#include <kvcache/kv_cache_iswa.h>

namespace kvc {
namespace {

TEST(kv_cache_iswa, swa_size_formula) {
    kv_cache_iswa_params p;
    p.kv.kv_size = 4096;
    p.kv.n_swa = 1024;
    p.kv.n_seq_max = 2;
    p.swa_full = false;
    p.n_ubatch = 512;
    EXPECT_EQ(iswa_swa_size(p), 2560u);  // 1024 * 2 + 512, already a multiple of 256
}

}  // namespace
}  // namespace kvc
