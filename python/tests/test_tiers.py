"""Tiers of the prefix cache from Python: a DiskStore below a KVCache, blocks evicted to it and attached
back by a fresh cache (a restart), the counters, and bad parameters."""
import pytest

import kvcache
from conftest import fill, small_cache


def tiered_cache(stores, model_id=42, write="on_evict"):
    tiers = kvcache.PrefixTierParams(stores=stores, model_id=model_id, write=write)
    prefix = kvcache.PrefixCacheParams(enabled=True, block_size=4, tiers=tiers)
    return small_cache(kv_size=16, n_seq_max=1, n_kv_pad=4, prefix=prefix)


def test_disk_store_evicts_then_a_fresh_cache_attaches(tmp_path):
    store = kvcache.DiskStore(tmp_path / "blocks", max_bytes=1 << 20)
    assert store.describe() == "disk:" + str(tmp_path / "blocks") and store.entries == 0
    c = tiered_cache([store])
    assert c.params.prefix.tiers.model_id == 42 and len(c.params.prefix.tiers.stores) == 1
    prompt = list(range(1, 14))  # 3 whole blocks of 4, and one token
    fill(c, prompt)
    c.prefix_publish()
    state = c.state_get(0)
    c.seq_rm(0)
    assert c.tier_stats()[0].written_blocks == 0  # on_evict: memory still holds them
    fill(c, list(range(100, 116)), start=0)  # every cell: the cached blocks are evicted, to the store
    s = c.prefix_stats()
    assert s.evicted_blocks == 3 and s.tier_written_blocks == 3 and s.tier_fetched_blocks == 0
    (t,) = c.tier_stats()
    assert t.where == store.describe() and t.written_blocks == 3 and t.errors == 0
    assert t.store.puts == 3 and store.entries == 3 and store.bytes > 0
    del c

    # a fresh store over the directory and a fresh cache (another run): the prompt is attached from disk
    store = kvcache.DiskStore(str(tmp_path / "blocks"))
    assert store.entries == 3
    c = tiered_cache([store])
    assert c.prefix_attach(0, prompt) == 12
    fill(c, prompt[12:])
    assert c.state_get(0) == state  # the rows the first cache computed
    s = c.prefix_stats()
    assert s.tier_fetched_blocks == 3 and s.hit_tokens == 12
    (t,) = c.tier_stats()
    assert t.fetches == 1 and t.fetched_blocks == 3 and t.refused_blocks == 0
    st = store.stats()
    assert st.hits == 3 and st.bytes_in > 0 and st.errors == 0
    assert "fetched_blocks=3" in repr(t)

    # another model_id reads nothing of it
    other = tiered_cache([store], model_id=43)
    assert other.prefix_attach(0, prompt) == 0


def test_write_through_shares_at_once(tmp_path):
    store = kvcache.DiskStore(tmp_path)
    a = tiered_cache([store], write=kvcache.TierWrite.through)
    fill(a, list(range(1, 10)))
    a.prefix_publish()
    assert a.prefix_stats().tier_written_blocks == 2 and store.entries == 2
    b = tiered_cache([store], write="never")
    assert b.prefix_attach(0, list(range(1, 10))) == 8
    assert b.tier_stats()[0].written_blocks == 0


def test_async_writes_land_after_a_drain(tmp_path):
    store = kvcache.DiskStore(tmp_path)
    tiers = kvcache.PrefixTierParams(stores=[store], model_id=42, async_writes=True, max_queued_bytes=1 << 20)
    c = small_cache(kv_size=16, n_seq_max=1, n_kv_pad=4,
                    prefix=kvcache.PrefixCacheParams(enabled=True, block_size=4, tiers=tiers))
    assert c.params.prefix.tiers.async_writes
    fill(c, list(range(1, 14)))
    c.prefix_publish()
    c.seq_rm(0)
    fill(c, list(range(100, 116)), start=0)  # evicts the 3 blocks: queued for the writer thread
    c.prefix_tier_drain()
    (t,) = c.tier_stats()
    assert t.written_blocks == 3 and t.dropped_blocks == 0 and store.entries == 3


def test_bad_tier_params(tmp_path):
    store = kvcache.DiskStore(tmp_path)
    with pytest.raises(kvcache.InvalidArgumentError, match="at most 3 tiers, not 4"):
        tiered_cache([store] * 4)
    with pytest.raises(kvcache.InvalidArgumentError, match="TierWrite 'sometimes': not one of"):
        kvcache.PrefixTierParams(write="sometimes")
    with pytest.raises(kvcache.InvalidArgumentError, match="dir is empty"):
        kvcache.DiskStore("")
    with pytest.raises(TypeError):
        kvcache.PrefixTierParams(stores=["not a store"])
    assert small_cache().tier_stats() == []


def dict_store(d, calls):
    def read_many(keys):
        calls.append("read")
        return [d.get(k) for k in keys]

    def put_many(items):
        calls.append("put")
        for k, v in items:
            d.setdefault(k, v)

    return kvcache.CallbackStore(read_many, put_many, contains_many=lambda keys: [k in d for k in keys],
                                 describe="dict")


def test_callback_store_of_python_callables():
    d, calls = {}, []
    store = dict_store(d, calls)
    a = tiered_cache([store], write="through")
    fill(a, list(range(1, 10)))
    a.prefix_publish()
    assert len(d) == 2 and all(isinstance(v, bytes) and k.startswith("kvcb1-") for k, v in d.items())
    b = tiered_cache([store])
    assert b.prefix_attach(0, list(range(1, 10))) == 8
    (t,) = b.tier_stats()
    assert t.where == "dict" and t.fetched_blocks == 2 and t.store.hits == 2 and t.store.puts == 2


def test_a_raising_callback_store_is_a_counted_miss():
    d, calls = {}, []
    good = dict_store(d, calls)
    a = tiered_cache([good], write="through")
    fill(a, list(range(1, 10)))
    a.prefix_publish()

    def broken(keys):
        raise RuntimeError("server gone")

    bad = kvcache.CallbackStore(broken, lambda items: None)
    c = tiered_cache([bad])
    assert c.prefix_attach(0, list(range(1, 10))) == 0  # recomputed, not raised
    assert bad.stats().errors == 1 and c.tier_stats()[0].fetched_blocks == 0
    # a value that is not the block asked for is refused by the cache, never used
    wrong = kvcache.CallbackStore(lambda keys: [b"not a block" for _ in keys], lambda items: None)
    c = tiered_cache([wrong])
    assert c.prefix_attach(0, list(range(1, 10))) == 0
    assert c.tier_stats()[0].refused_blocks == 1


def test_recurrent_memories_take_tiers(tmp_path):
    store = kvcache.DiskStore(tmp_path)
    tiers = kvcache.PrefixTierParams(stores=[store], model_id=5, write="through")
    m = kvcache.MemoryRecurrent(layers=[kvcache.RecurrentLayerDesc(n_embd_r=4, n_embd_s=4)], n_seq_max=1,
                                prefix=kvcache.PrefixCacheParams(enabled=True, block_size=4, tiers=tiers))
    (t,) = m.tier_stats()
    assert t.where == store.describe() and t.written_blocks == 0
    m.prefix_tier_drain()
