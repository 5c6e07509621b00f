"""The lmcache_disk benchmark part: pykvcache's BlockStore against LMCache's real
local disk tier (a private install, ``make lmcache-env`` or
``PYKVCACHE_LMCACHE_PATH``), and the reasons it gives when LMCache is absent."""

from __future__ import annotations

import json

import pytest
from pykvcache.tools.bench import BenchConfig, lmcache_part, run_bench
from pykvcache.tools.bench.lmcache_part import LMCACHE_PATH_ENV, lmcache_import_error, lmcache_install
from pykvcache.tools.cli import main

MiB = 1 << 20


def _lmcache_or_skip():
    where, reason = lmcache_install()
    if reason is None:
        reason = lmcache_import_error(where)
    if reason is not None:
        pytest.skip(f"no usable LMCache install: {reason}")
    return where


@pytest.mark.slow
def test_both_systems_store_and_load_identical_bytes_through_their_real_stores(tmp_path):
    _lmcache_or_skip()
    cfg = BenchConfig(
        out=tmp_path / "out",
        directory=tmp_path,
        parts=["lmcache_disk"],
        repeats=1,
        lmcache_chunk_sizes=[2 * MiB],
        lmcache_bytes=8 * MiB,
        lmcache_concurrency=[2],
        lmcache_latency_ops=3,
        cold_reads=False,
    )
    result = run_bench(cfg)
    (out,) = result.outputs
    assert out.skipped is None, out.raw.get("error")
    runs = out.raw["runs"]
    assert sorted(r["system"] for r in runs) == ["lmcache", "pykvcache"]
    for r in runs:
        # 4 chunks in flight + 3 one at a time, every one compared byte for byte.
        assert r["chunks"] == 4 and r["verified"] == 4 + 3
        assert len(r["latency_s"]["write"]) == 3 and len(r["latency_s"]["read"]) == 3
        assert r["file_bytes"] >= 7 * 2 * MiB
    lm = next(r for r in runs if r["system"] == "lmcache")
    assert lm["info"]["lmcache"] == "0.5.6" and lm["info"]["disk_io_threads"] == 2
    phases = [(p["system"], p["direction"]) for p in out.raw["phases"]]
    assert sorted(phases) == sorted((s, d) for s in ("lmcache", "pykvcache") for d in ("write", "flush", "read"))
    for p in out.raw["phases"]:
        assert p["errors"] == 0 and p["bytes"] == 8 * MiB and p["seconds"] > 0
    met, why = out.targets["every chunk read back identical, both systems"]
    assert met and why == "pykvcache 7/7, lmcache 7/7"
    ops = {(p["op"]) for p in out.raw["pairs"]}
    assert ops == {"load (cold)", "store (acknowledged)", "store + fsync (on device)"}
    for p in out.raw["pairs"]:
        assert p["ratio"] == pytest.approx([p["pykvcache"][0] / p["lmcache"][0]])
    md = result.report.read_text()
    assert "pykvcache vs LMCache's local disk tier" in md and "pykvcache / LMCache" in md
    # Only the report is left: both systems' files are gone.
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_path_without_lmcache_is_skipped_with_the_reason_and_how_to_install(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv(LMCACHE_PATH_ENV, str(empty))
    out = tmp_path / "out"
    rc = main(
        [
            "bench",
            "--out",
            str(out),
            "--dir",
            str(tmp_path),
            "--parts",
            "lmcache_disk",
            "--no-progress",
            "--lmcache-mib",
            "8",
            "--lmcache-concurrency",
            "2",
        ]
    )
    assert rc == 0
    part = json.loads((out / "results.json").read_text())["parts"]["lmcache_disk"]
    assert part["skipped"].startswith(f"{LMCACHE_PATH_ENV}={empty} holds no lmcache package")
    assert "make lmcache-env" in part["skipped"] and "never into vLLM's venv" in part["skipped"]
    assert f"Skipped: {part['skipped']}" in (out / "report.md").read_text()


def test_no_install_anywhere_says_so(tmp_path, monkeypatch):
    import importlib.util

    if importlib.util.find_spec("lmcache") is not None:
        pytest.skip("lmcache is importable from this environment itself")
    monkeypatch.delenv(LMCACHE_PATH_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    # Neither ./<dir> nor <repo>/<dir> exists under this name.
    monkeypatch.setattr(lmcache_part, "DEFAULT_DIR", ".lmcache-absent-for-this-test")
    where, reason = lmcache_install()
    assert where is None
    assert reason.startswith(f"LMCache is not installed ({LMCACHE_PATH_ENV} unset, no .lmcache-absent-for-this-test/)")
    assert "make lmcache-env" in reason


def test_an_install_that_does_not_import_is_skipped_with_its_own_error(tmp_path, monkeypatch):
    broken = tmp_path / "broken" / "lmcache"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('lmcache needs a module this install lacks')\n")
    monkeypatch.setenv(LMCACHE_PATH_ENV, str(broken.parent))
    cfg = BenchConfig(out=tmp_path / "out", directory=tmp_path, parts=["lmcache_disk"])
    (out,) = run_bench(cfg).outputs
    assert out.skipped == (f"LMCache does not import from {broken.parent}: ImportError: lmcache needs a module this install lacks")
