"""First contact with pykvcache under a real vLLM (the CPU build): what
start-up reports, how fast a bad setting is refused, which metrics exist
before the first request. One engine start plus one refused start
(driver_startup.py)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from engine_driver import run_driver
from vllm_marks import VLLM_ENGINE
from child_paths import child

pytestmark = VLLM_ENGINE

DRIVER = child("driver_startup.py")
# vLLM's log format in its spawned processes: "(EngineCore pid=1) WARNING 12-01 09:25:47 [file.py:12] ..."
VLLM_LINE = r"^\((?:EngineCore|Worker|MainProcess)[^)]*\) (?:INFO|WARNING) \d\d-\d\d [\d:]+ \[[\w.]+:\d+\] "


def _run(scenario: dict, workdir: Path, name: str) -> tuple[dict, str]:
    # Multi-process: the subject includes the log lines of vLLM's spawned
    # processes (EngineCore, Worker) and a refused start spawning none.
    return run_driver(str(DRIVER), scenario, workdir, name, multiprocess=True)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


@pytest.fixture(scope="module")
def started(model, tmp_path_factory):
    work = tmp_path_factory.mktemp("pykvcache-startup")
    from pykvcache.vllm.config import kv_transfer_config

    kv = kv_transfer_config([str(work / "store")], "1000TiB", lookahead=True,
                            staging_bytes=32 * (64 << 10), block_size=64)
    result, output = _run({"mode": "start", "model": model, "kv": kv}, work, "start")
    print(f"[startup] normal start {result['startup_s']} s", file=sys.stderr)
    return result, output, work


def test_startup_log_is_in_vllm_format_once_and_names_capacity_and_staging(started):
    _, output, _ = started
    lines = output.splitlines()

    def matching(fragment):
        return [line for line in lines if fragment in line]

    [summary] = matching("pykvcache: namespace ")
    assert re.match(VLLM_LINE, summary), summary
    assert "capacity_bytes 1099511627776000" in summary and "staging_bytes 2097152 (2.0 MiB): 15 slots" in summary, summary
    # The engine's warning (Rust, logger "pykvcache") and the gate's (logger
    # "pykvcache.gate.profile") used to print as bare stderr lines, the gate's
    # reason twice.
    for fragment in ("exceeds the storage filesystem size", "no gate profile configured"):
        found = matching(fragment)
        assert len(found) == 1, (fragment, found)
        assert re.match(VLLM_LINE, found[0]) and " WARNING " in found[0], found[0]


def test_pykvcache_counters_exist_at_zero_before_the_first_request(started):
    from pykvcache.vllm.metrics import COUNTERS, PREFIX

    result, _, _ = started
    before = result["metrics_before"]
    missing = sorted(set(PREFIX + name for name in COUNTERS) - set(before))
    assert not missing, missing
    assert all(before[PREFIX + name] == 0 for name in COUNTERS)
    assert result["metrics_after"][PREFIX + "disk_writes"] >= 0  # still there after a request


def test_a_bad_setting_is_refused_before_any_engine_starts(model, started):
    normal_start_s = started[0]["startup_s"]
    work = started[2]
    result, output = _run({"mode": "bad", "model": model,
                           "helper_args": {"storage_dirs": [str(work / "bad")],
                                           "capacity_bytes": "infGiB"}}, work, "bad")
    assert result["error"] and "capacity_bytes" in result["error"], result
    # No engine process, no model load: the error comes from the caller's process at once.
    assert "EngineCore" not in output and "Loading weights" not in output
    assert result["seconds"] < min(1.0, normal_start_s / 10), (result, normal_start_s)
    assert output.count("capacity_bytes must be") == 1, output
    print(f"[startup] bad setting refused after {result['seconds']} s "
          f"(a normal start: {normal_start_s} s)", file=sys.stderr)
