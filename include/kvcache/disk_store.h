/// @file
/// disk_block_store: a block_store_i in a local directory, one file per value, named by its key.
///
/// Files are written atomically (a temporary beside the target, fsync, rename, then one fsync of the
/// directory per put_many), so a crash or power loss leaves every file either absent or whole; a file
/// that is damaged all the same fails the check and is removed. The store keeps the size of every file
/// and their order of last use in memory, rebuilt at open from the directory (modification times; a hit
/// touches its file), and evicts the least recently used files to stay within max_bytes. One process
/// per directory: another process's files are seen at the next open.
#pragma once

#include <chrono>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include <kvcache/block_store.h>

namespace kvc {

/// How a disk_block_store is made.
struct disk_store_params {
    std::string dir;         ///< the directory (created if missing)
    uint64_t max_bytes = 0;  ///< the most bytes its files may take (0: no limit); the oldest go first
    /// The largest value stored or read (bigger files are refused without reading them).
    uint64_t max_value_bytes = uint64_t{1} << 30;
    block_value_check_fn check;  ///< refuses damaged or foreign values on read (empty: accept all)
    bool throw_errors = false;   ///< throw kvc::error(io) on I/O errors instead of counting them
};

/// A directory of values (disk_store.h).
class disk_block_store final : public block_store_i {
public:
    /// Opens (or creates) the directory and indexes its files: those named like a key (not temporaries),
    /// oldest first; removes temporaries whose writer is gone; evicts down to max_bytes. Throws
    /// kvc::error(io) when the directory cannot be created or listed.
    explicit disk_block_store(disk_store_params params);
    ~disk_block_store() override;                        ///< closes nothing: every call finishes its files
    disk_block_store(const disk_block_store&) = delete;  ///< not copyable
    disk_block_store& operator=(const disk_block_store&) = delete;  ///< not copyable

    size_t read_many(std::span<const std::string> keys, const block_value_fn& on_value) override;
    void put_many(std::span<const block_put> items) override;
    std::vector<uint8_t> contains_many(std::span<const std::string> keys) override;
    block_store_stats stats() const override;
    std::string describe() const override;

    uint64_t bytes() const;    ///< bytes of the files it holds now
    uint64_t entries() const;  ///< files it holds now

private:
    struct entry {
        uint64_t size = 0;
        std::list<std::string>::iterator lru;  // position in lru_ (front: next to go)
    };
    void fail(const std::string& what, int err);  // counts, logs the first of a kind, throws if asked
    bool evict_for(uint64_t need);                // evicts until need more bytes fit; false if they cannot
    void forget(const std::string& name, bool unlink_file);
    bool write_one(const std::string& name, std::span<const uint8_t> value);  // temporary, fsync, rename
    // reads an open file of the store into buf_; false (the file forgotten, the error counted) on failure
    bool read_one(const std::string& name, int fd, uint64_t size);

    disk_store_params p_;
    mutable std::mutex mu_;
    std::unordered_map<std::string, entry> files_;
    std::list<std::string> lru_;
    uint64_t bytes_ = 0;
    block_store_stats stats_;
    std::vector<uint8_t> buf_;  // the value read_many hands out (grows to the largest value read)
    bool logged_read_ = false, logged_write_ = false, logged_full_ = false;
};

}  // namespace kvc
