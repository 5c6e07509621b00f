"""``pykvcache cluster`` end to end: two real vLLM OpenAI servers on one store directory,
the vLLM project's router (vllm-router 0.1.17, ``cache_aware``) in front, driven through the
router as a user would, with the command docs/cluster.md gives.

One cluster start (two servers at once, ~25 s here), then:
  1. two documents sent at once; each one's two follow-ups go back to the node that holds
     its prefix (the router's prefix tree: round robin would split them);
  2. the node holding document A is killed (SIGKILL of its process group, a lost machine):
     the command reports it and takes it out of the router; A's follow-up sent again through
     the router is answered by the survivor with the same greedy tokens, its prefix read from
     the shared store (the survivor never saw A);
  3. SIGINT stops the command: exit status 0, ``stopped``, no process of the router's or a
     node's group left, no port listening.
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


def _served_by(nodes: dict[str, str], before: dict[str, float]) -> list[str]:
    return [n for n, url in nodes.items() if _metrics(url).get("vllm:request_success_total", 0) > before[n]]


def _counts(nodes: dict[str, str]) -> dict[str, float]:
    return {n: _metrics(url).get("vllm:request_success_total", 0) for n, url in nodes.items()}


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


def test_the_cluster_routes_by_prefix_serves_a_killed_nodes_prefixes_from_the_store_and_stops_clean(tiny_model, tmp_path):
    if not (ROUTER_PATH / "vllm_router").is_dir():
        pytest.skip(f"vllm-router is not installed in {ROUTER_PATH} (make router-env; make test installs it)")
    assert DOCS_COMMAND in (ROOT / "docs" / "cluster.md").read_text()
    from pykvcache.testing.tiny_model import synthetic_text
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    docs = {name: tokenizer(synthetic_text(300, seed=950 + i)).input_ids[:1400] for i, name in enumerate("AB")}
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    argv = DOCS_COMMAND.replace("<model>", tiny_model).replace("/mnt/shared/kv", str(store)).split()[1:]
    argv += ["--port", "0", "--capacity", "64MiB", "--staging", "16MiB", "--log-dir", str(tmp_path / "logs")]
    # The survivor loads A from the store unless loading looks 50x slower than recomputing: on a
    # loaded host the gate may judge a tiny model's recompute the cheaper (that is its job).
    argv += ["--kv-option", "gate_margin=0.02", "--router-path", str(ROUTER_PATH), *(f"--vllm-arg={a}" for a in VLLM_ARGS)]
    cmd = _Command([sys.executable, "-m", "pykvcache.tools.cli", *argv])
    try:
        cmd.until(lambda line: line.startswith("ready"), timeout=400)
        router = next(line for line in cmd.seen if line.startswith("router "))
        router_url, router_pid = router.split()[1], int(router.split()[3])
        members = {line.split()[0]: line.split() for line in cmd.seen if line.startswith("node-")}
        nodes = {name: words[1] for name, words in members.items()}
        pids = {name: int(words[3]) for name, words in members.items()}
        assert len(nodes) == 2

        # 1. Routing by prefix.
        before = _counts(nodes)
        first = [threading.Thread(target=_complete, args=(router_url, docs[d] + [7, 8])) for d in "AB"]
        for t in first:
            t.start()
        for t in first:
            t.join()
        assert sum(_counts(nodes).values()) - sum(before.values()) == 2
        holder: dict[str, set[str]] = {"A": set(), "B": set()}
        answers = {}
        for d, tail in (("A", [9, 10]), ("A", [11, 12]), ("B", [9, 10]), ("B", [11, 12])):
            before = _counts(nodes)
            answers[d, tail[0]] = _complete(router_url, docs[d] + tail)
            served = _served_by(nodes, before)
            assert len(served) == 1, served
            holder[d].add(served[0])
        # Each document's two follow-ups on the node that has it (round robin splits them).
        # The two documents usually land on two nodes; not always: both first requests may
        # reach the router before either counts as load.
        assert len(holder["A"]) == len(holder["B"]) == 1, f"a document's follow-ups went to several nodes: {holder}"
        holder = {d: nodes_.pop() for d, nodes_ in holder.items()}

        # 2. The node holding A is lost; the survivor serves A from the store.
        lost = holder["A"]
        [survivor] = [n for n in nodes if n != lost]
        deadline = time.monotonic() + 60
        while True:  # A's chunks on disk, written by the node about to be lost
            m = _metrics(nodes[lost])
            if m.get("vllm:pykvcache_disk_write_bytes_total", 0) > 0 and m.get("vllm:pykvcache_staging_slots_pinned", 1) == 0:
                break
            assert time.monotonic() < deadline, "the lost node never finished writing A's chunks"
            time.sleep(0.3)
        reads_before = _metrics(nodes[survivor]).get("vllm:pykvcache_disk_read_bytes_total", 0)
        os.killpg(pids[lost], signal.SIGKILL)
        report = cmd.until(lambda line: line.startswith(f"{lost} "), timeout=30)
        assert "exited with status -9" in report and "removed from the router" in report, report
        assert _complete(router_url, docs["A"] + [9, 10]) == answers["A", 9]
        assert _metrics(nodes[survivor]).get("vllm:pykvcache_disk_read_bytes_total", 0) > reads_before
    finally:
        if cmd.proc.poll() is None:
            os.kill(cmd.proc.pid, signal.SIGINT)
        try:
            rc = cmd.proc.wait(timeout=120)
        finally:
            if cmd.proc.poll() is None:
                os.killpg(cmd.proc.pid, signal.SIGKILL)
    # 3. A clean stop.
    cmd.until(lambda line: line.startswith("stopped"), timeout=10)
    assert cmd.seen[-1] == "stopped" and rc == 0, cmd.seen[-10:]
    for pgid in [router_pid, *pids.values()]:
        assert _group_gone(pgid), f"process group {pgid} outlived the cluster command"
    ports = [int(url.rsplit(":", 1)[1]) for url in [router_url, *nodes.values()]]
    assert not [p for p in ports if _listening(p)]
