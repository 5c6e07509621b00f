"""The serve part keeps every server's log and, with ``gate_trace``, the
gate's trace in the report's ``serve-logs/`` (the work directory is removed
after the run): the traces are how the gate's device model was diagnosed (decision 0079)."""

from __future__ import annotations

from pathlib import Path

from pykvcache.tools.bench.serve_options import ServeOptions
from pykvcache.tools.bench.serve_part import _keep_logs
from pykvcache.tools.bench.serve_run import server_config

BPT = 32 * 1024


def test_a_traced_servers_trace_and_logs_are_kept_under_its_logs_name(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    opts = ServeOptions(configs=["recompute", "pykvcache"], gate_trace=True)
    cfg = server_config("pykvcache", "m", opts, BPT, work / "pykvcache-1" / "kv")
    trace = Path(cfg.kv_transfer_config["kv_connector_extra_config"]["gate_trace"])
    assert not trace.is_relative_to(work / "pykvcache-1" / "kv"), "the trace is not in the namespace's directory"
    assert server_config("recompute", "m", opts, BPT, work / "recompute-1" / "kv").kv_transfer_config is None
    (work / "logs").mkdir(parents=True)
    trace.parent.mkdir(parents=True)
    trace.write_text('{"ev": "start"}\n')
    runs = [
        {
            "config": "pykvcache",
            "log": str(work / "logs" / "pykvcache-1.log"),
            "trace": str(trace),
            "predecessor": {"log": str(work / "logs" / "pykvcache-1-predecessor.log")},
        },
        {"config": "recompute", "log": str(work / "logs" / "recompute-1.log")},
        {"config": "pykvcache", "log": str(work / "logs" / "pykvcache-2.log"), "trace": str(work / "gone.jsonl")},
    ]
    for name in ("pykvcache-1", "pykvcache-1-predecessor", "recompute-1"):
        (work / "logs" / f"{name}.log").write_text(f"{name} served\n")
    _keep_logs(runs, out)
    kept = sorted(p.name for p in (out / "serve-logs").iterdir())
    assert kept == ["pykvcache-1-predecessor.log", "pykvcache-1.gate-trace.jsonl", "pykvcache-1.log", "recompute-1.log"]
    assert (out / "serve-logs" / "pykvcache-1.gate-trace.jsonl").read_text() == '{"ev": "start"}\n'


def test_without_gate_trace_no_server_writes_one(tmp_path):
    cfg = server_config("pykvcache", "m", ServeOptions(), BPT, tmp_path / "kv")
    assert "gate_trace" not in cfg.kv_transfer_config["kv_connector_extra_config"]
