"""Report generation, the CLI surface and the measuring helpers of the benchmark harness."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
from pykvcache.tools.bench.config import BenchConfig
from pykvcache.tools.bench.contention import CpuContention
from pykvcache.tools.bench.cpu_meter import CpuMeter
from pykvcache.tools.bench.machine import describe_machine, mount_of
from pykvcache.tools.bench.parts import Figure, PartOutput, Table
from pykvcache.tools.bench.report import RESULTS_JSON, write_report
from pykvcache.tools.cli import build_parser, main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _output() -> PartOutput:
    def draw(fig):
        ax = fig.subplots()
        ax.plot([2, 8, 28], [1.0, 2.0, 2.5], marker="o", label="pykvcache")
        ax.legend()

    return PartOutput(
        name="storage",
        title="Engine vs physical limit (fio)",
        tables=[Table(title="ratios", header=["chunk MiB", "x fio best"], rows=[["8", "0.95"], ["28", "0.97"]], note="medians")],
        figures=[Figure("storage_bandwidth.png", "GB/s by chunk size", draw)],
        targets={"engine >= 0.9x best fio": (True, "worst 0.95x"), "CPU <= 2x fio": (False, "worst 3.0x")},
        notes=["caches dropped before 2 of 2 read phases"],
        raw={"summary": [{"ratio_best": 0.95}]},
    )


def test_report_writes_markdown_png_and_json_that_name_the_machine_and_command(tmp_path):
    machine = describe_machine(tmp_path, ["pykvcache", "bench", "--out", "x", "--quick"])
    config = BenchConfig(out=tmp_path / "out", directory=tmp_path)
    skipped = PartOutput(name="fs_tier", title="vs vLLM fs tier", skipped="vLLM is not importable")
    report = write_report(tmp_path / "out", machine, config, [_output(), skipped], elapsed_s=12.0)

    md = report.read_text()
    assert "| chunk MiB | x fio best |" in md and "| 28 | 0.97 |" in md
    assert "| engine >= 0.9x best fio | yes | worst 0.95x |" in md
    assert "| CPU <= 2x fio | **no** | worst 3.0x |" in md
    assert "![GB/s by chunk size](storage_bandwidth.png)" in md
    assert "Skipped: vLLM is not importable" in md
    assert "`pykvcache bench --out x --quick`" in md
    assert machine.kernel in md and machine.cpu_model in md

    png = (tmp_path / "out" / "storage_bandwidth.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000

    raw = json.loads((tmp_path / "out" / RESULTS_JSON).read_text())
    assert raw["machine"]["command"] == "pykvcache bench --out x --quick"
    assert raw["parts"]["storage"]["targets"]["CPU <= 2x fio"] == {"met": False, "measured": "worst 3.0x"}
    assert raw["parts"]["storage"]["raw"]["summary"][0]["ratio_best"] == 0.95
    assert raw["parts"]["fs_tier"]["skipped"] == "vLLM is not importable"
    assert "python" in raw["machine"]["versions"]


def test_machine_description_finds_the_filesystem(tmp_path):
    m = describe_machine(tmp_path, ["pykvcache", "bench"])
    fstype, _, _ = mount_of(tmp_path)
    assert m.fs_type == fstype and m.fs_type
    assert m.cores == os.cpu_count()
    assert m.memory_bytes > 0
    assert "Linux" in m.one_line()


def test_cpu_meter_counts_a_busy_thread():
    spent: list[float] = []

    def spin():
        t0 = time.thread_time()
        stop = time.perf_counter() + 0.3
        while time.perf_counter() < stop:
            pass
        spent.append(time.thread_time() - t0)

    with CpuMeter() as meter:
        t = threading.Thread(target=spin)
        t.start()
        t.join()
    r = meter.result
    assert r is not None
    assert r.wall_s >= 0.29
    # Other processes may share the cores: compare with the thread's own clock.
    assert r.cpu_s >= 0.9 * spent[0] > 0.01
    assert r.cpu_s <= r.wall_s * (os.cpu_count() or 1) + 0.05
    assert sum(r.threads_s.values()) == pytest.approx(r.cpu_s, abs=0.05)
    assert r.per_gb(10**9) == pytest.approx(r.cpu_s)


def test_contention_keeps_every_core_busy_and_stops(tmp_path):
    with CpuContention(processes=2) as c:
        pids = c.pids
        assert len(pids) == 2
        ticks0 = [_cpu_ticks(p) for p in pids]
        time.sleep(0.3)
        ticks1 = [_cpu_ticks(p) for p in pids]
        assert all(b > a for a, b in zip(ticks0, ticks1))
    for p in pids:
        assert not os.path.exists(f"/proc/{p}") or _state(p) == "Z"


def _cpu_ticks(pid: int) -> int:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _state(pid: int) -> str:
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]


def test_cli_lists_parts_and_rejects_unknown_ones(tmp_path, capsys):
    assert main(["bench", "--list-parts", "--out", str(tmp_path)]) == 0
    listed = capsys.readouterr().out
    for name in ("storage", "fs_tier", "engine_profile"):
        assert name in listed
    assert main(["bench", "--out", str(tmp_path / "o"), "--dir", str(tmp_path), "--parts", "storage,nope"]) == 2
    assert "unknown benchmark part(s) nope" in capsys.readouterr().err
    assert main(["bench", "--out", str(tmp_path / "o"), "--dir", str(tmp_path / "absent")]) == 2
    assert not (tmp_path / "o").exists()


def test_cli_rejects_bad_sizes():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--out", "x", "--chunk-mib", "0.001"])
    args = build_parser().parse_args(["bench", "--out", "x", "--chunk-mib", "2,8,28", "--queue-depths", "1,32"])
    assert args.chunk_mib == [2 << 20, 8 << 20, 28 << 20] and args.queue_depths == [1, 32]


def test_adding_a_subcommand_is_one_function():
    from pykvcache.tools import cli

    @cli.subcommand("hello-test", "test-only subcommand")
    def _hello(parser):
        parser.add_argument("--name", default="x")
        return lambda args: 7 if args.name == "y" else 0

    try:
        assert cli.main(["hello-test", "--name", "y"]) == 7
    finally:
        del cli._SUBCOMMANDS["hello-test"]


def test_list_parts_needs_no_output_directory(capsys):
    # `pykvcache bench --list-parts` as the docs show it: nothing is written.
    assert main(["bench", "--list-parts"]) == 0
    assert "storage" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["bench"])
    assert exc.value.code == 2 and "--out" in capsys.readouterr().err
