// The hashes of blocks a prefix cache evicted, those of its last `capacity` evictions (less the ones
// published again since), each with what it was when it left: what the adaptive policy learns from
// (design D34). A ghost costs 16 bytes plus two table slots; the ring and the table grow with the ghosts
// actually remembered, up to `capacity`.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace kvc::detail {

class ghost_set {
public:
    struct ghost {
        uint64_t hash = 0;    // the block's chain hash
        uint32_t serial = 0;  // its place among the evictions of its stream and kind
        uint16_t stream = 0;
        uint8_t kind = 0;  // 0: never protected, 1: protected once (demoted or evicted from protection)
    };

    explicit ghost_set(uint32_t capacity) : cap_(capacity) {}

    // Remembers g, forgetting what the insertion `capacity` ago left (and an older ghost of g's hash).
    void insert(const ghost& g);
    // The ghost of hash h, forgotten now (it is published again).
    std::optional<ghost> take(uint64_t h);
    void clear();

    uint32_t size() const { return n_live_; }
    uint32_t capacity() const { return cap_; }
    size_t bytes() const { return ring_.capacity() * sizeof(entry) + slots_.capacity() * sizeof(uint32_t); }

private:
    static constexpr uint32_t none = UINT32_MAX;
    struct entry {  // a ghost in 16 bytes
        uint64_t hash = 0;
        uint32_t serial = 0;
        uint16_t stream = 0;
        uint8_t kind = 0;
        bool live = false;  // false: taken, or replaced by a newer ghost of its hash
    };
    static_assert(sizeof(entry) == 16);

    uint32_t find_slot(uint64_t h) const;  // the table slot of h's ghost, or none
    void erase_slot(uint32_t slot);        // backward-shift deletion (linear probing)
    void rehash(size_t n_slots);

    uint32_t cap_;
    std::vector<entry> ring_;      // FIFO: oldest at head_, grows to cap_
    uint32_t head_ = 0;            // the oldest entry, once the ring is full
    uint32_t n_live_ = 0;          // entries with live set
    std::vector<uint32_t> slots_;  // open addressing by hash: index into ring_, none = empty
};

}  // namespace kvc::detail
