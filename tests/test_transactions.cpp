// The transactionality suite (issue 21): for every kind of memory, tens of thousands of inputs that must be
// rejected (batches, sequence operations, state buffers, restore flags, session and 'ggsq' files), and
// after each rejection the whole observable memory (every sequence's positions and state, the whole state
// with its K/V bytes, the memory breakdown) hashed equal to before. Damaged inputs that a format cannot
// tell from data ('ggsq' files, state buffers without a checksum) may load: those are counted apart and
// the memory is put back. Prints the counts per memory and kind of input.
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <kvcache/batch.h>
#include <kvcache/kv_cache.h>
#include <kvcache/kv_cache_iswa.h>
#include <kvcache/memory_hybrid.h>
#include <kvcache/memory_recurrent.h>
#include <kvcache/session.h>
#include <kvcache/state.h>

#include "memory_test_util.h"

namespace kvc {
namespace {

namespace fs = std::filesystem;

constexpr uint32_t n_seq = 4;

// The memories: a KV cache unified, split by sequence and with a prefix cache, recurrent, iSWA, hybrid.
struct memory_kind {
    std::string name;
    std::function<std::unique_ptr<memory_i>()> make;
};

std::vector<memory_kind> memory_kinds() {
    kv_cache_params kv;
    kv.layers = {layer_desc{.n_head_kv = 1, .n_embd_head_k = 16, .n_embd_head_v = 16},
                 layer_desc{.n_head_kv = 2, .n_embd_head_k = 8, .n_embd_head_v = 8, .is_swa = true}};
    kv.kv_size = 32;
    kv.n_seq_max = n_seq;
    kv.v_trans = false;
    kv_cache_params split = kv;
    split.unified = false;
    kv_cache_params prefix = kv;
    prefix.prefix.enabled = true;
    prefix.prefix.block_size = 4;
    recurrent_params recr;
    recr.layers = {recurrent_layer_desc{.n_embd_r = 4, .n_embd_s = 8}, recurrent_layer_desc{}};
    recr.n_seq_max = n_seq;
    recr.n_rs_seq = 1;
    kv_cache_iswa_params iswa;
    iswa.kv = kv;
    iswa.kv.n_swa = 4;
    iswa.kv.swa = swa_type::standard;
    iswa.sizing = {.swa_full = false, .n_ubatch = 8};
    memory_hybrid_params hybrid{.attn = kv, .recr = recr, .iswa = std::nullopt, .prefix = {}};
    hybrid.attn.layers[0].has_kv = false;  // layer 0 recurrent, layer 1 attention
    hybrid.attn.layers[1].is_swa = false;
    hybrid.recr.layers = {recurrent_layer_desc{.n_embd_r = 4, .n_embd_s = 8}, recurrent_layer_desc{}};
    return {
        {"kv unified", [=] { return std::make_unique<kv_cache>(kv); }},
        {"kv split", [=] { return std::make_unique<kv_cache>(split); }},
        {"kv prefix", [=] { return std::make_unique<kv_cache>(prefix); }},
        {"recurrent", [=] { return std::make_unique<memory_recurrent>(recr); }},
        {"iswa", [=] { return std::make_unique<kv_cache_iswa>(iswa); }},
        {"hybrid", [=] { return std::make_unique<memory_hybrid>(hybrid); }},
    };
}

// Places runs of tokens and writes K/V rows of every attention layer (values of the sequence, the
// position and the dim, so that a row left behind by a rejected input shows in the state).
void fill(memory_i& m, const std::vector<test::run>& runs) {
    for (const test::run& r : runs) {
        const auto ctx = test::init_runs(m, n_seq, {r}, 8);
        ASSERT_EQ(ctx->get_status(), memory_status::success);
        do {
            ctx->apply();
            const ubatch& ub = ctx->get_ubatch();
            for (uint32_t il = 0; il < 2; ++il) {
                kv_cache_context* a = ctx->get_attn(il);
                if (!a) continue;
                constexpr uint32_t e = 16;  // n_head_kv x n_embd_head, both layers
                std::vector<float> rows(size_t{e} * ub.n_tokens);
                for (uint32_t t = 0; t < ub.n_tokens; ++t)
                    for (uint32_t d = 0; d < e; ++d)
                        rows[t * e + d] = static_cast<float>(ub.primary_seq(t) * 1000 + ub.pos[t] * 10 + d);
                const auto view = const_tensor_view::contiguous(
                    dtype::f32, reinterpret_cast<const std::byte*>(rows.data()), e, ub.n_tokens);
                a->cpy_k(il, view);
                a->cpy_v(il, view);
            }
        } while (ctx->next());
    }
}

const std::vector<test::run> contents = {{0, 0, 7}, {1, 0, 5}, {2, 3, 4}};

uint64_t hash_bytes(std::span<const uint8_t> b) {
    return std::hash<std::string_view>{}(std::string_view(reinterpret_cast<const char*>(b.data()), b.size()));
}

// Everything observable of a memory, hashed: positions and state of every sequence, the whole state (K/V
// bytes included), the breakdown of its bytes.
uint64_t observe(const memory_i& m) {
    std::string text;
    for (seq_id_t q = 0; q < static_cast<seq_id_t>(n_seq); ++q)
        text += fmt::format("{}:[{},{}] {:016x}\n", q, m.seq_pos_min(q), m.seq_pos_max(q),
                            hash_bytes(state_seq_get_data(m, q)));
    text += fmt::format("all {:016x}\n", hash_bytes(state_seq_get_data(m, seq_all)));
    const memory_breakdown b = m.get_memory_breakdown();
    text += fmt::format("bytes {} {} {} {} {}\n", b.committed, b.used, b.cached, b.pinned, b.free);
    return std::hash<std::string>{}(text);
}

// What each kind of input did: rejected (the memory checked unchanged), or accepted (a damaged input the
// format cannot tell from data; the memory was put back).
struct tally {
    std::map<std::string, uint64_t> rejected, accepted;
};

// Runs the inputs against one memory.
class run_inputs {
public:
    explicit run_inputs(const memory_kind& k)
        : kind_(k), m_(k.make()), dir_(fs::temp_directory_path() / fmt::format("kvc-tx-{}", ::getpid())) {
        fill(*m_, contents);
        baseline_ = observe(*m_);
        whole_ = state_seq_get_data(*m_, seq_all);
        fs::create_directories(dir_);
    }
    ~run_inputs() { fs::remove_all(dir_); }
    run_inputs(const run_inputs&) = delete;
    run_inputs& operator=(const run_inputs&) = delete;

    const tally& counts() const { return t_; }

    // One input: `f` must throw kvc::error (or report a failed placement, returning false) and leave the
    // memory as it was; when it succeeds instead, `may_accept` says whether that is allowed (a format
    // without a checksum), and the memory is put back.
    void input(const std::string& what, bool may_accept, const std::function<bool()>& f) {
        bool rejected = false;
        try {
            rejected = !f();
        } catch (const error&) {
            rejected = true;
        }
        if (rejected) {
            ++t_.rejected[what];
            const uint64_t now = observe(*m_);
            if (now != baseline_) {
                ADD_FAILURE() << kind_.name << ": a rejected " << what << " changed the memory";
                restore();
            }
            return;
        }
        ++t_.accepted[what];
        if (!may_accept) ADD_FAILURE() << kind_.name << ": an invalid " << what << " was accepted";
        restore();
    }

    memory_i& mem() { return *m_; }
    const std::vector<uint8_t>& whole() const { return whole_; }
    fs::path file(const std::string& name) const { return dir_ / name; }

private:
    void restore() {  // back to the baseline: the whole state restored, else a new memory
        try {
            state_seq_set_data(*m_, whole_, seq_all);
        } catch (const error&) {}
        if (observe(*m_) == baseline_) return;
        m_ = kind_.make();
        fill(*m_, contents);
        ASSERT_EQ(observe(*m_), baseline_);
    }

    const memory_kind& kind_;
    std::unique_ptr<memory_i> m_;
    fs::path dir_;
    uint64_t baseline_ = 0;
    std::vector<uint8_t> whole_;
    tally t_;
};

// Batches the memory must refuse: a sequence id outside [0, n_seq_max), a gap in a sequence's positions,
// a token id that is not one, a sequence twice in a token, a position going back.
void batches(run_inputs& r, std::mt19937& rng, int n) {
    std::uniform_int_distribution<int> flaw(0, 4), count(1, 6);
    for (int i = 0; i < n; ++i) {
        const int f = flaw(rng);
        const int tokens = count(rng) + (f == 1 || f == 4 ? 1 : 0);  // a gap or a step back needs two tokens
        r.input("batch", false, [&] {
            batch_storage b = batch::init(tokens, 0, 2);
            const seq_id_t s = static_cast<seq_id_t>(rng() % n_seq);
            pos_t p = r.mem().seq_pos_max(s) + 1;
            for (int k = 0; k < tokens; ++k) {
                std::vector<seq_id_t> ids = {s};
                token_t token = static_cast<token_t>(rng() % 100);
                pos_t at = p++;
                if (k == tokens - 1) {  // the flaw, in the last token
                    if (f == 0) ids[0] = static_cast<seq_id_t>(n_seq + rng() % 1000);
                    if (f == 1) at = p + 2 + static_cast<pos_t>(rng() % 50);  // a gap
                    if (f == 2) token = -1 - static_cast<token_t>(rng() % 1000);
                    if (f == 3) ids = {s, s};
                    if (f == 4) at = p - 3 - static_cast<pos_t>(rng() % 3);  // before the previous token
                }
                b.add(token, at, ids, k == tokens - 1);
            }
            batch_allocr a;
            a.init(b.view(), positions_of(r.mem()), {.n_seq_max = n_seq});
            const auto ctx = r.mem().init_batch(a, 8, false);
            return !is_fail(ctx->get_status());  // created, never applied: a failed status is the refusal
        });
    }
}

// Sequence operations with an argument no memory accepts: a sequence id outside [-1, n_seq_max), a
// divisor below 1, a shift that overflows int32.
void seq_ops(run_inputs& r, std::mt19937& rng, int n) {
    std::uniform_int_distribution<int> op(0, 6);
    for (int i = 0; i < n; ++i) {
        const seq_id_t bad = rng() % 2 ? static_cast<seq_id_t>(n_seq + rng() % 100000)
                                       : -2 - static_cast<seq_id_t>(rng() % 100000);
        const seq_id_t good = static_cast<seq_id_t>(rng() % 2);  // seqs 0 and 1 hold tokens from 0
        const pos_t p0 = static_cast<pos_t>(rng() % 8) - 1, p1 = static_cast<pos_t>(rng() % 12) - 1;
        const int o = op(rng);
        r.input("seq op", false, [&] {
            memory_i& m = r.mem();
            switch (o) {
                case 0:
                    return m.seq_rm(bad, p0, p1);
                case 1:
                    m.seq_cp(bad, good, p0, p1);
                    return true;
                case 2:
                    m.seq_cp(good, bad, p0, p1);
                    return true;
                case 3:
                    m.seq_keep(bad);
                    return true;
                case 4:
                    m.seq_add(bad, p0, p1, 1);
                    return true;
                case 5:
                    m.seq_div(good, p0, p1, -static_cast<int>(rng() % 3));  // 0, -1, -2
                    return true;
                default:
                    m.seq_add(good, 0, -1, std::numeric_limits<pos_t>::max());  // positions overflow
                    return true;
            }
        });
    }
}

// A valid buffer damaged: bytes changed, cut short, garbage appended. A changed byte of K/V data or of a
// position may still be a valid state (no checksum): those are counted as accepted.
std::vector<uint8_t> damaged(std::vector<uint8_t> b, std::mt19937& rng) {
    switch (rng() % 3) {
        case 0:
            for (int k = 0, n = 1 + static_cast<int>(rng() % 3); k < n; ++k)
                b[rng() % b.size()] ^= static_cast<uint8_t>(1 + rng() % 255);
            break;
        case 1:
            b.resize(rng() % b.size());
            break;
        default:
            for (int k = 0, n = 1 + static_cast<int>(rng() % 16); k < n; ++k)
                b.push_back(static_cast<uint8_t>(rng()));
    }
    return b;
}

void state_buffers(run_inputs& r, std::mt19937& rng, int n) {
    const std::vector<uint8_t> seq0 = state_seq_get_data(r.mem(), 0);
    for (int i = 0; i < n; ++i) {
        const bool whole = i % 4 == 0;
        const std::vector<uint8_t> bad = damaged(whole ? r.whole() : seq0, rng);
        const seq_id_t dest = whole ? seq_all : static_cast<seq_id_t>(rng() % n_seq);
        r.input("state buffer", true, [&] {
            state_seq_set_data(r.mem(), bad, dest);
            return true;
        });
    }
}

// Restore flags with bits no state_seq_flag has (issue 21: 0xFFFFFFFF was accepted), and destinations
// outside [-1, n_seq_max).
void restore_args(run_inputs& r, std::mt19937& rng, int n) {
    const std::vector<uint8_t> seq0 = state_seq_get_data(r.mem(), 0);
    for (int i = 0; i < n; ++i) {
        const auto flags = static_cast<state_seq_flags>(rng() | 2u);
        const seq_id_t bad_dest = static_cast<seq_id_t>(n_seq + rng() % 1000);
        r.input("restore flags", false, [&] {
            state_seq_set_data(r.mem(), seq0, 0, flags);
            return true;
        });
        r.input("restore destination", false, [&] {
            state_seq_set_data(r.mem(), seq0, bad_dest);
            return true;
        });
    }
}

void write_bytes(const fs::path& p, const std::vector<uint8_t>& b) {
    std::ofstream(p, std::ios::binary | std::ios::trunc)
        .write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

std::vector<uint8_t> read_bytes(const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Session files (plain and zstd) and 'ggsq' files of sequence 0, damaged. Session files have checksums:
// every damaged one is refused. 'ggsq' files have none: a changed token, position or K/V byte loads.
void files(run_inputs& r, std::mt19937& rng, int n) {
    const fs::path plain = r.file("s.kvc"), packed = r.file("s.zst"), ggsq = r.file("s.ggsq"),
                   bad = r.file("bad");
    save_file(r.mem(), plain.string(), 0, {.tokens = std::vector<token_t>{1, 2, 3}});
    save_file(r.mem(), packed.string(), 0, {.compress = true});
    save_llama_seq_file(r.mem(), ggsq.string(), 0, std::vector<token_t>{1, 2, 3});
    const std::vector<uint8_t> files[] = {read_bytes(plain), read_bytes(packed), read_bytes(ggsq)};
    for (int i = 0; i < n; ++i) {
        const int which = i % 3;
        write_bytes(bad, damaged(files[which], rng));
        const seq_id_t dest = static_cast<seq_id_t>(rng() % n_seq);
        if (which < 2)
            r.input("session file", false, [&] {
                load_file(r.mem(), bad.string(), dest);
                return true;
            });
        else
            r.input("ggsq file", true, [&] {
                load_llama_seq_file(r.mem(), bad.string(), dest);
                return true;
            });
    }
}

TEST(transactions, rejected_inputs_of_every_kind_leave_every_memory_unchanged) {
    uint64_t total = 0;
    for (const memory_kind& k : memory_kinds()) {
        run_inputs r(k);
        std::mt19937 rng(2026);
        batches(r, rng, 3000);
        seq_ops(r, rng, 3000);
        state_buffers(r, rng, 2000);
        restore_args(r, rng, 500);
        files(r, rng, 600);
        if (HasFailure()) return;
        std::string line = fmt::format("{:<10}", k.name);
        for (const auto& [what, n] : r.counts().rejected) {
            line += fmt::format("  {} {}", what, n);
            total += n;
        }
        for (const auto& [what, n] : r.counts().accepted) line += fmt::format("  ({} accepted: {})", what, n);
        std::printf("%s\n", line.c_str());
    }
    std::printf("rejected inputs, each followed by an unchanged memory: %llu\n",
                static_cast<unsigned long long>(total));
    EXPECT_GE(total, 50000u);
}

// A memory's largest state (state_max_bytes) bounds every state it writes, and is what a full memory
// writes when each cell lists as many sequences as it can (recurrent: every sequence in its own cell);
// a file holding a payload one byte longer is refused before the payload is read, naming both sizes, the
// memory unchanged. ('ggsq' files, whose payload size is the file's: kvcache session files declare theirs,
// tests/test_session.cpp.)
TEST(transactions, a_payload_over_the_largest_state_is_refused_before_it_is_read) {
    const fs::path path =
        fs::temp_directory_path() / fmt::format("kvc-transactions-{}-over.ggsq", ::getpid());
    for (const memory_kind& k : memory_kinds()) {
        SCOPED_TRACE(k.name);
        const auto m = k.make();
        fill(*m, contents);
        const uint64_t max = m->state_max_bytes();
        EXPECT_LE(test::whole(*m).size() - 8, max);
        if (k.name == "recurrent") {
            fill(*m, {{3, 0, 2}});  // the last sequence without a state: now every cell is used
            EXPECT_EQ(test::whole(*m).size() - 8, max);
        }
        const uint64_t before = observe(*m);
        const uint32_t head[3] = {llama_seq_file_magic, llama_seq_file_version, 0};  // no tokens
        std::vector<uint8_t> file(sizeof head + max + 1);
        std::memcpy(file.data(), head, sizeof head);
        write_bytes(path, file);
        for (const seq_id_t dest : {seq_all, seq_id_t{1}}) {
            try {
                load_llama_seq_file(*m, path.string(), dest);
                ADD_FAILURE() << "accepted";
            } catch (const error& e) {
                EXPECT_EQ(e.code(), errc::corrupt_data) << e.what();
                EXPECT_NE(std::string(e.what()).find(
                              fmt::format("the payload is {} bytes, more than the {} bytes", max + 1, max)),
                          std::string::npos)
                    << e.what();
            }
        }
        EXPECT_EQ(observe(*m), before);
    }
    fs::remove(path);
}

}  // namespace
}  // namespace kvc
