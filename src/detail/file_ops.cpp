#include "detail/file_ops.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>

namespace kvc::detail {

namespace {

constexpr file_ops system_ops{
    .open = [](const char* path, int flags, mode_t mode) { return ::open(path, flags, mode); },
    .read = ::read,
    .write = ::write,
    .pwrite = ::pwrite,
    .fstat = ::fstat,
    .fsync = ::fsync,
    .close = ::close,
    .rename = std::rename,
    .unlink = ::unlink,
    .opendir = ::opendir,
    .readdir = ::readdir,
    .closedir = ::closedir,
    .kill = ::kill,
};

}  // namespace

const file_ops& system_file_ops() {
    return system_ops;
}

// constinit: ready before any static initializer of another file could save or load
constinit file_ops file_io = system_ops;

}  // namespace kvc::detail
