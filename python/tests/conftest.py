"""Shared helpers of the kvcache pytest suite (ctest runs it with PYTHONPATH at the built package)."""
import os
import sys

import numpy as np
import pytest

import kvcache

EXAMPLES = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples", "python")
sys.path.insert(0, os.path.abspath(EXAMPLES))


def layers(n=2, n_head_kv=2, head=8, **kw):
    return [kvcache.LayerDesc(n_head_kv=n_head_kv, n_embd_head_k=head, n_embd_head_v=head, **kw) for _ in range(n)]


def small_cache(**kw):
    """A 2-layer cache of 2 KV heads of 8 values; keyword arguments override KVCacheParams fields."""
    args = dict(layers=layers(), type_k="f32", type_v="f32", kv_size=64, n_kv_pad=16, n_seq_max=4)
    args.update(kw)
    return kvcache.KVCache(**args)


def fill(cache, tokens, seq=0, start=None, n_ubatch=512, value=None):
    """Decodes tokens into seq, K/V of token t at position p = value(t, p) (default t + p / 100)."""
    start = cache.seq_pos_max(seq) + 1 if start is None else start
    b = kvcache.Batch(tokens=tokens, pos=range(start, start + len(tokens)), seq_ids=[seq] * len(tokens))
    ctx = cache.init_batch(b, n_ubatch=n_ubatch)
    assert not ctx.failed
    for ub in ctx:
        for il in cache.layer_ids:
            a = ctx.attn(il)
            width = 16
            rows = np.array([[(value or (lambda t, p: t + p / 100))(t, p) + il] * width
                             for t, p in zip(ub.token, ub.pos)], dtype=np.float32)
            a.cpy_k(il, rows)
            a.cpy_v(il, -rows)
    return ctx


@pytest.fixture
def tmp(tmp_path):
    return str(tmp_path)
