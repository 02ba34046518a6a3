#include "prefix/ghost_set.h"

#include <algorithm>
#include <cassert>

namespace kvc::detail {

namespace {
// The table stays at most half full: probes stay short.
constexpr size_t min_slots = 64;
size_t home(uint64_t h, size_t n_slots) {
    return (h * 0x9E3779B97F4A7C15ull >> 32) & (n_slots - 1);
}
}  // namespace

uint32_t ghost_set::find_slot(uint64_t h) const {
    if (slots_.empty()) return none;
    const size_t mask = slots_.size() - 1;
    for (size_t i = home(h, slots_.size());; i = (i + 1) & mask) {
        const uint32_t e = slots_[i];
        if (e == none) return none;
        if (ring_[e].hash == h) return static_cast<uint32_t>(i);
    }
}

void ghost_set::erase_slot(uint32_t slot) {
    const size_t mask = slots_.size() - 1;
    size_t i = slot;
    slots_[i] = none;
    for (size_t j = (i + 1) & mask; slots_[j] != none; j = (j + 1) & mask) {
        const size_t k = home(ring_[slots_[j]].hash, slots_.size());
        // the entry at j may fill the hole at i unless its home lies cyclically in (i, j]
        const bool stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
        if (stays) continue;
        slots_[i] = slots_[j];
        slots_[j] = none;
        i = j;
    }
}

void ghost_set::rehash(size_t n_slots) {
    slots_.assign(n_slots, none);
    const size_t mask = n_slots - 1;
    for (uint32_t e = 0; e < ring_.size(); ++e) {
        if (!ring_[e].live) continue;
        size_t i = home(ring_[e].hash, n_slots);
        while (slots_[i] != none) i = (i + 1) & mask;
        slots_[i] = e;
    }
}

void ghost_set::insert(const ghost& g) {
    if (cap_ == 0) return;
    if (const uint32_t s = find_slot(g.hash); s != none) {
        ring_[slots_[s]].live = false;
        --n_live_;
        erase_slot(s);
    }
    uint32_t e;
    if (ring_.size() < cap_) {
        e = static_cast<uint32_t>(ring_.size());
        if (ring_.size() == ring_.capacity())
            ring_.reserve(std::min<size_t>(cap_, std::max<size_t>(64, 2 * ring_.size())));
        ring_.push_back({});
        if (slots_.size() < 2 * ring_.size()) rehash(std::max(min_slots, slots_.size() * 2));
    } else {  // full: the oldest goes
        e = head_;
        head_ = head_ + 1 == cap_ ? 0 : head_ + 1;
        if (ring_[e].live) {
            erase_slot(find_slot(ring_[e].hash));
            --n_live_;
        }
    }
    ring_[e] = {.hash = g.hash, .serial = g.serial, .stream = g.stream, .kind = g.kind, .live = true};
    ++n_live_;
    const size_t mask = slots_.size() - 1;
    size_t i = home(g.hash, slots_.size());
    while (slots_[i] != none) i = (i + 1) & mask;
    slots_[i] = e;
}

std::optional<ghost_set::ghost> ghost_set::take(uint64_t h) {
    const uint32_t s = find_slot(h);
    if (s == none) return std::nullopt;
    entry& e = ring_[slots_[s]];
    assert(e.live);
    e.live = false;
    --n_live_;
    erase_slot(s);
    return ghost{.hash = e.hash, .serial = e.serial, .stream = e.stream, .kind = e.kind};
}

void ghost_set::clear() {
    ring_.clear();
    slots_.clear();
    head_ = 0;
    n_live_ = 0;
}

}  // namespace kvc::detail
