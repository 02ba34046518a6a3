// libFuzzer target: arbitrary bytes as batches for batch_allocr, then every split. The allocator must
// accept or reject with kvc::error, never crash, hang or trip a sanitizer; accepted batches must split
// into ubatches that give the batch back.
//
// Input layout (missing bytes read as 0): a header of option bytes, then per token its fields. Arrays
// are always allocated at their largest size, so that only the values are arbitrary: a batch's pointers
// are the caller's promise, its values are what kvcache must check.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <vector>

#include <kvcache/batch.h>
#include <kvcache/memory.h>

namespace {

struct reader {
    const uint8_t* data;
    size_t size;
    size_t at = 0;
    uint8_t u8() { return at < size ? data[at++] : 0; }
    int32_t i32() {
        uint32_t v = 0;
        for (int k = 0; k < 4; ++k) v |= static_cast<uint32_t>(u8()) << (8 * k);
        return static_cast<int32_t>(v);
    }
    int32_t small() { return static_cast<int8_t>(u8()); }  // -128..127: the interesting range
};

class table_memory final : public kvc::memory_i {
public:
    table_memory() { set_shape({.n_seq_max = 1, .n_pos = 1, .n_layer = 0}); }
    std::map<kvc::seq_id_t, std::pair<kvc::pos_t, kvc::pos_t>> ranges;
    kvc::memory_context_ptr init_batch(kvc::batch_allocr&, uint32_t, bool) override { return nullptr; }
    kvc::memory_context_ptr init_ubatches(std::vector<kvc::ubatch>, std::vector<int32_t>) override {
        return nullptr;
    }
    kvc::memory_context_ptr init_full() override { return nullptr; }
    kvc::memory_context_ptr init_update(bool) override { return nullptr; }
    bool get_can_shift() const override { return true; }
    void clear(bool) override {}
    bool seq_rm(kvc::seq_id_t, kvc::pos_t, kvc::pos_t) override { return true; }
    void seq_cp(kvc::seq_id_t, kvc::seq_id_t, kvc::pos_t, kvc::pos_t) override {}
    void seq_keep(kvc::seq_id_t) override {}
    void seq_add(kvc::seq_id_t, kvc::pos_t, kvc::pos_t, kvc::pos_t) override {}
    void seq_div(kvc::seq_id_t, kvc::pos_t, kvc::pos_t, int) override {}
    kvc::pos_t seq_pos_min(kvc::seq_id_t s) const override {
        const auto it = ranges.find(s);
        return it == ranges.end() ? -1 : it->second.first;
    }
    kvc::pos_t seq_pos_max(kvc::seq_id_t s) const override {
        const auto it = ranges.find(s);
        return it == ranges.end() ? -1 : it->second.second;
    }
    void state_write(kvc::io_write_i&, kvc::seq_id_t, kvc::state_seq_flags) const override {}
    kvc::state_stage_ptr state_stage(kvc::io_read_i&, kvc::seq_id_t, kvc::state_seq_flags) const override {
        return nullptr;
    }
    void state_commit(kvc::state_stage_i&) override {}
    bool state_fits(const kvc::state_stage_i&) override { return true; }
    std::string state_layout() const override { return {}; }
    uint64_t state_max_bytes() const override { return 0; }  // state_write writes nothing
    kvc::memory_breakdown get_memory_breakdown() const override { return {}; }
    kvc::kv_cache* layer_cache(uint32_t) override { return nullptr; }
    kvc::memory_recurrent* recurrent() override { return nullptr; }
};

void check(bool ok) {
    if (!ok) std::abort();  // an invariant of the splits is broken: a real bug
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    reader r{data, size};
    constexpr int32_t max_tokens = 64, max_seq = 64, max_embd = 4, max_pos = 4;
    const uint8_t flags = r.u8();
    kvc::batch_options opt;
    opt.n_seq_max = r.u8() % (max_seq + 1);  // 0 is invalid on purpose
    opt.n_vocab = r.small();
    opt.n_embd = r.u8() % (max_embd + 1);
    opt.n_pos = r.u8() % (max_pos + 1);
    opt.output_all = flags & 0x20;
    const int32_t n_tokens = r.small();  // may be <= 0
    const int32_t n = std::max(0, std::min(n_tokens, max_tokens));

    std::vector<kvc::token_t> tokens(max_tokens);
    std::vector<float> embd(static_cast<size_t>(max_tokens) * max_embd);
    std::vector<kvc::pos_t> pos(static_cast<size_t>(max_tokens) * max_pos);
    std::vector<int32_t> n_seq_id(max_tokens);
    std::vector<std::vector<kvc::seq_id_t>> rows(max_tokens, std::vector<kvc::seq_id_t>(max_seq));
    std::vector<const kvc::seq_id_t*> seq_ptrs(max_tokens);
    std::vector<int8_t> logits(max_tokens);
    for (int32_t i = 0; i < n; ++i) {
        tokens[i] = r.small();
        embd[i] = static_cast<float>(r.small());
        for (int32_t j = 0; j < max_pos; ++j) pos[j * n + i] = r.small();
        n_seq_id[i] = (flags & 0x40) ? r.small() : r.small() % 4;  // rarely huge, usually 1-3
        for (int32_t k = 0; k < 3; ++k) rows[i][k] = r.small() % 8;
        seq_ptrs[i] = (flags & 0x40) && r.u8() == 0xff ? nullptr : rows[i].data();
        logits[i] = static_cast<int8_t>(r.u8() & 1);
    }
    table_memory mem;
    for (kvc::seq_id_t s = 0; s < 8; ++s) {
        const int32_t lo = r.small(), hi = r.small();
        if (lo >= 0 && hi >= lo) mem.ranges[s] = {lo, hi};
    }

    kvc::batch b;
    b.n_tokens = n_tokens;
    b.token = (flags & 1) ? tokens.data() : nullptr;
    b.embd = (flags & 2) ? embd.data() : nullptr;
    b.pos = (flags & 4) ? pos.data() : nullptr;
    b.n_seq_id = (flags & 8) ? n_seq_id.data() : nullptr;
    b.seq_id = (flags & 16) ? seq_ptrs.data() : nullptr;
    b.logits = (flags & 0x80) ? logits.data() : nullptr;
    if (n_tokens > max_tokens)
        return 0;  // the arrays are max_tokens long: a larger count is the caller's lie

    kvc::batch_allocr a;
    try {
        a.init(b, (flags & 0x40) ? kvc::positions_of(mem) : kvc::memory_positions{}, opt);
    } catch (const kvc::error&) {
        check(a.get_n_tokens() == 0);
        return 0;
    }
    const uint32_t n_ubatch = 1 + r.u8() % 16;
    for (int strategy = 0; strategy < 4; ++strategy) {
        a.split_reset();
        uint32_t total = 0;
        for (int guard = 0; guard <= max_tokens; ++guard) {
            kvc::ubatch u = strategy == 0   ? a.split_simple(n_ubatch)
                            : strategy == 1 ? a.split_equal(n_ubatch, false)
                            : strategy == 2 ? a.split_equal(n_ubatch, true)
                                            : a.split_seq(n_ubatch);
            if (u.empty()) break;
            check(u.n_tokens <= n_ubatch && u.n_tokens == u.n_seq_tokens * u.n_seqs);
            total += u.n_tokens;
        }
        check(total == a.get_n_used());
        check(total == a.get_n_tokens() || (strategy == 2 && a.has_coupled()));
    }
    return 0;
}
