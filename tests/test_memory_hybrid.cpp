// memory_hybrid: spec batch-recurrent §5 (composition, batches in both parts, all-or-nothing seq_rm,
// positions combined, state of both parts).
#include <gtest/gtest.h>
#include <kvcache/memory_hybrid.h>

namespace kvc {
namespace {

TEST(memory_hybrid, placeholder) {}

}  // namespace
}  // namespace kvc
