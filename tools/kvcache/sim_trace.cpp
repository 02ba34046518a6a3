// kvcache sim: Mooncake-format traces, read and written, and the tokens they stand for.
#include "sim_trace.h"

#include <fstream>
#include <istream>
#include <ostream>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "files.h"

namespace kvc::cli {
namespace {

uint64_t mix(uint64_t x) {  // splitmix64's finaliser: distinct inputs, well-spread outputs
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

[[noreturn]] void bad(const std::string& name, size_t line, const std::string& what) {
    throw error(errc::invalid_argument, fmt::format("{}:{}: {}", name, line, what));
}

uint64_t get_uint(const nlohmann::json& j, const char* field, uint64_t max, const std::string& name,
                  size_t line) {
    const auto it = j.find(field);
    if (it == j.end()) bad(name, line, fmt::format("field '{}' is missing", field));
    if (!it->is_number_unsigned() && !(it->is_number_integer() && it->get<int64_t>() >= 0))
        bad(name, line, fmt::format("field '{}' must be a non-negative integer, got {}", field, it->dump()));
    const uint64_t v = it->get<uint64_t>();
    if (v > max) bad(name, line, fmt::format("field '{}' is {}, above the limit {}", field, v, max));
    return v;
}

}  // namespace

std::vector<sim_request> read_trace(std::istream& in, const std::string& name, uint32_t block) {
    constexpr uint64_t max_tokens = 1u << 24;  // 16M tokens: far beyond any context, small enough for cells
    std::vector<sim_request> reqs;
    std::string text;
    size_t line = 0;
    double last = 0;
    while (std::getline(in, text)) {
        ++line;
        if (text.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank lines are allowed
        nlohmann::json j;
        try {
            j = nlohmann::json::parse(text);
        } catch (const nlohmann::json::parse_error& e) {
            bad(name, line, fmt::format("not a JSON object ({})", e.what()));
        }
        if (!j.is_object()) bad(name, line, "not a JSON object");
        sim_request r;
        const auto ts = j.find("timestamp");
        if (ts == j.end()) bad(name, line, "field 'timestamp' is missing");
        if (!ts->is_number() || ts->get<double>() < 0)
            bad(name, line,
                fmt::format("field 'timestamp' must be a non-negative number, got {}", ts->dump()));
        r.timestamp = ts->get<double>();
        if (r.timestamp < last)
            bad(name, line,
                fmt::format("field 'timestamp' goes back in time ({} after {})", r.timestamp, last));
        last = r.timestamp;
        r.input_length = static_cast<uint32_t>(get_uint(j, "input_length", max_tokens, name, line));
        if (r.input_length == 0) bad(name, line, "field 'input_length' must be at least 1");
        r.output_length = static_cast<uint32_t>(get_uint(j, "output_length", max_tokens, name, line));
        const auto ids = j.find("hash_ids");
        if (ids == j.end()) bad(name, line, "field 'hash_ids' is missing");
        if (!ids->is_array()) bad(name, line, "field 'hash_ids' must be an array of non-negative integers");
        const size_t want = (r.input_length + block - 1) / block;
        if (ids->size() != want)
            bad(name, line,
                fmt::format("field 'hash_ids' has {} ids, but input_length {} needs {} blocks of {} tokens",
                            ids->size(), r.input_length, want, block));
        r.hash_ids.reserve(want);
        for (size_t k = 0; k < ids->size(); ++k) {
            const auto& v = (*ids)[k];
            if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<int64_t>() >= 0))
                bad(name, line,
                    fmt::format("field 'hash_ids'[{}] must be a non-negative integer, got {}", k, v.dump()));
            r.hash_ids.push_back(v.get<uint64_t>());
        }
        reqs.push_back(std::move(r));
    }
    if (reqs.empty()) throw error(errc::invalid_argument, fmt::format("{}: no requests", name));
    return reqs;
}

std::vector<sim_request> read_trace_file(const std::string& path, uint32_t block) {
    std::ifstream in = open_read(path, "trace");
    return read_trace(in, path, block);
}

void write_trace(std::ostream& out, const std::vector<sim_request>& reqs) {
    for (const sim_request& r : reqs) {
        out << "{\"timestamp\": " << fmt::format("{}", r.timestamp)
            << ", \"input_length\": " << r.input_length << ", \"output_length\": " << r.output_length
            << ", \"hash_ids\": [";
        for (size_t k = 0; k < r.hash_ids.size(); ++k) out << (k ? ", " : "") << r.hash_ids[k];
        out << "]}\n";
    }
}

token_t block_token(uint64_t id, uint32_t j) {
    return static_cast<token_t>(mix(id * 0x100000001B3ull + j) & 0x7FFFFFFF);
}

void prompt_tokens(const sim_request& r, uint32_t block, std::vector<token_t>& out) {
    for (uint32_t i = 0; i < r.input_length; ++i)
        out.push_back(block_token(r.hash_ids[i / block], i % block));
}

token_t output_token(uint64_t req, uint32_t i) {
    return static_cast<token_t>(mix(~(req << 24) ^ i ^ 0x5A5A000000000000ull) & 0x7FFFFFFF);
}

trace_stats analyse_trace(const std::vector<sim_request>& reqs, uint32_t trace_block, uint32_t cache_block) {
    trace_stats st;
    const uint32_t per = trace_block / cache_block;
    std::unordered_set<uint64_t> seen;
    for (size_t i = 0; i < reqs.size(); ++i) {
        const sim_request& r = reqs[i];
        ++st.requests;
        st.prompt_tokens += r.input_length;
        st.output_tokens += r.output_length;
        if (r.input_length + r.output_length > st.max_request) {
            st.max_request = r.input_length + r.output_length;
            st.max_request_index = i;
        }
        const uint32_t full = r.input_length / cache_block;
        for (uint32_t k = 0; k < full; ++k)
            (seen.insert(cache_block_key(r, k, per)).second ? st.unique_tokens : st.reusable_tokens) +=
                cache_block;
        st.unique_tokens += r.input_length - full * cache_block;  // a partial tail is never reused
    }
    return st;
}

std::vector<int64_t> follow_ups(const std::vector<sim_request>& reqs) {
    // ids are chained, so a request's last id and their count name all its ids: the latest request that
    // ends with each (id, count)
    struct key_hash {
        size_t operator()(const std::pair<uint64_t, size_t>& k) const {
            return std::hash<uint64_t>{}(k.first * 0x9E3779B97F4A7C15ull + k.second);
        }
    };
    std::unordered_map<std::pair<uint64_t, size_t>, size_t, key_hash> ends;
    std::vector<int64_t> parent(reqs.size(), -1);
    for (size_t i = 0; i < reqs.size(); ++i) {
        const std::vector<uint64_t>& ids = reqs[i].hash_ids;
        for (size_t n = ids.size(); n > 0; --n) {  // the longest continued prompt first
            const auto it = ends.find({ids[n - 1], n});
            if (it != ends.end() && reqs[it->second].input_length < reqs[i].input_length) {
                parent[i] = static_cast<int64_t>(it->second);
                break;
            }
        }
        if (!ids.empty()) ends[{ids.back(), ids.size()}] = i;
    }
    return parent;
}

}  // namespace kvc::cli
