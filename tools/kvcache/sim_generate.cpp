// kvcache sim: the built-in workloads. Each request is a prefix taken from a shared stream (a system
// prompt, a scaffold, a whole prompt) followed by a private stream (a question, a conversation, an agent's
// history); the blocks of a stream always get the same ids, so a later prompt that repeats a stream's
// beginning repeats its ids, as in Mooncake's traces.
#include "sim_generate.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <unordered_map>

#include <fmt/format.h>

namespace kvc::cli {
namespace {

// Random numbers from mt19937_64's raw output only (std distributions differ between libraries).
class rng {
public:
    explicit rng(uint64_t seed) : g_(seed) {}
    double uniform() { return static_cast<double>(g_() >> 11) * 0x1.0p-53; }  // [0, 1)
    uint32_t below(uint32_t n) { return static_cast<uint32_t>(uniform() * n); }
    double exponential(double mean) { return -std::log(1.0 - uniform()) * mean; }
    // A log-normal draw with the given mean and sigma of the underlying normal.
    double lognormal(double mean, double sigma) {
        const double z =
            std::sqrt(-2.0 * std::log(1.0 - uniform())) * std::cos(6.283185307179586 * uniform());
        return mean * std::exp(sigma * z - sigma * sigma / 2);
    }

private:
    std::mt19937_64 g_;
};

// Hands out block ids: block k of stream s always gets the same id; ids count up from 0 as Mooncake's do.
class id_table {
public:
    uint64_t stream() { return n_streams_++; }
    uint64_t id(uint64_t s, uint32_t k) {
        const auto [it, fresh] = ids_.try_emplace((s << 24) | k, next_);
        if (fresh) ++next_;
        return it->second;
    }

private:
    std::unordered_map<uint64_t, uint64_t> ids_;
    uint64_t next_ = 0, n_streams_ = 0;
};

struct builder {
    const generate_options& o;
    rng r;
    id_table ids;
    std::vector<sim_request> reqs;
    double t = 0;  // ms
    double rate;   // requests per second

    explicit builder(const generate_options& opt) : o(opt), r(opt.seed), rate(opt.rate > 0 ? opt.rate : 10) {}

    // A request of `shared_len` tokens of stream `shared` then `private_len` of stream `priv`: blocks wholly
    // inside the shared part carry the shared stream's ids, the others the private stream's (a block
    // straddling both belongs to the private stream: ids name whole blocks).
    void add(uint64_t shared, uint32_t shared_len, uint64_t priv, uint32_t private_len, uint32_t out) {
        sim_request q;
        t += r.exponential(1000.0 / rate);
        q.timestamp = std::round(t);
        q.input_length = shared_len + private_len;
        q.output_length = out;
        const uint32_t n = (q.input_length + o.block - 1) / o.block;
        for (uint32_t k = 0; k < n; ++k)
            q.hash_ids.push_back((k + 1) * o.block <= shared_len ? ids.id(shared, k) : ids.id(priv, k));
        reqs.push_back(std::move(q));
    }
};

uint32_t or_default(uint32_t v, uint32_t d) {
    return v ? v : d;
}

// SGLang's generated-shared-prefix benchmark: G groups of P prompts, a system prompt per group and a
// question per prompt; the prompts arrive shuffled.
std::vector<sim_request> shared_prefix(builder& b) {
    const uint32_t G = or_default(b.o.groups, 64), P = or_default(b.o.prompts, 16);
    const uint32_t S = or_default(b.o.system, 2048), Q = or_default(b.o.question, 128);
    const uint32_t O = or_default(b.o.output, 256);
    std::vector<uint64_t> systems(G);
    for (auto& s : systems) s = b.ids.stream();
    std::vector<uint32_t> order(static_cast<size_t>(G) * P);
    for (uint32_t i = 0; i < order.size(); ++i) order[i] = i / P;
    for (size_t i = order.size(); i > 1; --i)
        std::swap(order[i - 1], order[b.r.below(static_cast<uint32_t>(i))]);
    for (uint32_t g : order) b.add(systems[g], S, b.ids.stream(), Q, O);
    return std::move(b.reqs);
}

// Conversations of T turns sharing one system prompt: turn t's prompt is the system prompt, every earlier
// message and answer, and a new message. Up to 16 conversations are open at once, turns interleaved.
// agent: the same shape with a long scaffold, tool outputs as messages and short actions as answers.
std::vector<sim_request> conversations(builder& b, bool agent) {
    const uint32_t N = or_default(b.o.groups, agent ? 16 : 64), T = or_default(b.o.prompts, agent ? 16 : 8);
    const uint32_t S = or_default(b.o.system, agent ? 4096 : 512);
    const uint32_t U = or_default(b.o.question, agent ? 1024 : 256),
                   O = or_default(b.o.output, agent ? 128 : 256);
    const uint64_t system = b.ids.stream();
    struct conv {
        uint64_t stream;
        uint32_t turn = 0, len = 0;  // private tokens so far (messages and answers)
    };
    std::vector<conv> open;
    uint32_t started = 0;
    const uint32_t window = agent ? 4 : 16;
    while (started < N || !open.empty()) {
        while (open.size() < window && started < N) {
            open.push_back({b.ids.stream()});
            ++started;
        }
        const uint32_t i = b.r.below(static_cast<uint32_t>(open.size()));
        conv& c = open[i];
        const uint32_t msg = std::max<uint32_t>(1, static_cast<uint32_t>(b.r.lognormal(U, 0.5)));
        b.add(system, S, c.stream, c.len + msg, O);
        c.len += msg + O;  // the answer joins the history
        if (++c.turn == T) open.erase(open.begin() + i);
    }
    return std::move(b.reqs);
}

// n samples of each prompt, sent one after the other (a client asking for n completions).
std::vector<sim_request> parallel(builder& b) {
    const uint32_t R = or_default(b.o.groups, 128), n = or_default(b.o.prompts, 8);
    const uint32_t L = or_default(b.o.system, 1024), O = or_default(b.o.output, 512);
    for (uint32_t p = 0; p < R; ++p) {
        const uint64_t s = b.ids.stream();
        for (uint32_t k = 0; k < n; ++k) b.add(s, L, s, 0, O);
    }
    return std::move(b.reqs);
}

// Statistics like Mooncake's conversation trace (FAST'25): prompts of ~12k tokens on average, ~40% of
// prompt tokens reusable with an infinite cache, ~343 output tokens. 40% of requests continue an earlier
// conversation (its history, the answer and a new message), the others open a new one: one of 16 system
// prompts (1-3k tokens) half of the time, then a long document. Which conversation a follow-up continues:
// a recent one (`recency`), or the one whose turn was scheduled for it (`follow_gap`).
std::vector<sim_request> mooncake_like(builder& b) {
    const uint32_t N = or_default(b.o.prompts, 2000), O = or_default(b.o.output, 343);
    const double recency = b.o.recency < 0 ? 32 : b.o.recency;
    const double gap = b.o.follow_gap;
    std::vector<std::pair<uint64_t, uint32_t>> systems;
    for (uint32_t i = 0; i < 16; ++i) systems.emplace_back(b.ids.stream(), 1024 + b.r.below(4) * 512);
    struct conv {
        uint32_t sys;  // index in systems, or 16 for none
        uint64_t stream;
        uint32_t len;
    };
    std::vector<conv> convs;
    // follow_gap: (request index due, conversation), earliest first
    std::multimap<uint64_t, size_t> due;
    const auto schedule = [&](uint32_t i, size_t c) {
        constexpr double sigma = 1.0;
        if (b.r.uniform() < 0.4)
            due.emplace(
                i + 1 + static_cast<uint64_t>(b.r.lognormal(gap * std::exp(sigma * sigma / 2), sigma)), c);
    };
    const auto add = [&](const conv& c, uint32_t private_len, uint32_t out) {
        const uint32_t sl = c.sys < 16 ? systems[c.sys].second : 0;
        b.add(c.sys < 16 ? systems[c.sys].first : c.stream, sl, c.stream, private_len, out);
    };
    for (uint32_t i = 0; i < N; ++i) {
        const uint32_t out = 32 + b.r.below(2 * O - 64);
        size_t next = SIZE_MAX;
        if (gap > 0) {
            if (!due.empty() && due.begin()->first <= i) {
                next = due.begin()->second;
                due.erase(due.begin());
            }
        } else if (!convs.empty() && b.r.uniform() < 0.4) {
            // most follow-ups come soon after the turn before: the k-th most recent conversation
            const uint32_t n =
                static_cast<uint32_t>(std::min<size_t>(convs.size(), recency > 0 ? convs.size() : 256));
            const uint32_t k =
                recency > 0 ? std::min(static_cast<uint32_t>(b.r.exponential(recency)), n - 1) : b.r.below(n);
            next = convs.size() - 1 - k;
        }
        if (next != SIZE_MAX) {
            conv& c = convs[next];
            const uint32_t msg =
                std::clamp<uint32_t>(static_cast<uint32_t>(b.r.lognormal(1500, 1.0)), 16, 16384);
            if (c.len + msg < 120000) {
                add(c, c.len + msg, out);
                c.len += msg + out;
                if (gap > 0) schedule(i, next);
                continue;
            }
        }
        conv c{b.r.uniform() < 0.5 ? b.r.below(16) : 16u, b.ids.stream(), 0};
        c.len = std::clamp<uint32_t>(static_cast<uint32_t>(b.r.lognormal(10000, 1.0)), 64, 100000);
        add(c, c.len, out);
        c.len += out;
        convs.push_back(c);
        if (gap > 0) schedule(i, convs.size() - 1);
    }
    return std::move(b.reqs);
}

}  // namespace

const std::vector<std::string>& generator_kinds() {
    static const std::vector<std::string> k{"shared-prefix", "multi-turn", "agent", "parallel",
                                            "mooncake-like"};
    return k;
}

std::vector<sim_request> generate(const generate_options& o) {
    if (o.block == 0 || o.block > (1u << 20))
        throw error(errc::invalid_argument, fmt::format("--trace-block {} not in [1, 1048576]", o.block));
    if (!(o.rate >= 0)) throw error(errc::invalid_argument, fmt::format("--rate {} must be >= 0", o.rate));
    if (!(o.follow_gap >= 0 && o.follow_gap <= 1e9))
        throw error(errc::invalid_argument, fmt::format("--follow-gap {} not in [0, 1e9]", o.follow_gap));
    if (!(o.recency == -1 || (o.recency >= 0 && o.recency <= 1e9)))
        throw error(errc::invalid_argument, fmt::format("--recency {} not in [0, 1e9]", o.recency));
    if (o.follow_gap > 0 && o.recency >= 0)
        throw error(errc::invalid_argument, "--recency and --follow-gap exclude each other");
    builder b(o);
    if (o.kind == "shared-prefix") return shared_prefix(b);
    if (o.kind == "multi-turn") return conversations(b, false);
    if (o.kind == "agent") return conversations(b, true);
    if (o.kind == "parallel") return parallel(b);
    if (o.kind == "mooncake-like") return mooncake_like(b);
    throw error(errc::invalid_argument, fmt::format("--generate '{}': not one of shared-prefix, multi-turn, "
                                                    "agent, parallel, mooncake-like",
                                                    o.kind));
}

}  // namespace kvc::cli
