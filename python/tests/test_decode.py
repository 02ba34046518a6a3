"""The decode loop: batches, contexts, K/V in from numpy, zero-copy views out, masks, failures."""
import gc

import numpy as np
import pytest

import kvcache
from conftest import fill, layers, small_cache


def test_batch_from_lists_and_arrays():
    b = kvcache.Batch(tokens=np.array([4, 5, 6]), pos=np.arange(3), seq_ids=[[0, 1], [0], [1]],
                      logits=[True, False, True])
    assert len(b) == 3 and list(b.tokens) == [4, 5, 6] and b.seq_ids == [[0, 1], [0], [1]]
    assert b.logits == [True, False, True]
    assert kvcache.Batch(tokens=[1, 2]).logits == [False, True]  # only the last, by default
    with pytest.raises(kvcache.InvalidArgumentError, match="3 values for 2 tokens"):
        kvcache.Batch(tokens=[1, 2], pos=[0, 1, 2])
    with pytest.raises(kvcache.InvalidArgumentError, match="exactly one of tokens and embd"):
        kvcache.Batch()
    b = kvcache.Batch.init(2, n_seq_max=2)
    b.add(7, 0, [0, 1], True)
    b.add(8, 1, 1)
    assert b.seq_ids == [[0, 1], [1]]
    with pytest.raises(kvcache.InvalidArgumentError, match="full"):
        b.add(9, 2, 0)
    with pytest.raises(kvcache.InvalidArgumentError, match="leaves positions"):
        kvcache.Batch(tokens=[1]).add(2, 1, 0)
    b = kvcache.Batch(tokens=[1], pos=[0], seq_ids=[0])
    b.add(2, 1, 0)
    assert b.logits == [True, False] and b.pos.tolist() == [0, 1]


def test_views_dtype_shape_strides_and_zero_copy():
    c = small_cache(v_trans=False)
    fill(c, [10, 11])
    ctx = c.init_batch(kvcache.Batch(tokens=[12]))
    ctx.apply()
    a = ctx.attn(1)
    a.cpy_k(1, np.full((1, 16), 12 + 2 / 100 + 1))
    a.cpy_v(1, np.full((1, 16), -(12 + 2 / 100 + 1)))
    k = a.get_k(1)
    assert k.dtype == np.float32 and k.shape == (1, 16, 2, 8)  # [streams, n_kv, heads, head_dim]
    assert k.strides == (64 * 16 * 4, 16 * 4, 8 * 4, 4)  # rows of 16 values, kv_size 64 per stream
    assert np.allclose(k[0, 2].ravel(), 12 + 2 / 100 + 1)  # token 12 at position 2, layer 1
    assert np.allclose(a.get_v(1)[0, :3, 0, 0], -(np.array([10, 11, 12]) + np.arange(3) / 100 + 1))
    # zero-copy: a later write is visible through the old view, and the view keeps the memory alive
    c.seq_rm(0, 0, -1)
    fill(c, [20], start=0)
    assert np.allclose(k[0, 0], 20 + 1)
    del c, ctx, a
    gc.collect()
    assert np.allclose(k[0, 0], 21)


@pytest.mark.parametrize("type_k,np_type,last", [("f16", np.float16, 8), ("bf16", np.uint16, 8),
                                                 ("q8_0", np.uint8, 34), ("q4_0", np.uint8, 18)])
def test_views_of_other_types(type_k, np_type, last):
    head = 32 if type_k.startswith("q") else 8
    c = kvcache.KVCache(layers=layers(1, head=head), type_k=type_k, type_v="f16", kv_size=32, n_kv_pad=8)
    b = kvcache.Batch(tokens=[1, 2])
    ctx = c.init_batch(b)
    for _ in ctx:
        a = ctx.attn(0)
        k = np.linspace(-1, 1, 2 * 2 * head, dtype=np.float32).reshape(2, 2, head)
        a.cpy_k(0, k.astype(np.float16))  # float16 input is taken as is
        a.cpy_v(0, k)
        view = a.get_k(0)
        assert view.dtype == np_type and view.shape[-1] == last and view.shape[:3] == (1, 8, 2)
        dec = a.get_k_f32(0)
        assert dec.shape == (1, 8, 2, head)
        assert np.abs(dec[0, :2] - k).max() < (0.2 if type_k == "q4_0" else 0.02)
        vt = a.get_v(0)  # v_trans: [streams, head_dim, heads, n_kv]
        assert vt.dtype == np.float16 and vt.shape == (1, head, 2, 8)
        assert np.allclose(vt[0, :, :, 1].T, k[1], atol=1e-2)


def test_mask_and_multiple_sequences():
    c = small_cache()
    b = kvcache.Batch(tokens=[1, 2, 3, 4, 5], pos=[0, 1, 0, 1, 2], seq_ids=[0, 0, 1, 1, 1])
    ctx = c.init_batch(b)
    for ub in ctx:
        m = ctx.attn(0).kq_mask()
        assert m.shape == (5, 16) and m.dtype == np.float32
        seen = [set(np.flatnonzero(row == 0)) for row in m]
        assert seen == [{0}, {0, 1}, {2}, {2, 3}, {2, 3, 4}]
        assert np.isneginf(m[0, 1:]).all()
        assert ctx.attn(0).kq_mask(dtype=np.float16).dtype == np.float16
        assert list(ub.primary_seq) == [0, 0, 1, 1, 1]
    assert ctx.out_ids.tolist() == [4]


def test_bad_k_rows_raise_and_change_nothing():
    c = small_cache()
    fill(c, [1, 2])
    before = c.read_k_row(0, 0, 1)
    ctx = c.init_batch(kvcache.Batch(tokens=[3]))
    ctx.apply()
    a = ctx.attn(0)
    with pytest.raises(kvcache.InvalidArgumentError):
        a.cpy_k(0, np.zeros((1, 15), dtype=np.float32))
    with pytest.raises(kvcache.InvalidArgumentError, match="1 to 4 dimensions"):
        a.cpy_k(0, np.zeros((1, 1, 1, 1, 16)))
    with pytest.raises(kvcache.Error):
        a.get_k(7)
    assert np.array_equal(c.read_k_row(0, 0, 1), before)
    with pytest.raises(kvcache.InvalidStateError):
        ctx.apply()  # twice
    assert not ctx.next()
    with pytest.raises(kvcache.InvalidStateError, match="apply"):
        a.get_k(0)  # past the last ubatch


def test_invalid_batch_raises_memory_unchanged():
    c = small_cache()
    fill(c, [1, 2, 3])
    with pytest.raises(kvcache.Error) as e:
        c.init_batch(kvcache.Batch(tokens=[4], pos=[7]))  # gap after position 2
    assert "7" in str(e.value)
    with pytest.raises(kvcache.OutOfRangeError):
        c.init_batch(kvcache.Batch(tokens=[4], seq_ids=[9]))
    with pytest.raises(kvcache.OutOfRangeError, match=r"token\[0\] = 300 not in \[0, 256\)"):
        c.init_batch(kvcache.Batch(tokens=[300]), n_vocab=256)
    assert c.seq_pos_max(0) == 2 and c.used_cells() == 3


def test_no_room_is_a_status_not_an_exception():
    c = small_cache(kv_size=16, n_kv_pad=16)
    fill(c, list(range(12)))
    ctx = c.init_batch(kvcache.Batch(tokens=list(range(8)), seq_ids=[1] * 8))
    assert ctx.failed and ctx.status == kvcache.MemoryStatus.failed_prepare
    assert c.used_cells() == 12 and c.seq_pos_max(1) == -1
    with pytest.raises(kvcache.InvalidStateError, match="does not fit"):
        list(ctx)


def test_embeddings_batch():
    c = small_cache()
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    ctx = c.init_batch(kvcache.Batch(embd=rows), output_all=True)
    ub = next(iter(ctx))
    assert ub.n_embd == 4 and np.array_equal(ub.embd, rows) and ub.output.all()


def test_init_full_and_update():
    c = small_cache()
    ctx = c.init_full()
    assert ctx.attn(0) is not None
    fill(c, [1, 2, 3, 4])
    c.seq_add(0, 2, -1, 5)
    assert c.has_shift
    assert c.update() and not c.has_shift and not c.update()
    assert c.seq_pos_max(0) == 8
