// The C API's state and files: llama.cpp's state buffers and payloads, kvcache session files and
// llama.cpp's 'ggsq' sequence files.
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include <kvcache/session.h>
#include <kvcache/state.h>

#include "capi_impl.h"

using namespace kvc::capi;

namespace {

// What both loaders share: the caller's room for the tokens (checked by the loader once the file is known
// to be intact, before the memory changes), then the tokens copied out.
template <class Load>
void load_with_tokens(int32_t* tokens_out, size_t capacity, size_t* n_tokens_out, const Load& load) {
    const std::vector<kvc::token_t> tokens = load(tokens_out != nullptr ? capacity : SIZE_MAX);
    if (tokens_out != nullptr && !tokens.empty())
        std::memcpy(tokens_out, tokens.data(), tokens.size() * sizeof(int32_t));
    if (n_tokens_out != nullptr) *n_tokens_out = tokens.size();
}

}  // namespace

// -- state buffers --

kvc_status kvc_state_seq_get_size(const kvc_memory* mem, int32_t seq_id, uint32_t flags,
                                  size_t* out) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory& m = need(mem, "mem");
        need(out, "out") = kvc::state_seq_get_size(*m.mem, seq_id, flags);
    });
}

kvc_status kvc_memory_state_max_bytes(const kvc_memory* mem, uint64_t* out) noexcept {
    return guarded(__func__, [&] { need(out, "out") = need(mem, "mem").mem->state_max_bytes(); });
}

kvc_status kvc_state_seq_get_data(const kvc_memory* mem, int32_t seq_id, uint8_t* dst, size_t capacity,
                                  size_t* written, uint32_t flags) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory& m = need(mem, "mem");
        need_ptr(dst, "dst");
        const size_t n = kvc::state_seq_get_data(*m.mem, seq_id, std::span<uint8_t>(dst, capacity), flags);
        if (written) *written = n;
    });
}

kvc_status kvc_state_seq_set_data(kvc_memory* mem, const uint8_t* src, size_t size, int32_t dest,
                                  uint32_t flags, size_t* read) noexcept {
    return guarded(__func__, [&] {
        kvc_memory& m = need(mem, "mem");
        need_ptr(src, "src");
        const size_t n = kvc::state_seq_set_data(*m.mem, std::span<const uint8_t>(src, size), dest, flags);
        if (read) *read = n;
    });
}

kvc_status kvc_state_set_payload(kvc_memory* mem, const uint8_t* payload, size_t size, int32_t dest,
                                 uint32_t flags, size_t* read) noexcept {
    return guarded(__func__, [&] {
        kvc_memory& m = need(mem, "mem");
        need_ptr(payload, "payload");
        const size_t n = kvc::state_set_payload(*m.mem, std::span<const uint8_t>(payload, size), dest, flags);
        if (read) *read = n;
    });
}

// -- session files --

kvc_status kvc_state_seq_save_file(const kvc_memory* mem, const char* path, int32_t seq_id,
                                   const int32_t* tokens, size_t n_tokens, bool compress) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory& m = need(mem, "mem");
        need_ptr(path, "path");
        kvc::session_save_options opt;
        opt.compress = compress;
        opt.tokens = tokens_of(tokens, n_tokens);
        kvc::save_file(*m.mem, path, seq_id, opt);
    });
}

kvc_status kvc_state_seq_load_file(kvc_memory* mem, const char* path, int32_t dest, int32_t* tokens_out,
                                   size_t capacity, size_t* n_tokens_out) noexcept {
    return guarded(__func__, [&] {
        kvc_memory& m = need(mem, "mem");
        need_ptr(path, "path");
        load_with_tokens(tokens_out, capacity, n_tokens_out,
                         [&](size_t room) { return kvc::load_file(*m.mem, path, dest, room).tokens; });
    });
}

kvc_status kvc_state_seq_save_llama_file(const kvc_memory* mem, const char* path, int32_t seq_id,
                                         const int32_t* tokens, size_t n_tokens) noexcept {
    return guarded(__func__, [&] {
        const kvc_memory& m = need(mem, "mem");
        need_ptr(path, "path");
        kvc::save_llama_seq_file(*m.mem, path, seq_id, tokens_of(tokens, n_tokens));
    });
}

kvc_status kvc_state_seq_load_llama_file(kvc_memory* mem, const char* path, int32_t dest, int32_t* tokens_out,
                                         size_t capacity, size_t* n_tokens_out) noexcept {
    return guarded(__func__, [&] {
        kvc_memory& m = need(mem, "mem");
        need_ptr(path, "path");
        load_with_tokens(tokens_out, capacity, n_tokens_out,
                         [&](size_t room) { return kvc::load_llama_seq_file(*m.mem, path, dest, room); });
    });
}
