"""Runs a driver script (tests/children/driver*.py) on a scenario in a child
process and returns its ``RESULT`` line: one vLLM engine per child, so a crash
or a hang stays in the child and its log is kept beside the scenario.

The EngineCore runs inside the driver (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
unless the scenario's subject is the process layout: one process importing
vLLM instead of three (driver, EngineCore, Worker) halves an engine start here
(measured: 18-21 s against 42-44 s per scenario on this 2-core VM). pykvcache's
scheduler side and worker side then share one process, which they support (the
ttft benchmark runs that way); the staging region is still a memfd and the
disk I/O still goes through the Rust engine's ring thread. Scenarios that test
the layout itself (start-up logs of the spawned processes, TP > 1 workers)
pass ``multiprocess=True``; shutdown, /dev/shm lifecycle, the OpenAI server
and the README commands start their own processes and never come here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def driver_env(multiprocess: bool) -> dict[str, str]:
    """The environment every engine child gets (also for tests that start a
    driver themselves, e.g. under a cgroup's preexec_fn)."""
    return dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
                TOKENIZERS_PARALLELISM="false",
                VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocess else "0")


def needs_multiprocess(scenario: dict) -> bool:
    """Tensor parallelism spawns one worker process per rank whatever we ask;
    keep the EngineCore in its own process there too (vLLM's usual layout)."""
    return int(scenario.get("llm", {}).get("tensor_parallel_size", 1)) > 1


def run_driver(driver: str, scenario: dict, workdir: Path, name: str,
               timeout: float = 900, multiprocess: bool | None = None) -> tuple[dict, str]:
    if multiprocess is None:
        multiprocess = needs_multiprocess(scenario)
    path = workdir / f"{name}.json"
    path.write_text(json.dumps(scenario))
    proc = subprocess.run([sys.executable, driver, str(path)], capture_output=True,
                          text=True, timeout=timeout, env=driver_env(multiprocess))
    output = proc.stdout + "\n" + proc.stderr
    (workdir / f"{name}.log").write_text(output)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(output.splitlines()[-60:])
        pytest.fail(f"driver {name} failed (rc={proc.returncode}):\n{tail}")
    return json.loads(lines[-1][len("RESULT "):]), output
