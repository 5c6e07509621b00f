"""Runs a driver script (tests/children/driver*.py) on a scenario in a child
process and returns its ``RESULT`` line: a vLLM engine per process, so a crash
or a hang stays in the child and its log is kept beside the scenario."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_driver(driver: str, scenario: dict, workdir: Path, name: str,
               timeout: float = 900) -> tuple[dict, str]:
    path = workdir / f"{name}.json"
    path.write_text(json.dumps(scenario))
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
               TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, driver, str(path)], capture_output=True,
                          text=True, timeout=timeout, env=env)
    output = proc.stdout + "\n" + proc.stderr
    (workdir / f"{name}.log").write_text(output)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(output.splitlines()[-60:])
        pytest.fail(f"driver {name} failed (rc={proc.returncode}):\n{tail}")
    return json.loads(lines[-1][len("RESULT "):]), output
