"""First contact with pykvcache under a real vLLM (the CPU build): what
start-up reports, how fast a bad setting is refused, which metrics exist
before the first request. One engine start, then one driver process with the
helper's refusal (no engine) and one refused engine start (driver_startup.py)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from child_paths import child
from engine_driver import run_driver
from vllm_marks import VLLM_ENGINE

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

    kv = kv_transfer_config([str(work / "store")], "1000TiB", lookahead=True, staging_bytes=32 * (64 << 10), block_size=64)
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


#: Everything wrong at once, as a JSON --kv-transfer-config (PyKvCacheConnector): each used to
#: cost an engine start of its own (block_size alone first, vLLM's own refusal; then the
#: misspelt key alone; then the sizes), and four were accepted silently.
FIRST_CONTACT_PROBLEMS = {
    "block_size": (48, "block_size=48 (tokens per chunk) is not a multiple of vLLM's KV cache block size (32 tokens"),
    "capacty": ("1GiB", "unknown key(s) 'capacty'"),
    "capacity_bytes": (1, "capacity_bytes (1 bytes) is smaller than the smallest chunk file"),
    "staging_bytes": ("1000TiB", "is more than this host's memory"),
    "lookahead_bytes": ("2000TiB", "lookahead_bytes (2199023255552000 bytes) is more than staging_bytes"),
    "model_id": ("../../etc", "model_id must be a label"),
    "gate_trace": ("/proc/pykvcache-trace", "gate_trace /proc/pykvcache-trace is on a proc filesystem"),
}


@pytest.fixture(scope="module")
def refused(model, started):
    """One driver process: the helper's refusal (no engine), then the same kind of mistakes
    as a JSON dict handed to vLLM (one engine start, refused)."""
    work = started[2]
    extra = {
        "spec_name": "NvmeOffloadingSpec",
        "spec_module_path": "pykvcache.vllm",
        "storage_dirs": [str(work / "json-store")],
        **{key: value for key, (value, _) in FIRST_CONTACT_PROBLEMS.items()},
    }
    json_kv = {
        "kv_connector": "PyKvCacheConnector",
        "kv_connector_module_path": "pykvcache.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
    result, output = _run(
        {
            "mode": "bad",
            "model": model,
            "json_kv": json_kv,
            "helper_args": {"storage_dirs": [str(work / "bad")], "capacity_bytes": "infGiB"},
        },
        work,
        "bad",
    )
    from driver_startup import JSON_START

    # vLLM's processes log to stdout, which the output starts with: before the marker is
    # what the helper's part printed, after it the JSON start's (and the driver's stderr).
    helper_part, _, json_part = output.partition(JSON_START)
    return result, helper_part, json_part


def test_every_problem_of_a_json_config_is_reported_by_one_engine_start(refused, started):
    result, _, output = refused
    assert result["json_error"], result
    lines = output.splitlines()
    for key, (_, fragment) in FIRST_CONTACT_PROBLEMS.items():
        assert any(fragment in line for line in lines), (key, fragment, output[-4000:])
    # One error: the first pykvcache code that sees the settings (the worker's connector)
    # refused them before vLLM's own check and before the KV cache was allocated.
    assert "must be a multiple of the GPU KV cache block size" not in output
    assert "pykvcache: namespace" not in output
    print(
        f"[startup] JSON settings with {len(FIRST_CONTACT_PROBLEMS)} problems refused by one engine start "
        f"after {result['json_seconds']} s (a normal start: {started[0]['startup_s']} s)",
        file=sys.stderr,
    )


def test_a_bad_setting_is_refused_before_any_engine_starts(model, started, refused):
    normal_start_s = started[0]["startup_s"]
    result, output, _ = refused
    assert result["error"] and "capacity_bytes" in result["error"], result
    # No engine process, no model load: the error comes from the caller's process at once.
    assert "EngineCore" not in output and "Loading weights" not in output
    assert result["seconds"] < min(1.0, normal_start_s / 10), (result, normal_start_s)
    # Said once, by the exception: nothing logged it before it reached the caller.
    assert result["error"].count("capacity_bytes must be") == 1 and "capacity_bytes must be" not in output, output
    print(f"[startup] bad setting refused after {result['seconds']} s (a normal start: {normal_start_s} s)", file=sys.stderr)
