"""The reference runtime: load a GGUF model, decode batches through a kvcache memory, logits as numpy.

    kvcache.runtime.write_tiny_model("tiny.gguf")          # the tiny llama test model
    m = kvcache.runtime.Model("tiny.gguf")
    cache = kvcache.KVCache(m.cache_params(kv_size=256, n_seq_max=2))
    rt = kvcache.runtime.Runtime(m, cache)
    out = rt.decode(kvcache.Batch.get_one([1, 2, 3]))     # out["logits"]: [n_outputs, n_vocab] float32
"""
from ._kvcache.runtime import (  # noqa: F401
    Model,
    ModelHParams,
    ReferenceMemory,
    Runtime,
    logits_tolerance,
    relative_diff,
    tiny_model_bytes,
    write_tiny_model,
)
