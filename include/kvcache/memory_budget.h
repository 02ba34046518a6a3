/// @file
/// The memory budget: the most bytes a memory may ever hold, checked when it is created, before it
/// allocates anything, and memory_breakdown, what a memory holds now. Storage in host memory grows on
/// demand (kv_storage.h): the budget bounds what a memory can grow to, not what it holds.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

namespace kvc {

/// Where a memory's bytes are (memory_i::get_memory_breakdown), counting K/V and state rows:
/// committed = used + cached + free, and reserved >= committed.
struct memory_breakdown {
    uint64_t reserved = 0;   ///< every cell's bytes: the most it can hold (address space, not memory)
    uint64_t committed = 0;  ///< bytes backed by memory: the cells below each stream's commit mark
    uint64_t used = 0;       ///< cells some sequence holds
    uint64_t cached = 0;     ///< cells only the prefix cache holds (evictable)
    uint64_t pinned = 0;     ///< cells of pinned prefix blocks (within used or cached; not evictable)
    uint64_t free = 0;       ///< committed cells that hold nothing
    /// [n_seq_max] bytes of the cells each sequence holds (a cell shared by several counts in each).
    std::vector<uint64_t> seq;

    /// Adds another part's bytes (composite memories: iSWA, hybrid).
    memory_breakdown& operator+=(const memory_breakdown& o);
};

/// The machine's physical memory in bytes: the budget when a memory's params leave it at 0.
uint64_t physical_memory_bytes();

/// a * b, or UINT64_MAX when the product does not fit (sizes from untrusted parameters).
uint64_t mul_sat(uint64_t a, uint64_t b);
/// a + b, or UINT64_MAX when the sum does not fit.
uint64_t add_sat(uint64_t a, uint64_t b);

/// Throws kvc::error(out_of_memory) when `need` bytes exceed `budget` (0: physical_memory_bytes()),
/// naming what (e.g. "kv_cache"), both sizes and `detail` (how the need adds up).
void check_memory_budget(std::string_view what, uint64_t need, uint64_t budget, std::string_view detail);

}  // namespace kvc
