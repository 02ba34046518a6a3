// The POSIX calls behind session files (io_file_writer, io_file_reader, write_file_atomically), as a table
// of function pointers. Production uses the system's calls (one indirect call per system call, nothing
// else); tests swap the table to fail or "crash" the Nth call (tests/test_file_ops.cpp, in the spirit of
// SQLite's I/O error and crash tests). Not public: only the core and its tests see src/detail/.
#pragma once

#include <dirent.h>
#include <sys/stat.h>
#include <sys/types.h>

#include <cstddef>

namespace kvc::detail {

struct file_ops {
    int (*open)(const char* path, int flags, mode_t mode);  // open(2) with its mode always given
    ssize_t (*read)(int fd, void* dst, size_t n);
    ssize_t (*write)(int fd, const void* src, size_t n);
    ssize_t (*pwrite)(int fd, const void* src, size_t n, off_t offset);
    int (*fstat)(int fd, struct stat* st);
    int (*fsync)(int fd);
    int (*close)(int fd);
    int (*rename)(const char* from, const char* to);
    int (*unlink)(const char* path);
    // the stale-temporary cleanup of a save: listing the target's directory, asking whether a PID lives
    DIR* (*opendir)(const char* path);
    struct dirent* (*readdir)(DIR* d);
    int (*closedir)(DIR* d);
    int (*kill)(pid_t pid, int sig);
};

/// The system's calls.
const file_ops& system_file_ops();

/// The table every file operation of the core goes through (system_file_ops() unless a test swapped it).
/// Swap it only while no file operation runs.
extern file_ops file_io;

}  // namespace kvc::detail
