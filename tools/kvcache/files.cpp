#include "files.h"

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include <kvcache/types.h>

namespace kvc::cli {

namespace {

[[noreturn]] void fail(std::string_view verb, std::string_view what, const std::string& path) {
    const int err = errno;
    throw error(errc::io, fmt::format("cannot {} {} '{}': {}", verb, what, path,
                                      err != 0 ? std::strerror(err) : "an I/O error"));
}

}  // namespace

std::ifstream open_read(const std::string& path, std::string_view what, bool binary) {
    errno = 0;
    std::ifstream f(path, binary ? std::ios::in | std::ios::binary : std::ios::in);
    if (!f) fail("open", what, path);
    return f;
}

std::ofstream open_write(const std::string& path, std::string_view what) {
    errno = 0;
    std::ofstream f(path, std::ios::out | std::ios::binary | std::ios::trunc);
    if (!f) fail("open", what, path);
    return f;
}

void finish_write(std::ofstream& f, const std::string& path, std::string_view what) {
    // A write that failed before left its reason in errno
    if (f.good()) errno = 0;
    f.close();
    if (!f) fail("write", what, path);
}

void write_file(const std::string& path, std::string_view what, std::string_view bytes) {
    std::ofstream f = open_write(path, what);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    finish_write(f, path, what);
}

}  // namespace kvc::cli
