// kvcache sim: the serving loop (sim_engine.h) over one backend, and the checks before a run.
#include "sim_engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
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

void check_budget(const std::vector<sim_request>& reqs, const sim_options& o) {
    check_options(o);
    if (o.budget % o.cache_block != 0 || o.budget == 0)
        throw error(errc::invalid_argument, fmt::format("budget {} tokens must be a positive multiple of the "
                                                        "block size {}",
                                                        o.budget, o.cache_block));
    for (size_t i = 0; i < reqs.size() && o.memory != sim_memory::recurrent; ++i) {  // recurrent: no K/V
        const uint64_t need = static_cast<uint64_t>(reqs[i].input_length) + reqs[i].output_length;
        if (need > o.budget)
            throw error(errc::invalid_argument,
                        fmt::format("request {} needs {} cells ({} prompt + {} output tokens), more than the "
                                    "budget of {} tokens",
                                    i + 1, need, reqs[i].input_length, reqs[i].output_length, o.budget));
    }
}

sim_result run_sim(const std::vector<sim_request>& reqs, sim_policy policy, const sim_options& o) {
    check_budget(reqs, o);
    if (policy == sim_policy::oracle) return run_oracle(reqs, o);
    if (policy == sim_policy::lru_blocks) return run_lru_blocks(reqs, o);
    const auto t_start = clock_type::now();
    std::unique_ptr<sim_backend> be = policy == sim_policy::llama_server
                                          ? make_llama_server_backend(o, reqs)
                                          : make_kv_backend(o, policy == sim_policy::kvcache);
    sim_result r;
    r.policy = policy;
    r.budget_tokens = o.budget;
    r.requests = reqs.size();
    double ns = 0;
    const auto timed = [&](auto&& f) {
        const auto t0 = clock_type::now();
        f();
        ns += std::chrono::duration<double, std::nano>(clock_type::now() - t0).count();
    };

    std::vector<seq_id_t> free_seqs;
    for (uint32_t s = o.concurrency; s-- > 0;) free_seqs.push_back(static_cast<seq_id_t>(s));
    std::deque<size_t> queue;
    std::vector<uint64_t> arrived(reqs.size(), 0);  // step of arrival
    std::vector<live_request> live;
    std::vector<token_t> out_tok(o.concurrency);
    std::vector<sim_work> work;
    size_t next = 0, done = 0;
    uint64_t step = 0, reserved = 0, sum_live = 0;
    bool may_fit = true;  // the head of the queue may fit: something ended since it last did not
    const bool tokens = be->needs_tokens();
    size_t progress_mark = 0;
    const bool defer = o.defer_shared && policy == sim_policy::kvcache;
    std::unordered_set<uint64_t> computing;  // trace blocks the requests admitted in this step compute

    while (done < reqs.size()) {
        // arrivals
        if (o.respect_arrival) {
            if (queue.empty() && live.empty() && next < reqs.size())  // idle: skip to the next arrival
                step = std::max<uint64_t>(step,
                                          static_cast<uint64_t>(std::ceil(reqs[next].timestamp / o.step_ms)));
            while (next < reqs.size() && reqs[next].timestamp <= static_cast<double>(step) * o.step_ms) {
                arrived[next] = step;
                queue.push_back(next++);
            }
        } else {  // closed loop: a request arrives when a sequence is free for it
            while (next < reqs.size() && queue.size() + live.size() < o.concurrency) {
                arrived[next] = step;
                queue.push_back(next++);
            }
        }
        // admissions, in arrival order: the head waits until it fits
        computing.clear();
        while (may_fit && !queue.empty() && live.size() < o.concurrency) {
            const size_t q = queue.front();
            if (defer && std::any_of(reqs[q].hash_ids.begin(), reqs[q].hash_ids.end(),
                                     [&](uint64_t id) { return computing.count(id) != 0; }))
                break;  // part of its prompt is being computed in this step: attach it at the next
            live_request lr;
            lr.req = q;
            lr.seq = free_seqs.back();
            if (tokens) prompt_tokens(reqs[q], o.trace_block, lr.prompt);
            std::optional<uint32_t> hit;
            timed([&] { hit = be->start(lr.seq, q, lr.prompt, reqs[q].output_length, reserved); });
            if (!hit) {
                may_fit = false;
                break;
            }
            free_seqs.pop_back();
            queue.pop_front();
            lr.hit = *hit;
            if (defer)
                for (size_t k = lr.hit / o.trace_block; k < reqs[q].hash_ids.size(); ++k)
                    computing.insert(reqs[q].hash_ids[k]);
            const uint64_t waited = step - arrived[q];
            r.queued += waited > 0;
            r.wait_steps += waited;
            r.max_wait_steps = std::max(r.max_wait_steps, waited);
            r.prompt_tokens += reqs[q].input_length;
            r.hit_tokens += lr.hit;
            reserved += reqs[q].input_length - lr.hit + reqs[q].output_length;
            live.push_back(std::move(lr));
        }
        if (live.empty())  // the budget was checked: an idle cache holds any request
            throw error(errc::invalid_state, "sim: nothing live and the next request does not fit (a bug)");
        // one step: the prompt of each new request, one output token of the others
        work.clear();
        uint64_t placed = 0;
        for (size_t i = 0; i < live.size(); ++i) {
            const live_request& l = live[i];
            const sim_request& q = reqs[l.req];
            sim_work w;
            w.seq = l.seq;
            if (!l.prefilled) {
                w.p0 = static_cast<pos_t>(l.hit);
                w.n = q.input_length - l.hit;
                if (tokens) w.tokens = std::span<const token_t>(l.prompt).subspan(l.hit);
                r.prefill_tokens += w.n;
            } else {
                out_tok[i] = output_token(l.req, l.out_done);
                w.p0 = static_cast<pos_t>(q.input_length + l.out_done);
                w.n = 1;
                w.tokens = std::span<const token_t>(&out_tok[i], 1);
                r.output_tokens += 1;
            }
            placed += w.n;
            work.push_back(w);
        }
        timed([&] { be->step(work); });
        reserved -= placed;
        ++r.steps;
        sum_live += live.size();
        r.max_live = std::max<uint64_t>(r.max_live, live.size());
        r.peak_live_cells = std::max(r.peak_live_cells, be->live_cells());
        ++step;
        // advance, and end the requests that are done (their sequence is free for the next)
        for (size_t i = 0; i < live.size();) {
            live_request& l = live[i];
            if (!l.prefilled)
                l.prefilled = true;
            else
                ++l.out_done;
            if (l.out_done < reqs[l.req].output_length) {
                ++i;
                continue;
            }
            timed([&] { be->finish(l.seq); });
            free_seqs.push_back(l.seq);
            live[i] = std::move(live.back());
            live.pop_back();
            ++done;
            may_fit = true;
        }
        if (o.progress && done * 200 / reqs.size() != progress_mark) {
            progress_mark = done * 200 / reqs.size();
            o.progress(static_cast<double>(done) / static_cast<double>(reqs.size()));
        }
    }
    r.mean_live = r.steps ? static_cast<double>(sum_live) / static_cast<double>(r.steps) : 0;
    be->report(r);
    r.bookkeeping_ns = ns;
    r.wall_seconds = std::chrono::duration<double>(clock_type::now() - t_start).count();
    return r;
}

}  // namespace kvc::cli
