// The C API's state and files: llama.cpp's state buffers and payloads, kvcache session files and
// llama.cpp's 'ggsq' sequence files.
#include <algorithm>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <kvcache/session.h>
#include <kvcache/state.h>

#include "capi_impl.h"

using namespace kvc::capi;
using kvc::errc;

namespace {

// The tokens a file of `format` announces in its header; nullopt when the header cannot be read or is of
// the other format (the load then reports the problem, in its own words).
std::optional<uint32_t> announced_tokens(const std::string& path, kvc::session_file_format format) {
    try {
        const kvc::session_header h = kvc::read_session_header(path);
        if (h.format == format) return h.n_tokens;
    } catch (const kvc::error&) {}
    return std::nullopt;
}

// What both loaders share: checks the token capacity before anything is loaded, then loads.
template <class Load>
void load_with_tokens(const std::string& path, kvc::session_file_format format, int32_t* tokens_out,
                      size_t capacity, size_t* n_tokens_out, const Load& load) {
    if (tokens_out != nullptr)
        if (const auto n = announced_tokens(path, format); n && *n > capacity)
            throw_error(errc::out_of_range,
                        fmt::format("'{}' holds {} tokens, tokens_out has room for {}", path, *n, capacity));
    const std::vector<kvc::token_t> tokens = load();
    // The file was checked above; should it have been replaced in between, the first `capacity` tokens
    // are returned and n_tokens_out says how many there were.
    if (tokens_out != nullptr && !tokens.empty())
        std::memcpy(tokens_out, tokens.data(), std::min(capacity, tokens.size()) * sizeof(int32_t));
    if (n_tokens_out != nullptr) *n_tokens_out = tokens.size();
}

std::span<const kvc::token_t> tokens_of(const int32_t* tokens, size_t n_tokens) {
    need_array(tokens, n_tokens, "tokens");
    return n_tokens > 0 ? std::span<const kvc::token_t>(tokens, n_tokens) : std::span<const kvc::token_t>();
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
        load_with_tokens(path, kvc::session_file_format::kvcache, tokens_out, capacity, n_tokens_out,
                         [&] { return kvc::load_file(*m.mem, path, dest).tokens; });
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
        load_with_tokens(path, kvc::session_file_format::llama_seq, tokens_out, capacity, n_tokens_out,
                         [&] { return kvc::load_llama_seq_file(*m.mem, path, dest); });
    });
}
