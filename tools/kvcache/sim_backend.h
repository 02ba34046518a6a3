// kvcache sim: what the serving loop (sim_engine.cpp) asks of a policy. A backend holds the cache state
// of one policy; the loop decides who is live, in which order, and what each step decodes.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include <kvcache/types.h>

#include "sim_engine.h"

namespace kvc::cli {

/// Tokens one live request places in a step, at positions [p0, p0 + n).
struct sim_work {
    seq_id_t seq = 0;
    pos_t p0 = 0;
    uint32_t n = 0;
    std::span<const token_t> tokens;  ///< the n tokens (empty when the backend does not need tokens)
};

class sim_backend {
public:
    virtual ~sim_backend() = default;
    /// Starts request `req` (prompt tokens in `prompt` when needs_tokens(), `n_out` tokens to decode) on
    /// the empty sequence `seq` if it fits beside the `reserved` cells the live requests will still add;
    /// returns the prompt tokens reused, or nullopt when it must wait (the live requests are as they were).
    virtual std::optional<uint32_t> start(seq_id_t seq, uint64_t req, std::span<const token_t> prompt,
                                          uint32_t n_out, uint64_t reserved) = 0;
    /// Places one step's tokens (every live request's); throws if they do not fit (an accounting bug).
    virtual void step(std::span<const sim_work> work) = 0;
    /// The request on `seq` ended: its cells are released (kept as cache where the policy does).
    virtual void finish(seq_id_t seq) = 0;
    virtual uint64_t used_cells() const = 0;            ///< cells in use now, cached ones included
    virtual uint64_t live_cells() const = 0;            ///< cells live requests hold now
    virtual void report(sim_result& r) const = 0;       ///< evictions, copies
    virtual bool needs_tokens() const { return true; }  ///< start() reads `prompt`
    /// Prompt tokens the cache's memory holds now (the prefix route); 0 where the policy cannot tell.
    virtual uint32_t cached_prefix(std::span<const token_t> /*prompt*/) { return 0; }
};

/// The library's kv_cache, with its prefix cache (policy kvcache) or without (policy none).
std::unique_ptr<sim_backend> make_kv_backend(const sim_options& o, bool prefix);
/// The model of llama.cpp's server (bookkeeping over the trace's block ids, no cache underneath).
std::unique_ptr<sim_backend> make_llama_server_backend(const sim_options& o,
                                                       const std::vector<sim_request>& reqs);
/// Belady's MIN over the trace's cache blocks (no serving loop).
sim_result run_oracle(const std::vector<sim_request>& reqs, const sim_options& o);
/// A plain LRU over the trace's cache blocks, requests one after the other; a request hits the blocks of
/// its prompt up to the first missing one (no serving loop).
sim_result run_lru_blocks(const std::vector<sim_request>& reqs, const sim_options& o);

}  // namespace kvc::cli
