// kvcache sim: the serving loop that replays a trace through one policy, and what it measures.
//
// Requests arrive in trace order; at most `concurrency` are live. A request is admitted when its policy
// can hold it (its prompt not reused plus its whole output, next to what the live requests still need);
// otherwise it waits at the head of the queue. An admitted request prefills the rest of its prompt in one
// step, then decodes one output token per step in one batch with every live request, and ends.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <kvcache/prefix_cache.h>

#include "sim_trace.h"

namespace kvc::cli {

/// The policies kvcache sim compares.
enum class sim_policy : uint8_t {
    kvcache,       ///< the library's kv_cache with its prefix cache (real bookkeeping)
    none,          ///< the library's kv_cache without a prefix cache: nothing is reused
    llama_server,  ///< a model of llama.cpp's server: slots, their own common prefix, a RAM prompt cache
    oracle,        ///< Belady's MIN over the trace's cache blocks: the most block hits a cache this size has
    lru_blocks,    ///< a plain LRU over blocks, roots as evictable as leaves (the yardstick of Mooncake's
                   ///< paper)
};
const char* to_string(sim_policy p);
std::optional<sim_policy> parse_sim_policy(const std::string& s);

/// The model's memory the run stands for (docs/sim.md, "Recurrent and hybrid models").
enum class sim_memory : uint8_t {
    kv,         ///< attention K/V only: a kv_cache of `budget` cells
    recurrent,  ///< recurrent state only (Mamba): a memory_recurrent; the budget holds its snapshots
    hybrid,     ///< both (Jamba): a memory_hybrid, K/V of `budget` cells and a snapshot pool
    /// sliding-window layers beside full ones (Gemma 3): a kv_cache_iswa, a base cache of `budget` cells
    /// and a window-sized SWA cache
    iswa,
};
const char* to_string(sim_memory m);

/// How requests are spread over several instances (sim_options::instances) at arrival.
enum class sim_route : uint8_t {
    rr,      ///< round-robin, in arrival order
    prefix,  ///< the instance whose memory holds the longest prefix of the prompt; ties and misses: the
             ///< least loaded (live + queued requests), then the lowest index
};
const char* to_string(sim_route r);

/// The order in which an instance admits its waiting requests (kvcache only: llama.cpp's server and `none`
/// admit in arrival order).
enum class sim_schedule : uint8_t {
    fcfs,  ///< arrival order: the head of the queue waits until it fits
    /// longest cached prefix first among the first `schedule_window` waiting requests, ties in arrival
    /// order (SGLang's --schedule-policy lpm); the first of that order that does not fit waits
    lpm,
};
const char* to_string(sim_schedule s);

struct sim_options {
    uint32_t budget = 0;         ///< cells (tokens) of the cache
    uint32_t concurrency = 64;   ///< live requests at most (sequences, slots)
    uint32_t trace_block = 512;  ///< tokens per hash id
    uint32_t cache_block = 16;   ///< tokens per prefix-cache block
    evict_policy evict = evict_policy::lru;
    bool respect_arrival = false;  ///< wait for timestamps (else a request arrives when a slot is free)
    /// a request that continues an earlier one (follow_ups: a conversation's next turn) arrives only after
    /// that one ended, as a client sends the next turn once it has the answer
    bool wait_answer = false;
    double step_ms = 20;       ///< simulated time per step when timestamps are respected
    uint32_t n_ubatch = 4096;  ///< tokens per ubatch when placing a step's batch
    /// kvcache: a request sharing a trace block with what a request admitted in the same step is about to
    /// compute waits one step, so that it attaches that prefix instead of computing it again (SGLang's
    /// in-batch prefix sharing does the same).
    bool defer_shared = true;
    sim_schedule schedule = sim_schedule::fcfs;  ///< kvcache: the admission order
    /// lpm: waiting requests (the first in arrival order) whose cached prefix is looked up at each
    /// admission round; bounds the lookups per admitted request
    uint32_t schedule_window = 64;
    sim_memory memory = sim_memory::kv;
    uint32_t snapshot_interval = 64;  ///< recurrent, hybrid: kvcache's snapshot every N blocks
    /// recurrent, hybrid: kvcache's snapshot pool (0: what the budget's memory holds, a tenth of it for
    /// a hybrid model, at state_tokens each)
    uint32_t snapshots = 0;
    uint32_t state_tokens =
        1024;  ///< recurrent, hybrid: a sequence's state costs as much as this many tokens of K/V
    uint32_t window = 1024;  ///< iswa: the sliding window (tokens)
    /// iswa: cells the SWA cache gets beyond llama.cpp's size (window x concurrency + ubatch) for the windows
    /// of cached prefixes (0: a tenth of the budget)
    uint32_t swa_retain = 0;
    uint32_t checkpoint_every = 8192;      ///< recurrent, hybrid: llama-server's checkpoint step
    uint32_t max_checkpoints = 32;         ///< recurrent, hybrid: llama-server's checkpoints per slot
    uint64_t cache_ram = 0;                ///< llama-server: tokens its RAM prompt cache holds (0: off)
    float slot_similarity = 0.1f;          ///< llama-server: --slot-prompt-similarity
    std::function<void(double)> progress;  ///< called with the fraction of requests done (may be empty)
    /// Serving instances run in lockstep (one step of each per round), each with its own cache of
    /// `budget` cells and `concurrency` sequences; kvcache and none only when more than one.
    uint32_t instances = 1;
    sim_route route = sim_route::rr;  ///< how arrivals are spread over the instances
    /// kvcache: stores below every instance's prefix cache, shared by all of them (the same objects).
    prefix_tier_params tiers;
};

/// What one tier did during a run, summed over the instances.
struct sim_tier_result {
    std::string where;            ///< the store's describe()
    uint64_t fetches = 0;         ///< read_many calls of attaches
    uint64_t fetched_blocks = 0;  ///< blocks they brought back into memory
    uint64_t refused_blocks = 0;  ///< values that were not the block asked for
    uint64_t written_blocks = 0;  ///< blocks the caches wrote to it
    uint64_t errors = 0;          ///< calls that threw (caught by the caches)
    block_store_stats store;      ///< the store's own counters during the run (bytes, errors, round trips)
};

/// What one policy did with one trace at one budget.
struct sim_result {
    sim_policy policy = sim_policy::kvcache;
    sim_schedule schedule = sim_schedule::fcfs;  ///< the admission order (lpm: kvcache only)
    uint64_t budget_tokens = 0;
    uint64_t requests = 0;
    uint64_t prompt_tokens = 0;
    uint64_t hit_tokens = 0;      ///< prompt tokens reused (not computed)
    uint64_t prefill_tokens = 0;  ///< prompt tokens computed
    uint64_t output_tokens = 0;
    uint64_t evicted_tokens = 0;   ///< cached tokens dropped to make room
    uint64_t copied_tokens = 0;    ///< rows copied (llama-server's RAM cache saves and restores)
    uint64_t bytes_copied = 0;     ///< kvcache: prefix_stats::bytes_copied
    uint64_t peak_cells = 0;       ///< most cells in use at once (kvcache: cached cells included)
    uint64_t peak_live_cells = 0;  ///< most cells held by live requests at once
    /// kvcache, none: cells whose memory is committed (the real cache's elastic storage), at the peak and
    /// at the end of the run
    uint64_t peak_committed_cells = 0;
    uint64_t final_committed_cells = 0;
    uint64_t steps = 0;    ///< decode steps
    double mean_live = 0;  ///< live requests per step, averaged over steps
    uint64_t max_live = 0;
    uint64_t queued = 0;      ///< requests that waited at least one step for room or a slot
    uint64_t wait_steps = 0;  ///< steps waited, summed over requests
    uint64_t max_wait_steps = 0;
    double bookkeeping_ns = 0;      ///< time in the policy's calls (cache bookkeeping, placement, index)
    double wall_seconds = 0;        ///< the whole run
    uint64_t cache_hit_tokens = 0;  ///< kvcache: prefix_stats::hit_tokens (= hit_tokens + probe_hit_tokens)
    uint64_t probe_hit_tokens = 0;  ///< kvcache: tokens of attaches undone because the request did not fit
    bool has_serving = true;        ///< false for the oracle (no serving loop: no live/queue figures)
    /// recurrent, hybrid: the most snapshots (kvcache) or checkpoints (llama-server) held at once
    uint64_t peak_snapshots = 0;
    uint64_t swa_cells = 0;  ///< iswa, kvcache and none: cells of the SWA cache
    /// tiers: hit tokens of admitted requests whose blocks a store brought back for their attach
    uint64_t tier_hit_tokens = 0;
    std::vector<sim_tier_result> tiers;  ///< tiers, in order (empty without)
    uint32_t instances = 1;              ///< instances the figures above add up (peaks: summed per instance)
    std::vector<sim_result> per_instance;  ///< more than one instance: each one's figures

    double hit_rate() const { return prompt_tokens ? static_cast<double>(hit_tokens) / prompt_tokens : 0; }
    double ns_per_token() const {
        return prompt_tokens ? bookkeeping_ns / static_cast<double>(prompt_tokens) : 0;
    }
};

/// The result's name in tables, plots and JSON: the policy, "kvcache-lpm" for kvcache admitting by lpm.
std::string label(const sim_result& r);

/// Replays `reqs` through `policy`. Throws kvc::error when a request is larger than the budget (before
/// anything runs) or an option is out of range.
sim_result run_sim(const std::vector<sim_request>& reqs, sim_policy policy, const sim_options& o);

/// Whether `policy` can run with o.instances and o.tiers (kvcache: both; none: instances only); throws
/// kvc::error naming the option otherwise.
void check_instances(sim_policy policy, const sim_options& o);

/// The cells a request needs at least (prompt and output), checked against the budget before a run.
void check_budget(const std::vector<sim_request>& reqs, const sim_options& o);
/// Recurrent and hybrid memories: kvcache's snapshot pool (--snapshots, or the budget's memory: all of it
/// for a recurrent model, a tenth for a hybrid one, at --state-tokens each).
uint32_t snapshot_pool(const sim_options& o);
/// A hybrid memory: the K/V cells of kvcache's policy, the budget less its snapshot pool's memory.
uint32_t hybrid_kv_cells(const sim_options& o);

}  // namespace kvc::cli
