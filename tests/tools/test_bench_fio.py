"""The fio side of the benchmark harness, on real fio runs when fio is installed."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from pykvcache.tools.bench.cold_cache import DiskCounter
from pykvcache.tools.bench.fio_runner import FioError, FioJob, FioRunner, best, parse_fio_json, sweep_jobs
from pykvcache.tools.bench.machine import block_device_of

MiB = 1 << 20
needs_fio = pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed (apt-get install fio)")


def _direct_io_ok(path) -> bool:
    import mmap
    import os

    probe = path / "odirect-probe"
    buf = mmap.mmap(-1, 4096)
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
        try:
            os.write(fd, buf)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


@pytest.fixture
def runner(tmp_path):
    if not _direct_io_ok(tmp_path):
        pytest.skip("the test directory refuses O_DIRECT")
    dev = block_device_of(tmp_path)
    r = FioRunner(tmp_path / "fio", 16 * MiB, 2, disk=DiskCounter(dev.sysfs if dev else None))
    yield r
    r.cleanup()


@needs_fio
def test_precondition_writes_every_file_completely(runner):
    cmd = runner.precondition()
    assert "--rw=write" in cmd
    files = sorted(runner.directory.glob("pykvcache-fio.*"))
    assert [f.name for f in files] == ["pykvcache-fio.0", "pykvcache-fio.1"]
    for f in files:
        assert f.stat().st_size == 16 * MiB
        # Written, not just allocated: the file has data blocks for its whole length.
        assert f.stat().st_blocks * 512 >= 16 * MiB


@needs_fio
@pytest.mark.parametrize("rw", ["read", "write"])
def test_real_fio_run_is_parsed_with_bandwidth_and_cpu(runner, rw):
    job = FioJob(rw=rw, block_bytes=1 * MiB, iodepth=2, numjobs=2, runtime_s=0.3)
    res = runner.run(job)
    assert res.bytes >= 2 * MiB and res.bytes % MiB == 0
    assert 0.2 <= res.seconds <= 5
    assert res.bw_bytes_s == pytest.approx(res.bytes / res.seconds)
    assert res.cpu_user_s >= 0 and res.cpu_sys_s >= 0 and res.cpu_s > 0
    assert res.mean_latency_s is not None and res.mean_latency_s > 0
    for flag in ("--ioengine=io_uring", "--direct=1", "--fixedbufs", "--registerfiles", "--numjobs=2", "--iodepth=2"):
        assert flag in res.command
    assert not any(c.startswith("--output=") for c in res.command)
    if res.disk is not None and rw == "read":
        # O_DIRECT reads of preconditioned files must come from the device.
        assert res.disk["read_bytes"] >= 0.9 * res.bytes


@needs_fio
def test_aggregate_matches_fio_per_job_numbers(runner, tmp_path):
    runner.precondition()
    out = tmp_path / "raw.json"
    job = FioJob(rw="read", block_bytes=1 * MiB, iodepth=1, numjobs=2, runtime_s=0.3)
    subprocess.run(runner.command(job, out), check=True, capture_output=True)
    text = out.read_text()
    doc = json.loads(text[text.index("{") :])
    res = parse_fio_json(text, job, ["fio"])
    assert res.bytes == sum(j["read"]["io_bytes"] for j in doc["jobs"])
    cpu = sum((j["usr_cpu"] + j["sys_cpu"]) / 100 * j["job_runtime"] / 1000 for j in doc["jobs"])
    assert res.cpu_s == pytest.approx(cpu)


def test_parse_rejects_garbage_and_failed_jobs():
    job = FioJob(rw="read", block_bytes=MiB, iodepth=1, numjobs=1, runtime_s=1)
    with pytest.raises(FioError, match="no JSON"):
        parse_fio_json("fio: engine io_uring not loadable", job, [])
    failed = {"jobs": [{"jobname": "bench", "error": 22, "read": {}, "usr_cpu": 0, "sys_cpu": 0}]}
    with pytest.raises(FioError, match="error 22"):
        parse_fio_json(json.dumps(failed), job, [])
    empty = {"jobs": [{"jobname": "b", "error": 0, "job_runtime": 0, "usr_cpu": 0, "sys_cpu": 0, "read": {"io_bytes": 0, "runtime": 0}}]}
    with pytest.raises(FioError, match="no data"):
        parse_fio_json(json.dumps(empty), job, [])


def test_sweep_respects_the_registered_memory_cap_and_best_picks_fastest():
    jobs = sweep_jobs("read", 28 * MiB, [(1, 1), (1, 32), (16, 2), (16, 32)], 1.0, 1024 * MiB)
    assert [(j.numjobs, j.iodepth) for j in jobs] == [(1, 1), (1, 32), (16, 2)]
    assert best([], "read") is None


def test_fio_failure_is_a_clear_error(tmp_path):
    r = FioRunner(tmp_path / "missing" / "deeper", 1 * MiB, 1, fio="/bin/false")
    with pytest.raises(FioError, match="precondition failed"):
        r.precondition()


@needs_fio
def test_chunk_files_layout_writes_fresh_files_then_reads_them(runner):
    write = FioJob(rw="write", block_bytes=1 * MiB, iodepth=2, numjobs=1, runtime_s=0, chunk_files=6)
    read = FioJob(rw="read", block_bytes=1 * MiB, iodepth=2, numjobs=1, runtime_s=0, chunk_files=6)
    with pytest.raises(FioError, match="write of the same shape first"):
        runner.run(read)
    w = runner.run(write)
    files = sorted(runner.chunk_dir.iterdir())
    assert len(files) == 6 and all(f.stat().st_size == MiB for f in files)
    assert w.bytes == 6 * MiB and "--fallocate=none" in w.command and "--nrfiles=6" in w.command
    r = runner.run(read)
    assert r.bytes == 6 * MiB and r.gbps > 0
    # Every write starts from fresh files, as the engine's puts do.
    (runner.chunk_dir / "sentinel").write_bytes(b"x")
    runner.run(write)
    assert not (runner.chunk_dir / "sentinel").exists()
    assert len(list(runner.chunk_dir.iterdir())) == 6
    # An overwrite writes over the same files (same inodes), as recycling does.
    inodes = {f.name: f.stat().st_ino for f in runner.chunk_dir.iterdir()}
    over = FioJob(rw="write", block_bytes=1 * MiB, iodepth=2, numjobs=1, runtime_s=0, chunk_files=6, overwrite=True)
    o = runner.run(over)
    assert o.bytes == 6 * MiB and "overwrite" in over.label
    assert {f.name: f.stat().st_ino for f in runner.chunk_dir.iterdir()} == inodes
    runner.cleanup()
    with pytest.raises(FioError, match="write of the same shape first"):
        runner.run(over)
    runner.cleanup()
    assert not runner.chunk_dir.exists()
