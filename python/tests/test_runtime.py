"""kvcache.runtime: GGUF models decoded through every memory kind, logits as numpy, checked against the
oracle where there is one."""
import os
import threading

import numpy as np
import pytest

import kvcache
from kvcache import runtime


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    out = {}
    for arch in ("llama", "mamba", "jamba"):
        path = str(d / f"tiny_{arch}.gguf")
        assert runtime.write_tiny_model(path, arch) == os.path.getsize(path)
        out[arch] = runtime.Model(path)
    return out


def test_llama_matches_the_oracle(models):
    m = models["llama"]
    assert m.memory_kind == "kv" and m.hparams.n_vocab == 256 and m.hparams.arch == "llama"
    for type_k in ("f16", "bf16"):
        p = m.cache_params(kv_size=128, n_seq_max=2)
        p.type_k = type_k
        cache = kvcache.KVCache(p)
        rt = runtime.Runtime(m, cache, n_threads=2, n_ubatch=4)
        assert rt.memory is cache
        ref = runtime.ReferenceMemory(m, n_seq_max=2, n_threads=2)
        b = kvcache.Batch(tokens=list(range(10, 20)) + [3, 4, 5], pos=list(range(10)) + [0, 1, 2],
                          seq_ids=[0] * 10 + [1] * 3, logits=[1] * 13)
        out, exp = rt.decode(b), ref.decode(b)
        assert out["status"] == kvcache.MemoryStatus.success and out["n_ubatches"] >= 3
        assert out["logits"].shape == (13, 256) and out["logits"].dtype == np.float32
        assert out["output_ids"].tolist() == list(range(13))
        assert runtime.relative_diff(out["logits"], exp["logits"]) <= runtime.logits_tolerance(type_k)


def test_mismatched_memory_and_bad_batch(models):
    m = models["llama"]
    with pytest.raises(kvcache.Error):
        runtime.Runtime(m, kvcache.KVCache(layers=[kvcache.LayerDesc(n_embd_head_k=8, n_embd_head_v=8)],
                                           kv_size=16))
    cache = kvcache.KVCache(m.cache_params(kv_size=32))
    rt = runtime.Runtime(m, cache)
    rt.decode(kvcache.Batch.get_one([1, 2, 3]))
    with pytest.raises(kvcache.OutOfRangeError):
        rt.decode(kvcache.Batch.get_one([1000]))
    assert cache.seq_pos_max(0) == 2 and cache.used_cells() == 3
    out = rt.decode(kvcache.Batch.get_one(list(range(40))))  # no room: a status, nothing changed
    assert out["status"] == kvcache.MemoryStatus.failed_prepare and cache.used_cells() == 3
    with pytest.raises(kvcache.IOError):
        runtime.Model("/nonexistent/model.gguf")


def test_recurrent_models(models):
    for arch in ("mamba", "jamba"):
        m = models[arch]
        if arch == "mamba":
            mem = kvcache.MemoryRecurrent(m.recr_params(n_seq_max=2))
        else:
            mem = kvcache.MemoryHybrid(m.hybrid_params(kv_size=64, n_seq_max=2))
        rt = runtime.Runtime(m, mem, n_threads=2)
        a = rt.decode(kvcache.Batch(tokens=[5, 6, 7, 5, 6, 7], pos=[0, 1, 2] * 2, seq_ids=[0] * 3 + [1] * 3,
                                    logits=[0, 0, 1, 0, 0, 1]))["logits"]
        assert a.shape == (2, m.hparams.n_vocab) and np.isfinite(a).all()
        assert np.allclose(a[0], a[1], rtol=1e-5, atol=1e-5)  # same tokens, same state: same logits
        assert rt.memory.seq_pos_max(1) == 2


def test_recurrent_and_hybrid_prefix_caches_resume_from_snapshots(models):
    """A later request resumes from the snapshot a finished one left: its logits equal a full decode's."""
    prompt = [17, 42, 99, 3, 250, 128, 64, 5, 77, 200, 11, 12]
    for arch in ("mamba", "jamba"):
        m = models[arch]
        pc = kvcache.PrefixCacheParams(enabled=True, block_size=4, snapshot_interval=1)
        if arch == "mamba":
            p = m.recr_params(n_seq_max=3)
            p.prefix = pc
            mem = kvcache.MemoryRecurrent(p)
        else:
            p = m.hybrid_params(kv_size=64, n_seq_max=3)
            p.prefix = pc
            mem = kvcache.MemoryHybrid(p)
        rt = runtime.Runtime(m, mem, n_threads=2)
        full = rt.decode(kvcache.Batch(tokens=prompt + [13], pos=list(range(13)), seq_ids=[0] * 13,
                                       logits=[0] * 12 + [1]))["logits"]
        assert mem.seq_rm(0, -1, -1)
        n = mem.prefix_attach(1, prompt + [13])
        assert n == 12, arch  # the prompt's end, where seq 0's batch left a snapshot
        rest = rt.decode(kvcache.Batch(tokens=[13], pos=[12], seq_ids=[1], logits=[1]))["logits"]
        assert runtime.relative_diff(rest, full) <= runtime.logits_tolerance("f32"), arch
        st = mem.prefix_stats()
        assert st.hit_tokens == 12 and st.snapshots_saved >= 3 and st.snapshots >= 1, arch
        assert mem.prefix_lookup(prompt[:3]) == 0


def test_iswa_prefix_cache_resumes_with_the_window(models):
    """An iSWA pair resumes where the base cache has the prefix and the SWA cache the window before it."""
    m = models["llama"]
    kv = m.cache_params(kv_size=256, n_seq_max=2)
    kv.layers[0].is_swa = True
    kv.n_swa = 4
    kv.swa = "standard"
    kv.prefix = kvcache.PrefixCacheParams(enabled=True, block_size=4)
    mem = kvcache.KVCacheISWA(kv=kv, sizing=kvcache.ISWASizing(swa_full=False, n_ubatch=16))
    rt = runtime.Runtime(m, mem, n_threads=2)
    prompt = [17, 42, 99, 3, 250, 128, 64, 5, 77, 200, 11, 12, 13]
    full = rt.decode(kvcache.Batch(tokens=prompt, pos=list(range(13)), seq_ids=[0] * 13,
                                   logits=[0] * 12 + [1]))["logits"]
    assert mem.seq_rm(0, -1, -1)
    assert mem.prefix_attach(1, prompt) == 12
    assert mem.seq_pos_min(1) == 9  # the SWA cache's window: positions 9, 10, 11
    rest = rt.decode(kvcache.Batch(tokens=[13], pos=[12], seq_ids=[1], logits=[1]))["logits"]
    assert runtime.relative_diff(rest, full) <= runtime.logits_tolerance("f16")
    st = mem.prefix_stats()
    assert st.hit_tokens == 12 and st.blocks == 3 and st.swa_blocks == 3 and st.swa_evicted_blocks == 0


def test_decode_releases_the_gil(models):
    m = models["llama"]
    results, errors = {}, []

    def work(i):
        try:
            cache = kvcache.KVCache(m.cache_params(kv_size=256))
            rt = runtime.Runtime(m, cache, n_threads=1)
            results[i] = rt.decode(kvcache.Batch.get_one(list(range(100))))["logits"]
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and all(np.array_equal(results[0], results[i]) for i in range(3))


def test_one_memory_from_many_threads_is_serialised(models):
    m = models["llama"]
    cache = kvcache.KVCache(m.cache_params(kv_size=512, n_seq_max=4))
    rt = runtime.Runtime(m, cache, n_threads=1)

    def work(s):
        for i in range(20):
            rt.decode(kvcache.Batch(tokens=[i], pos=[i], seq_ids=[s]))
            cache.seq_pos_max(s)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [cache.seq_pos_max(s) for s in range(4)] == [19] * 4 and cache.used_cells() == 80
