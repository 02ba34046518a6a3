// kvcache sim: the serving loop (sim_engine.h) over one backend, and the checks before a run.
#include "sim_engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <functional>
#include <queue>
#include <unordered_set>

#include <fmt/format.h>

#include "sim_backend.h"

namespace kvc::cli {
namespace {

using clock_type = std::chrono::steady_clock;

// A request being served.
struct live_request {
    size_t req = 0;
    seq_id_t seq = 0;
    std::vector<token_t> prompt;  // empty when the backend does not read tokens
    uint32_t hit = 0;
    bool prefilled = false;
    uint32_t out_done = 0;
};

void check_options(const sim_options& o) {
    if (o.concurrency == 0 || o.concurrency > 4096)
        throw error(errc::invalid_argument, fmt::format("--concurrency {} not in [1, 4096]", o.concurrency));
    if (o.cache_block == 0 || o.trace_block % o.cache_block != 0)
        throw error(errc::invalid_argument,
                    fmt::format("--block {} must divide --trace-block {}", o.cache_block, o.trace_block));
    if (o.n_ubatch == 0) throw error(errc::invalid_argument, "--ubatch must be at least 1");
    if (o.schedule_window == 0 || o.schedule_window > 4096)
        throw error(errc::invalid_argument,
                    fmt::format("--schedule-window {} not in [1, 4096]", o.schedule_window));
    if (o.window == 0 || o.window > (1u << 24))
        throw error(errc::invalid_argument, fmt::format("--window {} not in [1, 2^24]", o.window));
    if (o.step_ms <= 0)
        throw error(errc::invalid_argument, fmt::format("--step-ms {} must be positive", o.step_ms));
    if (o.state_tokens == 0 || o.checkpoint_every == 0 || o.max_checkpoints == 0)
        throw error(errc::invalid_argument,
                    fmt::format("--state-tokens {}, --checkpoint-every {} and --max-checkpoints {} must be "
                                "at least 1",
                                o.state_tokens, o.checkpoint_every, o.max_checkpoints));
}

}  // namespace

const char* to_string(sim_memory m) {
    switch (m) {
        case sim_memory::kv:
            return "kv";
        case sim_memory::recurrent:
            return "recurrent";
        case sim_memory::hybrid:
            return "hybrid";
        case sim_memory::iswa:
            return "iswa";
    }
    return "?";
}

const char* to_string(sim_policy p) {
    switch (p) {
        case sim_policy::kvcache:
            return "kvcache";
        case sim_policy::none:
            return "none";
        case sim_policy::llama_server:
            return "llama-server";
        case sim_policy::oracle:
            return "oracle";
        case sim_policy::lru_blocks:
            return "lru-blocks";
    }
    return "?";
}

std::optional<sim_policy> parse_sim_policy(const std::string& s) {
    for (sim_policy p : {sim_policy::kvcache, sim_policy::none, sim_policy::llama_server, sim_policy::oracle,
                         sim_policy::lru_blocks})
        if (s == to_string(p)) return p;
    return std::nullopt;
}

uint32_t snapshot_pool(const sim_options& o) {
    if (o.snapshots > 0) return o.snapshots;
    const uint32_t share = o.memory == sim_memory::recurrent ? o.budget : o.budget / 10;
    return std::max<uint32_t>(1, share / o.state_tokens);
}

uint32_t hybrid_kv_cells(const sim_options& o) {
    const uint64_t pool = uint64_t{snapshot_pool(o)} * o.state_tokens;
    return pool < o.budget ? static_cast<uint32_t>((o.budget - pool) / o.cache_block * o.cache_block) : 0;
}

void check_budget(const std::vector<sim_request>& reqs, const sim_options& o) {
    check_options(o);
    if (o.budget % o.cache_block != 0 || o.budget == 0)
        throw error(errc::invalid_argument, fmt::format("budget {} tokens must be a positive multiple of the "
                                                        "block size {}",
                                                        o.budget, o.cache_block));
    // a hybrid's kvcache policy keeps its snapshots inside the budget
    const uint32_t cells = o.memory == sim_memory::hybrid ? hybrid_kv_cells(o) : o.budget;
    for (size_t i = 0; i < reqs.size() && o.memory != sim_memory::recurrent; ++i) {  // recurrent: no K/V
        const uint64_t need = static_cast<uint64_t>(reqs[i].input_length) + reqs[i].output_length;
        if (need > cells && cells < o.budget)
            throw error(
                errc::invalid_argument,
                fmt::format("request {} needs {} cells ({} prompt + {} output tokens), more than the {} "
                            "tokens of K/V the budget of {} leaves beside {} snapshots of {} tokens",
                            i + 1, need, reqs[i].input_length, reqs[i].output_length, cells, o.budget,
                            snapshot_pool(o), o.state_tokens));
        if (need > o.budget)
            throw error(errc::invalid_argument,
                        fmt::format("request {} needs {} cells ({} prompt + {} output tokens), more than the "
                                    "budget of {} tokens",
                                    i + 1, need, reqs[i].input_length, reqs[i].output_length, o.budget));
    }
}

namespace {

// A request in a queue; its prompt's tokens are made when it is first looked at (lpm) or admitted.
struct waiting {
    size_t req = 0;
    std::vector<token_t> prompt;
    bool made = false;
};

// One serving instance: its cache (backend), queue, live requests and figures.
struct instance {
    std::unique_ptr<sim_backend> be;
    sim_result r;
    std::vector<seq_id_t> free_seqs;
    std::deque<waiting> queue;                       // arrival order
    std::vector<std::pair<uint32_t, size_t>> order;  // lpm: (cached prefix, place in the queue) of a round
    std::vector<bool> taken;                         // lpm: [window] admitted in this round
    std::vector<live_request> live;
    std::vector<token_t> out_tok;
    std::vector<sim_work> work;
    std::unordered_set<uint64_t> computing;  // trace blocks the requests admitted in this step compute
    uint64_t reserved = 0, sum_live = 0;
    bool may_fit = true;  // the head of the queue may fit: something ended since it last did not
    double ns = 0;
    size_t load() const { return queue.size() + live.size(); }
};

// Adds up the instances' figures: counts and peaks summed (each instance peaks on its own), waits summed,
// max_wait the largest.
void add_instance(sim_result& a, const sim_result& b) {
    a.prompt_tokens += b.prompt_tokens;
    a.hit_tokens += b.hit_tokens;
    a.prefill_tokens += b.prefill_tokens;
    a.output_tokens += b.output_tokens;
    a.evicted_tokens += b.evicted_tokens;
    a.copied_tokens += b.copied_tokens;
    a.bytes_copied += b.bytes_copied;
    a.peak_cells += b.peak_cells;
    a.peak_committed_cells += b.peak_committed_cells;
    a.final_committed_cells += b.final_committed_cells;
    a.queued += b.queued;
    a.wait_steps += b.wait_steps;
    a.max_wait_steps = std::max(a.max_wait_steps, b.max_wait_steps);
    a.bookkeeping_ns += b.bookkeeping_ns;
    a.cache_hit_tokens += b.cache_hit_tokens;
    a.probe_hit_tokens += b.probe_hit_tokens;
    a.peak_snapshots += b.peak_snapshots;
    a.swa_cells += b.swa_cells;
    a.tier_hit_tokens += b.tier_hit_tokens;
    if (a.tiers.size() < b.tiers.size()) a.tiers.resize(b.tiers.size());
    for (size_t i = 0; i < b.tiers.size(); ++i) {
        sim_tier_result& t = a.tiers[i];
        t.where = b.tiers[i].where;
        t.fetches += b.tiers[i].fetches;
        t.fetched_blocks += b.tiers[i].fetched_blocks;
        t.refused_blocks += b.tiers[i].refused_blocks;
        t.written_blocks += b.tiers[i].written_blocks;
        t.errors += b.tiers[i].errors;
    }
}

block_store_stats minus(const block_store_stats& a, const block_store_stats& b) {
    return {.lookups = a.lookups - b.lookups,
            .hits = a.hits - b.hits,
            .puts = a.puts - b.puts,
            .skipped = a.skipped - b.skipped,
            .bytes_in = a.bytes_in - b.bytes_in,
            .bytes_out = a.bytes_out - b.bytes_out,
            .errors = a.errors - b.errors,
            .damaged = a.damaged - b.damaged,
            .evictions = a.evictions - b.evictions,
            .round_trips = a.round_trips - b.round_trips,
            .calls = a.calls - b.calls,
            .latency_ns = a.latency_ns - b.latency_ns,
            .max_latency_ns = a.max_latency_ns};
}

}  // namespace

void check_instances(sim_policy policy, const sim_options& o) {
    if (o.instances == 0 || o.instances > 256)
        throw error(errc::invalid_argument, fmt::format("--instances {} not in [1, 256]", o.instances));
    if (o.instances > 1 && policy != sim_policy::kvcache && policy != sim_policy::none)
        throw error(errc::invalid_argument,
                    fmt::format("--instances {}: policy {} runs one instance only (kvcache and none run "
                                "several)",
                                o.instances, to_string(policy)));
    if (o.tiers.stores.empty()) return;
    if (o.tiers.stores.size() > prefix_max_tiers)
        throw error(errc::invalid_argument, fmt::format("--tier given {} times, at most {}",
                                                        o.tiers.stores.size(), prefix_max_tiers));
    if (policy != sim_policy::kvcache)
        throw error(errc::invalid_argument,
                    fmt::format("--tier: policy {} has no prefix cache to put tiers under (only kvcache)",
                                to_string(policy)));
    if (o.memory != sim_memory::kv)
        throw error(errc::invalid_argument,
                    fmt::format("--tier: --memory {} has no tiers yet (only kv)", to_string(o.memory)));
}

const char* to_string(sim_schedule s) {
    return s == sim_schedule::fcfs ? "fcfs" : "lpm";
}

std::string label(const sim_result& r) {
    return r.schedule == sim_schedule::lpm ? fmt::format("{}-lpm", to_string(r.policy)) : to_string(r.policy);
}

const char* to_string(sim_route r) {
    return r == sim_route::rr ? "rr" : "prefix";
}

sim_result run_sim(const std::vector<sim_request>& reqs, sim_policy policy, const sim_options& o) {
    check_budget(reqs, o);
    check_instances(policy, o);
    if (policy == sim_policy::oracle) return run_oracle(reqs, o);
    if (policy == sim_policy::lru_blocks) return run_lru_blocks(reqs, o);
    const auto t_start = clock_type::now();
    std::vector<block_store_stats> store_before;
    for (const auto& s : o.tiers.stores) store_before.push_back(s->stats());
    const uint32_t n_inst = o.instances;
    std::vector<instance> inst(n_inst);
    for (instance& in : inst) {
        in.be = policy == sim_policy::llama_server ? make_llama_server_backend(o, reqs)
                                                   : make_kv_backend(o, policy == sim_policy::kvcache);
        in.r.policy = policy;
        in.r.budget_tokens = o.budget;
        for (uint32_t s = o.concurrency; s-- > 0;) in.free_seqs.push_back(static_cast<seq_id_t>(s));
        in.out_tok.resize(o.concurrency);
    }
    const auto timed = [](instance& in, auto&& f) {
        const auto t0 = clock_type::now();
        f();
        in.ns += std::chrono::duration<double, std::nano>(clock_type::now() - t0).count();
    };

    std::vector<uint64_t> arrived(reqs.size(), 0);  // step of arrival
    size_t next = 0, done = 0, in_system = 0, rr = 0;
    uint64_t step = 0, rounds = 0, sum_live = 0, max_live = 0, peak_live_cells = 0;
    const bool tokens = inst[0].be->needs_tokens();
    size_t progress_mark = 0;
    const bool defer = o.defer_shared && policy == sim_policy::kvcache;
    const bool lpm = o.schedule == sim_schedule::lpm && policy == sim_policy::kvcache;
    std::vector<token_t> scratch;
    // the instance a request goes to, at its arrival
    const auto route = [&](size_t q) -> instance& {
        if (n_inst == 1) return inst[0];
        if (o.route == sim_route::rr) return inst[rr++ % n_inst];
        scratch.clear();  // prompt_tokens appends
        prompt_tokens(reqs[q], o.trace_block, scratch);
        size_t best = 0;
        uint32_t best_hit = 0;
        for (size_t i = 0; i < n_inst; ++i) {
            uint32_t hit = 0;
            timed(inst[i], [&] { hit = inst[i].be->cached_prefix(scratch); });
            if (hit > best_hit || (hit == best_hit && inst[i].load() < inst[best].load()))
                best = i, best_hit = hit;
        }
        return inst[best];
    };
    // --wait-answer: the request each continues, whether it ended, the follow-ups waiting for each, and
    // those whose wait is over (by trace order)
    const std::vector<int64_t> parent = o.wait_answer ? follow_ups(reqs) : std::vector<int64_t>{};
    std::vector<bool> ended(o.wait_answer ? reqs.size() : 0);
    std::vector<std::vector<size_t>> held_by(o.wait_answer ? reqs.size() : 0);
    std::priority_queue<size_t, std::vector<size_t>, std::greater<>> ready;
    // whether request q waits for the answer it continues (then it is held until that request ends)
    const auto hold = [&](size_t q) {
        if (!o.wait_answer || parent[q] < 0 || ended[static_cast<size_t>(parent[q])]) return false;
        held_by[static_cast<size_t>(parent[q])].push_back(q);
        return true;
    };
    const auto arrive = [&](size_t q) {
        arrived[q] = step;
        route(q).queue.push_back({.req = q, .prompt = {}, .made = false});
        ++in_system;
    };

    // whether part of request q's prompt is being computed by a request admitted in this step
    const auto deferred = [&](const instance& in, size_t q) {
        return std::any_of(reqs[q].hash_ids.begin(), reqs[q].hash_ids.end(),
                           [&](uint64_t id) { return in.computing.count(id) != 0; });
    };
    const auto make_prompt = [&](waiting& w) {
        if (tokens && !w.made) prompt_tokens(reqs[w.req], o.trace_block, w.prompt);
        w.made = true;
    };
    // starts the waiting request w if it fits (its prompt moves to the live request); false: it waits
    const auto admit = [&](instance& in, waiting& w) {
        const size_t q = w.req;
        sim_result& r = in.r;
        make_prompt(w);
        live_request lr;
        lr.req = q;
        lr.seq = in.free_seqs.back();
        std::optional<uint32_t> hit;
        timed(in, [&] { hit = in.be->start(lr.seq, q, w.prompt, reqs[q].output_length, in.reserved); });
        if (!hit) return false;
        in.free_seqs.pop_back();
        lr.prompt = std::move(w.prompt);
        lr.hit = *hit;
        if (defer)
            for (size_t k = lr.hit / o.trace_block; k < reqs[q].hash_ids.size(); ++k)
                in.computing.insert(reqs[q].hash_ids[k]);
        const uint64_t waited = step - arrived[q];
        r.queued += waited > 0;
        r.wait_steps += waited;
        r.max_wait_steps = std::max(r.max_wait_steps, waited);
        r.prompt_tokens += reqs[q].input_length;
        r.hit_tokens += lr.hit;
        ++r.requests;
        in.reserved += reqs[q].input_length - lr.hit + reqs[q].output_length;
        in.live.push_back(std::move(lr));
        return true;
    };
    // lpm, one round: looks up the cached prefix of the first `schedule_window` waiting requests (admissions
    // attach and place nothing, so the cache's blocks do not change during the step), then admits in that
    // order, longest first; one that shares a block being computed waits for the next step, and the first
    // that does not fit ends the admissions of the step. Returns the requests admitted.
    const auto lpm_round = [&](instance& in) {
        const size_t n = std::min<size_t>(o.schedule_window, in.queue.size());
        in.order.clear();
        for (size_t i = 0; i < n; ++i) {
            make_prompt(in.queue[i]);
            uint32_t m = 0;  // one waiting request: no order to find, no lookup
            if (n > 1) timed(in, [&] { m = in.be->cached_prefix(in.queue[i].prompt); });
            in.order.emplace_back(m, i);
        }
        std::stable_sort(in.order.begin(), in.order.end(),
                         [](const auto& a, const auto& b) { return a.first > b.first; });
        in.taken.assign(n, false);
        size_t admitted = 0;
        for (const auto& c : in.order) {
            if (in.live.size() >= o.concurrency) break;
            if (defer && deferred(in, in.queue[c.second].req)) continue;
            if (!admit(in, in.queue[c.second])) {
                in.may_fit = false;
                break;
            }
            in.taken[c.second] = true;
            ++admitted;
        }
        size_t kept = 0;  // the first n without the admitted ones, in arrival order
        for (size_t i = 0; i < n; ++i)
            if (!in.taken[i]) {
                if (kept != i) in.queue[kept] = std::move(in.queue[i]);
                ++kept;
            }
        in.queue.erase(in.queue.begin() + static_cast<std::ptrdiff_t>(kept),
                       in.queue.begin() + static_cast<std::ptrdiff_t>(n));
        return admitted;
    };
    // lpm: rounds until one admits nothing, one does not fit or every sequence is live. A step's first
    // round admits or does not fit (nothing is being computed yet), and admissions run only when the queue
    // may fit (after an admission or an end), so the lookups per request are at most 3 x schedule_window.
    const auto admit_lpm = [&](instance& in) {
        while (in.may_fit && !in.queue.empty() && in.live.size() < o.concurrency)
            if (lpm_round(in) == 0) break;
    };

    while (done < reqs.size()) {
        // arrivals, in trace order; a follow-up waiting for the answer it continues arrives once it is
        // there (ready), before any later request
        if (o.respect_arrival) {
            if (in_system == 0 && ready.empty() && next < reqs.size())  // idle: skip to the next arrival
                step = std::max<uint64_t>(step,
                                          static_cast<uint64_t>(std::ceil(reqs[next].timestamp / o.step_ms)));
            while (next < reqs.size() && reqs[next].timestamp <= static_cast<double>(step) * o.step_ms) {
                if (!hold(next)) arrive(next);
                ++next;
            }
            for (; !ready.empty(); ready.pop()) arrive(ready.top());
        } else {  // closed loop: a request arrives when a sequence is free for it
            while (in_system < static_cast<size_t>(o.concurrency) * n_inst) {
                while (next < reqs.size() && hold(next)) ++next;
                if (!ready.empty() && (next == reqs.size() || ready.top() < next)) {
                    arrive(ready.top());
                    ready.pop();
                } else if (next < reqs.size()) {
                    arrive(next++);
                } else {
                    break;
                }
            }
        }
        // admissions: the head (fcfs) or the first of the round's order (lpm) waits until it fits. Every
        // instance admits before any steps, so that what one reads from a shared tier was written before
        // this round.
        size_t live_now = 0;
        for (instance& in : inst) {
            in.computing.clear();
            if (lpm)
                admit_lpm(in);
            else
                while (in.may_fit && !in.queue.empty() && in.live.size() < o.concurrency) {
                    if (defer && deferred(in, in.queue.front().req))
                        break;  // part of its prompt is being computed in this step: attach it at the next
                    if (!admit(in, in.queue.front())) {
                        in.may_fit = false;
                        break;
                    }
                    in.queue.pop_front();
                }
            live_now += in.live.size();
        }
        if (live_now == 0)  // the budget was checked: an idle cache holds any request
            throw error(errc::invalid_state, "sim: nothing live and the next request does not fit (a bug)");
        // one step of each instance: the prompt of each new request, one output token of the others
        uint64_t live_cells = 0;
        for (instance& in : inst) {
            if (in.live.empty()) continue;
            sim_result& r = in.r;
            in.work.clear();
            uint64_t placed = 0;
            for (size_t i = 0; i < in.live.size(); ++i) {
                const live_request& l = in.live[i];
                const sim_request& q = reqs[l.req];
                sim_work w;
                w.seq = l.seq;
                if (!l.prefilled) {
                    w.p0 = static_cast<pos_t>(l.hit);
                    w.n = q.input_length - l.hit;
                    if (tokens) w.tokens = std::span<const token_t>(l.prompt).subspan(l.hit);
                    r.prefill_tokens += w.n;
                } else {
                    in.out_tok[i] = output_token(l.req, l.out_done);
                    w.p0 = static_cast<pos_t>(q.input_length + l.out_done);
                    w.n = 1;
                    w.tokens = std::span<const token_t>(&in.out_tok[i], 1);
                    r.output_tokens += 1;
                }
                placed += w.n;
                in.work.push_back(w);
            }
            timed(in, [&] { in.be->step(in.work); });
            in.reserved -= placed;
            ++r.steps;
            in.sum_live += in.live.size();
            r.max_live = std::max<uint64_t>(r.max_live, in.live.size());
            r.peak_live_cells = std::max(r.peak_live_cells, in.be->live_cells());
            live_cells += in.be->live_cells();
            // advance, and end the requests that are done (their sequence is free for the next)
            for (size_t i = 0; i < in.live.size();) {
                live_request& l = in.live[i];
                if (!l.prefilled)
                    l.prefilled = true;
                else
                    ++l.out_done;
                if (l.out_done < reqs[l.req].output_length) {
                    ++i;
                    continue;
                }
                timed(in, [&] { in.be->finish(l.seq); });
                in.free_seqs.push_back(l.seq);
                if (o.wait_answer) {  // its follow-ups have their answer: they arrive from the next step
                    ended[l.req] = true;
                    for (size_t c : held_by[l.req]) ready.push(c);
                    held_by[l.req] = {};
                }
                in.live[i] = std::move(in.live.back());
                in.live.pop_back();
                ++done;
                --in_system;
                in.may_fit = true;
            }
        }
        ++rounds;
        sum_live += live_now;
        max_live = std::max<uint64_t>(max_live, live_now);
        peak_live_cells = std::max(peak_live_cells, live_cells);
        ++step;
        if (o.progress && done * 200 / reqs.size() != progress_mark) {
            progress_mark = done * 200 / reqs.size();
            o.progress(static_cast<double>(done) / static_cast<double>(reqs.size()));
        }
    }
    for (instance& in : inst) {
        sim_result& r = in.r;
        r.mean_live = r.steps ? static_cast<double>(in.sum_live) / static_cast<double>(r.steps) : 0;
        in.be->report(r);
        r.bookkeeping_ns = in.ns;
    }
    sim_result r;
    if (n_inst == 1) {
        r = std::move(inst[0].r);
    } else {
        r.policy = policy;
        r.budget_tokens = o.budget;
        r.instances = n_inst;
        for (instance& in : inst) {
            add_instance(r, in.r);
            r.per_instance.push_back(std::move(in.r));
        }
        r.steps = rounds;
        r.mean_live = rounds ? static_cast<double>(sum_live) / static_cast<double>(rounds) : 0;
        r.max_live = max_live;
        r.peak_live_cells = peak_live_cells;
    }
    r.requests = reqs.size();
    if (lpm) r.schedule = sim_schedule::lpm;
    for (size_t i = 0; i < o.tiers.stores.size(); ++i) {
        if (r.tiers.size() <= i) r.tiers.resize(i + 1);
        r.tiers[i].where = o.tiers.stores[i]->describe();
        r.tiers[i].store = minus(o.tiers.stores[i]->stats(), store_before[i]);
    }
    r.wall_seconds = std::chrono::duration<double>(clock_type::now() - t_start).count();
    return r;
}

}  // namespace kvc::cli
