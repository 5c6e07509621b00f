"""pykvcache engine: write and read GB/s for 2/8/28 MiB chunks at 1/8/32 chunk
operations in flight, through the Python API (the same code as `pykvcache bench`)."""

from __future__ import annotations

import pytest
from conftest import record
from pykvcache.tools.bench.engine_bench import EngineCase, run_engine_case


@pytest.mark.parametrize("queue_depth", [1, 8, 32])
@pytest.mark.parametrize("chunk_mib", [2, 8, 28])
def test_engine_write_then_read(benchmark, sizes, bench_dir, disk, chunk_mib, queue_depth):
    chunk = sizes.chunk(chunk_mib)
    case = EngineCase(chunk, queue_depth, sizes.total(chunk))
    phases = benchmark.pedantic(
        run_engine_case, args=(case, bench_dir / "engine"), kwargs={"disk": disk, "cold": sizes.cold}, rounds=1 if sizes.smoke else 3
    )
    write, read = phases
    assert write.errors == read.errors == 0
    assert write.bytes == read.bytes == case.chunks * chunk
    benchmark.extra_info["write_gbps"] = round(write.gbps, 3)
    record(benchmark, read)
