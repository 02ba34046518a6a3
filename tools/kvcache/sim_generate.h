// kvcache sim: built-in workloads, seeded, written as Mooncake-format traces so a run can be repeated and
// shared (kvcache sim --generate KIND --out FILE).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sim_trace.h"

namespace kvc::cli {

/// Every generator's knobs; each kind reads the ones it documents (0 = the kind's default).
struct generate_options {
    std::string kind;  ///< shared-prefix, multi-turn, agent, parallel, mooncake-like
    uint64_t seed = 1;
    uint32_t block = 512;   ///< tokens per hash id (Mooncake's traces: 512)
    uint32_t groups = 0;    ///< shared-prefix: groups (64); multi-turn: conversations (64); agent: agents
                            ///< (16); parallel: prompts (128)
    uint32_t prompts = 0;   ///< shared-prefix: prompts per group (16); multi-turn, agent: turns (8, 16);
                            ///< parallel: samples per prompt (8); mooncake-like: requests (2000)
    uint32_t system = 0;    ///< shared-prefix: system prompt (2048); multi-turn: system prompt (512);
                            ///< agent: scaffold (4096); parallel: prompt (1024)
    uint32_t question = 0;  ///< shared-prefix: question (128); multi-turn: user message (256); agent:
                            ///< tool output (1024)
    uint32_t output = 0;    ///< output tokens per request (256; agent 128; parallel 512; mooncake-like 343)
    /// mooncake-like: a follow-up continues the k-th most recent conversation, k ~ Exp(recency); 0: k
    /// uniform in the 256 most recent (little locality). Default 32.
    double recency = -1;
    /// mooncake-like: instead of `recency`, a turn is continued with probability 0.4, a log-normal
    /// number of requests later with this median (sigma 1: Mooncake's conversation trace has 141 /
    /// 423 / 1,662 requests at the 10th / 50th / 90th percentile). 0: off.
    double follow_gap = 0;
    double rate = 0;  ///< mean arrivals per second (Poisson), 0: the kind's default (10)
};

/// The kinds generate() knows, for help texts and errors.
const std::vector<std::string>& generator_kinds();

/// A workload; throws kvc::error naming the kind or the knob that is wrong.
std::vector<sim_request> generate(const generate_options& o);

}  // namespace kvc::cli
