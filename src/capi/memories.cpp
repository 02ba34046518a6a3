// The C API's memories, batches and contexts: creating each kind of memory, building batches, placing
// them through contexts (init, apply, next, the current ubatch), and the sequence operations.
#include <limits>
#include <memory>
#include <span>

#include <fmt/format.h>
#include <kvcache/memory_hybrid.h>

#include "capi_impl.h"

using namespace kvc::capi;
using kvc::errc;

// -- memory creation --

namespace {

// A memory handle over a C++ memory.
kvc_memory* new_memory(kvc::memory_ptr mem, kvc_memory_kind kind) {
    auto m = std::make_unique<kvc_memory>();
    m->kind = kind;
    m->mem = std::move(mem);
    return m.release();
}

}  // namespace

kvc_status kvc_kv_cache_create(const kvc_kv_cache_params* params, kvc_memory** out) noexcept {
    if (out) *out = nullptr;
    return guarded(__func__, [&] {
        const kvc_kv_cache_params& c = need(params, "params");
        need(out, "out");
        auto engine = to_cpp(c.engine, "params.engine");
        kvc::kv_cache_params kp = to_cpp(c, "params");
        kp.engine = engine.get();
        *out = new_memory(std::make_unique<kvc::kv_cache>(std::move(kp)), KVC_MEMORY_KIND_KV_CACHE);
        (*out)->engine = std::move(engine);
    });
}

kvc_status kvc_iswa_create(const kvc_iswa_params* params, kvc_memory** out) noexcept {
    if (out) *out = nullptr;
    return guarded(__func__, [&] {
        const kvc_iswa_params& c = need(params, "params");
        need(out, "out");
        auto engine = to_cpp(c.kv.engine, "params.kv.engine");
        kvc::kv_cache_iswa_params p;
        p.kv = to_cpp(c.kv, "params.kv");
        p.kv.engine = engine.get();
        p.sizing = to_cpp(c.sizing);
        *out = new_memory(std::make_unique<kvc::kv_cache_iswa>(std::move(p)), KVC_MEMORY_KIND_ISWA);
        (*out)->engine = std::move(engine);
    });
}

kvc_status kvc_recurrent_create(const kvc_recurrent_params* params, kvc_memory** out) noexcept {
    if (out) *out = nullptr;
    return guarded(__func__, [&] {
        const kvc_recurrent_params& c = need(params, "params");
        need(out, "out");
        *out = new_memory(std::make_unique<kvc::memory_recurrent>(to_cpp(c, "params")),
                          KVC_MEMORY_KIND_RECURRENT);
    });
}

kvc_status kvc_hybrid_create(const kvc_hybrid_params* params, kvc_memory** out) noexcept {
    if (out) *out = nullptr;
    return guarded(__func__, [&] {
        const kvc_hybrid_params& c = need(params, "params");
        need(out, "out");
        auto engine = to_cpp(c.attn.engine, "params.attn.engine");
        kvc::memory_hybrid_params p;
        p.attn = to_cpp(c.attn, "params.attn");
        p.attn.engine = engine.get();
        p.recr = to_cpp(c.recr, "params.recr");
        if (c.iswa) p.iswa = to_cpp(c.sizing);
        p.memory_budget = c.memory_budget;
        p.prefix = prefix_to_cpp(c.prefix, "params");
        *out = new_memory(std::make_unique<kvc::memory_hybrid>(std::move(p)),
                          c.iswa ? KVC_MEMORY_KIND_HYBRID_ISWA : KVC_MEMORY_KIND_HYBRID);
        (*out)->engine = std::move(engine);
    });
}

kvc_status kvc_memory_get_kind(const kvc_memory* mem, kvc_memory_kind* out) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory& m = need(mem, "mem");
        need(out, "out") = m.kind;
    });
}

kvc_status kvc_memory_get_breakdown(const kvc_memory* mem, kvc_memory_breakdown* out, uint64_t* seq_bytes,
                                    size_t n_seq) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory& m = need(mem, "mem");
        kvc_memory_breakdown& o = need(out, "out");
        if (n_seq > 0) need(seq_bytes, "seq_bytes");
        const kvc::memory_breakdown b = m.mem->get_memory_breakdown();
        o = {.reserved = b.reserved,
             .committed = b.committed,
             .used = b.used,
             .cached = b.cached,
             .pinned = b.pinned,
             .free = b.free};
        for (size_t s = 0; s < n_seq; ++s) seq_bytes[s] = s < b.seq.size() ? b.seq[s] : 0;
    });
}

void kvc_memory_free(kvc_memory* mem) noexcept {
    delete mem;
}

// -- batches --

namespace {

kvc::batch_storage& editable(kvc_batch* batch) {
    kvc_batch& b = need(batch, "batch");
    if (!b.storage)
        throw_error(errc::invalid_argument, "the batch comes from kvc_batch_get_one and cannot be changed");
    return *b.storage;
}

}  // namespace

kvc_batch* kvc_batch_init(int32_t n_tokens_alloc, int32_t n_embd, int32_t n_seq_max) noexcept {
    kvc_batch* out = nullptr;
    (void)guarded(__func__, [&] {
        auto b = std::make_unique<kvc_batch>();
        b->storage.emplace(n_tokens_alloc, n_embd, n_seq_max);
        b->n_embd = n_embd;
        out = b.release();
    });
    return out;
}

kvc_batch* kvc_batch_get_one(const int32_t* tokens, size_t n_tokens) noexcept {
    kvc_batch* out = nullptr;
    (void)guarded(__func__, [&] {
        need_ptr(tokens, "tokens");
        if (n_tokens == 0 || n_tokens > static_cast<size_t>(std::numeric_limits<int32_t>::max()))
            throw_error(errc::invalid_argument, fmt::format("n_tokens = {} not in [1, INT32_MAX]", n_tokens));
        auto b = std::make_unique<kvc_batch>();
        b->tokens.assign(tokens, tokens + n_tokens);
        out = b.release();
    });
    return out;
}

void kvc_batch_free(kvc_batch* batch) noexcept {
    delete batch;
}

kvc_status kvc_batch_add(kvc_batch* batch, int32_t token, int32_t pos, const int32_t* seq_ids,
                         size_t n_seq_ids, bool output) noexcept {
    return guarded(__func__, [&] {
        kvc::batch_storage& s = editable(batch);
        need_ptr(seq_ids, "seq_ids");
        s.add(token, pos, std::span<const kvc::seq_id_t>(seq_ids, n_seq_ids), output);
    });
}

kvc_status kvc_batch_add_embd(kvc_batch* batch, const float* embd, int32_t pos, const int32_t* seq_ids,
                              size_t n_seq_ids, bool output) noexcept {
    return guarded(__func__, [&] {
        kvc::batch_storage& s = editable(batch);
        need_ptr(embd, "embd");
        need_ptr(seq_ids, "seq_ids");
        if (batch->n_embd == 0)
            throw_error(errc::invalid_argument,
                        "this batch holds tokens, not embeddings (use kvc_batch_add)");
        s.add(std::span<const float>(embd, static_cast<size_t>(batch->n_embd)), pos,
              std::span<const kvc::seq_id_t>(seq_ids, n_seq_ids), output);
    });
}

kvc_status kvc_batch_clear(kvc_batch* batch) noexcept {
    return guarded(__func__, [&] { editable(batch).clear(); });
}

kvc_status kvc_batch_set_output(kvc_batch* batch, int32_t i, bool output) noexcept {
    return guarded(__func__, [&] { editable(batch).set_output(i, output); });
}

int32_t kvc_batch_n_tokens(const kvc_batch* batch) noexcept {
    return static_cast<int32_t>(guarded_count(__func__, [&] {
        const kvc_batch& b = need(batch, "batch");
        return int64_t{b.storage ? b.storage->size() : static_cast<int32_t>(b.tokens.size())};
    }));
}

int32_t kvc_batch_capacity(const kvc_batch* batch) noexcept {
    return static_cast<int32_t>(guarded_count(__func__, [&] {
        const kvc_batch& b = need(batch, "batch");
        return int64_t{b.storage ? b.storage->capacity() : static_cast<int32_t>(b.tokens.size())};
    }));
}

// -- placement --

namespace {

kvc_memory_context* new_context(kvc_memory& m, kvc::memory_context_ptr ctx,
                                std::unique_ptr<kvc_memory_context> c = nullptr) {
    if (!c) c = std::make_unique<kvc_memory_context>();
    c->mem = &m;
    c->ctx = std::move(ctx);
    return c.release();
}

}  // namespace

kvc_status kvc_memory_init_batch(kvc_memory* mem, const kvc_batch* batch, uint32_t n_ubatch, bool embd_all,
                                 kvc_memory_context** out) noexcept {
    if (out) *out = nullptr;
    return guarded(__func__, [&] {
        kvc_memory& m = need(mem, "mem");
        const kvc_batch& b = need(batch, "batch");
        need(out, "out");
        auto c = std::make_unique<kvc_memory_context>();
        kvc::batch_options opt;
        opt.n_seq_max = m.mem->n_seq_max();
        opt.n_embd = b.n_embd;
        opt.n_pos = m.mem->n_pos();
        opt.output_all = embd_all;
        c->balloc.init(b.view(), positions_of(m.mem.get()), opt);
        kvc::memory_context_ptr ctx = m.mem->init_batch(c->balloc, n_ubatch, embd_all);
        *out = new_context(m, std::move(ctx), std::move(c));
    });
}

kvc_status kvc_memory_init_full(kvc_memory* mem, kvc_memory_context** out) noexcept {
    if (out) *out = nullptr;
    return guarded(__func__, [&] {
        kvc_memory& m = need(mem, "mem");
        need(out, "out");
        *out = new_context(m, m.mem->init_full());
    });
}

kvc_status kvc_memory_init_update(kvc_memory* mem, bool optimize, kvc_memory_context** out) noexcept {
    if (out) *out = nullptr;
    return guarded(__func__, [&] {
        kvc_memory& m = need(mem, "mem");
        need(out, "out");
        *out = new_context(m, m.mem->init_update(optimize));
    });
}

kvc_status kvc_memory_update(kvc_memory* mem, bool optimize, bool* updated) noexcept {
    return guarded(__func__, [&] {
        kvc_memory& m = need(mem, "mem");
        const kvc::memory_context_ptr ctx = m.mem->init_update(optimize);
        const bool work = ctx->get_status() == kvc::memory_status::success;
        if (work) ctx->apply();
        if (updated) *updated = work;
    });
}

void kvc_memory_context_free(kvc_memory_context* ctx) noexcept {
    delete ctx;
}

kvc_status kvc_memory_context_get_status(const kvc_memory_context* ctx, kvc_memory_status* out) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory_context& c = need(ctx, "ctx");
        need(out, "out") = static_cast<kvc_memory_status>(c.ctx->get_status());
    });
}

kvc_status kvc_memory_context_apply(kvc_memory_context* ctx) noexcept {
    return guarded(__func__, [&] { need(ctx, "ctx").ctx->apply(); });
}

kvc_status kvc_memory_context_next(kvc_memory_context* ctx, bool* more) noexcept {
    return guarded(__func__, [&] {
        kvc_memory_context& c = need(ctx, "ctx");
        bool& m = need(more, "more");
        m = c.ctx->next();
    });
}

int64_t kvc_memory_context_n_tokens(const kvc_memory_context* ctx) noexcept {
    return guarded_count(__func__, [&] { return int64_t{need(ctx, "ctx").ctx->get_ubatch().n_tokens}; });
}

kvc_status kvc_memory_context_get_ubatch(const kvc_memory_context* ctx, kvc_ubatch_view* out) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory_context& c = need(ctx, "ctx");
        kvc_ubatch_view& v = need(out, "out");
        const kvc::ubatch& ub = c.ctx->get_ubatch();
        const auto ptr = [](const auto& vec) { return vec.empty() ? nullptr : vec.data(); };
        v.n_tokens = ub.n_tokens;
        v.n_seq_tokens = ub.n_seq_tokens;
        v.n_seqs = ub.n_seqs;
        v.n_seqs_unq = ub.n_seqs_unq;
        v.n_pos = ub.n_pos;
        v.n_embd = ub.n_embd;
        v.equal_seqs = ub.equal_seqs;
        v.token = ptr(ub.token);
        v.embd = ptr(ub.embd);
        v.pos = ptr(ub.pos);
        v.n_seq_id = ptr(ub.n_seq_id);
        v.seq_id_begin = ptr(ub.seq_id_begin);
        v.seq_id_data = ptr(ub.seq_id_data);
        v.seq_id_unq = ptr(ub.seq_id_unq);
        v.output = ptr(ub.output);
        v.batch_idx = ptr(ub.batch_idx);
    });
}

kvc_status kvc_memory_context_out_ids(const kvc_memory_context* ctx, const int32_t** ids,
                                      size_t* n) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory_context& c = need(ctx, "ctx");
        need(ids, "ids");
        need(n, "n");
        const std::span<const int32_t> o = c.ctx->out_ids();
        *ids = o.empty() ? nullptr : o.data();
        *n = o.size();
    });
}

// -- sequences --

kvc_status kvc_memory_clear(kvc_memory* mem, bool data) noexcept {
    return guarded(__func__, [&] { need(mem, "mem").mem->clear(data); });
}

kvc_status kvc_memory_seq_rm(kvc_memory* mem, int32_t seq_id, int32_t p0, int32_t p1,
                             bool* removed) noexcept {
    return guarded(__func__, [&] {
        const bool r = need(mem, "mem").mem->seq_rm(seq_id, p0, p1);
        if (removed) *removed = r;
    });
}

kvc_status kvc_memory_seq_cp(kvc_memory* mem, int32_t src, int32_t dst, int32_t p0, int32_t p1) noexcept {
    return guarded(__func__, [&] { need(mem, "mem").mem->seq_cp(src, dst, p0, p1); });
}

kvc_status kvc_memory_seq_keep(kvc_memory* mem, int32_t seq_id) noexcept {
    return guarded(__func__, [&] { need(mem, "mem").mem->seq_keep(seq_id); });
}

kvc_status kvc_memory_seq_add(kvc_memory* mem, int32_t seq_id, int32_t p0, int32_t p1,
                              int32_t shift) noexcept {
    return guarded(__func__, [&] { need(mem, "mem").mem->seq_add(seq_id, p0, p1, shift); });
}

kvc_status kvc_memory_seq_div(kvc_memory* mem, int32_t seq_id, int32_t p0, int32_t p1, int d) noexcept {
    return guarded(__func__, [&] { need(mem, "mem").mem->seq_div(seq_id, p0, p1, d); });
}

kvc_status kvc_memory_seq_pos_min(const kvc_memory* mem, int32_t seq_id, int32_t* out) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory& m = need(mem, "mem");
        need(out, "out") = m.mem->seq_pos_min(seq_id);
    });
}

kvc_status kvc_memory_seq_pos_max(const kvc_memory* mem, int32_t seq_id, int32_t* out) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory& m = need(mem, "mem");
        need(out, "out") = m.mem->seq_pos_max(seq_id);
    });
}

kvc_status kvc_memory_can_shift(const kvc_memory* mem, bool* out) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory& m = need(mem, "mem");
        need(out, "out") = m.mem->get_can_shift();
    });
}
