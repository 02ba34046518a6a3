// The Redis block store from an installed kvcache (kvcache::redis, or pkg-config kvcache-redis): a store
// on a server that is not there is a miss, counted and logged once, never an error the engine sees
// (docs/tiers.md). Give a port where a redis-server listens as the first argument to see a round trip.
// Exit status 0 when every check passed.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <kvcache/redis/redis_store.h>

int main(int argc, char** argv) {
    kvc::redis_store_params p;
    p.port = argc > 1 ? std::atoi(argv[1]) : 1;  // port 1: nothing listens
    p.key_prefix = "kvcache-example:";
    p.connect_timeout_ms = 100;
    kvc::redis_block_store store(p);
    const std::vector<uint8_t> value{1, 2, 3};
    const std::string key = "kvcb1-example";
    store.put_many(std::vector<kvc::block_put>{{key, value}});
    const std::vector<std::vector<uint8_t>> got = store.get_many(std::vector<std::string>{key});
    const kvc::block_store_stats s = store.stats();
    const bool up = argc > 1;
    const bool ok = up ? got[0] == value && s.errors == 0 : got[0].empty() && s.errors >= 1;
    std::printf("%s: %s; %llu calls, %llu errors, %llu round trips\n", store.describe().c_str(),
                ok ? "ok" : "FAILED", static_cast<unsigned long long>(s.calls),
                static_cast<unsigned long long>(s.errors), static_cast<unsigned long long>(s.round_trips));
    return ok ? 0 : 1;
}
