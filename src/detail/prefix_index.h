// The index of a kv_cache's prefix cache: blocks of block_size tokens chained by hash, their cells, and
// the queue they are evicted from. It knows cells by index only; kv_cache holds and frees them
// (src/kv_cache_prefix.cpp).
//
// A block is found by (parent, tokens): the hash finds candidates, the parent id and the stored tokens
// prove the match, so a hit never serves cells of other tokens (a root's parent is its key). States:
//   held     some cell of the block has a sequence: not evictable
//   queued   no cell has a sequence and no block depends on it: in its stream's queue, oldest first
//   waiting  no cell has a sequence, but children still depend on it: queued when the last one goes
//   dead     out of the table (its cells changed), kept only until its children go, so that no
//            child can ever verify against a block that reuses its id
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include <kvcache/types.h>

namespace kvc::detail {

class prefix_index {
public:
    static constexpr uint32_t none = UINT32_MAX;
    enum class state : uint8_t { unused, held, queued, waiting, dead };

    struct block {
        uint64_t hash = 0;
        uint64_t seed = 0;  // the parent's hash; a root's key
        uint32_t parent = none;
        uint32_t prev = none;  // eviction queue links
        uint32_t next = none;
        uint32_t n_children = 0;
        uint32_t held = 0;   // cells with at least one sequence
        uint32_t depth = 0;  // its tokens are at positions [depth * block_size, + block_size)
        uint32_t stream = 0;
        state st = state::unused;
    };

    prefix_index(uint32_t block_size, uint32_t n_stream);

    uint32_t block_size() const { return bs_; }
    uint32_t size() const { return n_live_; }  // blocks in the table
    const block& at(uint32_t id) const { return blocks_[id]; }
    std::span<const token_t> tokens(uint32_t id) const { return {tokens_.data() + size_t{id} * bs_, bs_}; }
    std::span<const uint32_t> cells(uint32_t id) const { return {cells_.data() + size_t{id} * bs_, bs_}; }
    void set_cell(uint32_t id, uint32_t j, uint32_t cell) { cells_[size_t{id} * bs_ + j] = cell; }

    // The block after `parent` (none: a root of `key`) holding exactly `toks` (block_size tokens).
    uint32_t find(uint32_t parent, uint64_t key, std::span<const token_t> toks) const;
    // The chain of blocks holding the longest prefix of `toks` in whole blocks, appended to out. The
    // hashes of a chain depend on the tokens only, so they are computed first and the table, records and
    // tokens of the blocks ahead are fetched while a block is verified.
    void match(uint64_t key, std::span<const token_t> toks, std::vector<uint32_t>& out) const;
    // A new held block (held = block_size) after `parent` (none: a root of `key`). The caller checked
    // that find() has none.
    uint32_t add(uint32_t parent, uint64_t key, std::span<const token_t> toks,
                 std::span<const uint32_t> cells, uint32_t stream);

    // held 0 -> 1 (a sequence joined a cell of a block without any): out of the queue
    void acquire(uint32_t id);
    // held 1 -> 0: to the end of its stream's queue, or waiting while children depend on it
    void release(uint32_t id);
    // Queued blocks to the end of their queues again, in this order (blocks let go together: the deepest
    // go first).
    void requeue(std::span<const uint32_t> ids);

    // The blocks whose eviction frees at least `n` cells of `stream`, in eviction order (children before
    // their parents). False, out unchanged, if every evictable block together frees fewer.
    bool plan_eviction(uint32_t stream, uint32_t n, std::vector<uint32_t>& out) const;
    // Takes a block out of the table (and queue). Its record is reused at once, or, while children depend
    // on it, once they are gone (dead). The caller has let go of its cells.
    void remove(uint32_t id);

    void clear();
    size_t bytes() const;  // memory of the index (records, tokens, cells, table)

private:
    uint64_t hash_of(uint64_t seed, std::span<const token_t> toks) const;
    uint64_t seed_of(uint32_t parent, uint64_t key) const {
        return parent == none ? key : blocks_[parent].hash;
    }
    void table_insert(uint32_t id);
    void table_erase(uint32_t id);
    void grow();
    void push_back(uint32_t id);   // queue tail (newest)
    void push_front(uint32_t id);  // queue head (next to go)
    void unlink(uint32_t id);
    void free_record(uint32_t id);
    void child_gone(uint32_t parent);

    uint32_t bs_;
    std::vector<block> blocks_;
    std::vector<token_t> tokens_;  // [blocks * bs]
    std::vector<uint32_t> cells_;  // [blocks * bs]
    std::vector<uint32_t> free_ids_;
    std::vector<uint32_t> slots_;  // open addressing by hash, linear probing; none = empty
    uint32_t n_live_ = 0;
    struct queue {
        uint32_t head = none;
        uint32_t tail = none;
    };
    std::vector<queue> queues_;  // per stream
};

}  // namespace kvc::detail
