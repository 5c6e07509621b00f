"""``pykvcache cluster`` end to end, as docs/cluster.md gives it: a real vLLM OpenAI server on
a store directory and the vLLM project's router (vllm-router 0.1.17, ``cache_aware``) in front,
driven through the router as a user would, then stopped with Ctrl-C (SIGINT): exit status 0,
``stopped``, no process of the router's or the node's group left, no port listening.

One node: what two nodes add (routing by prefix, a killed node reported and taken out of the
router, the survivors and a joining node serving from the store) is the cluster benchmark
part's test, tests/shared_fs/test_shared_fs_cluster.py, which runs the same ``Cluster``.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from vllm_marks import VLLM_ENGINE

pytestmark = VLLM_ENGINE

ROOT = Path(__file__).resolve().parents[2]
ROUTER_PATH = ROOT / ".vllm-router"
#: The command docs/cluster.md gives, before this machine's sizes.
DOCS_COMMAND = "pykvcache cluster --model <model> --store /mnt/shared/kv --nodes 2"
VLLM_ARGS = ["--dtype=float32", "--enforce-eager", "--max-model-len=2048", f"--kv-cache-memory-bytes={64 << 20}", "--max-num-seqs=4"]


def _metrics(url: str) -> dict[str, float]:
    from pykvcache.tools.vllm_server import parse_metrics

    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        return parse_metrics(r.read().decode())


def _complete(url: str, prompt: list[int]) -> list[int]:
    body = json.dumps({"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return list(json.loads(r.read())["choices"][0]["token_ids"])


class _Command:
    """The running command: its stdout lines as they come."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def until(self, predicate, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    break
                continue
            self.seen.append(line)
            if predicate(line):
                return line
        pytest.fail("the cluster command never printed the awaited line; its output:\n" + "\n".join(self.seen[-60:]))


def _group_gone(pgid: int, timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_the_documented_command_starts_serves_through_the_router_and_stops_clean_on_ctrl_c(tiny_model, tmp_path):
    if not (ROUTER_PATH / "vllm_router").is_dir():
        pytest.skip(f"vllm-router is not installed in {ROUTER_PATH} (make router-env; make test installs it)")
    assert DOCS_COMMAND in (ROOT / "docs" / "cluster.md").read_text()
    from pykvcache.testing.tiny_model import synthetic_text
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    doc = tokenizer(synthetic_text(300, seed=950)).input_ids[:1400]
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    argv = DOCS_COMMAND.replace("<model>", tiny_model).replace("/mnt/shared/kv", str(store)).split()[1:]
    argv += ["--nodes", "1", "--port", "0", "--capacity", "64MiB", "--staging", "16MiB", "--log-dir", str(tmp_path / "logs")]
    argv += ["--router-path", str(ROUTER_PATH), *(f"--vllm-arg={a}" for a in VLLM_ARGS)]
    cmd = _Command([sys.executable, "-m", "pykvcache.tools.cli", *argv])
    try:
        cmd.until(lambda line: line.startswith("ready"), timeout=400)
        router = next(line for line in cmd.seen if line.startswith("router "))
        router_url, router_pid = router.split()[1], int(router.split()[3])
        members = {line.split()[0]: line.split() for line in cmd.seen if line.startswith("node-")}
        nodes = {name: words[1] for name, words in members.items()}
        pids = {name: int(words[3]) for name, words in members.items()}
        assert len(nodes) == 1
        # A request through the router, answered by the node (its own counter).
        [node_url] = nodes.values()
        before = _metrics(node_url).get("vllm:request_success_total", 0)
        assert len(_complete(router_url, doc + [7, 8])) == 6
        assert _metrics(node_url).get("vllm:request_success_total", 0) == before + 1
    finally:
        if cmd.proc.poll() is None:
            os.kill(cmd.proc.pid, signal.SIGINT)
        try:
            rc = cmd.proc.wait(timeout=120)
        finally:
            if cmd.proc.poll() is None:
                os.killpg(cmd.proc.pid, signal.SIGKILL)
    # A clean stop.
    cmd.until(lambda line: line.startswith("stopped"), timeout=10)
    assert cmd.seen[-1] == "stopped" and rc == 0, cmd.seen[-10:]
    for pgid in [router_pid, *pids.values()]:
        assert _group_gone(pgid), f"process group {pgid} outlived the cluster command"
    ports = [int(url.rsplit(":", 1)[1]) for url in [router_url, *nodes.values()]]
    assert not [p for p in ports if _listening(p)]
