"""Shared set-up of the pytest-benchmark suite.

Off by default in `make test` (run with `--benchmark-disable`, each benchmark
body executes once with tiny sizes so the suite cannot rot). Run for real with
`pytest benches` (PYKVCACHE_BENCH_DIR picks the storage; default: a temporary
directory on the filesystem of the working directory).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from pykvcache.tools.bench import cold_cache
from pykvcache.tools.bench.cold_cache import DiskCounter
from pykvcache.tools.bench.machine import block_device_of

MiB = 1 << 20


@dataclass(frozen=True)
class Sizes:
    """Real sizes when benchmarking; tiny ones in smoke mode."""

    smoke: bool

    def chunk(self, mib: int) -> int:
        # Smoke mode keeps the ratios between chunk sizes but not the bytes.
        return (mib * MiB) // 64 if self.smoke else mib * MiB

    def total(self, chunk: int) -> int:
        return max(chunk * 4, 2 * MiB) if self.smoke else max(chunk * 32, 512 * MiB)

    @property
    def cold(self) -> bool:
        return not self.smoke

    @property
    def fio_runtime_s(self) -> float:
        return 0.2 if self.smoke else 1.0

    @property
    def fio_file_bytes(self) -> int:
        return 8 * MiB if self.smoke else 256 * MiB


@pytest.fixture(scope="session")
def sizes(request) -> Sizes:
    smoke = bool(request.config.getoption("benchmark_disable", False))
    if smoke:
        # Tiny sizes leave nothing to settle, and dropping the machine's caches
        # would only slow down whatever else runs beside the smoke test.
        cold_cache.PAUSE_S = 0.0
    return Sizes(smoke=smoke)


@pytest.fixture(scope="session")
def bench_dir() -> Path:
    base = Path(os.environ.get("PYKVCACHE_BENCH_DIR", os.getcwd()))
    path = Path(tempfile.mkdtemp(prefix="pykvcache-benches-", dir=base))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def disk(bench_dir) -> DiskCounter:
    dev = block_device_of(bench_dir)
    return DiskCounter(dev.sysfs if dev else None)


def record(benchmark, phase) -> None:
    """Put the phase's own measurements beside pytest-benchmark's timings."""
    benchmark.extra_info.update(
        gbps=round(phase.gbps, 3),
        cpu_s_per_gb=phase.cpu_s_per_gb and round(phase.cpu_s_per_gb, 5),
        bytes=phase.bytes,
        device_fraction=phase.device_fraction,
    )
