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
    return dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        TOKENIZERS_PARALLELISM="false",
        VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocess else "0",
    )


def needs_multiprocess(scenario: dict) -> bool:
    """Tensor parallelism spawns one worker process per rank whatever we ask;
    keep the EngineCore in its own process there too (vLLM's usual layout)."""
    return int(scenario.get("llm", {}).get("tensor_parallel_size", 1)) > 1


def run_driver(
    driver: str, scenario: dict, workdir: Path, name: str, timeout: float = 900, multiprocess: bool | None = None
) -> tuple[dict, str]:
    if multiprocess is None:
        multiprocess = needs_multiprocess(scenario)
    path = workdir / f"{name}.json"
    path.write_text(json.dumps(scenario))
    proc = subprocess.run(
        [sys.executable, driver, str(path)], capture_output=True, text=True, timeout=timeout, env=driver_env(multiprocess)
    )
    output = proc.stdout + "\n" + proc.stderr
    (workdir / f"{name}.log").write_text(output)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(output.splitlines()[-60:])
        pytest.fail(f"driver {name} failed (rc={proc.returncode}):\n{tail}")
    return json.loads(lines[-1][len("RESULT ") :]), output


class EngineHost:
    """One ``driver.py --host`` process running in-process engines one after
    another (see driver.py's ``_host``): a module's engines pay vLLM's import
    once (~8-10 s of each in-process driver run here, most of it). Every
    engine still starts from scratch on its own store, staging and config;
    only the Python process is shared, so a restart scenario is a new engine,
    and the per-scenario log and result are as with a child of its own. A
    failed or timed-out scenario ends the host; the next one starts a new."""

    def __init__(self, driver: str):
        self.driver = driver
        self.proc: subprocess.Popen | None = None
        self.log: Path | None = None

    def _start(self, workdir: Path) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            self.log = workdir / "engine-host.log"
            self.proc = subprocess.Popen(
                [sys.executable, self.driver, "--host"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=open(self.log, "a"),
                text=True,
                env=driver_env(multiprocess=False),
            )
        return self.proc

    def run(self, scenario: dict, workdir: Path, name: str, timeout: float) -> tuple[dict, str]:
        import selectors

        path, log = workdir / f"{name}.json", workdir / f"{name}.log"
        path.write_text(json.dumps(scenario))
        proc = self._start(workdir)
        env = driver_env(multiprocess=False)  # the caller's environment now, as a child would get
        proc.stdin.write(json.dumps({"scenario": str(path), "log": str(log), "env": env}) + "\n")
        proc.stdin.flush()
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            ready = sel.select(timeout)
        line = proc.stdout.readline() if ready else ""
        output = log.read_text(errors="replace") if log.exists() else ""
        if not line.startswith("RESULT "):
            self.close()
            why = "timed out" if not ready else (line.strip() or f"host exited ({proc.poll()})")
            tail = "\n".join(output.splitlines()[-60:])
            pytest.fail(f"driver {name} failed in the engine host ({why[:4000]}):\n{tail}")
        return json.loads(line[len("RESULT ") :]), output

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.stdin.close()
                try:
                    self.proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            self.proc = None


_HOSTS: dict[str, EngineHost] = {}


def hosted_run(driver: str, scenario: dict, workdir: Path, name: str, timeout: float = 900) -> tuple[dict, str]:
    """``run_driver`` through this session's engine host for ``driver`` (in-process
    engines only: a scenario that needs several processes gets a child of its own)."""
    if needs_multiprocess(scenario):
        return run_driver(driver, scenario, workdir, name, timeout)
    host = _HOSTS.setdefault(driver, EngineHost(driver))
    return host.run(scenario, workdir, name, timeout)


def close_hosts() -> None:
    for host in _HOSTS.values():
        host.close()
    _HOSTS.clear()
