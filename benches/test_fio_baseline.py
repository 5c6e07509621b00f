"""fio (io_uring, O_DIRECT, fixed buffers, preconditioned files) at the engine's
shapes and at several jobs: the physical limit the engine is compared with."""

from __future__ import annotations

import shutil

import pytest
from conftest import record
from pykvcache.tools.bench.fio_runner import FioJob, FioRunner
from pykvcache.tools.bench.storage_part import fio_phase

pytestmark = pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed (apt-get install fio)")


@pytest.fixture(scope="module")
def runner(bench_dir, disk, sizes):
    r = FioRunner(bench_dir / "fio", sizes.fio_file_bytes, 4, disk=disk)
    r.precondition()
    yield r
    r.cleanup()


@pytest.mark.parametrize("numjobs,iodepth", [(1, 1), (1, 8), (1, 32), (4, 4)])
@pytest.mark.parametrize("chunk_mib", [2, 8, 28])
@pytest.mark.parametrize("rw", ["read", "write"])
def test_fio(benchmark, runner, sizes, rw, chunk_mib, numjobs, iodepth):
    job = FioJob(rw, sizes.chunk(chunk_mib), iodepth, numjobs, sizes.fio_runtime_s)
    result = benchmark.pedantic(runner.run, args=(job,), rounds=1 if sizes.smoke else 3)
    assert result.bytes > 0
    record(benchmark, fio_phase(result, 0))
