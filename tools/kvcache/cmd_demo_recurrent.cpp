// kvcache demo --model FILE with a mamba or jamba model: the same job through the memory the model needs
// (memory_recurrent, or memory_hybrid with the attention layers in a KV cache). Several sequences share
// a system prompt, decode in parallel, draft tokens that are partly rejected and rolled back (rollback
// planes, n_rs_seq 4), save one sequence to a session file and restore it into another, and finish a
// request whose sequence is then reused. After every phase the logits are compared with
// reference_recurrent, which recomputes each sequence from its first token without any memory.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <kvcache/memory_hybrid.h>
#include <kvcache/memory_recurrent.h>
#include <kvcache/runtime/reference_recurrent.h>
#include <kvcache/runtime/runtime.h>
#include <kvcache/session.h>

#include "demo_recurrent.h"

namespace kvc::cli {
namespace {

namespace fs = std::filesystem;

constexpr uint32_t rollback_depth = 4;  // draft tokens a step may reject

class demo_recurrent {
public:
    demo_recurrent(const model& m, const recurrent_demo_options& o)
        : m_(m), o_(o), ref_(m, o.seqs, 1), rng_(0x5EED) {
        const runtime_params rp{.n_threads = o.threads, .n_ubatch = 512};
        if (m.memory_kind() == model_memory::recurrent) {
            recurrent_params p = m.recr_params(o.seqs);
            p.n_rs_seq = rollback_depth;
            recr_ = std::make_unique<memory_recurrent>(p);
            rt_ = std::make_unique<runtime>(m, *recr_, rp);
            mem_ = recr_.get();
            states_ = recr_.get();
        } else {
            memory_hybrid_params p = m.hybrid_params(o.ctx, o.seqs);
            p.attn.type_k = o.type_k;
            p.attn.type_v = o.type_v;
            p.attn.v_trans = o.v_trans;
            p.attn.unified = o.unified;
            p.recr.n_rs_seq = rollback_depth;
            hybrid_ = std::make_unique<memory_hybrid>(p);
            rt_ = std::make_unique<runtime>(m, *hybrid_, rp);
            mem_ = hybrid_.get();
            states_ = &hybrid_->get_recr();
            limit_ = std::max(logits_tolerance(o.type_k), logits_tolerance(o.type_v));
        }
        limit_ = std::max(limit_, logits_tolerance(dtype::f32));
    }

    int run() {
        const model_hparams& hp = m_.hparams();
        const bool hybrid = hybrid_ != nullptr;
        fmt::print("model   {}: {} {} layers, {} dims, d_inner {}, d_state {}, d_conv {}, vocab {}\n",
                   hp.name.empty() ? "(unnamed)" : hp.name, hp.n_layer, hybrid ? "jamba" : "mamba", hp.n_embd,
                   hp.ssm_d_inner, hp.ssm_d_state, hp.ssm_d_conv, hp.n_vocab);
        fmt::print(
            "memory  {}: {} sequences, one state cell each, {} rollback planes; {:.1f} KiB of state\n\n",
            hybrid ? "hybrid (recurrent + KV cache)" : "recurrent", o_.seqs, rollback_depth,
            static_cast<double>(states_->size_bytes()) / 1024);
        const uint32_t n = o_.seqs;
        phase("shared system prompt", [&] {
            step({{0, tokens(32)}});
            for (seq_id_t s = 1; s < static_cast<seq_id_t>(n); ++s) {
                mem_->seq_cp(0, s, -1, -1);
                ref_.seq_cp(0, s, -1, -1);
            }
            return fmt::format("32 tokens in seq 0, seq_cp to {} more (one shared cell)", n - 1);
        });
        phase("parallel decoding", [&] {
            std::vector<std::pair<seq_id_t, std::vector<token_t>>> prompts;
            prompts.reserve(n);
            for (seq_id_t s = 0; s < static_cast<seq_id_t>(n); ++s)
                prompts.emplace_back(s, tokens(3 + 2 * s));
            step(prompts);
            generate(16);
            return fmt::format("{} prompts in one batch (copy-on-write), then 16 steps of {} tokens", n, n);
        });
        phase("draft and roll back", [&] {
            uint32_t rejected = 0;
            for (int round = 0; round < 6; ++round) {
                std::vector<std::pair<seq_id_t, std::vector<token_t>>> drafts;
                drafts.reserve(n);
                for (seq_id_t s = 0; s < static_cast<seq_id_t>(n); ++s)
                    drafts.emplace_back(s, tokens(rollback_depth));
                step(drafts);
                for (seq_id_t s = 0; s < static_cast<seq_id_t>(n); ++s) {
                    const auto back = static_cast<pos_t>(next() % rollback_depth);  // 0..3 rejected
                    if (back == 0) continue;
                    const pos_t p0 = mem_->seq_pos_max(s) - back + 1;
                    if (!mem_->seq_rm(s, p0, -1))
                        throw error(errc::invalid_state, fmt::format("demo: seq {} did not roll back", s));
                    ref_.seq_rm(s, p0, -1);
                    rejected += static_cast<uint32_t>(back);
                }
            }
            generate(4);
            return fmt::format("6 rounds of {} draft tokens per sequence, {} rejected and rolled back",
                               rollback_depth, rejected);
        });
        phase("save and restore", [&] {
            // under a name of its own while in use (demos may run side by side), then kept for the reader
            const std::string file = fmt::format("{}.{}", o_.session, ::getpid());
            const uint64_t bytes = save_file(*mem_, file, 1);
            const seq_id_t last = static_cast<seq_id_t>(n) - 1;
            load_file(*mem_, file, last);
            fs::rename(file, o_.session);
            ref_.seq_cp(1, last, -1, -1);
            generate(8);
            return fmt::format("seq 1 -> {} bytes -> seq {}", bytes, last);
        });
        phase("request done, seq reused", [&] {
            const seq_id_t done = n > 2 ? 2 : 0;
            mem_->seq_rm(done, -1, -1);
            ref_.seq_rm(done, -1, -1);
            step({{done, tokens(12)}});
            generate(8);
            return fmt::format("seq {} removed, a new prompt in it", done);
        });
        fmt::print(
            "\n{} tokens decoded through the memory in {:.2f} s; worst difference {:.2e} (limit {:.0e}): "
            "{}\n",
            n_decoded_, seconds_, worst_, limit_, worst_ <= limit_ ? "cache == recompute" : "MISMATCH");
        fmt::print("session file kept in {} (kvcache inspect {} shows what it holds)\n", o_.session,
                   o_.session);
        return worst_ <= limit_ ? 0 : 1;
    }

private:
    std::vector<token_t> tokens(size_t count) {
        std::vector<token_t> t(count);
        for (auto& x : t) x = static_cast<token_t>(next() % m_.hparams().n_vocab);
        return t;
    }
    uint64_t next() {  // splitmix64
        rng_ += 0x9E3779B97F4A7C15ull;
        uint64_t z = rng_;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }

    // One batch, every token an output; compares the logits with the oracle's.
    void step(const std::vector<std::pair<seq_id_t, std::vector<token_t>>>& groups) {
        size_t count = 0;
        for (const auto& g : groups) count += g.second.size();
        batch_storage b = batch::init(static_cast<int32_t>(count), 0, 1);
        for (const auto& [s, toks] : groups) {
            pos_t p = mem_->seq_pos_max(s) + 1;
            const seq_id_t ids[1] = {s};
            for (token_t t : toks) b.add(t, p++, ids, true);
        }
        const auto t0 = std::chrono::steady_clock::now();
        const decode_result a = rt_->decode(b.view());
        seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (is_fail(a.status)) throw error(errc::invalid_state, "demo: the memory has no room for the batch");
        const decode_result r = ref_.decode(b.view());
        n_decoded_ += count;
        phase_worst_ = std::max(phase_worst_, relative_diff(a.logits, r.logits));
    }

    // steps of one token for every live sequence
    void generate(int steps) {
        for (int i = 0; i < steps; ++i) {
            std::vector<std::pair<seq_id_t, std::vector<token_t>>> groups;
            for (seq_id_t s = 0; s < static_cast<seq_id_t>(o_.seqs); ++s)
                if (mem_->seq_pos_max(s) >= 0) groups.emplace_back(s, tokens(1));
            step(groups);
        }
    }

    template <class F>
    void phase(const char* name, F&& body) {
        ++n_phase_;
        phase_worst_ = 0;
        const std::string what = body();
        worst_ = std::max(worst_, phase_worst_);
        const bool ok = phase_worst_ <= limit_;
        fmt::print("{}. {:<24} {}\n", n_phase_, name, what);
        fmt::print("   state cells [{}]  max|diff| {:.2e} {} {:.0e}  {}\n", states_->picture(), phase_worst_,
                   ok ? "<=" : ">", limit_, ok ? "ok" : "MISMATCH");
    }

    const model& m_;
    recurrent_demo_options o_;
    std::unique_ptr<memory_recurrent> recr_;  // the memory: recurrent,
    std::unique_ptr<memory_hybrid> hybrid_;   // or hybrid
    memory_i* mem_ = nullptr;
    const memory_recurrent* states_ = nullptr;
    std::unique_ptr<runtime> rt_;
    reference_recurrent ref_;
    uint64_t rng_;
    double limit_ = 0, worst_ = 0, phase_worst_ = 0, seconds_ = 0;
    size_t n_decoded_ = 0;
    int n_phase_ = 0;
};

}  // namespace

int run_recurrent_demo(const model& m, const recurrent_demo_options& o) {
    demo_recurrent d(m, o);
    return d.run();
}

}  // namespace kvc::cli
