"""The storage part's ``--encrypt`` comparison (decision 0083): plaintext and sealed engine
cases side by side, their ratios, and one whole run through the CLI with tiny sizes."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
from pykvcache.tools.bench.engine_bench import EngineCase, run_engine_case
from pykvcache.tools.bench.sealed import PLAIN, SEALED, engine_cases, sealed_output
from pykvcache.tools.cli import main

MiB = 1 << 20


def _phase(system, direction, gbps, cpu, repeat):
    return SimpleNamespace(
        system=system, direction=direction, chunk_bytes=8 * MiB, gbps=gbps, cpu_s_per_gb=cpu, params={"queue_depth": 1, "repeat": repeat}
    )


def test_the_ratio_is_the_median_of_paired_repeats_and_the_target_covers_loads_and_stores():
    phases = [
        _phase(PLAIN, "read", 1.0, 0.1, 0),
        _phase(SEALED, "read", 0.9, 0.2, 0),
        _phase(PLAIN, "read", 2.0, 0.1, 1),
        _phase(SEALED, "read", 1.9, 0.3, 1),
        _phase(PLAIN, "write", 1.0, 0.1, 0),
        _phase(SEALED, "write", 0.8, 0.2, 0),
    ]
    table, targets, raw = sealed_output(phases)  # type: ignore[arg-type]
    read = next(r for r in raw if r["direction"] == "read")
    assert read["ratio"] == pytest.approx((0.9 + 0.95) / 2) and read["repeats"] == 2
    assert read["sealed_cpu_s_per_gb"] == pytest.approx(0.25)
    [(met, why)] = targets.values()
    assert not met and "0.80x (write, 8 MiB, QD 1)" in why
    assert len(table.rows) == 2


def test_engine_cases_alternate_and_both_verify_fully(tmp_path):
    cfg = SimpleNamespace(encrypt=True, store_kwargs={"verify": "header", "segment_bytes": 1 << 20})
    first = engine_cases(cfg, tmp_path, 0)  # type: ignore[arg-type]
    assert [s for s, _ in first] == [PLAIN, SEALED] and [s for s, _ in engine_cases(cfg, tmp_path, 1)] == [SEALED, PLAIN]  # type: ignore[arg-type]
    assert all(kw["verify"] == "full" and kw["segment_bytes"] == 1 << 20 for _, kw in first)
    key = first[1][1]["encryption_key_file"]
    assert "encryption_key_file" not in first[0][1]
    assert (tmp_path / "bench-encryption.key").stat().st_mode & 0o777 == 0o600 and str(tmp_path) in key


def test_a_sealed_engine_case_moves_every_chunk_sealed(tmp_path):
    [(_, kwargs)] = [c for c in engine_cases(SimpleNamespace(encrypt=True, store_kwargs={}), tmp_path, 0) if c[0] == SEALED]  # type: ignore[arg-type]
    case = EngineCase(chunk_bytes=1 * MiB, queue_depth=2, total_bytes=4 * MiB, store_kwargs=kwargs, system=SEALED)
    write, read = run_engine_case(case, tmp_path / "engine", cold=False)
    assert (write.system, read.system, write.errors, read.errors) == (SEALED, SEALED, 0, 0)
    assert (read.info["stats"]["sealed_puts"], read.info["stats"]["opened_gets"]) == (4, 4)


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_bench_encrypt_through_the_cli(tmp_path, monkeypatch):
    from pykvcache.tools.bench import config as bench_config

    original = bench_config.quick

    def tiny(cfg):
        cfg = original(cfg)
        cfg.chunk_sizes, cfg.queue_depths, cfg.engine_bytes = [1 * MiB], [1], 4 * MiB
        cfg.fio_file_bytes, cfg.fio_runtime_s, cfg.fio_sweep = 4 * MiB, 0.1, [(1, 1)]
        return cfg

    monkeypatch.setattr("pykvcache.tools.bench.quick", tiny)
    monkeypatch.setattr("pykvcache.tools.bench.cold_cache.PAUSE_S", 0.0)
    out = tmp_path / "out"
    argv = ["bench", "--out", str(out), "--dir", str(tmp_path), "--quick", "--parts", "storage", "--no-progress", "--warm", "--encrypt"]
    main(argv)  # the tiny sizes may miss targets: the exit code is not the subject
    assert "Sealed (encryption key, AES-256-GCM) vs plaintext" in (out / "report.md").read_text()
    rows = json.loads((out / "results.json").read_text())["parts"]["storage"]["raw"]["sealed"]
    assert {r["direction"] for r in rows} == {"read", "write", "write_preformatted", "overwrite", "overwrite_no_recycle"}
    assert all(r["sealed_gbps"] > 0 and r["ratio"] > 0 for r in rows)
    assert [p.name for p in tmp_path.iterdir()] == ["out"], "the key file and the chunks are gone"
