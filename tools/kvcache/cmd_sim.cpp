// kvcache sim: replays a serving trace (Mooncake's JSONL, or a built-in generator's) through the library's
// kv_cache with its prefix cache and through the policies people would otherwise use (llama.cpp's server,
// no reuse, the offline optimum), at one budget or a sweep of budgets; prints a table per budget, --json,
// and --plot draws hit rate against budget. docs/sim.md says what is modelled.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <kvcache/disk_store.h>
#ifdef KVC_SIM_REDIS
#include <kvcache/redis/redis_store.h>
#endif

#include "commands.h"
#include "files.h"
#include "rss.h"
#include "sim_engine.h"
#include "sim_generate.h"
#include "sim_plot.h"
#include "sim_trace.h"

namespace kvc::cli {
namespace {

struct sim_cli_options {
    std::string trace, out, plot;
    generate_options gen;
    std::string policies = "kvcache,llama-server,none,oracle";
    std::string budget, sweep;
    std::string evict = "lru", arrival = "ignore", memory = "kv", schedule = "fcfs";
    std::vector<sim_schedule> schedules;  // kvcache runs once per schedule
    sim_options sim;
    bool json = false;
    bool wide = false;          // every column (ns, waits, commits, copies), about 190 characters wide
    bool policy_given = false;  // --policy was on the command line (else the default adapts to the options)
    std::string route = "rr", tier_write = "evict";
    std::vector<std::string> tiers;
};

std::vector<std::string> split_commas(const std::string& s) {
    std::vector<std::string> v;
    std::stringstream in(s);
    for (std::string x; std::getline(in, x, ',');)
        if (!x.empty()) v.push_back(x);
    return v;
}

// A budget: tokens ("65536") or a percentage of the trace's unique prompt tokens ("3%"), rounded up to
// whole cache blocks.
uint32_t parse_budget(const std::string& s, uint64_t unique, uint32_t block) {
    const bool pct = !s.empty() && s.back() == '%';
    double v = 0;
    size_t used = 0;
    try {
        v = std::stod(pct ? s.substr(0, s.size() - 1) : s, &used);
    } catch (const std::exception&) {
        used = 0;
    }
    if (used != s.size() - (pct ? 1 : 0) || !(v > 0) || (pct && v > 1000))
        throw error(
            errc::invalid_argument,
            fmt::format("budget '{}': want a positive token count or a percentage in (0%, 1000%]", s));
    const double tokens = pct ? std::ceil(static_cast<double>(unique) * v / 100) : v;
    if (tokens > 2e9)
        throw error(errc::invalid_argument,
                    fmt::format("budget '{}' is {:.0f} tokens, above the limit 2e9", s, tokens));
    const auto t = static_cast<uint64_t>(tokens);
    return static_cast<uint32_t>((t + block - 1) / block * block);
}

// "1073741824", "64M", "8G": bytes (K, M, G, T are powers of 1024).
uint64_t parse_bytes(const std::string& s, const std::string& what) {
    size_t used = 0;
    uint64_t v = 0;
    try {
        v = std::stoull(s, &used);
    } catch (const std::exception&) {
        used = 0;
    }
    int shift = 0;
    if (used > 0 && used + 1 == s.size()) {
        const std::string units = "KMGT";
        const size_t u = units.find(static_cast<char>(std::toupper(static_cast<unsigned char>(s.back()))));
        if (u != std::string::npos) shift = 10 * static_cast<int>(u + 1), ++used;
    }
    if (used == 0 || used != s.size() || (shift && v > (UINT64_MAX >> shift)))
        throw error(errc::invalid_argument,
                    fmt::format("{}: max='{}' is not a byte count (e.g. 1073741824, 64M, 8G)", what, s));
    return v << shift;
}

// --tier disk:DIR[,max=BYTES] or redis:HOST:PORT: a store every instance's prefix cache shares.
std::shared_ptr<block_store_i> make_tier(const std::string& spec) {
    const std::string what = fmt::format("--tier '{}'", spec);
    const auto bad = [&] {
        return error(errc::invalid_argument,
                     fmt::format("{}: want disk:DIR[,max=BYTES] or redis:HOST:PORT", what));
    };
    if (spec.rfind("disk:", 0) == 0) {
        std::string dir = spec.substr(5);
        uint64_t max = 0;
        if (const size_t c = dir.rfind(",max="); c != std::string::npos) {
            max = parse_bytes(dir.substr(c + 5), what);
            dir.resize(c);
        }
        if (dir.empty()) throw bad();
        disk_store_params p;
        p.dir = dir;
        p.max_bytes = max;
        return std::make_shared<disk_block_store>(p);
    }
    if (spec.rfind("redis:", 0) == 0) {
        const std::string hp = spec.substr(6);
        const size_t c = hp.rfind(':');
        if (c == std::string::npos || c == 0 || c + 1 == hp.size()) throw bad();
        int port = 0;
        size_t used = 0;
        try {
            port = std::stoi(hp.substr(c + 1), &used);
        } catch (const std::exception&) {
            used = 0;
        }
        if (used != hp.size() - c - 1 || port < 1 || port > 65535)
            throw error(errc::invalid_argument,
                        fmt::format("{}: port '{}' not in [1, 65535]", what, hp.substr(c + 1)));
#ifdef KVC_SIM_REDIS
        redis_store_params p;
        p.host = hp.substr(0, c);
        p.port = port;
        return std::make_shared<redis_block_store>(p);
#else
        throw error(errc::unsupported,
                    fmt::format("{}: this build has no Redis store (built with KVC_BUILD_REDIS=OFF)", what));
#endif
    }
    throw bad();
}

std::string pct(double x) {
    return fmt::format("{:.1f}%", 100 * x);
}

// What most readers want, in 100 columns; --wide adds the serving and memory columns.
void print_narrow_table(const std::vector<sim_result>& rs) {
    fmt::print("{:<13}  {:>8}  {:>10}  {:>14}  {:>14}  {:>10}  {:>6}  {:>8}\n", "policy", "hit rate",
               "hit tokens", "prefill tokens", "evicted tokens", "peak cells", "queued", "ns/token");
    for (const sim_result& r : rs)
        fmt::print("{:<13}  {:>8}  {:>10}  {:>14}  {:>14}  {:>10}  {:>6}  {:>8.1f}\n", label(r),
                   pct(r.hit_rate()), r.hit_tokens, r.prefill_tokens, r.evicted_tokens,
                   r.has_serving ? std::to_string(r.peak_cells) : "-",
                   r.has_serving ? std::to_string(r.queued) : "-", r.ns_per_token());
}

void print_wide_table(const std::vector<sim_result>& rs) {
    fmt::print(
        "{:<13} {:>7} {:>12} {:>12} {:>11} {:>10} {:>10} {:>15} {:>11} {:>7} {:>12} {:>10} {:>9} {:>7}\n",
        "policy", "hit", "hit tok", "prefill tok", "evicted", "peak cells", "live cells", "committed pk/end",
        "live mean/max", "queued", "wait mean/max", "copied", "ns/tok", "wall s");
    for (const sim_result& r : rs) {
        const std::string live = r.has_serving ? fmt::format("{:.1f}/{}", r.mean_live, r.max_live) : "-";
        const std::string wait =
            r.has_serving ? fmt::format("{:.1f}/{}", r.requests ? double(r.wait_steps) / r.requests : 0.0,
                                        r.max_wait_steps)
                          : "-";
        const bool real = r.policy == sim_policy::kvcache || r.policy == sim_policy::none;  // the real cache
        const std::string committed =
            real ? fmt::format("{}/{}", r.peak_committed_cells, r.final_committed_cells) : "-";
        fmt::print(
            "{:<13} {:>7} {:>12} {:>12} {:>11} {:>10} {:>10} {:>15} {:>13} {:>7} {:>12} {:>10} {:>9.1f} "
            "{:>7.2f}\n",
            label(r), pct(r.hit_rate()), r.hit_tokens, r.prefill_tokens, r.evicted_tokens,
            r.has_serving ? std::to_string(r.peak_cells) : "-",
            r.has_serving ? std::to_string(r.peak_live_cells) : "-", committed, live,
            r.has_serving ? std::to_string(r.queued) : "-", wait,
            r.policy == sim_policy::kvcache || r.policy == sim_policy::none
                ? fmt::format("{} B", r.bytes_copied)
                : fmt::format("{} tok", r.copied_tokens),
            r.ns_per_token(), r.wall_seconds);
    }
}

// Recurrent, hybrid and iSWA models: the states each policy keeps (kvcache's snapshots, llama-server's
// checkpoints), in tokens of K/V memory (a state costs state_tokens; an iSWA checkpoint, the window) and
// as a share of the budget; for iSWA, kvcache's SWA cache instead.
void print_snapshots(const std::vector<sim_result>& rs, const sim_options& o) {
    const uint32_t cost = o.memory == sim_memory::iswa ? o.window : o.state_tokens;
    for (const sim_result& r : rs) {
        if (r.policy != sim_policy::kvcache && r.policy != sim_policy::llama_server) continue;
        if (o.memory == sim_memory::iswa && r.policy == sim_policy::kvcache) {
            fmt::print("{:<13} SWA cache: {} cells, {} of the budget (window {} x {} requests + more)\n",
                       label(r), r.swa_cells,
                       pct(static_cast<double>(r.swa_cells) / static_cast<double>(r.budget_tokens)), o.window,
                       o.concurrency);
            continue;
        }
        const double tokens = static_cast<double>(r.peak_snapshots) * cost;
        fmt::print("{:<13} states kept: {} {} at peak = {:.0f} tokens ({} of budget, {} per state)\n",
                   label(r), r.peak_snapshots, r.policy == sim_policy::kvcache ? "snapshots" : "checkpoints",
                   tokens, pct(tokens / static_cast<double>(r.budget_tokens)), cost);
    }
}

// Several instances or tiers: what the figures stand for (printed above the table).
void print_setup(const sim_options& o) {
    std::string tiers;
    for (const auto& st : o.tiers.stores) {
        if (!tiers.empty()) tiers.append(", ");
        tiers.append(st->describe());
    }
    fmt::print("instances {}, route {} (budget and concurrency per instance; peaks summed over them)",
               o.instances, to_string(o.route));
    fmt::print("\n");
    if (!tiers.empty())
        fmt::print("tiers {}, write {}\n", tiers, o.tiers.write == tier_write::through ? "through" : "evict");
}

std::string mib(uint64_t bytes) {
    return fmt::format("{:.1f} MiB", static_cast<double>(bytes) / (1 << 20));
}

// Several instances: each one's hit rate; tiers: what each store did.
void print_instances(const std::vector<sim_result>& rs) {
    for (const sim_result& r : rs) {
        if (!r.per_instance.empty()) {
            std::string hits, reqs;
            for (const sim_result& x : r.per_instance) {
                hits.append(fmt::format(" {}", pct(x.hit_rate())));
                reqs.append(fmt::format(" {}", x.requests));
            }
            fmt::print("{:<13} per instance: hit{}; requests{}\n", label(r), hits, reqs);
        }
        for (const sim_tier_result& t : r.tiers)
            fmt::print(
                "{0:<13} tier {1}\n{5:<13} fetched {2} blocks in {3} fetches ({4} read), written {6} blocks "
                "({7})\n{5:<13} refused {8}, errors {9}; the store: {10} errors, {11} damaged, {12} evicted, "
                "{13} "
                "round trips\n",
                label(r), t.where, t.fetched_blocks, t.fetches, mib(t.store.bytes_in), "", t.written_blocks,
                mib(t.store.bytes_out), t.refused_blocks, t.errors, t.store.errors, t.store.damaged,
                t.store.evictions, t.store.round_trips);
        if (!r.tiers.empty())
            fmt::print("{:<13} hit tokens from tiers: {} ({} of the hit tokens)\n", label(r),
                       r.tier_hit_tokens,
                       pct(r.hit_tokens ? static_cast<double>(r.tier_hit_tokens) / r.hit_tokens : 0));
    }
}

// `instance`: one of several instances' figures, whose stores' own counters are the whole run's (in the
// sum), not its own.
nlohmann::ordered_json to_json(const sim_result& r, bool instance = false) {
    nlohmann::ordered_json j;
    j["policy"] = to_string(r.policy);
    j["budget_tokens"] = r.budget_tokens;
    j["requests"] = r.requests;
    j["prompt_tokens"] = r.prompt_tokens;
    j["hit_tokens"] = r.hit_tokens;
    j["hit_rate"] = r.hit_rate();
    j["prefill_tokens"] = r.prefill_tokens;
    j["evictions"] = r.evicted_tokens;  // tokens
    j["copied_tokens"] = r.copied_tokens;
    j["bytes_copied"] = r.bytes_copied;
    if (r.has_serving) {
        j["peak_cells"] = r.peak_cells;
        j["peak_live_cells"] = r.peak_live_cells;
        j["max_live"] = r.max_live;
        j["mean_live"] = r.mean_live;
        j["queued"] = r.queued;
        j["wait_steps"] = r.wait_steps;
        j["max_wait_steps"] = r.max_wait_steps;
        j["steps"] = r.steps;
        j["output_tokens"] = r.output_tokens;
    } else {
        for (const char* k : {"peak_cells", "peak_live_cells", "max_live", "mean_live", "queued",
                              "wait_steps", "max_wait_steps", "steps", "output_tokens"})
            j[k] = nullptr;
    }
    j["bookkeeping_ns_per_token"] = r.ns_per_token();
    j["wall_seconds"] = r.wall_seconds;
    if (r.policy == sim_policy::kvcache || r.policy == sim_policy::none) {
        j["peak_committed_cells"] = r.peak_committed_cells;
        j["final_committed_cells"] = r.final_committed_cells;
    }
    if (r.policy == sim_policy::kvcache) {
        j["schedule"] = to_string(r.schedule);
        j["cache_hit_tokens"] = r.cache_hit_tokens;  // the prefix cache's own counter
        j["probe_hit_tokens"] = r.probe_hit_tokens;
    }
    if (!r.tiers.empty()) {
        j["tier_hit_tokens"] = r.tier_hit_tokens;
        auto& ts = j["tiers"] = nlohmann::ordered_json::array();
        for (const sim_tier_result& t : r.tiers) {
            nlohmann::ordered_json x{{"where", t.where},
                                     {"fetches", t.fetches},
                                     {"fetched_blocks", t.fetched_blocks},
                                     {"refused_blocks", t.refused_blocks},
                                     {"written_blocks", t.written_blocks},
                                     {"errors", t.errors}};
            if (!instance) {
                x["bytes_in"] = t.store.bytes_in;
                x["bytes_out"] = t.store.bytes_out;
                x["store_errors"] = t.store.errors;
                x["store_damaged"] = t.store.damaged;
                x["store_lookups"] = t.store.lookups;
                x["store_hits"] = t.store.hits;
                x["store_evictions"] = t.store.evictions;
                x["round_trips"] = t.store.round_trips;
                x["store_calls"] = t.store.calls;
                x["store_latency_ns"] = t.store.latency_ns;
            }
            ts.push_back(std::move(x));
        }
    }
    if (!r.per_instance.empty()) {
        j["instances"] = r.instances;
        auto& is = j["per_instance"] = nlohmann::ordered_json::array();
        for (const sim_result& x : r.per_instance) is.push_back(to_json(x, true));
    }
    return j;
}

// A bar on stderr, only when it is a terminal.
struct progress_bar {
    std::string label;
    void operator()(double f) const {
        const int w = 30, n = static_cast<int>(f * w);
        std::fprintf(stderr, "\r%-28s [%s%s] %3d%%", label.c_str(), std::string(n, '#').c_str(),
                     std::string(w - n, ' ').c_str(), static_cast<int>(f * 100));
        if (f >= 1) std::fprintf(stderr, "\r%*s\r", 70, "");
        std::fflush(stderr);
    }
};

void run(sim_cli_options o) {
    if (o.trace.empty() == o.gen.kind.empty())
        throw error(errc::invalid_argument, "give one workload: --trace FILE.jsonl or --generate KIND");
    o.gen.block = o.sim.trace_block;
    std::vector<sim_request> reqs =
        o.trace.empty() ? generate(o.gen) : read_trace_file(o.trace, o.sim.trace_block);
    if (!o.out.empty()) {
        std::ofstream f = open_write(o.out, "trace");
        write_trace(f, reqs);
        finish_write(f, o.out, "trace");
        if (o.budget.empty() && o.sweep.empty()) {
            fmt::print("{} requests written to {}\n", reqs.size(), o.out);
            return;
        }
    }
    if (o.evict == "lru")
        o.sim.evict = evict_policy::lru;
    else if (o.evict == "slru")
        o.sim.evict = evict_policy::slru;
    else if (o.evict == "adaptive")
        o.sim.evict = evict_policy::adaptive;
    else
        throw error(errc::invalid_argument,
                    fmt::format("--evict '{}': not one of lru, slru, adaptive", o.evict));
    for (const std::string& s : split_commas(o.schedule)) {
        if (s != "fcfs" && s != "lpm")
            throw error(errc::invalid_argument, fmt::format("--schedule '{}': not one of fcfs, lpm", s));
        o.schedules.push_back(s == "fcfs" ? sim_schedule::fcfs : sim_schedule::lpm);
    }
    if (o.schedules.empty()) throw error(errc::invalid_argument, "--schedule: no order given");
    if (o.memory == "kv")
        o.sim.memory = sim_memory::kv;
    else if (o.memory == "recurrent")
        o.sim.memory = sim_memory::recurrent;
    else if (o.memory == "hybrid")
        o.sim.memory = sim_memory::hybrid;
    else if (o.memory == "iswa")
        o.sim.memory = sim_memory::iswa;
    else
        throw error(errc::invalid_argument,
                    fmt::format("--memory '{}': not one of kv, recurrent, hybrid, iswa", o.memory));
    if (o.arrival != "ignore" && o.arrival != "respect")
        throw error(errc::invalid_argument,
                    fmt::format("--arrival '{}': not one of ignore, respect", o.arrival));
    o.sim.respect_arrival = o.arrival == "respect";
    if (o.route == "rr")
        o.sim.route = sim_route::rr;
    else if (o.route == "prefix")
        o.sim.route = sim_route::prefix;
    else
        throw error(errc::invalid_argument, fmt::format("--route '{}': not one of rr, prefix", o.route));
    if (o.tier_write == "evict")
        o.sim.tiers.write = tier_write::on_evict;
    else if (o.tier_write == "through")
        o.sim.tiers.write = tier_write::through;
    else
        throw error(errc::invalid_argument,
                    fmt::format("--tier-write '{}': not one of evict, through", o.tier_write));
    if (o.tiers.size() > prefix_max_tiers)
        throw error(errc::invalid_argument,
                    fmt::format("--tier given {} times, at most {}", o.tiers.size(), prefix_max_tiers));
    for (const std::string& t : o.tiers) o.sim.tiers.stores.push_back(make_tier(t));
    // several instances or tiers: the policies that can use them, unless asked for others (refused)
    if (!o.policy_given && !o.tiers.empty())
        o.policies = "kvcache";
    else if (!o.policy_given && o.sim.instances != 1)
        o.policies = "kvcache,none";
    std::vector<sim_policy> policies;
    for (const std::string& p : split_commas(o.policies)) {
        const auto v = parse_sim_policy(p);
        if (!v)
            throw error(
                errc::invalid_argument,
                fmt::format("--policy '{}': not one of kvcache, none, llama-server, oracle, lru-blocks", p));
        policies.push_back(*v);
        check_instances(*v, o.sim);
    }
    if (policies.empty()) throw error(errc::invalid_argument, "--policy: no policy given");
    if (o.sim.cache_block == 0 || o.sim.trace_block % o.sim.cache_block != 0)
        throw error(errc::invalid_argument, fmt::format("--block {} must divide --trace-block {}",
                                                        o.sim.cache_block, o.sim.trace_block));
    const trace_stats ts = analyse_trace(reqs, o.sim.trace_block, o.sim.cache_block);
    std::vector<std::string> budget_specs =
        o.sweep.empty() ? std::vector<std::string>{o.budget.empty() ? "10%" : o.budget}
                        : split_commas(o.sweep);
    if (!o.sweep.empty() && !o.budget.empty())
        throw error(errc::invalid_argument, "give --budget or --sweep, not both");
    std::vector<uint32_t> budgets;
    for (const std::string& b : budget_specs) {
        sim_options so = o.sim;
        so.budget = parse_budget(b, ts.unique_tokens, o.sim.cache_block);
        check_budget(reqs, so);  // every budget before anything runs
        if (so.budget > ts.unique_tokens)
            fmt::print(stderr,
                       "kvcache sim: warning: budget '{}' ({} tokens) exceeds the trace's {} unique prompt "
                       "tokens:\n  at 100% the cache holds every block already; above, only live requests' "
                       "cells compete\n",
                       b, so.budget, ts.unique_tokens);
        budgets.push_back(so.budget);
    }
    const double ideal = ts.prompt_tokens ? double(ts.reusable_tokens) / double(ts.prompt_tokens) : 0;
    if (!o.json)
        fmt::print(
            "trace   {} requests, {} prompt tokens (mean {:.0f}), {} output tokens,\n        {} unique "
            "prompt "
            "tokens; an infinite cache hits {} of prompt tokens\n",
            ts.requests, ts.prompt_tokens, double(ts.prompt_tokens) / double(ts.requests), ts.output_tokens,
            ts.unique_tokens, pct(ideal));
    const bool tty = ::isatty(2) != 0;
    // every run writes its tier records under a model id of its own, so that no run (nor an earlier
    // kvcache sim on the same directory or server) reads another's: each starts with cold tiers
    uint64_t model_id = std::random_device{}();
    model_id = (model_id << 32) ^ std::random_device{}();
    std::vector<sim_result> all;
    for (size_t bi = 0; bi < budgets.size(); ++bi) {
        sim_options so = o.sim;
        so.budget = budgets[bi];
        std::vector<sim_result> rs;
        for (sim_policy p : policies)
            for (sim_schedule sc : o.schedules) {  // kvcache once per admission order, the others once
                if (p != sim_policy::kvcache && sc != o.schedules[0]) continue;
                so.schedule = sc;
                if (tty)
                    so.progress = progress_bar{
                        fmt::format("{} {} @ {}", to_string(p), to_string(sc), budget_specs[bi])};
                so.tiers.model_id = model_id++;
                rs.push_back(run_sim(reqs, p, so));
            }
        if (!o.json) {
            fmt::print(
                "\nbudget  {} tokens ({} of unique), {} blocks of {} tokens\n        memory {}, evict {}, "
                "concurrency {}\n",
                so.budget, pct(double(so.budget) / double(ts.unique_tokens)), so.budget / so.cache_block,
                so.cache_block, o.memory, o.evict, so.concurrency);
            if (so.instances != 1 || !so.tiers.stores.empty()) print_setup(so);
            if (o.wide)
                print_wide_table(rs);
            else
                print_narrow_table(rs);
            if (so.memory != sim_memory::kv) print_snapshots(rs, so);
            print_instances(rs);
        }
        all.insert(all.end(), rs.begin(), rs.end());
    }
    const rss mem = read_rss();
    if (!o.json)
        fmt::print("\nprocess memory: {:.1f} MiB resident at the end, {:.1f} MiB at the peak\n",
                   static_cast<double>(mem.now) / (1 << 20), static_cast<double>(mem.peak) / (1 << 20));
    if (o.json) {
        nlohmann::ordered_json j;
        j["trace"] = {{"requests", ts.requests},
                      {"prompt_tokens", ts.prompt_tokens},
                      {"output_tokens", ts.output_tokens},
                      {"unique_tokens", ts.unique_tokens},
                      {"reusable_tokens", ts.reusable_tokens},
                      {"ideal_hit_rate", ideal}};
        j["concurrency"] = o.sim.concurrency;
        j["evict"] = o.evict;
        j["schedule"] = o.schedule;
        j["memory"] = o.memory;
        if (o.sim.memory == sim_memory::iswa) j["window"] = o.sim.window;
        if (o.sim.memory != sim_memory::kv) j["state_tokens"] = o.sim.state_tokens;
        if (o.sim.instances != 1) {
            j["instances"] = o.sim.instances;
            j["route"] = to_string(o.sim.route);
        }
        if (!o.sim.tiers.stores.empty()) {
            j["tiers"] = nlohmann::ordered_json::array();
            for (const auto& st : o.sim.tiers.stores) j["tiers"].push_back(st->describe());
            j["tier_write"] = o.tier_write;
        }
        j["rss_bytes"] = mem.now;
        j["peak_rss_bytes"] = mem.peak;
        auto& arr = j["results"] = nlohmann::ordered_json::array();
        for (const sim_result& r : all) {
            arr.push_back(to_json(r));
            if (o.sim.memory != sim_memory::kv) arr.back()["peak_snapshots"] = r.peak_snapshots;
            if (o.sim.memory == sim_memory::iswa) arr.back()["swa_cells"] = r.swa_cells;
        }
        fmt::print("{}\n", j.dump(2));
    }
    if (!o.plot.empty()) {
        const std::string name = o.trace.empty() ? o.gen.kind : o.trace;
        write_file(
            o.plot, "plot",
            plot_hit_rates(all, ts, o.evict == "lru" ? name : fmt::format("{} (evict {})", name, o.evict)));
        if (!o.json) fmt::print("\nplot in {}\n", o.plot);
    }
}

}  // namespace

void add_sim_command(CLI::App& app) {
    auto o = std::make_shared<sim_cli_options>();
    CLI::App* cmd = app.add_subcommand(
        "sim",
        "Replay a serving trace through the prefix cache and other policies: hit rate, prefill, "
        "live sequences, cost");
    cmd->add_option("--trace", o->trace,
                    "a Mooncake-format JSONL trace (timestamp, input_length, "
                    "output_length, hash_ids)");
    cmd->add_option("--generate", o->gen.kind,
                    "a built-in workload: shared-prefix, multi-turn, agent, parallel, "
                    "mooncake-like");
    cmd->add_option("--out", o->out,
                    "write the workload as JSONL to FILE (then stop unless --budget/--sweep)");
    cmd->add_option("--policy", o->policies,
                    "policies, comma-separated: kvcache, llama-server, none, oracle, lru-blocks (with "
                    "--tier: kvcache; with --instances: kvcache,none)")
        ->capture_default_str()
        ->each([o](const std::string&) { o->policy_given = true; });
    cmd->add_option("--budget", o->budget,
                    "cache size: TOKENS or a percentage of the unique prompt tokens "
                    "(default 10%)");
    cmd->add_option("--sweep", o->sweep, "several budgets, comma-separated (e.g. 1%,3%,10%,30%)");
    cmd->add_option("--concurrency", o->sim.concurrency, "live requests at most (sequences, slots)")
        ->capture_default_str();
    cmd->add_option("--evict", o->evict, "the prefix cache's eviction policy: lru, slru, adaptive")
        ->capture_default_str();
    cmd->add_option("--arrival", o->arrival,
                    "ignore: a request arrives when a sequence is free; respect: at its "
                    "timestamp")
        ->capture_default_str();
    cmd->add_option("--wait-answer", o->sim.wait_answer,
                    "a request continuing an earlier one (a conversation's next turn) arrives only after it "
                    "ended (1) or in trace order regardless (0)")
        ->capture_default_str();
    cmd->add_option("--step-ms", o->sim.step_ms, "simulated ms per decode step (--arrival respect)")
        ->capture_default_str();
    cmd->add_option("--trace-block", o->sim.trace_block, "tokens per hash id")->capture_default_str();
    cmd->add_option("--block", o->sim.cache_block, "tokens per prefix-cache block")->capture_default_str();
    cmd->add_option("--ubatch", o->sim.n_ubatch, "tokens per ubatch when placing a step")
        ->capture_default_str();
    cmd->add_option("--defer-shared", o->sim.defer_shared,
                    "kvcache: a request whose first block is being computed by one admitted in the same step "
                    "waits a step (1) or not (0)")
        ->capture_default_str();
    cmd->add_option("--schedule", o->schedule,
                    "kvcache's admission order: fcfs (arrival order) or lpm (longest cached prefix first "
                    "among the first --schedule-window waiting requests); fcfs,lpm runs kvcache with both")
        ->capture_default_str();
    cmd->add_option("--schedule-window", o->sim.schedule_window,
                    "lpm: waiting requests looked at per admission round")
        ->capture_default_str();
    cmd->add_option(
           "--memory", o->memory,
           "the model's memory: kv (attention), recurrent (Mamba: state only), hybrid (Jamba: both), "
           "iswa (Gemma 3: sliding-window layers beside full ones)")
        ->capture_default_str();
    cmd->add_option("--window", o->sim.window, "iswa: the sliding window (tokens)")->capture_default_str();
    cmd->add_option(
           "--swa-retain", o->sim.swa_retain,
           "iswa: SWA cells beyond llama.cpp's size for the windows of cached prefixes (0: a tenth of "
           "the budget)")
        ->capture_default_str();
    cmd->add_option(
           "--snapshot-interval", o->sim.snapshot_interval,
           "recurrent, hybrid: kvcache keeps a snapshot every N blocks (and at prompt and sequence ends)")
        ->capture_default_str();
    cmd->add_option("--snapshots", o->sim.snapshots,
                    "recurrent, hybrid: kvcache's snapshot pool (0: the budget's memory, a tenth of it for "
                    "hybrid, at --state-tokens each)")
        ->capture_default_str();
    cmd->add_option("--state-tokens", o->sim.state_tokens,
                    "recurrent, hybrid: one sequence's state costs as much memory as this many tokens of K/V")
        ->capture_default_str();
    cmd->add_option("--checkpoint-every", o->sim.checkpoint_every,
                    "recurrent, hybrid: llama-server's checkpoint step (tokens)")
        ->capture_default_str();
    cmd->add_option("--max-checkpoints", o->sim.max_checkpoints,
                    "recurrent, hybrid: llama-server's checkpoints per slot")
        ->capture_default_str();
    cmd->add_option("--cache-ram", o->sim.cache_ram, "llama-server: tokens of its RAM prompt cache (0: off)")
        ->capture_default_str();
    cmd->add_option("--slot-similarity", o->sim.slot_similarity, "llama-server: --slot-prompt-similarity")
        ->capture_default_str();
    cmd->add_option("--seed", o->gen.seed, "generator seed")->capture_default_str();
    cmd->add_option("--groups", o->gen.groups, "generator: groups / conversations / agents / prompts");
    cmd->add_option("--prompts", o->gen.prompts, "generator: prompts per group / turns / samples / requests");
    cmd->add_option("--system", o->gen.system, "generator: shared prefix tokens");
    cmd->add_option("--question", o->gen.question,
                    "generator: private tokens per request (question, message, "
                    "tool output)");
    cmd->add_option("--output", o->gen.output, "generator: output tokens per request");
    cmd->add_option("--rate", o->gen.rate, "generator: arrivals per second");
    cmd->add_option(
        "--recency", o->gen.recency,
        "mooncake-like: follow-ups continue the k-th most recent conversation, k ~ Exp(N) (default "
        "32); 0: uniform over the 256 most recent");
    cmd->add_option("--follow-gap", o->gen.follow_gap,
                    "mooncake-like: instead of --recency, a turn is continued (probability 0.4) a log-normal "
                    "number of requests later, of this median (Mooncake's conversation trace: 423)");
    cmd->add_option("--instances", o->sim.instances,
                    "serving instances in lockstep, each with its own budget and concurrency (kvcache, none)")
        ->capture_default_str();
    cmd->add_option("--route", o->route,
                    "several instances: rr (round-robin) or prefix (the instance holding the longest prefix "
                    "of the prompt; else the least loaded)")
        ->capture_default_str();
    cmd->add_option("--tier", o->tiers,
                    "kvcache: a store below every instance's prefix cache, shared: disk:DIR[,max=BYTES] or "
                    "redis:HOST:PORT (repeatable, asked in order)")
        ->allow_extra_args(false);
    cmd->add_option("--tier-write", o->tier_write,
                    "tiers: write blocks when memory evicts them (evict) or when they are published "
                    "(through)")
        ->capture_default_str();
    cmd->add_flag("--json", o->json, "print JSON");
    cmd->add_flag("--wide", o->wide,
                  "every column in the tables: live and committed cells, waits, copies, wall time (~190 "
                  "characters)");
    cmd->add_option("--plot", o->plot, "draw hit rate against budget, one line per policy, into FILE.svg");
    cmd->callback([o] { run(*o); });
}

}  // namespace kvc::cli
