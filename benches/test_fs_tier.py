"""vLLM's filesystem tier and pykvcache driven the same way (identical data,
chunk sizes and job shapes), idle and under CPU contention."""

from __future__ import annotations

import importlib.util

import pytest
from conftest import record
from pykvcache.tools.bench.contention import CpuContention
from pykvcache.tools.bench.fs_tier_bench import FsCase, run_fs_case, vllm_fs_tier_available

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


@pytest.mark.parametrize("contended", [False, True], ids=["idle", "contended"])
@pytest.mark.parametrize("shape", ["one_job", "jobs_of_8", "jobs_of_1"])
@pytest.mark.parametrize("chunk_mib", [8, 28])
@pytest.mark.parametrize("system", ["fs_tier", "pykvcache"])
def test_store_then_load(benchmark, sizes, bench_dir, disk, system, chunk_mib, shape, contended):
    assert vllm_fs_tier_available() is None
    chunk = sizes.chunk(chunk_mib)
    case = FsCase(chunk, sizes.total(chunk), shape, contended)

    def run():
        with CpuContention(enabled=contended):
            return run_fs_case(case, bench_dir / "fs", [system], disk=disk, cold=sizes.cold, repeat=0)

    write, read = benchmark.pedantic(run, rounds=1 if sizes.smoke else 3)
    assert write.errors == read.errors == 0 and read.bytes == case.chunks * chunk
    benchmark.extra_info["store_gbps"] = round(write.gbps, 3)
    record(benchmark, read)
