"""pykvcache: an NVMe SSD tier for LLM KV caches.

The engine (``pykvcache._core``, Rust) moves checksummed chunks between a
bounded staging pool and files with io_uring + O_DIRECT. ``pykvcache.vllm``
plugs it into vLLM's offloading connector.
"""

from pykvcache._core import (
    FORMAT_VERSION,
    HEADER_BYTES,
    BackendUnavailable,
    BlockStore,
    CorruptChunk,
    IoHandle,
    IoResult,
    PoolExhausted,
    PykvcacheError,
    StagingPool,
    StoreError,
    __version__,
    probe_storage_dir,
)
from pykvcache.preformat import BackgroundPreformat, PreformatReport, preformat

__all__ = [
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "BackendUnavailable",
    "BackgroundPreformat",
    "BlockStore",
    "CorruptChunk",
    "IoHandle",
    "IoResult",
    "PoolExhausted",
    "PreformatReport",
    "PykvcacheError",
    "StagingPool",
    "StoreError",
    "__version__",
    "preformat",
    "probe_storage_dir",
]
