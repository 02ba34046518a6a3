// The prefix cache's state inside a memory_recurrent (src/memory_recurrent_prefix.cpp): the index of the
// token chains sequences decoded, the pool of snapshots attached to its blocks, and what each sequence has
// decoded in order.
//
// A block of the index is useful only through a snapshot at its end or below it: a leaf without a
// snapshot that no sequence holds is removed at once. Eviction takes snapshots (prefix/snapshot_queue),
// wherever their blocks are in a chain, and then the blocks that lead to no other snapshot.
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <functional>
#include <unordered_set>
#include <vector>

#include <kvcache/memory_recurrent.h>

#include "prefix/prefix_index.h"
#include "prefix/snapshot_queue.h"
#include "tiers/tier_set.h"

namespace kvc {

// What one sequence has decoded from position 0 in order: the chain of its published blocks (tail: the
// deepest, held while the sequence tracks; checked by generation) and the tokens after it.
struct recurrent_tracker {
    // A snapshot the engine writes in the current step, published at the next.
    struct pending {
        uint64_t boundary = 0;  // the state after tokens [0, boundary)
        uint32_t slot = 0;
        bool kept = false;    // false: the sequence's rolling snapshot, dropped when it takes its next one
        bool prompt = false;  // taken while a prompt was processed (several tokens of the sequence)
        bool end = false;     // at that prompt's end (its newest boundary before its last token)
        bool fork = false;    // where that prompt left a chain of the index
    };
    bool active = true;
    uint8_t priority = prefix_default_priority;  // of the blocks it publishes
    uint64_t key = 0;
    uint32_t tail = detail::prefix_index::none;
    uint32_t tail_gen = 0;
    uint32_t n_full = 0;                         // chain blocks: positions [0, n_full * block_size)
    std::vector<token_t> toks;                   // positions [n_full * block_size, next())
    std::vector<pending> snaps;                  // ascending boundaries
    uint32_t roll = detail::prefix_index::none;  // the block of its published rolling snapshot
    uint32_t roll_gen = 0;
    // the block of the snapshot it resumed from or its prompt took last
    uint32_t last = detail::prefix_index::none;
    uint32_t last_gen = 0;
    std::vector<token_t> prompt;  // with a key: the attached prompt, which embeddings fed later stand for
    uint64_t fork = 0;            // a boundary where its prompt leaves a chain of the index: kept (0: none)
};

struct memory_recurrent::prefix_state {
    enum class slot_state : uint8_t { free, pending, published };
    // What a snapshot was taken for. How often each kind is resumed from decides where new ones enter the
    // eviction order: conversations come back to prompt ends (or to where sequences ended, when clients
    // send back what was decoded), shared documents to interval snapshots.
    enum class snap_kind : uint8_t { rolling, interval, prompt_end, sequence_end, branch, fetched };
    static constexpr size_t n_kinds = 6;
    struct kind_use {
        uint32_t taken = 0;  // published (halved with `used` past kind_window: recent use counts)
        uint32_t used = 0;   // resumed from
    };
    static constexpr uint32_t kind_window = 1024;
    // A snapshot prefix_plan chose for a block of the ubatch being placed.
    struct request {
        seq_id_t seq = 0;
        uint32_t block = 0;
        uint64_t boundary = 0;
        bool kept = false;
        bool prompt = false;
        bool end = false;
        bool fork = false;
    };

    detail::prefix_index index;
    detail::snapshot_queue queue;  // published snapshots in eviction order
    uint32_t bs;
    uint32_t interval;                    // snapshot_interval in blocks (0: prompt and sequence ends only)
    std::vector<recurrent_tracker> seqs;  // [n_seq_max]
    std::vector<seq_id_t> pending;        // sequences with snapshots to publish
    std::vector<uint32_t> holders;        // [index records] trackers whose tail it is
    std::vector<uint32_t> block_slot;     // [index records] its published snapshot, or none
    std::vector<uint32_t> slot_block;     // [slots] the block a published snapshot belongs to
    std::vector<snap_kind> slot_kind;     // [slots]
    std::array<kind_use, n_kinds> use{};
    uint32_t n_cold = 0;  // snapshots of cold kinds published: one in 16 enters as others
    // Where sequences that kept no snapshot ended (chain hashes, the newest 256): a prompt that goes past
    // one counts as a use of sequence ends, so their use is learnt without keeping them (as ARC's ghosts)
    std::deque<uint64_t> ghosts;
    std::unordered_set<uint64_t> ghost_set;
    static constexpr size_t max_ghosts = 256;
    std::vector<slot_state> slots;     // [slots]
    std::vector<uint32_t> free_slots;  // min-heap: the lowest free slot is taken first
    uint32_t top = 0;                  // slots [0, top) may hold memory (fit_snapshots)
    std::vector<uint32_t> zeros;       // [bs] the cells of a block (a recurrent block has none)
    std::vector<request> requests;     // scratch of prefix_plan
    uint32_t n_kept = 0;               // requests of kept snapshots not placed yet
    std::vector<rs_snap> snaps;        // scratch: the rows of the ubatch being placed
    prefix_stats stats;
    std::function<void(const prefix_event&)> on_event;
    detail::tier_set tiers;  // below memory (src/memory_recurrent_tier.cpp)
    std::function<void(uint32_t)>
        before_evict;  // with tiers: a snapshot about to be evicted (its rows intact)

    prefix_state(const prefix_cache_params& p, uint32_t n_seq_max, uint32_t n_slots);

    static constexpr uint32_t none = detail::prefix_index::none;
    pos_t next(const recurrent_tracker& t) const {
        return static_cast<pos_t>(uint64_t{t.n_full} * bs + t.toks.size());
    }
    bool alive(uint32_t id, uint32_t gen) const { return id == none || index.alive(id, gen); }
    bool has_snapshot(uint32_t id) const { return id < block_slot.size() && block_slot[id] != none; }
    // The depth of the deepest block of the chain of `tokens` with a snapshot that resumes before the last
    // token; -1 if none. chain: the matched blocks.
    // limit: the snapshot resumes before min(limit, tokens.size()).
    int64_t deepest(std::span<const token_t> tokens, uint64_t key, std::vector<uint32_t>& chain,
                    size_t limit = SIZE_MAX) const;
    // Whether block b of ub continues t in order, with tokens it knows.
    bool in_order(const recurrent_tracker& t, const ubatch& ub, uint32_t b) const;

    void emit(prefix_event::kind type, uint32_t id);
    void call(const prefix_event& e);
    void grow();  // per-record tables cover every index record
    void hold(uint32_t id);
    void unhold(uint32_t id);
    // Removes id and its ancestors while each is a queued leaf without a snapshot; how many went.
    uint32_t collect(uint32_t id);
    uint32_t take_slot();  // none when the pool is full
    void free_slot(uint32_t slot);
    // The slot's rows are the state at the end of block id.
    void publish(uint32_t slot, uint32_t id, snap_kind kind);
    // A kind resumed from less than once in 16 of its snapshots: they enter the queue as the next to go.
    bool cold(snap_kind kind) const;
    // Whether enough of a kind was published or resumed from to tell how useful it is.
    bool known(snap_kind kind) const;
    void enqueue(uint32_t slot, snap_kind kind);  // a published snapshot, or a rolling one kept
    void taken(snap_kind kind);                   // counts a snapshot of that kind kept (or a ghost)
    void ghost(const recurrent_tracker& t);       // t ends without a snapshot there: remember where
    // Whether the prompt, resumed at `from` (whose chain hash is seed; a root: the key), goes past a ghost:
    // a sequence end would have served it.
    void find_ghost(std::span<const token_t> tokens, uint64_t seed, uint64_t from);
    // t's prompt reached the snapshot of block id: the one t resumed from or took before is superseded
    void passed(recurrent_tracker& t, uint32_t id);
    void drop_snapshot(uint32_t id);  // the block keeps its place in the chain
    // The first snapshot in eviction order (if rolling_only, only if it is a rolling one), with the blocks
    // only it served.
    bool evict_one(bool rolling_only);
    void stop(recurrent_tracker& t);  // no more publishing; pending snapshots are dropped
    void reset();
};

}  // namespace kvc
