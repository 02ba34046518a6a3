"""The reference runtime driven from Python: write the tiny llama model (GGUF), load it, decode a prompt and a
few greedy tokens through a KVCache, and compare every step's logits (numpy arrays) with the runtime's
oracle, which recomputes attention from plain f32 keys and values. Then the sequence goes to a session
file and comes back as sequence 1 of a new cache (as after a restart): the next logits must be identical. Exit status 0 when all agree.
"""
import os
import sys
import tempfile

import numpy as np

import kvcache
from kvcache import runtime


def main():
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tiny.gguf")
        runtime.write_tiny_model(path)  # 2 layers, 4 heads over 2 KV heads of 16 values, vocabulary 256
        model = runtime.Model(path)     # memory-mapped, checked
        h = model.hparams
        print(f"{h.arch}: {h.n_layer} layers, n_embd {h.n_embd}, vocabulary {h.n_vocab}")

        cache = kvcache.KVCache(model.cache_params(kv_size=256, n_seq_max=2))  # f16 K/V
        rt = runtime.Runtime(model, cache, n_threads=2)
        ref = runtime.ReferenceMemory(model, n_seq_max=2, n_threads=2)
        tol = runtime.logits_tolerance(kvcache.dtype.f16)

        worst, tokens = 0.0, [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
        batch = kvcache.Batch.get_one(tokens)
        for _ in range(6):
            out, expect = rt.decode(batch), ref.decode(batch)
            logits = out["logits"]  # [n_outputs, n_vocab] float32
            worst = max(worst, runtime.relative_diff(logits, expect["logits"]))
            tokens.append(int(logits[-1].argmax()))  # greedy
            batch = kvcache.Batch.get_one(tokens[-1:])
        print(f"generated {tokens[13:]}; worst relative difference {worst:.2e} (bound {tol:.0e})")

        # a session file: sequence 0 with its tokens, restored as sequence 1 of a new cache
        session = os.path.join(tmp, "seq0.kvc")
        cache.save_file(session, seq_id=0, tokens=tokens[:-1], compress=True)
        cache2 = kvcache.KVCache(model.cache_params(kv_size=512, n_seq_max=2))
        info = cache2.load_file(session, dest=1)
        same_tokens = list(info.tokens) == tokens[:-1]
        a = rt.decode(kvcache.Batch(tokens=[tokens[-1]], pos=[len(tokens) - 1], seq_ids=[0]))["logits"]
        rt2 = runtime.Runtime(model, cache2, n_threads=2)
        b = rt2.decode(kvcache.Batch(tokens=[tokens[-1]], pos=[len(tokens) - 1], seq_ids=[1]))["logits"]
        print(f"session file: {os.path.getsize(session)} bytes; restored logits identical: {np.array_equal(a, b)}")

    ok = worst <= tol and same_tokens and np.array_equal(a, b)
    print("cache == recompute" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
