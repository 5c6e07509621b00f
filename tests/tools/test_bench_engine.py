"""The engine and fs-tier drivers of the benchmark, on real files with tiny sizes,
and one whole ``run_bench`` through the CLI."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
from pykvcache.tools.bench.cold_cache import DiskCounter
from pykvcache.tools.bench.engine_bench import EngineCase, run_engine_case
from pykvcache.tools.bench.fs_tier_bench import FsCase, run_fs_case, split_jobs, vllm_fs_tier_available
from pykvcache.tools.bench.machine import block_device_of
from pykvcache.tools.cli import main

MiB = 1 << 20


def _chunk_files_left(root):
    """Files the bench left under its directory, but the root's capacity ledger: that is the
    directory's bookkeeping for every writer sharing it (decision 0053), not data."""
    return [p for p in root.rglob("*") if p.is_file() and p != root / ".capacity-ledger"]


def _disk(path) -> DiskCounter:
    dev = block_device_of(path)
    return DiskCounter(dev.sysfs if dev else None)


def test_engine_case_writes_then_reads_every_chunk(tmp_path):
    case = EngineCase(chunk_bytes=1 * MiB, queue_depth=2, total_bytes=6 * MiB)
    write, read = run_engine_case(case, tmp_path / "engine", disk=_disk(tmp_path), cold=True)
    assert (write.direction, read.direction) == ("write", "read")
    for p in (write, read):
        assert p.system == "pykvcache" and p.errors == 0
        assert p.chunks == 6 and p.bytes == 6 * MiB
        assert p.seconds > 0 and p.gbps > 0 and p.cpu_s > 0
        assert p.params["queue_depth"] == 2
        assert p.info["backend"] in ("io_uring", "threads")
    assert read.info["stats"]
    if read.disk is not None and read.info["direct_io"]:
        assert read.device_fraction >= 0.9
    # The benchmark removes what it wrote.
    assert _chunk_files_left(tmp_path / "engine") == []


def test_engine_case_overwrites_a_full_store_with_and_without_recycling(tmp_path):
    case = EngineCase(chunk_bytes=1 * MiB, queue_depth=2, total_bytes=6 * MiB, overwrite=True)
    phases = run_engine_case(case, tmp_path / "engine", disk=_disk(tmp_path), cold=False)
    assert [p.direction for p in phases] == ["write", "read", "overwrite", "overwrite_no_recycle"]
    over, fresh = phases[2], phases[3]
    for p in (over, fresh):
        assert p.errors == 0 and p.chunks == 6 and p.info["evictions"] == 6
    assert over.info["recycled_files"] + over.info["recycle_skipped"] == 6 and over.info["recycled_files"] > 0
    assert fresh.info["recycled_files"] == 0
    assert _chunk_files_left(tmp_path / "engine") == []


def test_engine_case_fills_a_preformatted_store_by_overwriting_fillers(tmp_path):
    case = EngineCase(chunk_bytes=1 * MiB, queue_depth=2, total_bytes=6 * MiB, preformat=True)
    phases = run_engine_case(case, tmp_path / "engine", disk=_disk(tmp_path), cold=False)
    assert [p.direction for p in phases] == ["write", "read", "write_preformatted"]
    pre = phases[2]
    assert pre.errors == 0 and pre.chunks == 6 and pre.info["fillers"] == 6 and pre.info["preformat_gbps"] > 0
    # Every put evicted a filler and overwrote its file.
    assert pre.info["evictions"] == 6 and pre.info["recycled_files"] == 6
    assert _chunk_files_left(tmp_path / "engine") == []


def test_job_shapes_split_chunks_like_the_fs_tier_jobs():
    assert split_jobs(5, "one_job") == [[0, 1, 2, 3, 4]]
    assert split_jobs(10, "jobs_of_8") == [list(range(8)), [8, 9]]
    assert split_jobs(3, "jobs_of_1") == [[0], [1], [2]]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_fs_tier_and_pykvcache_move_identical_data(tmp_path):
    assert vllm_fs_tier_available() is None
    case = FsCase(chunk_bytes=1 * MiB, total_bytes=4 * MiB, shape="jobs_of_1", contention=False)
    phases = run_fs_case(
        case, tmp_path, ["fs_tier", "pykvcache", "pykvcache_tier", "pykvcache_tier_direct"], disk=_disk(tmp_path), cold=True, repeat=0
    )
    assert [(p.system, p.direction) for p in phases] == [
        ("fs_tier", "write"),
        ("fs_tier", "read"),
        ("pykvcache", "write"),
        ("pykvcache", "read"),
        ("pykvcache_tier", "write"),
        ("pykvcache_tier", "read"),
        ("pykvcache_tier_direct", "write"),
        ("pykvcache_tier_direct", "read"),
    ]
    for p in phases:
        assert p.errors == 0 and p.bytes == 4 * MiB and p.params["jobs"] == 4
    assert phases[0].info["threads"] == 32
    assert phases[4].info["backend"] in ("io_uring", "threads")
    assert [p.info["cpu_tier_io"] for p in phases[4:]] == ["copy", "copy", "direct", "direct"]
    assert [p.info["region"] for p in phases[4:]] == [False, False, True, True], "direct moves chunks from the region"
    for name in ("vllm-fs-tier", "pykvcache", "pykvcache-tier", "pykvcache-tier-direct"):
        assert not (tmp_path / name).exists()


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_run_bench_end_to_end_through_the_cli(tmp_path, monkeypatch):
    from pykvcache.tools.bench import config as bench_config

    # The quick preset, shrunk further so the test takes seconds.
    original = bench_config.quick

    def tiny(cfg):
        cfg = original(cfg)
        cfg.chunk_sizes, cfg.queue_depths, cfg.engine_bytes = [1 * MiB], [1, 4], 8 * MiB
        cfg.fio_file_bytes, cfg.fio_runtime_s, cfg.fio_sweep = 8 * MiB, 0.2, [(1, 1), (2, 1)]
        return cfg

    monkeypatch.setattr("pykvcache.tools.bench.quick", tiny)
    # Tiny files leave nothing to settle; cold reads are covered above.
    monkeypatch.setattr("pykvcache.tools.bench.cold_cache.PAUSE_S", 0.0)
    out = tmp_path / "out"
    argv = ["bench", "--out", str(out), "--dir", str(tmp_path), "--quick", "--parts", "storage", "--no-progress", "--warm"]
    rc = main(argv)
    assert rc == 0
    md = (out / "report.md").read_text()
    assert "pykvcache engine vs fio" in md and "x fio best" in md
    raw = json.loads((out / "results.json").read_text())
    summary = raw["parts"]["storage"]["raw"]["summary"]
    assert {(s["direction"], s["chunk_bytes"]) for s in summary} == {
        (d, MiB) for d in ("read", "write", "write_preformatted", "overwrite", "overwrite_no_recycle")
    }
    for s in summary:
        assert s["engine_gbps"] > 0 and s["fio_best_gbps"] > 0
        assert s["ratio_best"] == pytest.approx(s["engine_gbps"] / s["fio_best_gbps"])
    assert (out / "storage_bandwidth.png").stat().st_size > 10_000
    # Only the report is left behind: the benchmark's own files are gone.
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
