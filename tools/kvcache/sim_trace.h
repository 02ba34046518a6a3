// kvcache sim: serving traces in Mooncake's JSONL format (one request per line: timestamp in ms,
// input_length, output_length, hash_ids of chained trace blocks), and the tokens they stand for.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include <kvcache/types.h>

namespace kvc::cli {

/// One request of a trace. Equal hash_ids at the same index of two requests mean equal token blocks
/// (ids are chained: an id names its block and everything before it).
struct sim_request {
    double timestamp = 0;            ///< arrival, ms
    uint32_t input_length = 0;       ///< prompt tokens
    uint32_t output_length = 0;      ///< tokens decoded
    std::vector<uint64_t> hash_ids;  ///< [ceil(input_length / trace_block)] ids of the prompt's blocks
};

/// Reads a JSONL trace; `name` (a file name) prefixes every error, which names the line and the field.
/// Checks that hash_ids has ceil(input_length / block) entries and that timestamps never go back.
std::vector<sim_request> read_trace(std::istream& in, const std::string& name, uint32_t block);
std::vector<sim_request> read_trace_file(const std::string& path, uint32_t block);
/// Writes one JSON object per line, fields in Mooncake's order.
void write_trace(std::ostream& out, const std::vector<sim_request>& reqs);

/// Token j (0-based) of the block named `id`: deterministic, spread over [0, 2^31).
token_t block_token(uint64_t id, uint32_t j);
/// Appends the prompt of `r` (input_length tokens from its hash_ids) to out.
void prompt_tokens(const sim_request& r, uint32_t block, std::vector<token_t>& out);
/// Output token i of request number `req`: never equal to a prompt token of the same place in practice
/// (answers are not reused, docs/sim.md).
token_t output_token(uint64_t req, uint32_t i);

/// What a trace holds, counted in cache blocks of `cache_block` tokens (the unit of reuse).
struct trace_stats {
    uint64_t requests = 0;
    uint64_t prompt_tokens = 0;
    uint64_t output_tokens = 0;
    uint64_t unique_tokens = 0;    ///< prompt tokens of distinct cache blocks, plus partial tails
    uint64_t reusable_tokens = 0;  ///< tokens of cache blocks seen earlier: the hits of an infinite cache
    uint32_t max_request = 0;      ///< largest input_length + output_length
    uint64_t max_request_index = 0;
};
trace_stats analyse_trace(const std::vector<sim_request>& reqs, uint32_t trace_block, uint32_t cache_block);

/// For each request, the latest earlier one it continues (its follow-up): one whose hash_ids are all the
/// first of its own and whose prompt is shorter (the turn before, in a conversation); -1 when none. A
/// request with the same ids and length (a sample of the same prompt) continues nothing.
std::vector<int64_t> follow_ups(const std::vector<sim_request>& reqs);

/// Key of cache block k of a prompt (the k-th `cache_block` tokens): its trace block's id and place.
inline uint64_t cache_block_key(const sim_request& r, uint32_t k, uint32_t per_trace_block) {
    return r.hash_ids[k / per_trace_block] * per_trace_block + k % per_trace_block;
}

}  // namespace kvc::cli
