"""Creating every memory kind from parameters, and what bad parameters raise."""
import pytest

import kvcache
from conftest import layers, small_cache


def test_kv_cache_from_params_and_kwargs():
    p = kvcache.KVCacheParams(layers=layers(3, head=32), kv_size=32, type_k="q8_0", type_v="f16", n_seq_max=2,
                              unified=False)
    c = kvcache.KVCache(p)
    assert c.size == 32 and c.n_stream == 2 and c.n_seq_max == 2
    assert c.params.type_k == kvcache.dtype.q8_0 and c.params.auto_update  # Python's default
    assert c.layer_ids == [0, 1, 2]
    # K: 3 layers x 2 streams x 32 cells x 2 heads x 34-byte blocks; V: 64 values of f16
    assert c.size_k_bytes == 3 * 2 * 32 * 2 * 34 and c.size_v_bytes == 3 * 2 * 32 * 64 * 2
    assert c.size_bytes == c.size_k_bytes + c.size_v_bytes > 0
    assert "kv streams=2" in c.layout
    k = kvcache.KVCache(layers=layers(1), kv_size=16)
    assert k.size == 16 and k.params.type_k == kvcache.dtype.f16


def test_bad_params_name_the_field():
    with pytest.raises(kvcache.InvalidArgumentError) as e:
        kvcache.KVCache(layers=layers(1, head=100), type_k="q4_0", kv_size=16)
    assert e.value.status == "invalid_argument" and e.value.code == 1
    assert "100" in str(e.value)
    with pytest.raises(ValueError):  # InvalidArgumentError is also a ValueError
        kvcache.KVCache(layers=layers(1), kv_size=0)
    with pytest.raises(kvcache.InvalidArgumentError, match="not one of f32, f16, bf16, q8_0, q4_0"):
        kvcache.KVCacheParams(type_k="f64")
    with pytest.raises(TypeError, match="no field 'kv_sise'"):
        kvcache.KVCacheParams(kv_sise=3)
    with pytest.raises(kvcache.OutOfMemoryError):
        kvcache.KVCache(layers=layers(1), kv_size=1 << 20, memory_budget=1024)


def test_filter_callable():
    c = kvcache.KVCache(layers=layers(4), kv_size=16, filter=lambda il: il % 2 == 0)
    assert c.layer_ids == [0, 2]
    assert c.has_layer(2) and not c.has_layer(1)


def test_iswa():
    ls = layers(4)
    for i in (1, 3):
        ls[i].is_swa = True
    p = kvcache.KVCacheISWAParams(kv=kvcache.KVCacheParams(layers=ls, kv_size=1024, n_swa=8, swa="standard"),
                                  sizing=kvcache.ISWASizing(swa_full=False, n_ubatch=16))
    m = kvcache.KVCacheISWA(p)
    assert isinstance(m.base, kvcache.KVCache) and isinstance(m.swa, kvcache.KVCache)
    assert m.base.layer_ids == [0, 2] and m.swa.layer_ids == [1, 3]
    assert m.swa.size == 256 and m.base.size == 1024  # roundup(8 + 16, 256)
    assert m.layout.startswith("iswa base=")
    with pytest.raises(kvcache.InvalidArgumentError):  # no SWA rule
        kvcache.KVCacheISWA(kv=kvcache.KVCacheParams(layers=ls, kv_size=256))


def test_recurrent_and_hybrid():
    r = kvcache.MemoryRecurrent(layers=[kvcache.RecurrentLayerDesc(n_embd_r=6, n_embd_s=4)] * 2, n_seq_max=3,
                                n_rs_seq=2)
    assert r.size == 3 and r.n_rs_seq == 2 and r.has_r(1) and r.has_s(0)
    assert r.get_r(0).shape == (3, 3, 6)  # [1 + n_rs_seq planes, cells, n_embd_r]
    with pytest.raises(kvcache.InvalidArgumentError):
        kvcache.MemoryRecurrent(layers=[kvcache.RecurrentLayerDesc(n_embd_r=4)], type_r="q8_0")
    attn_layers = layers(2)
    attn_layers[0].has_kv = False
    h = kvcache.MemoryHybrid(
        attn=kvcache.KVCacheParams(layers=attn_layers, kv_size=32, n_seq_max=2),
        recr=kvcache.RecurrentParams(layers=[kvcache.RecurrentLayerDesc(n_embd_r=4, n_embd_s=4),
                                             kvcache.RecurrentLayerDesc()], n_seq_max=2))
    assert isinstance(h.attn, kvcache.KVCache) and isinstance(h.recr, kvcache.MemoryRecurrent)
    assert h.attn.layer_ids == [1] and h.recr.layer_ids == [0]
    with pytest.raises(kvcache.InvalidArgumentError, match="n_seq_max"):
        kvcache.MemoryHybrid(attn=kvcache.KVCacheParams(layers=attn_layers, kv_size=32, n_seq_max=2),
                             recr=kvcache.RecurrentParams(layers=[kvcache.RecurrentLayerDesc(n_embd_r=4)] * 2,
                                                          n_seq_max=3))


def test_parts_keep_the_memory_alive():
    ls = layers(2)
    ls[1].is_swa = True
    m = kvcache.KVCacheISWA(kv=kvcache.KVCacheParams(layers=ls, kv_size=64, n_swa=4, swa="standard"))
    base = m.base
    del m
    assert base.size == 64 and base.seq_pos_max(0) == -1


def test_breakdown_and_sizes():
    c = small_cache()
    b = c.memory_breakdown()
    assert b.reserved == c.size_bytes and b.used == 0 and len(b.seq) == 4
    from conftest import fill
    fill(c, [1, 2, 3])
    b = c.memory_breakdown()
    assert b.used > 0 and b.seq[0] == b.used and b.seq[1] == 0
    assert c.used_cells() == 3
