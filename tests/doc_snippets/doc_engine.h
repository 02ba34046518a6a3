// What the C++ fragments of the docs take from the engine around them (scripts/doc_snippets.py): the
// model, and the engine's decode step. The harnesses of tests/doc_snippets/ include it; the programs run
// in a temporary directory.
#pragma once

#include <cstdio>
#include <span>
#include <stdexcept>

#include <kvcache/batch.h>
#include <kvcache/kv_cache.h>
#include <kvcache/runtime/runtime.h>
#include <kvcache/runtime/tiny_model.h>

namespace doc {

// The tiny llama model (runtime/tiny_model.h), written into the working directory on first use.
inline const kvc::model& model() {
    static const kvc::model m = [] {
        kvc::write_tiny_model("tiny.gguf");
        return kvc::model::load("tiny.gguf");
    }();
    return m;
}

// The model's cache parameters (f16 K/V, one stream).
inline kvc::kv_cache_params model_cache_params() {
    return model().cache_params(/*kv_size=*/256, /*n_seq_max=*/4);
}

// The engine's decode step: `tokens` into sequence seq at positions pos, pos + 1, ... (logits of the last
// token), through init_batch and the context (the reference runtime here).
inline void decode(kvc::memory_i& mem, kvc::seq_id_t seq, std::span<const kvc::token_t> tokens,
                   kvc::pos_t pos) {
    if (tokens.empty()) return;
    kvc::batch_storage b = kvc::batch::init(static_cast<int32_t>(tokens.size()), 0, 1);
    for (size_t i = 0; i < tokens.size(); ++i)
        b.add(tokens[i], pos + static_cast<kvc::pos_t>(i), {&seq, 1}, i + 1 == tokens.size());
    kvc::runtime rt(model(), mem, {.n_threads = 1});
    if (rt.decode(b.view()).status != kvc::memory_status::success)
        throw std::runtime_error("decode: no room");
}

inline int failures = 0;
inline void check(bool ok, const char* what) {
    std::printf("  [%s] %s\n", ok ? "ok" : "FAILED", what);
    if (!ok) ++failures;
}

}  // namespace doc
