// libFuzzer target: arbitrary bytes as state buffers restored into small caches (whole memory and one
// sequence, unified and per-sequence streams, transposed V and quantised types). A rejected buffer must
// leave the cache byte for byte as it was; an accepted one must save back to a buffer that restores.
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include <kvcache/kv_cache.h>
#include <kvcache/state.h>

namespace {

kvc::kv_cache_params shape(int variant) {
    kvc::kv_cache_params p;
    p.layers = {kvc::layer_desc{.n_head_kv = 1, .n_embd_head_k = 32, .n_embd_head_v = 32}};
    p.kv_size = 8;
    p.n_seq_max = 2;
    p.unified = variant % 2 == 0;
    p.type_k = variant / 2 == 0 ? kvc::dtype::f16 : kvc::dtype::q8_0;
    p.type_v = variant / 2 == 0 ? kvc::dtype::f16 : kvc::dtype::q4_0;
    p.v_trans = variant / 2 == 0;
    p.n_pos = variant == 3 ? 4 : 1;
    return p;
}

// A cache with a little content, so that "unchanged" means something.
std::unique_ptr<kvc::kv_cache> make(int variant) {
    auto c = std::make_unique<kvc::kv_cache>(shape(variant));
    kvc::ubatch u;
    u.n_tokens = 2;
    u.n_seq_tokens = 1;
    u.n_seqs = 2;
    u.n_pos = c->params().n_pos;
    u.pos.assign(2 * size_t{u.n_pos}, 1);
    u.pos[0] = 0;
    u.seq_id_begin = {0, 1, 2};
    u.n_seq_id = {1, 1};
    u.seq_id_data = {0, 0};
    u.seq_id_unq = {0};
    u.n_seqs_unq = 1;
    u.output = {0, 0};
    c->apply_ubatch(c->find_slot(u), u);
    return c;
}

void check(bool ok) {
    if (!ok) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size < 1) return 0;
    const int variant = data[0] % 4;
    const kvc::seq_id_t dest = (data[0] >> 2) % 3 == 2 ? kvc::seq_all : (data[0] >> 2) % 3;
    std::vector<uint8_t> buf = {0xd8, 0x3c, 0x14, 0xaf, 0, 0, 0, 0};  // magic + source id: reach the payload
    buf.insert(buf.end(), data + 1, data + size);
    auto c = make(variant);
    const std::vector<uint8_t> before = kvc::state_seq_get_data(*c, kvc::seq_all);
    try {
        kvc::state_seq_set_data(*c, buf, dest);
    } catch (const kvc::error&) {
        check(kvc::state_seq_get_data(*c, kvc::seq_all) == before);
        return 0;
    }
    const std::vector<uint8_t> saved = kvc::state_seq_get_data(*c, kvc::seq_all);
    auto fresh = make(variant);
    kvc::state_seq_set_data(*fresh, saved, kvc::seq_all);  // must not throw
    check(kvc::state_seq_get_data(*fresh, kvc::seq_all) == saved);
    return 0;
}
