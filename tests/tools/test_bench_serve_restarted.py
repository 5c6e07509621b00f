"""The serve part's ``restarted`` configuration: a predecessor serves other
documents on the same storage before the measured server starts, and the
part says whether the measured server restored what it learnt (0073). The
serving run itself is what docs/performance.md reports; here the pieces that
decide what it measures."""

from __future__ import annotations

from pathlib import Path

import pytest
from pykvcache.tools.bench.serve_options import RESTARTED, ServeOptions, check_sweep, steps_for
from pykvcache.tools.bench.serve_restart import RESTORED_MARK, predecessor_workload, restored
from pykvcache.tools.bench.serve_run import server_config
from pykvcache.tools.bench.serve_workload import Workload, build_sessions

BPT = 32 * 1024


def test_the_predecessor_serves_none_of_the_measured_documents(tiny_model):
    opts = ServeOptions(doc_tokens=256, documents=4)
    tok = str(Path(tiny_model) / "tokenizer.json")
    theirs, _ = build_sessions(predecessor_workload(opts, BPT), tok)
    for level in range(2):  # every concurrency level's documents (run_server: seed + 1000 * level)
        ours, _ = build_sessions(Workload(documents=opts.documents, doc_tokens=opts.doc_tokens, seed=opts.seed + 1000 * level), tok)
        # The first block after "Document N." already differs: no chunk hash is shared.
        assert not {d.split(".", 1)[1][:64] for d in theirs} & {d.split(".", 1)[1][:64] for d in ours}


def test_the_predecessor_reads_its_documents_back_from_disk():
    """More documents than staging holds, each asked for by two sessions: the
    second finds it evicted from staging, so the gate learns from real reads."""
    opts = ServeOptions(doc_tokens=1536, staging_bytes=160 << 20)
    w = predecessor_workload(opts, BPT)
    assert w.documents * opts.doc_tokens * BPT > 1.5 * opts.staging_bytes
    assert w.sessions == 2 * w.documents and w.turns >= 2


def test_restarted_is_pykvcache_with_one_more_server_per_repeat(tmp_path):
    opts = ServeOptions(configs=["recompute", "pykvcache", RESTARTED], repeats=2)
    assert opts.check() == []
    ours = server_config("pykvcache", "m", opts, BPT, tmp_path / "kv")
    theirs = server_config(RESTARTED, "m", opts, BPT, tmp_path / "kv")
    assert theirs.kv_transfer_config == ours.kv_transfer_config and theirs.args == ours.args
    without = steps_for(ServeOptions(configs=["recompute", "pykvcache", "gate_off"], repeats=2))
    assert steps_for(opts) == without + 2
    sweep = ServeOptions(configs=["recompute", RESTARTED], contexts=[4096])
    assert any(p.startswith(f"configuration {RESTARTED}: the session workload only") for p in check_sweep(sweep))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (f"INFO x: {RESTORED_MARK} /kv/ns/gate-device.json (4 loads: 25 MB/s)", (4, 25.0)),
        ("INFO pykvcache gate: on, cost model from default", None),
    ],
)
def test_restored_reads_the_measured_servers_log(tmp_path, text, expected):
    log = tmp_path / "server.log"
    log.write_text("start\n" + text + "\n")
    assert restored(log) == expected
    assert restored(tmp_path / "missing.log") is None


def test_the_mark_is_what_the_gate_logs():
    from pykvcache.vllm.scheduler import gate_plan

    assert RESTORED_MARK in Path(gate_plan.__file__).read_text()
