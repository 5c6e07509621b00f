"""``vllm-router``, the vLLM project's load balancer, as a child process.

pykvcache does not route: the router is installed on its own (``pip install
vllm-router==0.1.17``, or ``dev/setup_router.sh`` into a private directory given as
``router_path``) and started as its launcher (``python -m vllm_router.launch_router``) in its
own process group, so that stopping it leaves nothing behind. Its HTTP API answers which
workers it routes to (``/list_workers``), takes new ones (``/add_worker``) and drops dead
ones (``/remove_worker``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from ..vllm_server import ServerFailed, free_port, log_tail, stop_group


class RouterMissing(RuntimeError):
    """vllm-router is not importable with the given path."""


def router_environment(router_path: str | None) -> dict[str, str]:
    env = dict(os.environ)
    if router_path:
        env["PYTHONPATH"] = os.pathsep.join([router_path, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def check_router(router_path: str | None) -> None:
    """Raise :class:`RouterMissing` with the install command when the router cannot be imported."""
    probe = subprocess.run(
        [sys.executable, "-c", "import vllm_router.launch_router, vllm_router_rs"],
        env=router_environment(router_path), capture_output=True, text=True, check=False,
    )  # fmt: skip
    if probe.returncode != 0:
        where = f" under {router_path}" if router_path else ""
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        raise RouterMissing(
            f"vllm-router is not importable{where} ({last}); install it with "
            "`pip install vllm-router==0.1.17` (or `bash dev/setup_router.sh DIR` and pass --router-path DIR)"
        )


class Router:
    """The router process: ``start()``, ``stop()``, and its worker API."""

    def __init__(self, args: list[str], log_path: Path, host: str = "127.0.0.1", port: int = 0, router_path: str | None = None):
        self.args = args
        self.log_path = log_path
        self.host = host
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self.router_path = router_path
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        return [sys.executable, "-m", "vllm_router.launch_router", "--host", self.host, "--port", str(self.port), *self.args]

    def start(self, timeout_s: float = 60.0) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            log.write(("$ " + " ".join(self.command()) + "\n").encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=router_environment(self.router_path), start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise ServerFailed(f"router: exited with status {self.proc.returncode}; log {self.log_path}:\n{log_tail(self.log_path)}")
            try:
                self.get("/health", timeout=2)
                return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ServerFailed(f"router: not healthy after {timeout_s:.0f} s; log {self.log_path}:\n{log_tail(self.log_path)}")
            time.sleep(0.3)

    def get(self, path: str, timeout: float = 10) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            body = r.read().decode()
        try:
            return json.loads(body)
        except ValueError:
            return body

    def workers(self) -> list[str]:
        """The worker URLs the router routes to now."""
        listed = self.get("/list_workers")
        urls: list[Any] = (listed.get("urls") or listed.get("workers") or []) if isinstance(listed, dict) else list(listed)
        return sorted(u if isinstance(u, str) else str(u.get("url")) for u in urls)

    def add_worker(self, url: str) -> None:
        query = urllib.parse.urlencode({"url": url})
        req = urllib.request.Request(f"{self.url}/add_worker?{query}", method="POST")
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()

    def remove_worker(self, url: str) -> None:
        query = urllib.parse.urlencode({"url": url})
        req = urllib.request.Request(f"{self.url}/remove_worker?{query}", method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            r.read()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        proc = self.proc
        if proc is None:
            return
        stop_group(proc, signal.SIGTERM, grace_s=10)
