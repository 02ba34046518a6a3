"""Recurrent and hybrid memories driven from Python: the engine contract through RecurrentStep, checked
against an oracle of per-sequence sums, with sharing (seq_cp) and rollback (seq_rm of a suffix)."""
import numpy as np
import pytest

import kvcache

WIDTH = 4


def decode_sums(mem, batch, attn_layers=()):
    """A toy recurrent engine: each token adds (token, 1, 0, ...) to its sequence's state in both layers."""
    ctx = mem.init_batch(batch, n_ubatch=8)
    assert not ctx.failed
    for ub in ctx:
        rc = ctx.recr()
        for il in mem_layers(mem):
            for which in ("r", "s"):
                st = rc.step(il, which)
                for b in range(st.n_seqs):
                    state = st.state(b)
                    for t in range(st.n_seq_tokens):
                        state[0] += ub.token[b * st.n_seq_tokens + t]
                        state[1] += 1
                        st.store(b, t)
                st.finish()
        for il in attn_layers:
            a = ctx.attn(il)
            a.cpy_k(il, np.zeros((ub.n_tokens, 16)))
            a.cpy_v(il, np.zeros((ub.n_tokens, 16)))


def mem_layers(mem):
    return (mem.recr if isinstance(mem, kvcache.MemoryHybrid) else mem).layer_ids


def state_of(mem, seq, il=0, which="r"):
    r = mem.recr if isinstance(mem, kvcache.MemoryHybrid) else mem
    cell = r.seq_tail(seq)
    rows = r.get_r(il) if which == "r" else r.get_s(il)
    return rows[0, cell, :2].tolist()


def recurrent(n_rs_seq=0):
    return kvcache.MemoryRecurrent(layers=[kvcache.RecurrentLayerDesc(n_embd_r=WIDTH, n_embd_s=WIDTH)] * 2,
                                   n_seq_max=4, n_rs_seq=n_rs_seq)


def test_states_follow_the_contract():
    m = recurrent()
    decode_sums(m, kvcache.Batch(tokens=[1, 2, 3, 10, 20], seq_ids=[0, 0, 0, 1, 1], pos=[0, 1, 2, 0, 1]))
    assert state_of(m, 0) == [6, 3] and state_of(m, 1, 1, "s") == [30, 2]
    m.seq_cp(0, 2)  # shared copy-on-write
    decode_sums(m, kvcache.Batch(tokens=[5], seq_ids=[2], pos=[3]))
    assert state_of(m, 2) == [11, 4] and state_of(m, 0) == [6, 3]
    m.validate()
    assert not m.seq_rm(0, 1, -1)  # no rollback: a suffix cannot go, nothing changed
    assert m.seq_pos_max(0) == 2


def test_rollback():
    m = recurrent(n_rs_seq=2)
    decode_sums(m, kvcache.Batch(tokens=[1, 2, 3, 4], pos=range(4)))
    assert state_of(m, 0) == [10, 4]
    assert m.seq_rm(0, 2, -1)  # back to after position 1
    assert m.seq_pos_max(0) == 1
    decode_sums(m, kvcache.Batch(tokens=[7], pos=[2]))
    assert state_of(m, 0) == [1 + 2 + 7, 3]


def test_stale_step_is_refused():
    m = recurrent()
    ctx = m.init_batch(kvcache.Batch(tokens=[1, 2], seq_ids=[0, 1], pos=[0, 0]), n_ubatch=1)
    ctx.apply()
    st = ctx.recr().step(0, "r")
    ctx.next()
    with pytest.raises(kvcache.InvalidStateError, match="moved on"):
        st.finish()
    with pytest.raises(kvcache.InvalidArgumentError, match="'r' or 's'"):
        ctx.recr().step(0, "x")


def test_hybrid():
    ls = [kvcache.LayerDesc(n_head_kv=2, n_embd_head_k=8, n_embd_head_v=8, has_kv=i == 1) for i in range(2)]
    recr = [kvcache.RecurrentLayerDesc(n_embd_r=WIDTH, n_embd_s=WIDTH), kvcache.RecurrentLayerDesc()]
    h = kvcache.MemoryHybrid(attn=kvcache.KVCacheParams(layers=ls, kv_size=32, n_seq_max=2),
                             recr=kvcache.RecurrentParams(layers=recr, n_seq_max=2))
    decode_sums(h, kvcache.Batch(tokens=[3, 4, 5], pos=range(3)), attn_layers=[1])
    assert state_of(h, 0) == [12, 3]
    assert h.attn.used_cells() == 3 and h.seq_pos_max(0) == 2
    data = h.state_get(0)
    h.clear()
    h.state_set(data, 1)
    assert state_of(h, 1) == [12, 3] and h.attn.seq_pos_max(1) == 2
    part = h.state_get(1, partial=True)
    assert len(part) < len(data)


def test_hybrid_with_iswa_attention_and_prefix_cache():
    """A hit needs the base cache's blocks, the SWA cache's window and a snapshot; events name each part."""
    ls = [kvcache.LayerDesc(n_head_kv=2, n_embd_head_k=8, n_embd_head_v=8, has_kv=i > 0, is_swa=i == 1)
          for i in range(3)]
    recr = [kvcache.RecurrentLayerDesc(n_embd_r=WIDTH, n_embd_s=WIDTH)] + [kvcache.RecurrentLayerDesc()] * 2
    events = []
    h = kvcache.MemoryHybrid(
        attn=kvcache.KVCacheParams(layers=ls, kv_size=32, n_seq_max=2, n_swa=4, swa="standard"),
        recr=kvcache.RecurrentParams(layers=recr, n_seq_max=2),
        iswa=kvcache.ISWASizing(swa_full=False, n_ubatch=8),
        prefix=kvcache.PrefixCacheParams(enabled=True, block_size=4, on_event=events.append))
    prompt = list(range(1, 11))
    decode_sums(h, kvcache.Batch(tokens=prompt, pos=range(10), seq_ids=[0] * 10), attn_layers=[1, 2])
    h.seq_rm(0)
    assert h.prefix_lookup(prompt + [99]) == 8
    assert h.prefix_attach(1, prompt + [99]) == 8
    assert h.seq_pos_max(1) == 7 and state_of(h, 1) == [sum(prompt[:8]), 8]
    assert {e["part"] for e in events if e["type"] == "stored"} == {"kv", "swa", "snapshot"}
    s = h.prefix_stats()
    assert s.hit_tokens == 8 and s.swa_published_blocks == sum(e["part"] == "swa" for e in events)
