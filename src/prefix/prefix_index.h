// The index of a kv_cache's prefix cache: blocks of block_size tokens chained by hash, their cells, and
// the queues they are evicted from. It knows cells by index only; kv_cache holds and frees them
// (src/kv_cache_prefix.cpp).
//
// A block is found by (parent, tokens): the hash finds candidates, the parent id and the stored tokens
// prove the match, so a hit never serves cells of other tokens (a root's parent is its key). States:
//   held     some cell of the block has a sequence, or the block is pinned: not evictable
//   queued   evictable and no block depends on it: in its stream's queue of its level, oldest first
//   waiting  evictable, but children still depend on it: queued when the last one goes
//   dead     out of the table (its cells changed), kept only until its children go, so that no
//            child can ever verify against a block that reuses its id
// Eviction order: the lowest level first, each level's queue oldest first. A level is the block's
// priority (0-100) and, with the SLRU policy, its segment: a block that was hit since it was published
// joins the protected segment of its priority, which goes after the probationary one; the protected
// blocks of a stream are bounded, those of chains waiting for children included (the oldest of the lowest
// priority drop back to probation, with the protected chain that waits for them alone). The adaptive
// policy is SLRU whose evicted blocks leave ghosts: a block published again while its ghost is remembered
// counts as hit, and each stream's protected bound moves with the ghosts that come back (design D34).
//
// A cache with a sliding window keeps only the blocks near each boundary (design D30), so its chains
// have gaps: it adds every block as a root whose key is its parent's hash (root_depth gives its depth).
// Such blocks never wait for children, and a lookup finds each one by (hash, parent hash, tokens).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include <kvcache/prefix_cache.h>
#include <kvcache/types.h>

#include "prefix/ghost_set.h"

namespace kvc::detail {

class prefix_index {
public:
    static constexpr uint32_t none = UINT32_MAX;
    static constexpr uint32_t n_levels = 2 * (prefix_max_priority + 1);
    enum class state : uint8_t { unused, held, queued, waiting, dead };

    // 40 bytes: the index costs ~2.5 bytes per token of 16-token blocks for its records.
    struct block {
        uint64_t hash = 0;  // chained: XXH3 of the tokens seeded with the parent's hash (a root's key)
        uint32_t parent = none;
        uint32_t depth = 0;    // its tokens are at positions [depth * block_size, + block_size)
        uint32_t prev = none;  // eviction queue links
        uint32_t next = none;
        uint32_t n_children = 0;
        uint32_t gen = 0;   // bumped when it leaves the table: a reference (id, gen) is then stale
        uint16_t held = 0;  // cells with at least one sequence
        uint16_t pins = 0;
        uint16_t stream = 0;
        uint8_t priority : 7 = prefix_default_priority;
        uint8_t seen : 1 = 0;     // protected once in this life (the adaptive policy's ghosts keep it)
        uint8_t segment : 1 = 0;  // 1: protected (SLRU, adaptive)
        uint8_t hit : 1 = 0;      // attached since it last left protection
        state st : 3 = state::unused;
        uint8_t stored : 3 = 0;  // bit t: tier t holds its record (kv_cache's tiers)
    };
    static_assert(prefix_max_tiers <= 3, "block::stored has a bit per tier");
    static_assert(prefix_max_priority < 128, "block::priority has 7 bits");
    static_assert(sizeof(block) == 40, "a block record stays 40 bytes");

    // max_protected: evictable protected blocks per stream (SLRU; where the adaptive policy starts);
    // ignored by LRU. capacity: the blocks a stream holds, which scales the adaptive policy's ghosts and
    // steps.
    prefix_index(uint32_t block_size, uint32_t n_stream, evict_policy policy, uint32_t max_protected,
                 uint32_t capacity = 0);

    uint32_t block_size() const { return bs_; }
    uint32_t size() const { return n_live_; }        // blocks in the table
    uint32_t records() const { return n_records_; }  // ids in use or free: [0, records())
    const block& at(uint32_t id) const { return chunks_[id / chunk].blocks[id % chunk]; }
    std::span<const token_t> tokens(uint32_t id) const {
        return {chunks_[id / chunk].tokens.get() + size_t{id % chunk} * bs_, bs_};
    }
    std::span<const uint32_t> cells(uint32_t id) const {
        return {chunks_[id / chunk].cells.get() + size_t{id % chunk} * bs_, bs_};
    }
    void set_stored(uint32_t id, uint8_t tiers) { rec(id).stored = tiers & 7u; }
    void set_cell(uint32_t id, uint32_t j, uint32_t cell) {
        chunks_[id / chunk].cells[size_t{id % chunk} * bs_ + j] = cell;
    }
    // The key of the chain a block is in: its root's (with a window, every block is a root keyed by its
    // parent's hash).
    uint64_t key_of(uint32_t id) const { return chunks_[id / chunk].keys[id % chunk]; }
    // The seed of its hash: the parent's hash, or a root's key.
    uint64_t seed(uint32_t id) const { return seed_of(at(id).parent, root_key(id)); }
    // A block is alive while it is in the table; (id, gen) names one life of a record.
    bool alive(uint32_t id, uint32_t gen) const {
        return id < n_records_ && at(id).gen == gen && at(id).st != state::unused && at(id).st != state::dead;
    }
    uint32_t pinned_blocks(uint32_t stream) const { return streams_[stream].n_pinned; }
    // The bound on a stream's evictable protected blocks (the adaptive policy moves it).
    uint32_t max_protected(uint32_t stream) const { return streams_[stream].max_protected; }

    // The block after `parent` (none: a root of `key`) holding exactly `toks` (block_size tokens).
    uint32_t find(uint32_t parent, uint64_t key, std::span<const token_t> toks) const;
    // The block whose chain hash is h, after a block of hash parent_hash (a root: of that key), holding
    // `toks`: how another index with the same chains names a block (memory_hybrid's parts). none if absent.
    uint32_t find_hash(uint64_t h, uint64_t parent_hash, std::span<const token_t> toks) const;
    // The chain of blocks holding the longest prefix of `toks` in whole blocks, appended to out. The
    // hashes of a chain depend on the tokens only, so they are computed first and the table, records and
    // tokens of the blocks ahead are fetched while a block is verified.
    void match(uint64_t key, std::span<const token_t> toks, std::vector<uint32_t>& out) const;
    // A block with hash h, whatever its parent and tokens (none if absent): for checks that a chain the
    // caller already verified still has its blocks.
    uint32_t find_any(uint64_t h) const;
    // XXH3 of the tokens seeded with the parent's hash (a root's key): a block's chain hash.
    static uint64_t chain_hash(uint64_t seed, std::span<const token_t> toks);
    // A new block after `parent` (none: a root of `key`, at depth root_depth) with `held` holders
    // (block_size: every cell has a sequence; a recurrent memory counts its trackers, 0: evictable at
    // once). The caller checked that find() has none.
    uint32_t add(uint32_t parent, uint64_t key, std::span<const token_t> toks,
                 std::span<const uint32_t> cells, uint32_t stream, uint8_t priority, uint16_t held,
                 uint32_t root_depth = 0);

    // held 0 -> 1 (a sequence joined a cell of a block without any): out of the queue
    void acquire(uint32_t id);
    // held 1 -> 0: evictable unless pinned
    void release(uint32_t id);
    void pin(uint32_t id);
    void unpin(uint32_t id);
    // An attach reused the block (SLRU: it joins the protected segment when it is let go).
    void hit(uint32_t id);
    // A queued block moves to the end of its new level's queue.
    void set_priority(uint32_t id, uint8_t priority);
    // Queued blocks to the end of their queues again, in this order (blocks let go together: the deepest
    // go first).
    void requeue(std::span<const uint32_t> ids);
    // A queued block to the head of its queue: the next to go at its level.
    void to_front(uint32_t id);

    // The blocks whose eviction frees at least `n` cells of `stream`, in eviction order (children before
    // their parents), none of `keep` (sorted ids). False, out unchanged, if every evictable block together
    // frees fewer.
    bool plan_eviction(uint32_t stream, uint32_t n, std::vector<uint32_t>& out,
                       std::span<const uint32_t> keep = {}) const;
    // The block leaves to make room (called before remove): the adaptive policy keeps its ghost.
    void evicting(uint32_t id);
    // Takes a block out of the table (and queue). Its record is reused at once, or, while children depend
    // on it, once they are gone (dead). The caller has let go of its cells.
    void remove(uint32_t id);

    void clear();
    size_t bytes() const;  // memory of the index (records, tokens, cells, table)
    // The event of block id (its record intact: before it is removed).
    prefix_event event(prefix_event::kind type, uint32_t id) const {
        const block& b = at(id);
        return {
            .type = type, .hash = b.hash, .parent_hash = seed(id), .depth = b.depth, .tokens = tokens(id)};
    }

private:
    struct queue {
        uint32_t head = none;
        uint32_t tail = none;
    };
    struct stream_queues {
        std::array<queue, n_levels> levels;
        std::array<uint64_t, (n_levels + 63) / 64> nonempty{};  // bit l: levels[l] has blocks
        uint32_t n_protected = 0;                               // queued blocks of protected levels
        uint32_t n_protected_waiting = 0;                       // protected, waiting for children
        uint32_t max_protected = 0;                             // the bound on both
        uint64_t bound = 0;  // the adaptive policy's bound in 1/131072 of a block (max_protected << 17)
        uint32_t n_pinned = 0;
        std::array<uint32_t, 2> evicted{};  // evictions of never-protected and once-protected blocks
    };

    // Records, tokens and cells in chunks: growth copies nothing and wastes at most one chunk.
    static constexpr uint32_t chunk = 1024;
    struct chunk_data {
        std::unique_ptr<block[]> blocks;
        std::unique_ptr<token_t[]> tokens;  // [chunk * bs]
        std::unique_ptr<uint32_t[]> cells;  // [chunk * bs]
        std::unique_ptr<uint64_t[]> keys;   // [chunk]: the key of the block's chain (its root's)
    };
    block& rec(uint32_t id) { return chunks_[id / chunk].blocks[id % chunk]; }
    void add_chunk();
    uint64_t hash_of(uint64_t seed, std::span<const token_t> toks) const { return chain_hash(seed, toks); }
    uint64_t seed_of(uint32_t parent, uint64_t key) const { return parent == none ? key : at(parent).hash; }
    uint64_t root_key(uint32_t id) const { return key_of(id); }
    // The block is the one after `parent` (a root of `key`) holding `toks`, whose hash is h.
    bool is(uint32_t id, uint64_t h, uint32_t parent, uint64_t key, std::span<const token_t> toks) const;
    static uint32_t level_of(const block& b) { return 2u * b.priority + b.segment; }
    // The lowest non-empty level >= from (of protected levels only: odd), or n_levels.
    static uint32_t next_level(const stream_queues& q, uint32_t from, bool protected_only = false);
    void table_insert(uint32_t id);
    void table_erase(uint32_t id);
    void grow();
    void push_back(uint32_t id);   // queue tail (newest)
    void push_front(uint32_t id);  // queue head (next to go)
    void unlink(uint32_t id);
    void make_evictable(uint32_t id);  // no sequence and no pin holds it any more
    void make_held(uint32_t id);       // a sequence or a pin holds it now
    void demote_protected(uint32_t stream);
    void learn(const ghost_set::ghost& g);  // a ghost published again (adaptive)
    void free_record(uint32_t id);
    void child_gone(uint32_t parent, uint32_t child_level);

    uint32_t bs_;
    evict_policy policy_;
    uint32_t max_protected_;
    uint32_t capacity_;
    ghost_set ghosts_;
    std::vector<chunk_data> chunks_;
    uint32_t n_records_ = 0;
    std::vector<uint32_t> free_ids_;
    std::vector<uint32_t> slots_;  // open addressing by hash, linear probing; none = empty
    uint32_t n_live_ = 0;
    std::vector<stream_queues> streams_;
};

// No block: prefix_index::none, for the sources of the prefix cache.
inline constexpr uint32_t none = prefix_index::none;

// Checks the tokens of a prefix call: at most INT32_MAX, none negative, with a vocabulary (n_vocab > 0) each
// below it; kvc::error(invalid_argument) naming `what`, the token and the bound.
void check_prompt_tokens(std::span<const token_t> tokens, int32_t n_vocab, const char* what);

// Calls the listener with e, if there is one; what it throws is caught and counted in `errors` (the
// cache's state must not depend on the listener).
void notify(const std::function<void(const prefix_event&)>& listener, const prefix_event& e,
            uint64_t& errors);

}  // namespace kvc::detail
