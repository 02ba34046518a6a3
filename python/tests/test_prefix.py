"""The prefix cache from Python: lookup, attach, pin / unpin, publish, stats and events."""
import pytest

import kvcache
from conftest import fill, small_cache


def prefix_cache(**kw):
    events = []
    prefix = kvcache.PrefixCacheParams(enabled=True, block_size=4, on_event=events.append, **kw)
    return small_cache(kv_size=32, prefix=prefix), events


def test_attach_gives_the_cached_prefix():
    c, events = prefix_cache()
    prompt = list(range(1, 11))
    fill(c, prompt, seq=0)
    c.prefix_publish()
    assert [e["type"] for e in events] == ["stored", "stored"]  # two whole blocks of 4
    assert events[1]["tokens"] == [5, 6, 7, 8] and events[1]["depth"] == 1
    assert events[1]["parent_hash"] == events[0]["hash"]
    assert {e["part"] for e in events} == {"kv"}  # a plain cache has one part
    assert c.prefix_lookup(prompt[:9] + [99]) == 8
    assert c.prefix_attach(1, prompt[:9] + [99]) == 8
    assert c.seq_pos_max(1) == 7 and c.used_cells() == 10  # shared, not copied
    s = c.prefix_stats()
    assert s.hit_tokens == 8 and s.lookups == 2 and s.blocks == 2 and s.shared_cells == 8
    with pytest.raises(kvcache.InvalidArgumentError, match="seq 1 is not empty"):
        c.prefix_attach(1, prompt)
    assert c.prefix_lookup(prompt, key=7) == 0  # another namespace


def test_pin_unpin_and_eviction():
    c, _ = prefix_cache()
    fill(c, list(range(1, 9)), seq=0)
    c.prefix_publish()
    c.seq_rm(0)
    assert c.prefix_stats().cached_cells == 8
    assert c.prefix_pin(list(range(1, 9))) == 8
    assert c.prefix_stats().pinned_cells == 8
    fill(c, list(range(100, 124)), seq=1)  # fills the 24 free cells: nothing pinned may go
    assert c.init_batch(kvcache.Batch(tokens=[1], seq_ids=[2])).failed
    assert c.prefix_unpin(list(range(1, 9))) == 8
    fill(c, [1], seq=2)  # now a cached block is evicted
    assert c.prefix_stats().evicted_blocks >= 1
    with pytest.raises(kvcache.OutOfRangeError, match="priority 101"):
        c.prefix_attach(3, [1, 2], priority=101)


def test_without_prefix_cache():
    with pytest.raises(kvcache.UnsupportedError):
        small_cache().prefix_lookup([1, 2, 3])
    assert small_cache().prefix_stats().blocks == 0
    assert small_cache().tier_stats() == []
    small_cache().prefix_publish()  # nothing to publish


def test_every_memory_answers_the_prefix_calls():
    r = kvcache.MemoryRecurrent(layers=[kvcache.RecurrentLayerDesc(n_embd_r=2, n_embd_s=4)], n_seq_max=2,
                                prefix=kvcache.PrefixCacheParams(enabled=True, block_size=4))
    assert isinstance(r, kvcache.Memory)
    assert r.prefix_lookup([1, 2, 3, 4, 5]) == 0 and r.tier_stats() == []
    with pytest.raises(kvcache.UnsupportedError, match="plain KV cache"):
        r.prefix_pin([1, 2, 3, 4, 5])
    with pytest.raises(kvcache.UnsupportedError):
        r.prefix_set_priority([1, 2, 3, 4, 5], 0, 10)
    without = kvcache.MemoryRecurrent(layers=[kvcache.RecurrentLayerDesc(n_embd_r=2, n_embd_s=4)])
    with pytest.raises(kvcache.UnsupportedError, match="no prefix cache"):
        without.prefix_attach(0, [1, 2, 3])
    assert without.prefix_stats().snapshots == 0


def test_callback_errors_are_counted():
    def boom(e):
        raise RuntimeError("no")

    c = small_cache(kv_size=32, prefix=kvcache.PrefixCacheParams(enabled=True, block_size=4, on_event=boom))
    fill(c, list(range(1, 9)))
    c.prefix_publish()
    assert c.prefix_stats().event_errors == 2 and c.prefix_stats().blocks == 2


@pytest.mark.parametrize("policy", ["lru", "slru", "adaptive"])
def test_adaptive_keeps_a_prompt_published_again_after_its_eviction(policy):
    # evicted by a burst, sent again (a miss), then another burst: only the adaptive policy's ghosts
    # remember that it came back
    c, _ = prefix_cache(policy=getattr(kvcache.EvictPolicy, policy))
    conv = [1, 1, 1, 1, 2, 2, 2, 2, 0]
    for burst in range(2):
        fill(c, conv, seq=0)
        c.prefix_publish()
        c.seq_rm(0)
        for t in range(3 + 10 * burst, 13 + 10 * burst):  # one-off prompts of a block: 10 for 8 blocks
            fill(c, [t] * 4, seq=1)
            c.prefix_publish()
            c.seq_rm(1)
        if burst == 0:
            assert c.prefix_lookup(conv) == 0
    assert c.prefix_lookup(conv) == (8 if policy == "adaptive" else 0)
