#include <kvcache/redis/redis_store.h>

#include <hiredis/hiredis.h>
#include <signal.h>
#include <sys/time.h>

#include <algorithm>
#include <cerrno>
#include <ctime>
#include <string_view>
#include <vector>

#include <fmt/format.h>

namespace kvc {

namespace {

timeval to_timeval(uint32_t ms) {
    return {.tv_sec = static_cast<time_t>(ms / 1000), .tv_usec = static_cast<suseconds_t>(ms % 1000) * 1000};
}

struct reply_deleter {
    void operator()(redisReply* r) const { freeReplyObject(r); }
};
using reply_ptr = std::unique_ptr<redisReply, reply_deleter>;

// hiredis writes with write(2): a server that went away would raise SIGPIPE and kill the engine. The
// signal is blocked in this thread for the call and a SIGPIPE the call raised is taken back, so neither
// the process's handlers nor other threads change.
class sigpipe_guard {
public:
    sigpipe_guard() {
        sigemptyset(&pipe_);
        sigaddset(&pipe_, SIGPIPE);
        sigset_t pending;
        sigpending(&pending);
        was_pending_ = sigismember(&pending, SIGPIPE) == 1;
        pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
    }
    ~sigpipe_guard() {
        if (!was_pending_) {
            const timespec zero{};
            while (sigtimedwait(&pipe_, nullptr, &zero) > 0) {}
        }
        pthread_sigmask(SIG_SETMASK, &old_, nullptr);
    }
    sigpipe_guard(const sigpipe_guard&) = delete;
    sigpipe_guard& operator=(const sigpipe_guard&) = delete;

private:
    sigset_t pipe_{}, old_{};
    bool was_pending_ = false;
};

// What went wrong on a connection: hiredis reports a timeout as the EAGAIN of the socket's timeout.
std::string what_failed(const redisContext* c, uint32_t timeout_ms) {
    if (c->err == REDIS_ERR_IO && (errno == EAGAIN || errno == EWOULDBLOCK))
        return fmt::format("no answer within the command timeout of {} ms", timeout_ms);
    return c->errstr;
}

}  // namespace

struct redis_block_store::conn {
    redisContext* ctx = nullptr;
    conn() = default;
    ~conn() {
        if (ctx) redisFree(ctx);
    }
    conn(const conn&) = delete;
    conn& operator=(const conn&) = delete;
};

redis_block_store::redis_block_store(redis_store_params params) : p_(std::move(params)) {
    if (p_.host.empty()) throw error(errc::invalid_argument, "redis store: no host given");
    if (p_.port <= 0 || p_.port > 65535)
        throw error(errc::invalid_argument,
                    fmt::format("redis store: port {} is not in [1, 65535]", p_.port));
    if (p_.backoff_min_ms == 0 || p_.backoff_max_ms < p_.backoff_min_ms)
        throw error(
            errc::invalid_argument,
            fmt::format("redis store: back-off {}..{} ms: the minimum must be positive and at most the "
                        "maximum",
                        p_.backoff_min_ms, p_.backoff_max_ms));
    if (p_.connect_timeout_ms == 0 || p_.command_timeout_ms == 0)
        throw error(errc::invalid_argument,
                    "redis store: timeouts must be positive (no call may block for ever)");
    backoff_ms_ = p_.backoff_min_ms;
}

redis_block_store::~redis_block_store() = default;

std::string redis_block_store::describe() const {
    return fmt::format("redis:{}:{}", p_.host, p_.port);
}

bool redis_block_store::connected() const {
    const std::lock_guard lock(mu_);
    return c_ != nullptr;
}

block_store_stats redis_block_store::stats() const {
    const std::lock_guard lock(mu_);
    return stats_;
}

void redis_block_store::failed(const std::string& what) {
    c_.reset();
    ++stats_.errors;
    next_attempt_ = std::chrono::steady_clock::now() + std::chrono::milliseconds(backoff_ms_);
    backoff_ms_ = std::min(p_.backoff_max_ms, backoff_ms_ * 2);
    const std::string msg = fmt::format("redis store {}: {}", describe(), what);
    if (p_.throw_errors) throw error(errc::io, msg);
    if (!down_logged_) {
        down_logged_ = true;
        log(log_level::warn, msg +
                                 " (serving without it: misses until it answers; retrying with back-off; "
                                 "further errors are only counted)");
    }
}

void redis_block_store::succeeded() {
    ++stats_.round_trips;
    backoff_ms_ = p_.backoff_min_ms;
    if (down_logged_) {
        down_logged_ = false;
        log(log_level::info, fmt::format("redis store {}: answering again", describe()));
    }
}

bool redis_block_store::connect() {
    if (c_) return true;
    if (std::chrono::steady_clock::now() < next_attempt_) {
        ++stats_.errors;  // a call refused within the back-off: counted, not logged
        return false;
    }
    auto c = std::make_unique<conn>();
    c->ctx = redisConnectWithTimeout(p_.host.c_str(), p_.port, to_timeval(p_.connect_timeout_ms));
    if (!c->ctx) {
        failed("cannot allocate a connection");
        return false;
    }
    if (c->ctx->err) {
        failed(fmt::format("cannot connect: {}", c->ctx->errstr));
        return false;
    }
    if (redisSetTimeout(c->ctx, to_timeval(p_.command_timeout_ms)) != REDIS_OK) {
        failed("cannot set the command timeout");
        return false;
    }
    c_ = std::move(c);
    return true;
}

size_t redis_block_store::read_many(std::span<const std::string> keys, const block_value_fn& on_value) {
    const std::lock_guard lock(mu_);
    const block_store_call_timer timer(stats_);
    stats_.lookups += keys.size();
    if (keys.empty() || !connect()) return 0;
    std::vector<std::string> names;
    names.reserve(keys.size());
    std::vector<const char*> argv{"MGET"};
    std::vector<size_t> argl{4};
    for (const std::string& k : keys) {
        names.push_back(p_.key_prefix + k);
        argv.push_back(names.back().data());
        argl.push_back(names.back().size());
    }
    const sigpipe_guard guard;
    const reply_ptr r(static_cast<redisReply*>(
        redisCommandArgv(c_->ctx, static_cast<int>(argv.size()), argv.data(), argl.data())));
    if (!r) {
        failed(fmt::format("MGET of {} keys: {}", keys.size(), what_failed(c_->ctx, p_.command_timeout_ms)));
        return 0;
    }
    if (r->type != REDIS_REPLY_ARRAY || r->elements != keys.size()) {
        failed(r->type == REDIS_REPLY_ERROR
                   ? fmt::format("MGET: {}", std::string_view(r->str, r->len))
                   : fmt::format("MGET of {} keys: a reply of type {} with {} elements", keys.size(), r->type,
                                 r->elements));
        return 0;
    }
    succeeded();
    size_t found = 0;
    for (size_t i = 0; i < keys.size(); ++i) {
        const redisReply* e = r->element[i];
        if (e->type != REDIS_REPLY_STRING) continue;  // nil: absent (or expired)
        const std::span<const uint8_t> v(reinterpret_cast<const uint8_t*>(e->str), e->len);
        if (v.empty() || v.size() > p_.max_value_bytes || (p_.check && !p_.check(keys[i], v))) {
            ++stats_.damaged;
            continue;
        }
        ++stats_.hits;
        stats_.bytes_in += v.size();
        ++found;
        on_value(i, v);  // straight from the reply's buffer
    }
    return found;
}

void redis_block_store::put_many(std::span<const block_put> items) {
    for (const block_put& it : items)
        if (it.value.empty())
            throw error(errc::invalid_argument, fmt::format("redis store: empty value for '{}'", it.key));
    const std::lock_guard lock(mu_);
    const block_store_call_timer timer(stats_);
    if (items.empty() || !connect()) return;
    const std::string ttl = std::to_string(p_.ttl_seconds);
    const sigpipe_guard guard;
    size_t sent = 0;
    uint64_t bytes = 0;
    for (const block_put& it : items) {
        if (it.value.size() > p_.max_value_bytes) {
            ++stats_.skipped;
            continue;
        }
        const std::string name = p_.key_prefix + std::string(it.key);
        const char* argv[] = {"SET", name.data(), reinterpret_cast<const char*>(it.value.data()), "EX",
                              ttl.data()};
        const size_t argl[] = {3, name.size(), it.value.size(), 2, ttl.size()};
        if (redisAppendCommandArgv(c_->ctx, p_.ttl_seconds ? 5 : 3, argv, argl) != REDIS_OK) {
            failed(fmt::format("SET '{}': {}", name, c_->ctx->errstr));
            return;
        }
        ++sent;
        bytes += it.value.size();
    }
    if (sent == 0) return;
    size_t stored = 0;
    std::string refused;  // the first error reply (e.g. OOM: maxmemory reached with noeviction)
    for (size_t i = 0; i < sent; ++i) {
        void* raw = nullptr;
        if (redisGetReply(c_->ctx, &raw) != REDIS_OK) {
            failed(fmt::format("pipeline of {} SETs, reply {}: {}", sent, i,
                               what_failed(c_->ctx, p_.command_timeout_ms)));
            stats_.puts += stored;
            return;
        }
        const reply_ptr r(static_cast<redisReply*>(raw));
        if (r->type == REDIS_REPLY_ERROR) {
            if (refused.empty()) refused.assign(r->str, r->len);
        } else {
            ++stored;
        }
    }
    succeeded();
    stats_.puts += stored;
    stats_.bytes_out += bytes;
    if (!refused.empty()) {
        // the server answered but refused values (full): counted per value, logged once, connection kept
        stats_.errors += sent - stored;
        const std::string msg = fmt::format("redis store {}: {} of {} SETs refused: {}", describe(),
                                            sent - stored, sent, refused);
        if (p_.throw_errors) throw error(errc::io, msg);
        if (!down_logged_) {
            down_logged_ = true;  // reset (with an "answering again") by the next call that succeeds
            log(log_level::warn, msg + " (further errors are only counted)");
        }
    }
}

std::vector<uint8_t> redis_block_store::contains_many(std::span<const std::string> keys) {
    const std::lock_guard lock(mu_);
    const block_store_call_timer timer(stats_);
    std::vector<uint8_t> out(keys.size());
    if (keys.empty() || !connect()) return out;
    const sigpipe_guard guard;
    for (const std::string& k : keys) {
        const std::string name = p_.key_prefix + k;
        const char* argv[] = {"EXISTS", name.data()};
        const size_t argl[] = {6, name.size()};
        if (redisAppendCommandArgv(c_->ctx, 2, argv, argl) != REDIS_OK) {
            failed(fmt::format("EXISTS '{}': {}", name, c_->ctx->errstr));
            return out;
        }
    }
    for (size_t i = 0; i < keys.size(); ++i) {
        void* raw = nullptr;
        if (redisGetReply(c_->ctx, &raw) != REDIS_OK) {
            failed(fmt::format("pipeline of {} EXISTS, reply {}: {}", keys.size(), i,
                               what_failed(c_->ctx, p_.command_timeout_ms)));
            std::fill(out.begin(), out.end(), 0);
            return out;
        }
        const reply_ptr r(static_cast<redisReply*>(raw));
        out[i] = r->type == REDIS_REPLY_INTEGER && r->integer > 0 ? 1 : 0;
    }
    succeeded();
    return out;
}

}  // namespace kvc
