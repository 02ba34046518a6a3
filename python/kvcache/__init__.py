"""kvcache: the sequence memory of LLM inference engines (KV cache, recurrent state, iSWA, hybrid, prefix cache).

The classes mirror the C++ API (namespace kvc) with Python names: KVCache, KVCacheISWA, MemoryRecurrent and
MemoryHybrid are memories; Batch is what you submit; init_batch gives a Context whose ubatches you apply,
write K/V into (AttnContext.cpy_k / cpy_v, from numpy) and read back as zero-copy numpy views (get_k /
get_v) with the KQ mask (kq_mask). kvcache.runtime decodes GGUF models through a memory. docs/python.md is
the guide.
"""
from ._kvcache import (  # noqa: F401
    SEQ_ALL,
    AttnContext,
    Batch,
    BlockStore,
    BlockStoreStats,
    CallbackStore,
    Context,
    CorruptDataError,
    DiskStore,
    Error,
    EvictPolicy,
    InvalidArgumentError,
    InvalidStateError,
    IOError,
    ISWASizing,
    KVCache,
    KVCacheISWA,
    KVCacheISWAParams,
    KVCacheParams,
    LayerDesc,
    Memory,
    MemoryBreakdown,
    MemoryHybrid,
    MemoryHybridParams,
    MemoryRecurrent,
    MemoryStatus,
    OutOfMemoryError,
    OutOfRangeError,
    PrefixCacheParams,
    PrefixStats,
    PrefixTierParams,
    RecrContext,
    RecurrentLayerDesc,
    RecurrentParams,
    RecurrentStep,
    RopeParams,
    RopeType,
    SessionInfo,
    SWAType,
    TierStats,
    TierWrite,
    Ubatch,
    UnsupportedError,
    __version__,
    block_size,
    dtype,
    read_session_header,
    row_size,
)
from . import runtime  # noqa: F401


def _context_iter(self):
    """Applies each ubatch in turn and yields it (apply, build the layers, then the loop calls next)."""
    if self.failed:
        raise InvalidStateError(f"the batch does not fit (status {self.status.name}): nothing to apply")
    while True:
        self.apply()
        yield self.ubatch
        if not self.next():
            return


Context.__iter__ = _context_iter
