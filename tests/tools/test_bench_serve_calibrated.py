"""The serve part's ``calibrated`` configuration: its servers get the profile
that ``pykvcache calibrate`` wrote before the first round, the others do not;
the calibration is the real command line (checked with its own parser), and
a calibration that fails stops the part with its output's tail."""

from __future__ import annotations

import argparse
import json

import pytest
from pykvcache.tools.bench.serve_calibrate import calibrate, calibrate_command
from pykvcache.tools.bench.serve_options import CALIBRATED, ServeOptions, check_sweep, steps_for
from pykvcache.tools.bench.serve_run import server_config
from pykvcache.tools.calibrate.cli import add_arguments

BPT = 32 * 1024


def test_only_the_calibrated_servers_get_the_profile(tmp_path):
    profile = tmp_path / "p.json"
    profile.write_text("{}")
    opts = ServeOptions(configs=["recompute", "pykvcache", CALIBRATED], calibrated_profile=str(profile))
    assert opts.check() == []
    theirs = server_config(CALIBRATED, "m", opts, BPT, tmp_path / "kv")
    ours = server_config("pykvcache", "m", opts, BPT, tmp_path / "kv")
    extra = theirs.kv_transfer_config["kv_connector_extra_config"]
    assert extra.pop("gate_profile") == str(profile)
    assert extra == ours.kv_transfer_config["kv_connector_extra_config"] and theirs.args == ours.args


def test_a_missing_profile_is_refused_and_an_unset_one_costs_a_step(tmp_path):
    opts = ServeOptions(configs=["recompute", CALIBRATED], calibrated_profile=str(tmp_path / "none.json"))
    assert any("is not a file" in p for p in opts.check())
    with_profile = steps_for(ServeOptions(configs=["recompute", CALIBRATED], calibrated_profile=__file__))
    assert steps_for(ServeOptions(configs=["recompute", CALIBRATED])) == with_profile + 1
    sweep = ServeOptions(configs=["recompute", CALIBRATED], contexts=[4096])
    assert any(p.startswith(f"configuration {CALIBRATED}: the session workload only") for p in check_sweep(sweep))


def test_the_calibration_is_a_valid_command_sized_for_the_workload(tmp_path):
    opts = ServeOptions(chunk_tokens=64, doc_tokens=1536, max_model_len=2048)
    cmd = calibrate_command("/models/m", opts, tmp_path / "kv", tmp_path / "p.json")
    assert cmd[1:3] == ["-m", "pykvcache.tools.calibrate"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(cmd[3:])
    assert (args.model, args.dtype, args.block_size, args.chunk_tokens, args.quick) == ("/models/m", "float32", 32, 64, True)
    longest = opts.doc_tokens + opts.turns * (opts.question_tokens + opts.answer_tokens) + opts.output_tokens
    assert args.max_tokens == min(longest, opts.max_model_len - 32)


def test_a_failed_calibration_raises_with_its_output(tmp_path):
    """The real command on a model directory that holds no model: it exits
    non-zero and the part says why instead of serving without a profile."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"not": "a model"}))
    log = tmp_path / "logs" / "calibrate.log"
    opts = ServeOptions(configs=["recompute", CALIBRATED])
    with pytest.raises(RuntimeError, match="pykvcache calibrate exited with") as err:
        calibrate(str(tmp_path / "model"), opts, tmp_path / "work", log)
    assert log.read_text() and str(tmp_path / "model") in str(err.value)
    assert not (tmp_path / "work" / "calibrate" / "kv").exists(), "its storage directory is removed"


def test_gate_trace_gives_every_pykvcache_server_a_trace_beside_its_storage(tmp_path):
    opts = ServeOptions(configs=["recompute", "pykvcache", CALIBRATED], calibrated_profile=__file__, gate_trace=True)
    for name in ("pykvcache", CALIBRATED):
        extra = server_config(name, "m", opts, BPT, tmp_path / name / "kv").kv_transfer_config["kv_connector_extra_config"]
        assert extra["gate_trace"] == str(tmp_path / name / "gate-trace.jsonl")
    assert server_config("recompute", "m", opts, BPT, tmp_path / "r" / "kv").kv_transfer_config is None
