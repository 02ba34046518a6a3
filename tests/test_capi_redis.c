/* kvc_redis_store_new (kvcache_redis's <kvcache/redis/kvcache_redis.h>) from C11: a KV cache writes its
 * blocks through to a redis-server the test starts itself (a free port of 127.0.0.1, no persistence) and
 * a fresh memory over a fresh store attaches them; a server that is down is a counted miss; bad
 * parameters are refused. Exits 77 (skipped) without redis-server on PATH, or when it does not start. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp, kill, nanosleep */
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <kvcache/kvcache.h>
#include <kvcache/redis/kvcache_redis.h>

#include "capi_test.h"

extern char** environ;

/* A port nothing listens on now (the kernel's choice for port 0). */
static int free_port(void) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    int port = 0;
    if (bind(fd, (struct sockaddr*)&a, sizeof a) == 0 && getsockname(fd, (struct sockaddr*)&a, &len) == 0)
        port = ntohs(a.sin_port);
    close(fd);
    return port;
}

static int answers(int port) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons((uint16_t)port);
    const int ok = connect(fd, (struct sockaddr*)&a, sizeof a) == 0;
    close(fd);
    return ok;
}

static void sleep_ms(long ms) {
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

/* Starts redis-server on port in dir; its pid, or 0 when it does not answer within 5 s. */
static pid_t start_server(int port, const char* dir) {
    char port_s[16];
    snprintf(port_s, sizeof port_s, "%d", port);
    char* argv[] = {"redis-server", "--port", port_s,  "--bind",   "127.0.0.1",   "--save", "",
                    "--appendonly", "no",     "--dir", (char*)dir, "--daemonize", "no",     NULL};
    posix_spawn_file_actions_t fa; /* the server's log is not the test's */
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    pid_t pid = 0;
    const int err = posix_spawnp(&pid, "redis-server", &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    if (err != 0) return 0;
    for (int i = 0; i < 500; ++i) {
        if (answers(port)) return pid;
        sleep_ms(10);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    return 0;
}

static kvc_batch* tok_batch(int32_t seq, int32_t p0, int32_t p1, int32_t base) {
    kvc_batch* b = kvc_batch_init(p1 - p0, 0, 1);
    for (int32_t p = p0; p < p1; ++p) CHECK_OK(kvc_batch_add(b, base + p, p, &seq, 1, p == p1 - 1));
    return b;
}

static kvc_memory* tiered_cache(kvc_block_store* store) {
    kvc_kv_cache_params p = small_params(16, 1);
    p.prefix.enabled = true;
    p.prefix.block_size = 4;
    p.prefix.tiers.stores = &store;
    p.prefix.tiers.n_stores = 1;
    p.prefix.tiers.model_id = 5;
    p.prefix.tiers.write = KVC_TIER_WRITE_THROUGH;
    kvc_memory* mem = NULL;
    CHECK_OK(kvc_kv_cache_create(&p, &mem));
    return mem;
}

static kvc_block_store* redis_store(int port) {
    kvc_redis_store_params rp = kvc_redis_store_default_params();
    CHECK(strcmp(rp.host, "127.0.0.1") == 0 && rp.port == 6379 && strcmp(rp.key_prefix, "kvc:") == 0);
    rp.port = port;
    rp.key_prefix = "capi:";
    kvc_block_store* store = NULL;
    CHECK_OK(kvc_redis_store_new(&rp, &store));
    return store;
}

static void test_through_redis(int port) {
    kvc_block_store* store = redis_store(port);
    kvc_memory* mem = tiered_cache(store);
    kvc_block_store_free(store);
    kvc_batch* b = tok_batch(0, 0, 13, 100);
    decode(mem, b, 16);
    kvc_batch_free(b);
    CHECK_OK(kvc_memory_prefix_publish(mem));
    kvc_tier_stats ts;
    CHECK_OK(kvc_memory_get_tier_stats(mem, 0, &ts));
    char where[64];
    snprintf(where, sizeof where, "redis:127.0.0.1:%d", port);
    CHECK(strcmp(ts.where, where) == 0);
    CHECK(ts.written_blocks == 3 && ts.store.puts == 3 && ts.store.round_trips >= 1 && ts.store.errors == 0);
    kvc_memory_free(mem);

    /* another engine: a fresh store and memory attach the prompt from the server */
    store = redis_store(port);
    mem = tiered_cache(store);
    int32_t prompt[13];
    for (int i = 0; i < 13; ++i) prompt[i] = 100 + i;
    uint32_t n = 0;
    CHECK_OK(kvc_memory_prefix_attach(mem, 0, prompt, 13, 0, 50, &n));
    CHECK(n == 12);
    kvc_prefix_stats ps;
    CHECK_OK(kvc_memory_get_prefix_stats(mem, &ps));
    CHECK(ps.tier_fetched_blocks == 3);
    kvc_block_store_stats ss;
    CHECK_OK(kvc_block_store_get_stats(store, &ss));
    CHECK(ss.hits == 3 && ss.round_trips >= 1 && ss.bytes_in > 0);
    kvc_memory_free(mem);
    kvc_block_store_free(store);
}

/* No server: misses, counted as errors; the attach recomputes. */
static void test_server_down(int port) {
    kvc_redis_store_params rp = kvc_redis_store_default_params();
    rp.port = port;
    rp.connect_timeout_ms = 50;
    kvc_block_store* store = NULL;
    CHECK_OK(kvc_redis_store_new(&rp, &store));
    kvc_memory* mem = tiered_cache(store);
    int32_t prompt[9];
    for (int i = 0; i < 9; ++i) prompt[i] = 100 + i;
    uint32_t n = 99;
    CHECK_OK(kvc_memory_prefix_attach(mem, 0, prompt, 9, 0, 50, &n));
    CHECK(n == 0);
    kvc_block_store_stats ss;
    CHECK_OK(kvc_block_store_get_stats(store, &ss));
    CHECK(ss.errors >= 1 && ss.hits == 0);
    kvc_memory_free(mem);
    kvc_block_store_free(store);
}

static void test_bad_params(void) {
    kvc_redis_store_params rp = kvc_redis_store_default_params();
    kvc_block_store* store = (kvc_block_store*)1;
    CHECK_ERR(kvc_redis_store_new(NULL, &store), KVC_ERR_INVALID_ARGUMENT,
              "kvc_redis_store_new: params is NULL");
    CHECK(store == NULL);
    CHECK_ERR(kvc_redis_store_new(&rp, NULL), KVC_ERR_INVALID_ARGUMENT, "out is NULL");
    rp.port = 0;
    CHECK_ERR(kvc_redis_store_new(&rp, &store), KVC_ERR_INVALID_ARGUMENT, "port 0 is not in [1, 65535]");
    rp.port = 6379;
    rp.host = "";
    CHECK_ERR(kvc_redis_store_new(&rp, &store), KVC_ERR_INVALID_ARGUMENT, "params.host is NULL or empty");
    CHECK(store == NULL);
}

int main(void) {
    test_bad_params();
    test_server_down(free_port());
    if (system("command -v redis-server >/dev/null 2>&1") != 0) {
        printf("capi_redis: skipped: no redis-server on PATH (apt-get install redis-server)\n");
        return 77;
    }
    char dir[] = "/tmp/kvc-capi-redis-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    const int port = free_port();
    const pid_t pid = start_server(port, dir);
    if (pid == 0) {
        printf("capi_redis: skipped: redis-server did not start on port %d\n", port);
        rmdir(dir);
        return 77;
    }
    test_through_redis(port);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0);
    return capi_report("capi_redis");
}
