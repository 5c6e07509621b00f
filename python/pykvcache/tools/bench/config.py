"""What a benchmark run measures and how long it may take.

Three presets: the default finishes in about four minutes on a 2-core machine
(two chunk sizes, two engine depths, a trimmed fio sweep); ``full`` (``--full``)
is the whole sweep (three chunk sizes, three depths, eight fio shapes); the
quick one (``make demo``) measures storage and the fs tier in under a minute.
Every size is a parameter, so tests run the same code with tiny sizes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

MiB = 1 << 20

# (numjobs, iodepth) pairs fio tries at each block size; the best is the limit.
FIO_SWEEP_FULL: tuple[tuple[int, int], ...] = (
    (1, 1), (1, 4), (1, 8), (1, 16), (1, 32),
    (4, 1), (4, 4),
    (16, 1),
)  # fmt: skip
# The shapes that came out best in full sweeps on the development machines (one
# deep job, several jobs); ``fio_sweep_for`` adds one job at each engine depth.
FIO_SWEEP_DEFAULT: tuple[tuple[int, int], ...] = ((1, 32), (4, 4))
FIO_SWEEP_QUICK: tuple[tuple[int, int], ...] = ((1, 1), (1, 8), (4, 1), (4, 4))
#: Parts the quick preset runs when none are named: storage and the fs tier.
QUICK_PARTS = ("storage", "fs_tier")


@dataclass
class BenchConfig:
    out: Path
    directory: Path
    # None = every part registered as default (see ``pykvcache bench --list-parts``).
    parts: list[str] | None = None
    repeats: int = 2
    cold_reads: bool = True
    # Also drop dentry/inode caches before reads (see cold_cache.drop_caches).
    cold_metadata: bool = False
    # Engine vs fio (the physical limit).
    chunk_sizes: list[int] = field(default_factory=lambda: [8 * MiB, 28 * MiB])
    queue_depths: list[int] = field(default_factory=lambda: [1, 8])
    engine_bytes: int = 512 * MiB
    fio_runtime_s: float = 0.5
    fio_file_bytes: int = 256 * MiB
    fio_sweep: list[tuple[int, int]] = field(default_factory=lambda: list(FIO_SWEEP_DEFAULT))
    # Registered buffers of one fio run (numjobs x depth x bs) stay under this.
    fio_max_inflight_bytes: int = 2048 * MiB
    # Against vLLM's fs tier.
    fs_chunk_sizes: list[int] = field(default_factory=lambda: [28 * MiB])
    fs_bytes: int = 384 * MiB
    fs_shapes: list[str] = field(default_factory=lambda: ["one_job", "jobs_of_8", "jobs_of_1"])
    fs_contention: list[bool] = field(default_factory=lambda: [False, True])
    # Against LMCache's local disk tier (lmcache_part.py, not a default part):
    # chunk sizes (2 MiB = pykvcache's serving chunk of 64 tokens x 32 KiB, 8 MiB =
    # LMCache's default 256-token chunk), bytes per system per case, operations in
    # flight (LMCache's disk threads = pykvcache's queue depth), one-at-a-time ops.
    lmcache_chunk_sizes: list[int] = field(default_factory=lambda: [2 * MiB, 8 * MiB])
    lmcache_bytes: int = 512 * MiB
    lmcache_concurrency: list[int] = field(default_factory=lambda: [4, 16])
    lmcache_latency_ops: int = 32
    # Memory of vLLM's serving processes (memory part): distinct ~1000-token
    # prompts, each ~14 MiB of KV, through a staging region several times smaller.
    memory_requests: int = 16
    memory_staging_bytes: int = 32 * MiB
    # Extra BlockStore keyword arguments for every pykvcache store (segment_bytes, ...).
    store_kwargs: dict[str, Any] = field(default_factory=dict)
    # Storage part: every engine case also with an encryption key (sealed chunks), both
    # verify="full", side by side (``--encrypt``; decision 0083).
    encrypt: bool = False
    argv: list[str] | None = None
    # Set by the quick preset; parts with their own quick sizes read it.
    quick: bool = False
    # The serve part (serve_options.py; None = its defaults): a model spec name
    # or directory, configurations, concurrency levels, repeats.
    serve_model: str | None = None
    # serve_options.PRESETS: "sessions" (default), "long-context", "quick" (--quick).
    serve_preset: str | None = None
    serve_configs: list[str] | None = None
    serve_concurrency: list[int] | None = None
    serve_repeats: int | None = None
    serve_busy_cores: int | None = None
    # "key=value" overrides of any serve option (serve_options.ServeOptions).
    serve_set: list[str] = field(default_factory=list)
    # "key=value" overrides of the disk_hit part's options (disk_hit_run.DiskHitOptions).
    disk_hit_set: list[str] = field(default_factory=list)
    # "key=value" overrides of the cluster part's options (cluster_run.ClusterOptions).
    cluster_set: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["out"], d["directory"] = str(self.out), str(self.directory)
        return d


def full(config: BenchConfig) -> BenchConfig:
    """The whole sweep (``--full``): ~10 minutes on a 2-core machine."""
    return replace(
        config,
        chunk_sizes=[2 * MiB, 8 * MiB, 28 * MiB],
        queue_depths=[1, 8, 32],
        fio_sweep=list(FIO_SWEEP_FULL),
        fio_runtime_s=1.0,
        fs_bytes=512 * MiB,
        fs_chunk_sizes=[8 * MiB, 28 * MiB],
        memory_requests=24,
    )


def quick(config: BenchConfig) -> BenchConfig:
    """The smoke preset: one chunk size, fewer depths and shapes, one repeat."""
    return replace(
        config,
        repeats=1,
        chunk_sizes=[8 * MiB],
        queue_depths=[1, 8],
        engine_bytes=256 * MiB,
        fio_runtime_s=0.5,
        fio_file_bytes=128 * MiB,
        fio_sweep=list(FIO_SWEEP_QUICK),
        fs_chunk_sizes=[8 * MiB],
        fs_bytes=256 * MiB,
        fs_shapes=["one_job", "jobs_of_1"],
        lmcache_chunk_sizes=[2 * MiB],
        lmcache_bytes=128 * MiB,
        lmcache_concurrency=[4],
        lmcache_latency_ops=16,
        parts=config.parts if config.parts is not None else list(QUICK_PARTS),
        quick=True,
        memory_requests=8,
    )


def smoke(config: BenchConfig) -> BenchConfig:
    """The quick preset at its smallest sizes: every step of it runs, on a few
    chunks each, so a test of ``make demo`` proves the storage comparison works
    without spending minutes measuring it (``PYKVCACHE_DEMO_BENCH=smoke``).
    Its ratios are not measurements (the demo prints so when it runs it)."""
    return replace(
        quick(config),
        engine_bytes=64 * MiB,
        fio_runtime_s=0.25,
        fio_file_bytes=64 * MiB,
        fio_sweep=[(1, 1), (1, 8)],
        fs_bytes=64 * MiB,
    )


def fio_sweep_for(config: BenchConfig) -> list[tuple[int, int]]:
    """The sweep plus one-job runs at every engine queue depth, so each engine
    depth has a like-for-like fio figure."""
    pairs = list(dict.fromkeys([*config.fio_sweep, *((1, qd) for qd in config.queue_depths)]))
    return pairs
