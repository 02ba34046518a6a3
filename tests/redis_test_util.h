// A redis-server that a test starts itself: on a free port of 127.0.0.1, with a temporary directory, no
// persistence; killed (SIGKILL) or stopped (SIGSTOP) at will. Tests that need one skip (GTEST_SKIP) with a
// message when no redis-server binary is on PATH or it does not come up.
#pragma once

#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

namespace kvc::test {

// A port nothing listens on now (the kernel's choice for port 0).
inline int free_port() {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    socklen_t len = sizeof a;
    int port = 0;
    if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
        port = ntohs(a.sin_port);
    ::close(fd);
    return port;
}

inline bool have_redis_server() {
    return std::system("command -v redis-server >/dev/null 2>&1") == 0;
}

class redis_server {
public:
    // Starts a server (on `port`, or a free one); ok() tells whether it answers.
    explicit redis_server(int port = 0) : port_(port ? port : free_port()) {
        dir_ = std::filesystem::temp_directory_path() / fmt::format("kvc-redis-{}-{}", ::getpid(), port_);
        std::filesystem::create_directories(dir_);
        start();
    }
    ~redis_server() {
        stop();
        std::error_code ec;
        std::filesystem::remove_all(dir_, ec);
    }
    redis_server(const redis_server&) = delete;
    redis_server& operator=(const redis_server&) = delete;

    bool ok() const { return ok_; }
    int port() const { return port_; }
    pid_t pid() const { return pid_; }

    void kill9() {
        if (pid_ > 0) {
            ::kill(pid_, SIGKILL);
            ::waitpid(pid_, nullptr, 0);
            pid_ = -1;
        }
    }
    void pause() { ::kill(pid_, SIGSTOP); }
    void resume() { ::kill(pid_, SIGCONT); }
    void restart() {
        kill9();
        start();
    }

    // A command on a connection of the test's own (hiredis), e.g. INFO commandstats; the reply as text.
    std::string command(const std::vector<std::string>& args) const {
        redisContext* c = redisConnectWithTimeout("127.0.0.1", port_, {.tv_sec = 2, .tv_usec = 0});
        if (!c || c->err) {
            if (c) redisFree(c);
            return "";
        }
        std::vector<const char*> argv;
        std::vector<size_t> argl;
        for (const std::string& a : args) {
            argv.push_back(a.data());
            argl.push_back(a.size());
        }
        auto* r = static_cast<redisReply*>(
            redisCommandArgv(c, static_cast<int>(argv.size()), argv.data(), argl.data()));
        std::string out;
        if (r &&
            (r->type == REDIS_REPLY_STRING || r->type == REDIS_REPLY_STATUS || r->type == REDIS_REPLY_ERROR))
            out.assign(r->str, r->len);
        else if (r && r->type == REDIS_REPLY_INTEGER)
            out = std::to_string(r->integer);
        if (r) freeReplyObject(r);
        redisFree(c);
        return out;
    }

    // calls=N of one command in INFO commandstats (0 when it never ran)
    long calls(const std::string& cmd) const {
        const std::string info = command({"INFO", "commandstats"});
        const std::string tag = "cmdstat_" + cmd + ":calls=";
        const size_t at = info.find(tag);
        return at == std::string::npos ? 0 : std::stol(info.substr(at + tag.size()));
    }

private:
    void start() {
        ok_ = false;
        pid_ = ::fork();
        if (pid_ == 0) {
            const std::string port = std::to_string(port_), dir = dir_.string(), log = dir + "/redis.log";
            ::execlp("redis-server", "redis-server", "--port", port.c_str(), "--bind", "127.0.0.1", "--save",
                     "", "--appendonly", "no", "--dir", dir.c_str(), "--daemonize", "no", "--loglevel",
                     "warning", "--logfile", log.c_str(), "--protected-mode", "no",
                     static_cast<char*>(nullptr));
            ::_exit(127);
        }
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
        while (std::chrono::steady_clock::now() < until) {
            if (::waitpid(pid_, nullptr, WNOHANG) == pid_) {  // exited: no binary, or the port is taken
                pid_ = -1;
                return;
            }
            if (command({"PING"}) == "PONG") {
                ok_ = true;
                return;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
    }
    void stop() {
        if (pid_ > 0) {
            ::kill(pid_, SIGCONT);
            kill9();
        }
    }

    int port_;
    std::filesystem::path dir_;
    pid_t pid_ = -1;
    bool ok_ = false;
};

}  // namespace kvc::test

// Skips the test, saying why, when no server could be started.
#define KVC_REQUIRE_REDIS(server)                                                                     \
    do {                                                                                              \
        if (!kvc::test::have_redis_server())                                                          \
            GTEST_SKIP() << "no redis-server on PATH (apt-get install redis-server)";                 \
        if (!(server).ok()) GTEST_SKIP() << "redis-server did not start on port " << (server).port(); \
    } while (0)
