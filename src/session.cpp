// Session files (design D11) and llama.cpp's per-sequence files.
#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <memory>

#include <xxhash.h>
#include <zstd.h>
#include <zstd_errors.h>

#include <fmt/format.h>
#include <kvcache/limits.h>
#include <kvcache/memory_budget.h>
#include <kvcache/session.h>
#include <kvcache/state.h>

#include "detail/byte_fields.h"
#include "detail/state_io.h"

namespace kvc {

static_assert(std::endian::native == std::endian::little, "session files are little-endian");

namespace {

// The largest zstd window kvcache writes and reads: 2^23 bytes, what levels up to 19 use (20-22 are
// capped to it). The decompressor holds the window beside the payload, so a frame may not make it hold
// more than this (zstd's own limit is 2^27).
constexpr int zstd_window_log = 23;

ZSTD_DStream* new_dstream() {
    ZSTD_DStream* ds = ZSTD_createDStream();
    if (ds == nullptr) return nullptr;
    ZSTD_initDStream(ds);
    ZSTD_DCtx_setParameter(ds, ZSTD_d_windowLogMax, zstd_window_log);
    return ds;
}

std::string zstd_error(size_t r) {
    if (ZSTD_getErrorCode(r) == ZSTD_error_frameParameter_windowTooLarge)
        return fmt::format("the frame needs a window over {} bytes, the most kvcache writes and reads",
                           size_t{1} << zstd_window_log);
    return ZSTD_getErrorName(r);
}

// Header fields at fixed offsets (docs/state-format.md).
constexpr size_t off_magic = 0, off_version = 4, off_flags = 8, off_seq = 12, off_state_flags = 16,
                 off_n_tokens = 20, off_layout_len = 24, off_payload = 32, off_stored = 40,
                 off_fingerprint = 48, off_checksum = 56, off_header_checksum = 64;

using detail::load_at;
using detail::store_at;

uint64_t xxh3(const void* p, size_t n) {
    return XXH3_64bits(p, n);
}

// XXH3-64 of bytes given in pieces (the body of a session file).
class xxh3_stream {
public:
    xxh3_stream() : state_(XXH3_createState()) {
        if (!state_) throw error(errc::out_of_memory, "session: cannot allocate a hash state");
        XXH3_64bits_reset(state_);
    }
    ~xxh3_stream() { XXH3_freeState(state_); }
    xxh3_stream(const xxh3_stream&) = delete;
    xxh3_stream& operator=(const xxh3_stream&) = delete;

    void update(const void* p, size_t n) { XXH3_64bits_update(state_, p, n); }
    uint64_t digest() const { return XXH3_64bits_digest(state_); }

private:
    XXH3_state_t* state_;
};

// Forwards to a file and hashes what passes (the body of a session file).
class hashing_writer final : public io_write_i {
public:
    explicit hashing_writer(io_write_i& down) : down_(&down) {}

    void write(const void* src, size_t size) override {
        hash_.update(src, size);
        down_->write(src, size);
        n_ += size;
    }
    size_t n_bytes() const override { return n_; }
    uint64_t digest() const { return hash_.digest(); }

private:
    io_write_i* down_;
    xxh3_stream hash_;
    size_t n_ = 0;
};

// Compresses what it is given into one zstd frame written downstream.
class zstd_writer final : public io_write_i {
public:
    zstd_writer(io_write_i& down, int level, uint64_t src_size) : down_(&down), cctx_(ZSTD_createCCtx()) {
        if (!cctx_) throw error(errc::out_of_memory, "save_file: cannot allocate a zstd context");
        check(ZSTD_CCtx_setParameter(cctx_, ZSTD_c_compressionLevel, level));
        if (level >= 20) check(ZSTD_CCtx_setParameter(cctx_, ZSTD_c_windowLog, zstd_window_log));
        check(ZSTD_CCtx_setPledgedSrcSize(cctx_, src_size));  // the frame records the payload's size
        out_.resize(ZSTD_CStreamOutSize());
    }
    ~zstd_writer() override { ZSTD_freeCCtx(cctx_); }
    zstd_writer(const zstd_writer&) = delete;
    zstd_writer& operator=(const zstd_writer&) = delete;

    void write(const void* src, size_t size) override {
        ZSTD_inBuffer in{src, size, 0};
        while (in.pos < in.size) pump(in, ZSTD_e_continue);
        n_ += size;
    }
    size_t n_bytes() const override { return n_; }
    void finish() {
        ZSTD_inBuffer in{nullptr, 0, 0};
        while (pump(in, ZSTD_e_end) != 0) {}
    }

private:
    static size_t check(size_t r) {
        if (ZSTD_isError(r)) throw error(errc::io, fmt::format("save_file: zstd: {}", ZSTD_getErrorName(r)));
        return r;
    }
    size_t pump(ZSTD_inBuffer& in, ZSTD_EndDirective mode) {
        ZSTD_outBuffer out{out_.data(), out_.size(), 0};
        const size_t left = check(ZSTD_compressStream2(cctx_, &out, &in, mode));
        if (out.pos) down_->write(out_.data(), out.pos);
        return left;
    }

    io_write_i* down_;
    ZSTD_CCtx* cctx_;
    std::vector<uint8_t> out_;
    size_t n_ = 0;
};

[[noreturn]] void bad_file(errc code, const std::string& what) {
    throw error(code, fmt::format("session: {}", what));
}

// What the magic of a file that is not a kvcache session says it is.
std::string what_else(uint32_t magic) {
    switch (magic) {
        case llama_seq_file_magic:
            return "a llama.cpp sequence file ('ggsq'; read it with load_llama_seq_file)";
        case llama_session_file_magic:
            return "a llama.cpp whole-context session file ('ggsn'), which is not read";
        case state_seq_magic:
            return "a per-sequence state buffer (state_seq_set_data reads it)";
        default:
            return fmt::format("it starts with {:#010x}", magic);
    }
}

struct parsed_session {
    session_info info;
    std::span<const uint8_t> payload;  // into the file, or into the storage given to parse
};

// Checks the fixed header of a kvcache session file of `size` bytes: magic, version, header checksum and
// flags. head: the file's first min(size, session_header_size) bytes.
void check_session_header(std::span<const uint8_t> head, uint64_t size) {
    if (size < 4) bad_file(errc::corrupt_data, fmt::format("not a kvcache session file ({} bytes)", size));
    const auto magic = load_at<uint32_t>(head, off_magic);
    if (magic != session_magic)
        bad_file(errc::corrupt_data, fmt::format("not a kvcache session file: {}", what_else(magic)));
    if (size < 8)
        bad_file(errc::corrupt_data,
                 fmt::format("truncated: {} bytes, the header has {}", size, session_header_size));
    const auto version = load_at<uint32_t>(head, off_version);
    if (version != session_version)
        bad_file(errc::unsupported, fmt::format("unsupported format version {} (this build reads version {})",
                                                version, session_version));
    if (size < session_header_size)
        bad_file(errc::corrupt_data,
                 fmt::format("truncated: {} bytes, the header has {}", size, session_header_size));
    const auto header_sum = load_at<uint64_t>(head, off_header_checksum);
    if (xxh3(head.data(), off_header_checksum) != header_sum)
        bad_file(errc::corrupt_data,
                 fmt::format("header checksum mismatch (stored {:016x}, computed {:016x}): "
                             "the file is damaged",
                             header_sum, xxh3(head.data(), off_header_checksum)));
    const auto flags = load_at<uint32_t>(head, off_flags);
    if (flags & ~session_flag_zstd) bad_file(errc::unsupported, fmt::format("unknown flags {:#x}", flags));
    const auto state_flags = load_at<uint32_t>(head, off_state_flags);
    if (state_flags & ~state_seq_flag_partial_only)
        bad_file(errc::unsupported, fmt::format("unknown state flags {:#x}", state_flags));
}

// Decompresses one zstd frame that must hold exactly `declared` bytes. The buffer grows with what the
// frame really produces, never to what it declares: a damaged or hostile frame may declare any size
// (a 331-byte file declaring 8 GiB was zero-filled for 31 s before it was refused).
void decompress(std::span<const uint8_t> src, uint64_t declared, std::vector<uint8_t>& out) {
    const std::unique_ptr<ZSTD_DStream, size_t (*)(ZSTD_DStream*)> ds(new_dstream(), ZSTD_freeDStream);
    if (!ds) bad_file(errc::out_of_memory, "cannot create a zstd stream");
    ZSTD_inBuffer in{src.data(), src.size(), 0};
    size_t have = 0;
    out.clear();
    for (;;) {
        if (have == out.size() && have < declared) {  // full: grow, at most to the declared size
            // doubling, until the frame has given an eighth of what it declares: then all of it at once, so
            // that the last growth does not hold the old buffer beside one twice its size (peak 1.125x,
            // not 1.5x), and what is zero-filled stays within 8x what the frame really produced
            const uint64_t next =
                have >= declared / 8
                    ? declared
                    : std::min<uint64_t>(declared, std::max<uint64_t>(uint64_t{1} << 16, 2 * have));
            try {
                out.resize(static_cast<size_t>(next));
            } catch (const std::bad_alloc&) {
                bad_file(errc::out_of_memory, fmt::format("cannot allocate {} bytes for the payload", next));
            }
        }
        ZSTD_outBuffer ob{out.data(), out.size(), have};
        const size_t in_before = in.pos;
        const size_t ret = ZSTD_decompressStream(ds.get(), &ob, &in);
        if (ZSTD_isError(ret))
            bad_file(errc::corrupt_data, fmt::format("the payload does not decompress: {}", zstd_error(ret)));
        const bool progress = ob.pos > have || in.pos > in_before;
        have = ob.pos;
        if (ret == 0) break;  // the frame is complete
        // all the declared bytes are out and the frame can only give more: it holds more than declared
        // (checked after a call, so that a frame of 0 bytes is decoded too)
        if (have == declared && !progress)
            bad_file(errc::corrupt_data,
                     fmt::format("the zstd frame holds more than the {} bytes the header says", declared));
        if (in.pos == in.size && ob.pos < ob.size)
            bad_file(errc::corrupt_data, "the payload does not decompress: the zstd frame is truncated");
    }
    if (have != declared)
        bad_file(errc::corrupt_data,
                 fmt::format("the zstd frame holds {} bytes, the header says {}", have, declared));
    if (in.pos != in.size)
        bad_file(errc::corrupt_data, fmt::format("{} bytes follow the zstd frame", in.size - in.pos));
    out.resize(have);
}

// Checks the 12-byte header of a llama.cpp sequence file of `size` bytes and that its tokens follow;
// returns their number. head: the file's first min(size, 12) bytes or more.
uint32_t check_llama_header(std::span<const uint8_t> head, uint64_t size) {
    if (size < 12) bad_file(errc::corrupt_data, fmt::format("truncated: {} bytes, the header has 12", size));
    const auto magic = load_at<uint32_t>(head, 0);
    if (magic != llama_seq_file_magic)
        bad_file(errc::corrupt_data,
                 fmt::format("not a llama.cpp sequence file: {}",
                             magic == session_magic ? "a kvcache session file (load_file reads it)"
                                                    : what_else(magic)));
    const auto version = load_at<uint32_t>(head, 4);
    if (version != llama_seq_file_version)
        bad_file(errc::unsupported, fmt::format("unsupported llama.cpp sequence file version {} (this build "
                                                "reads version {})",
                                                version, llama_seq_file_version));
    const auto n_tokens = load_at<uint32_t>(head, 8);
    if (uint64_t{n_tokens} * 4 > size - 12)
        bad_file(errc::corrupt_data,
                 fmt::format("truncated: {} tokens announced, {} bytes left", n_tokens, size - 12));
    return n_tokens;
}

// The fields of a session file's header, checked (check_session_header) and checked against the size
// of the file (truncated, trailing bytes). head: the file's first min(size, session_header_size) bytes.
struct session_fields {
    session_info info;  // without the layout and the tokens
    uint32_t n_tokens = 0;
    uint32_t layout_len = 0;
    uint64_t before_payload = 0;  // header, layout and tokens
};

session_fields read_fields(std::span<const uint8_t> head, uint64_t size) {
    check_session_header(head, size);
    session_fields f;
    session_info& info = f.info;
    info.version = load_at<uint32_t>(head, off_version);
    info.file_flags = load_at<uint32_t>(head, off_flags);
    info.seq_id = load_at<int32_t>(head, off_seq);
    info.state_flags = load_at<uint32_t>(head, off_state_flags);
    f.n_tokens = load_at<uint32_t>(head, off_n_tokens);
    f.layout_len = load_at<uint32_t>(head, off_layout_len);
    info.payload_bytes = load_at<uint64_t>(head, off_payload);
    info.stored_bytes = load_at<uint64_t>(head, off_stored);
    info.layout_fingerprint = load_at<uint64_t>(head, off_fingerprint);
    info.checksum = load_at<uint64_t>(head, off_checksum);

    f.before_payload = session_header_size + uint64_t{f.layout_len} + uint64_t{f.n_tokens} * 4;
    if (info.stored_bytes > size || f.before_payload + info.stored_bytes > size)
        bad_file(errc::corrupt_data, fmt::format("truncated: the header promises {} bytes, the file has {}",
                                                 f.before_payload + info.stored_bytes, size));
    const uint64_t expected = f.before_payload + info.stored_bytes;
    if (expected < size)
        bad_file(errc::corrupt_data, fmt::format("{} trailing bytes after the {} the header promises",
                                                 size - expected, expected));
    if (!(info.file_flags & session_flag_zstd) && info.payload_bytes != info.stored_bytes)
        bad_file(errc::corrupt_data, fmt::format("payload of {} bytes stored in {} without compression",
                                                 info.payload_bytes, info.stored_bytes));
    return f;
}

void check_checksum(const session_info& info, uint64_t sum) {
    if (sum != info.checksum)
        bad_file(errc::corrupt_data, fmt::format("checksum mismatch (stored {:016x}, computed {:016x}): the "
                                                 "file is damaged",
                                                 info.checksum, sum));
}

// After the checksum: the layout against its fingerprint, the tokens from their bytes, and a zstd frame's
// declared size (from the frame's first bytes, `frame_head`) against the header's.
void check_body(session_info& info, std::string_view layout, std::span<const uint8_t> tokens,
                std::span<const uint8_t> frame_head) {
    info.layout.assign(layout);
    if (xxh3(info.layout.data(), info.layout.size()) != info.layout_fingerprint)
        bad_file(errc::corrupt_data, "the layout fingerprint does not match the layout");
    info.tokens.resize(tokens.size() / 4);
    if (!tokens.empty()) std::memcpy(info.tokens.data(), tokens.data(), tokens.size());
    if (!(info.file_flags & session_flag_zstd)) return;
    const unsigned long long frame = ZSTD_getFrameContentSize(frame_head.data(), frame_head.size());
    if (frame != info.payload_bytes)
        bad_file(errc::corrupt_data,
                 fmt::format("the zstd frame holds {} bytes, the header says {}",
                             frame >= ZSTD_CONTENTSIZE_ERROR ? 0 : frame, info.payload_bytes));
}

// want_payload: a compressed payload is inflated into storage, if it declares at most max_payload bytes.
parsed_session parse(std::span<const uint8_t> file, bool want_payload, std::vector<uint8_t>& storage,
                     uint64_t max_payload = UINT64_MAX, std::string_view max_name = {}) {
    const size_t size = file.size();
    const session_fields f = read_fields(file.first(std::min(size, session_header_size)), size);
    parsed_session p;
    p.info = f.info;
    session_info& info = p.info;
    const auto body = file.subspan(session_header_size);
    check_checksum(info, xxh3(body.data(), body.size()));
    const auto stored = file.subspan(f.before_payload);
    check_body(info, std::string_view(reinterpret_cast<const char*>(body.data()), f.layout_len),
               body.subspan(f.layout_len, size_t{f.n_tokens} * 4), stored);
    if (!(info.file_flags & session_flag_zstd)) {
        p.payload = stored;
        return p;
    }
    if (!want_payload) return p;
    check_limit("read_session: the payload", max_name, info.payload_bytes, max_payload);
    decompress(stored, info.payload_bytes, storage);
    p.payload = storage;
    return p;
}

// -- loading from a file in pieces --

constexpr size_t read_chunk = size_t{1} << 20;  // bytes per read of a file streamed through

// n bytes of f into the hash, a chunk at a time; the first bytes also into `first` (up to its size).
void hash_through(io_file_reader& f, uint64_t n, xxh3_stream& h, std::span<uint8_t> first) {
    std::vector<uint8_t> buf(static_cast<size_t>(std::min<uint64_t>(n, read_chunk)));
    for (uint64_t done = 0; done < n;) {
        const auto k = static_cast<size_t>(std::min<uint64_t>(n - done, buf.size()));
        f.read(buf.data(), k);
        h.update(buf.data(), k);
        if (done < first.size())
            std::memcpy(first.data() + done, buf.data(),
                        std::min<size_t>(k, first.size() - static_cast<size_t>(done)));
        done += k;
    }
}

// The payload of a file read by a memory's state_stage straight from the file: no copy of the file is
// held, only what the stage keeps (issue 20: a 1 GiB session took 2.1 GB). Plain payloads go from the
// file into the stage's buffers; zstd payloads are decompressed on the way, a chunk of input at a time.
// (read_session_stream reads a file held in memory the same way.)
// What passes is hashed (when `hash` is set), so that the caller can check the file did not change since
// it was verified. Running out, or bytes left over at end_of_state, are corrupt_data as for a buffer.
class payload_source final : public io_read_i {
public:
    payload_source(io_read_i& f, uint64_t stored, uint64_t payload, bool zstd, xxh3_stream* hash)
        : f_(&f), stored_(stored), payload_(payload), hash_(hash) {
        if (!zstd) return;
        ds_.reset(new_dstream());
        if (!ds_) bad_file(errc::out_of_memory, "cannot create a zstd stream");
        in_buf_.resize(static_cast<size_t>(std::min<uint64_t>(stored, read_chunk)));
    }

    void read(void* dst, size_t size) override {
        if (size > payload_ - n_)
            throw error(errc::corrupt_data,
                        fmt::format("state: truncated at byte {}: {} bytes needed, {} left", n_, size,
                                    payload_ - n_));
        if (ds_)
            inflate(dst, size);
        else
            pull(dst, size);
        n_ += size;
    }
    size_t n_bytes() const override { return n_; }

    void end_of_state() override {
        if (n_ != payload_)
            throw error(errc::corrupt_data, fmt::format("state: {} trailing bytes after the state at byte {}",
                                                        payload_ - n_, n_));
        if (!ds_) return;
        // the frame ends here: no more output, and no input after it
        uint8_t extra = 0;
        while (frame_left_ != 0) {
            ZSTD_outBuffer out{&extra, 1, 0};
            step(out);
            if (out.pos != 0)
                bad_file(
                    errc::corrupt_data,
                    fmt::format("the zstd frame holds more than the {} bytes the header says", payload_));
        }
        if (in_.pos != in_.size || taken_ != stored_)
            bad_file(errc::corrupt_data, fmt::format("{} bytes follow the zstd frame",
                                                     (in_.size - in_.pos) + (stored_ - taken_)));
    }

private:
    // size bytes of the plain payload: small reads (a state's fields) come from a buffer filled a chunk
    // at a time, large ones (rows) straight from the file.
    void pull(void* dst, size_t size) {
        auto* out = static_cast<uint8_t*>(dst);
        const size_t have = std::min(size, buf_.size() - buf_at_);
        if (have) std::memcpy(out, buf_.data() + buf_at_, have);
        buf_at_ += have;
        out += have;
        size -= have;
        if (size == 0) return;
        if (size >= small_read) {
            fetch(out, size);
            return;
        }
        buf_.resize(static_cast<size_t>(std::min<uint64_t>(small_read, stored_ - taken_)));
        fetch(buf_.data(), buf_.size());
        buf_at_ = size;  // read() checked that the payload holds size more bytes
        std::memcpy(out, buf_.data(), size);
    }
    void fetch(void* dst, size_t size) {
        f_->read(dst, size);
        if (hash_) hash_->update(dst, size);
        taken_ += size;
    }

    // One call of the decompressor into out, refilling the input first when it is used up.
    void step(ZSTD_outBuffer& out) {
        if (in_.pos == in_.size) {
            if (taken_ == stored_)
                bad_file(errc::corrupt_data, "the payload does not decompress: the zstd frame is truncated");
            const auto k = static_cast<size_t>(std::min<uint64_t>(stored_ - taken_, in_buf_.size()));
            fetch(in_buf_.data(), k);
            in_ = {in_buf_.data(), k, 0};
        }
        frame_left_ = ZSTD_decompressStream(ds_.get(), &out, &in_);
        if (ZSTD_isError(frame_left_))
            bad_file(errc::corrupt_data,
                     fmt::format("the payload does not decompress: {}", zstd_error(frame_left_)));
    }

    void inflate(void* dst, size_t size) {
        ZSTD_outBuffer out{dst, size, 0};
        while (out.pos < out.size) {
            if (frame_left_ == 0)  // the frame ended before the payload did
                bad_file(errc::corrupt_data, fmt::format("the zstd frame holds {} bytes, the header says {}",
                                                         n_ + out.pos, payload_));
            step(out);
        }
    }

    io_read_i* f_;  // the stored bytes: a file, or a file in memory
    uint64_t stored_, payload_;
    xxh3_stream* hash_;
    size_t n_ = 0;  // payload bytes given out
    std::unique_ptr<ZSTD_DStream, size_t (*)(ZSTD_DStream*)> ds_{nullptr, ZSTD_freeDStream};
    static constexpr size_t small_read = 64 * 1024;
    std::vector<uint8_t> buf_;  // plain payloads: bytes read ahead, from buf_at_
    size_t buf_at_ = 0;
    std::vector<uint8_t> in_buf_;  // zstd payloads: the compressed input
    ZSTD_inBuffer in_{nullptr, 0, 0};
    uint64_t taken_ = 0;     // stored bytes read from the file
    size_t frame_left_ = 1;  // ZSTD_decompressStream's last answer: 0 once the frame is complete
};

// Runs f; a kvc::error it throws gets "load 'path': " in front.
template <class F>
auto about_file(const char* op, const std::string& path, F&& f) {
    try {
        return f();
    } catch (const error& e) {
        throw error(e.code(), fmt::format("{} '{}': {}", op, path, e.what()));
    }
}

}  // namespace

uint64_t save_file(const memory_i& mem, const std::string& path, seq_id_t seq_id,
                   const session_save_options& options) {
    return about_file("save_file", path, [&] {
        if (options.zstd_level < 1 || options.zstd_level > ZSTD_maxCLevel())
            throw error(errc::invalid_argument,
                        fmt::format("zstd level {} not in [1, {}]", options.zstd_level, ZSTD_maxCLevel()));
        check_state_seq_flags(options.flags);
        io_size_counter counter;
        mem.state_write(counter, seq_id, options.flags);  // also checks seq_id before a file is made
        const uint64_t payload_bytes = counter.n_bytes();
        const std::string layout = mem.state_layout();
        return write_file_atomically(path, [&](io_file_writer& f) {
            uint8_t header[session_header_size] = {};
            f.write(header, sizeof header);  // placeholder: sizes and checksums are known at the end
            hashing_writer body(f);
            body.write(layout.data(), layout.size());
            body.write(options.tokens.data(), options.tokens.size_bytes());
            const size_t before = body.n_bytes();
            if (options.compress) {
                zstd_writer z(body, options.zstd_level, payload_bytes);
                mem.state_write(z, seq_id, options.flags);
                z.finish();
            } else {
                mem.state_write(body, seq_id, options.flags);
            }
            store_at<uint32_t>(header, off_magic, session_magic);
            store_at<uint32_t>(header, off_version, session_version);
            store_at<uint32_t>(header, off_flags, options.compress ? session_flag_zstd : 0);
            store_at<int32_t>(header, off_seq, seq_id);
            store_at<uint32_t>(header, off_state_flags, options.flags);
            store_at<uint32_t>(header, off_n_tokens, static_cast<uint32_t>(options.tokens.size()));
            store_at<uint32_t>(header, off_layout_len, static_cast<uint32_t>(layout.size()));
            store_at<uint64_t>(header, off_payload, payload_bytes);
            store_at<uint64_t>(header, off_stored, body.n_bytes() - before);
            store_at<uint64_t>(header, off_fingerprint, xxh3(layout.data(), layout.size()));
            store_at<uint64_t>(header, off_checksum, body.digest());
            store_at<uint64_t>(header, off_header_checksum, xxh3(header, off_header_checksum));
            f.write_at(0, header, sizeof header);
        });
    });
}

session_info read_session(std::span<const uint8_t> file, std::vector<uint8_t>* payload,
                          uint64_t max_payload) {
    std::vector<uint8_t> storage;
    const uint64_t memory = get_limits().memory_bytes;
    const uint64_t limit = max_payload != 0 ? max_payload : memory != 0 ? memory : physical_memory_bytes();
    parsed_session p =
        parse(file, payload != nullptr, storage, limit, max_payload != 0 ? "max_payload" : "memory_bytes");
    if (payload) {
        if (p.payload.data() == storage.data())
            *payload = std::move(storage);
        else
            payload->assign(p.payload.begin(), p.payload.end());
    }
    return std::move(p.info);
}

session_info read_session_stream(
    std::span<const uint8_t> file,
    const std::function<void(io_read_i& payload, const session_info& info)>& read) {
    std::vector<uint8_t> unused;  // parse inflates nothing without want_payload
    const parsed_session p = parse(file, false, unused);
    const session_info& info = p.info;
    io_span_reader stored(file.last(static_cast<size_t>(info.stored_bytes)));  // parse checked the sizes
    payload_source src(stored, info.stored_bytes, info.payload_bytes, info.file_flags & session_flag_zstd,
                       nullptr);
    read(src, info);
    src.end_of_state();
    return info;
}

// A caller's room for the tokens, checked once the file is known to be intact (a damaged file is reported
// as damaged whatever the room).
void check_room(size_t n_tokens, size_t max_tokens) {
    if (n_tokens > max_tokens)
        throw error(errc::out_of_range,
                    fmt::format("the file holds {} tokens, room for {}", n_tokens, max_tokens));
}

namespace {

// A layout line as this version writes it: files written before the rename say "rotation=none" for what
// is now "hadamard=none" (no Hadamard rotation of quantised K/V; "rotation" read as "no RoPE").
std::string current_layout(std::string layout) {
    for (size_t at = 0; (at = layout.find(" rotation=none ", at)) != std::string::npos;)
        layout.replace(at, 15, " hadamard=none ");
    return layout;
}

}  // namespace

namespace {

// The first pass of load_file: the header, then the whole body through the checksum, a chunk at a time;
// the layout and the tokens are kept. Everything parse() checks, without holding the file.
session_info verify_file(const std::string& path, session_fields& fields) {
    io_file_reader f(path);
    const uint64_t size = f.size();
    check_limit("bytes in the file", "file_bytes", size, file_bytes_limit());  // before reading any
    std::vector<uint8_t> head(static_cast<size_t>(std::min<uint64_t>(size, session_header_size)));
    f.read(head.data(), head.size());
    fields = read_fields(head, size);
    session_info info = fields.info;
    xxh3_stream h;
    std::string layout(fields.layout_len, '\0');  // both within the file's size (read_fields)
    f.read(layout.data(), layout.size());
    h.update(layout.data(), layout.size());
    std::vector<uint8_t> tokens(size_t{fields.n_tokens} * 4);
    f.read(tokens.data(), tokens.size());
    h.update(tokens.data(), tokens.size());
    std::array<uint8_t, 18> frame_head{};  // the longest zstd frame header (ZSTD_FRAMEHEADERSIZE_MAX)
    hash_through(f, info.stored_bytes, h, frame_head);
    check_checksum(info, h.digest());
    check_body(info, layout, tokens,
               std::span(frame_head)
                   .first(static_cast<size_t>(std::min<uint64_t>(info.stored_bytes, frame_head.size()))));
    return info;
}

}  // namespace

session_info load_file(memory_i& mem, const std::string& path, seq_id_t dest, size_t max_tokens) {
    return about_file("load_file", path, [&] {
        session_fields fields;
        session_info info = verify_file(path, fields);
        check_room(info.tokens.size(), max_tokens);
        const std::string layout = mem.state_layout();
        if (current_layout(info.layout) != layout)
            throw error(errc::invalid_state,
                        fmt::format("session: layout mismatch: the file's is \"{}\", this memory's is \"{}\"",
                                    info.layout, layout));
        detail::check_payload_size(mem, info.payload_bytes, "session");  // before a byte is inflated
        // Second pass: the payload from the file into the memory's stage. The body is hashed again, so that
        // a file changed since the first pass is refused before the memory changes.
        io_file_reader f(path);
        if (f.size() != fields.before_payload + info.stored_bytes)
            bad_file(errc::corrupt_data, "the file changed while it was loaded");
        std::vector<uint8_t> head(session_header_size);
        f.read(head.data(), head.size());
        xxh3_stream h;
        hash_through(f, fields.before_payload - session_header_size, h, {});
        payload_source src(f, info.stored_bytes, info.payload_bytes, info.file_flags & session_flag_zstd, &h);
        check_state_seq_flags(info.state_flags);
        const state_stage_ptr stage = mem.state_stage(src, dest, info.state_flags);
        src.end_of_state();
        if (h.digest() != info.checksum) bad_file(errc::corrupt_data, "the file changed while it was loaded");
        mem.state_commit(*stage);
        return info;
    });
}

uint64_t save_llama_seq_file(const memory_i& mem, const std::string& path, seq_id_t seq_id,
                             std::span<const token_t> tokens) {
    return about_file("save_llama_seq_file", path, [&] {
        io_size_counter counter;
        mem.state_write(counter, seq_id, 0);  // checks seq_id before a file is made
        return write_file_atomically(path, [&](io_file_writer& f) {
            const uint32_t head[3] = {llama_seq_file_magic, llama_seq_file_version,
                                      static_cast<uint32_t>(tokens.size())};
            f.write(head, sizeof head);
            f.write(tokens.data(), tokens.size_bytes());
            mem.state_write(f, seq_id, 0);
        });
    });
}

std::vector<token_t> load_llama_seq_file(memory_i& mem, const std::string& path, seq_id_t dest,
                                         size_t max_tokens) {
    return about_file("load_llama_seq_file", path, [&] {
        io_file_reader f(path);  // one pass: the header, the tokens, then the payload into the stage
        const uint64_t size = f.size();
        check_limit("bytes in the file", "file_bytes", size, file_bytes_limit());  // before reading any
        std::vector<uint8_t> head(static_cast<size_t>(std::min<uint64_t>(size, 12)));
        f.read(head.data(), head.size());
        const uint32_t n_tokens = check_llama_header(head, size);
        std::vector<token_t> tokens(n_tokens);  // within the file's size (check_llama_header)
        f.read(tokens.data(), tokens.size() * sizeof(token_t));
        // No checksum: what can be checked is structure. A token is a vocabulary index, never negative.
        for (uint32_t i = 0; i < n_tokens; ++i)
            if (tokens[i] < 0)
                bad_file(errc::corrupt_data,
                         fmt::format("token {} of {} is {}, not a token id: the file is damaged", i, n_tokens,
                                     tokens[i]));
        const uint64_t payload = size - 12 - uint64_t{n_tokens} * 4;
        detail::check_payload_size(mem, payload, "session");
        payload_source src(f, payload, payload, false, nullptr);
        const state_stage_ptr stage = mem.state_stage(src, dest, 0);
        src.end_of_state();
        check_room(n_tokens, max_tokens);  // no checksum: the state's own checks tell a damaged file first
        mem.state_commit(*stage);
        return tokens;
    });
}

session_header read_session_header(const std::string& path) {
    return about_file("read_session_header", path, [&] {
        io_file_reader r(path);
        const uint64_t size = r.size();
        std::vector<uint8_t> bytes(static_cast<size_t>(std::min<uint64_t>(size, session_header_size)));
        r.read(bytes.data(), bytes.size());
        const std::span<const uint8_t> head(bytes);
        const uint32_t magic = size < 4 ? 0 : load_at<uint32_t>(head, 0);
        session_header h;
        if (magic == llama_seq_file_magic) {
            h.format = session_file_format::llama_seq;
            h.n_tokens = check_llama_header(head, size);
            h.version = llama_seq_file_version;
            return h;
        }
        if (magic != session_magic)
            bad_file(errc::corrupt_data,
                     fmt::format("neither a kvcache session file nor a llama.cpp sequence file: {}",
                                 size < 4 ? fmt::format("{} bytes", size) : what_else(magic)));
        check_session_header(head, size);
        h.format = session_file_format::kvcache;
        h.version = load_at<uint32_t>(head, off_version);
        h.n_tokens = load_at<uint32_t>(head, off_n_tokens);
        return h;
    });
}

}  // namespace kvc
