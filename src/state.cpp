#include <cstring>

#include <fmt/format.h>
#include <kvcache/state.h>

namespace kvc {

void io_vector_writer::write(const void* src, size_t size) {
    const auto* p = static_cast<const uint8_t*>(src);
    out_->insert(out_->end(), p, p + size);
    n_ += size;
}

void io_span_writer::write(const void* src, size_t size) {
    if (size > dst_.size() - n_)
        throw error(errc::out_of_range,
                    fmt::format("state: buffer of {} bytes is too small ({} more needed at byte {})",
                                dst_.size(), size - (dst_.size() - n_), n_));
    if (size) std::memcpy(dst_.data() + n_, src, size);
    n_ += size;
}

void io_span_reader::read(void* dst, size_t size) {
    if (size > src_.size() - n_)
        throw error(errc::corrupt_data, fmt::format("state: truncated at byte {}: {} bytes needed, {} left",
                                                    n_, size, src_.size() - n_));
    if (size) std::memcpy(dst, src_.data() + n_, size);
    n_ += size;
}

size_t state_seq_get_size(const memory_i& mem, seq_id_t seq_id, state_seq_flags flags) {
    io_size_counter counter;
    mem.state_write(counter, seq_id, flags);
    return 8 + counter.n_bytes();
}

std::vector<uint8_t> state_seq_get_data(const memory_i& mem, seq_id_t seq_id, state_seq_flags flags) {
    std::vector<uint8_t> out;
    io_vector_writer w(out);
    const uint32_t magic = state_seq_magic;
    w.write(&magic, 4);
    w.write(&seq_id, 4);
    mem.state_write(w, seq_id, flags);
    return out;
}

size_t state_seq_set_data(memory_i& mem, std::span<const uint8_t> data, seq_id_t dest,
                          state_seq_flags flags) {
    io_span_reader r(data);
    uint32_t magic = 0;
    seq_id_t source = 0;
    r.read(&magic, 4);
    if (magic != state_seq_magic)
        throw error(errc::corrupt_data,
                    fmt::format("state: not a sequence state (magic {:#010x}, expected {:#010x})", magic,
                                state_seq_magic));
    r.read(&source, 4);
    // Check first (nothing changes), including that the payload ends with the buffer; then restore.
    mem.state_check(r, dest, flags);
    if (r.remaining() != 0)
        throw error(errc::corrupt_data, fmt::format("state: {} trailing bytes after the state at byte {}",
                                                    r.remaining(), r.n_bytes()));
    io_span_reader again(data.subspan(8));
    mem.state_read(again, dest, flags);
    return data.size();
}

}  // namespace kvc
