"""Stopping a real vLLM OpenAI server: what is left behind, what is persisted.

Each test starts ``python -m vllm.entrypoints.openai.api_server`` with the
tiny model (its own process group), and stops it the way operators and
orchestrators do:

* SIGKILL of every process of the server before any KV transfer (the OOM
  killer, ``kill -9``, a container runtime): the staging region must not
  outlive the engine. It used to stay in /dev/shm, fully resident, one per
  restart (its name was only removed after the first transfer). vLLM's
  default SIGTERM (``--shutdown-timeout 0``: the API server SIGTERMs the
  EngineCore and SIGKILLs it at once) ends the engine the same way, so the
  SIGKILL case covers it;
* SIGTERM right after requests stored chunks, with ``--shutdown-timeout``:
  the EngineCore drains and pykvcache's shutdown writes them all before exit,
  and leaves no staging behind either.
  (With vLLM's default timeout of 0 the chunks still queued in the scheduler
  are lost: docs/vllm.md says to set it.)
"""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from driver import staging_memfds
from test_vllm_e2e import BLOCK_TOKENS, CHUNK_TOKENS, _kv_config
from vllm_marks import VLLM_ENGINE

pytestmark = VLLM_ENGINE


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pykvcache_shm() -> set[str]:
    return {os.path.basename(p) for p in glob.glob("/dev/shm/pykvcache-*")}


def _in_use(paths: set[str]) -> set[str]:
    """Those of ``paths`` some process maps or holds open."""
    used = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                used.update(p for p in paths if p in f.read())
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link in paths:
                    used.add(link)
        except OSError:
            pass
    return used


def _remove_vllm_leftovers(mapped: set[str]) -> list[str]:
    """vLLM's own shared memory (its message queues' ``psm_*``, ~400 MiB here)
    stays in /dev/shm when its processes are SIGKILLed: remove what the stopped
    server's processes mapped (``Server.dev_shm_mapped``, taken before the stop)
    and nobody uses now, so that runs do not pile up. Only those: tests on the
    other xdist worker create theirs meanwhile (a "new since the test began"
    rule removed a starting engine's multiprocessing semaphore: a named
    semaphore is mapped under a temporary name, so no scan of maps sees it in use).
    vLLM's ``sem.mp-*`` leftovers (32 bytes each) are left for that reason."""
    present = {p for p in mapped if os.path.exists(p)}
    removed = sorted(present - _in_use(present))
    for path in removed:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return removed


class Server:
    """One OpenAI API server with pykvcache, in its own session."""

    def __init__(self, model: str, store: Path, log: Path, *extra_args: str) -> None:
        from pykvcache.vllm.layout import staging_shm_prefix

        engine_id = f"shutdown-{uuid.uuid4().hex[:12]}"
        # Room for every chunk of the concurrent requests; prompt chunks only,
        # so that the count of chunks a request stores is known. A minute's I/O
        # deadline: what is asserted is the stop, not a stalled disk (a CI host
        # writing beside other suites took over the default 2 s for some puts,
        # the directory's breaker opened and the rest were skipped, as designed;
        # tests/e2e/test_vllm_stalled_dir.py covers that path).
        kv = _kv_config(store, 256, offload_prompt_only=True, io_deadline_s=60)
        kv["engine_id"] = engine_id
        self.prefix = staging_shm_prefix(engine_id)
        self.port = _free_port()
        self.log = log
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--port",
            str(self.port),
            "--host",
            "127.0.0.1",
            "--dtype",
            "float32",
            "--block-size",
            str(BLOCK_TOKENS),
            "--enable-prefix-caching",
            "--enforce-eager",
            "--max-model-len",
            "2048",
            "--kv-cache-memory-bytes",
            str(8 << 20),
            "--seed",
            "0",
            "--kv-transfer-config",
            json.dumps(kv),
            *extra_args,
        ]
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", TOKENIZERS_PARALLELISM="false")
        self._log_file = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        pytest.fail(f"server not ready in {timeout} s:\n{self.tail()}")

    def complete(self, prompt_ids: list[int], *, model: str, max_tokens: int = 1, timeout: float = 300) -> dict:
        body = json.dumps({"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def requests_in_engine(self) -> int:
        """Requests the engine runs or queues now (its own gauges)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as r:
            text = r.read().decode()
        return int(
            sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{"))
            )
        )

    def model_name(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=30) as r:
            return json.loads(r.read())["data"][0]["id"]

    def dev_shm_mapped(self) -> set[str]:
        """The /dev/shm files the server's processes map now."""
        mapped = set()
        for pid in self.pids():
            try:
                with open(f"/proc/{pid}/maps") as f:
                    for line in f:
                        fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
                        path = fields[5].strip() if len(fields) == 6 else ""
                        if path.startswith("/dev/shm/") and not path.endswith("(deleted)"):
                            mapped.add(path)
            except OSError:
                pass
        return mapped

    def pids(self) -> list[int]:
        """Every live process of the server's session."""
        out = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if os.getsid(int(pid)) == self.proc.pid:
                    out.append(int(pid))
            except OSError:
                pass
        return out

    def stop(self, sig: int, timeout: float = 120) -> float:
        """Sends ``sig`` (to the server process; SIGKILL to every process of
        it) and waits until no process of the session is left."""
        started = time.monotonic()
        if sig == signal.SIGKILL:
            os.killpg(self.proc.pid, signal.SIGKILL)
        else:
            self.proc.send_signal(sig)
        deadline = started + timeout
        while time.monotonic() < deadline:
            self.proc.poll()
            if not self.pids():
                return time.monotonic() - started
            time.sleep(0.2)
        self.kill()
        pytest.fail(f"server still running {timeout} s after signal {sig}:\n{self.tail()}")

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._log_file.close()

    def pykvcache_lines(self) -> str:
        """What pykvcache logged that explains a missing chunk: its breakers, its
        warnings, and the last non-zero pykvcache counters vLLM logged."""
        text = self.log.read_text(errors="replace").splitlines()
        said = [line for line in text if "pykvcache" in line and ("WARNING" in line or "ERROR" in line or "breaker" in line)]
        counters = [line for line in text if "KV Transfer metrics" in line]
        if counters:
            last = counters[-1].split("KV Transfer metrics: ", 1)[-1].split(", ")
            said.append("last counters: " + ", ".join(c for c in last if "pykvcache" in c and not c.endswith(("=0", "=0.0"))))
        return "\n".join(said[-20:])

    def tail(self, lines: int = 60) -> str:
        if not self._log_file.closed:
            self._log_file.flush()
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


@pytest.fixture
def server_factory(tmp_path, model):
    servers = []

    def start(*extra_args: str) -> Server:
        server = Server(model, tmp_path / "store", tmp_path / f"server{len(servers)}.log", *extra_args)
        servers.append(server)
        server.wait_ready()
        return server

    yield start
    for server in servers:
        server.kill()


def _stop_leaving_no_staging(server: Server, sig: int) -> float:
    """Stops the server with ``sig`` and asserts that its staging region (one
    memfd while it served) is gone with it: not in /dev/shm, held by no process."""
    before = _pykvcache_shm()
    held = staging_memfds(server.prefix)
    mapped = server.dev_shm_mapped()
    seconds = server.stop(sig)
    vllm_leftovers = _remove_vllm_leftovers(mapped)
    print(
        f"[{signal.Signals(sig).name}] all processes gone {seconds:.1f} s after the signal; vLLM's own leftovers removed: {vllm_leftovers}",
        file=sys.stderr,
    )
    leaked = _pykvcache_shm() - before
    for name in leaked:  # keep the machine clean when the test fails (before the fix)
        if name.startswith(server.prefix):
            os.unlink(f"/dev/shm/{name}")
    assert not {n for n in leaked if n.startswith(server.prefix)}, "staging left in /dev/shm"
    assert len(held) == 1, "the engine held its staging region (a memfd) while it served"
    assert not staging_memfds(server.prefix), "a process still holds the region"
    return seconds


def test_killed_before_any_transfer_leaves_no_staging_behind(server_factory):
    _stop_leaving_no_staging(server_factory(), signal.SIGKILL)


def _prompts(tokenizer, count: int) -> list[list[int]]:
    from pykvcache.testing.tiny_model import synthetic_text

    return [tokenizer(synthetic_text(250, seed=700 + i)).input_ids for i in range(count)]


def _chunk_files(store: Path) -> tuple[int, int]:
    chunks = len(list(store.rglob("*.kvc")))
    temps = len([p for p in store.rglob("*") if p.name.startswith(".tmp")])
    return chunks, temps


def test_sigterm_under_load_persists_every_chunk_with_a_shutdown_timeout(server_factory, model, tmp_path):
    """Concurrent requests, SIGTERM as soon as the first one is answered. With
    ``--shutdown-timeout`` the EngineCore drains the requests and pykvcache's
    shutdown writes every queued chunk: all of them are on disk, no temp file
    and no staging region is left. (vLLM's default stop aborts what is in flight and SIGKILLs the
    EngineCore at once: chunks in staging not yet written are lost; that
    costs a server start here and asserts nothing, so it is not run.)"""
    import threading

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = _prompts(tokenizer, 8)
    expected = sum(len(ids) // CHUNK_TOKENS for ids in prompts)
    store = tmp_path / "store"
    outcome = {}
    for label, args in (("timeout", ("--shutdown-timeout", "60")),):
        server = server_factory(*args)
        name = server.model_name()
        answered = threading.Event()
        done = []

        def send(ids, server=server, name=name, answered=answered, done=done):
            try:
                # A bounded wait: uvicorn's graceful stop waits for open
                # connections, and an aborted request is never answered.
                out = server.complete(ids, model=name, max_tokens=32, timeout=20)
                # Computed in full (ignore_eos: 32 tokens); the API server
                # answers a request it aborted at the stop with "abort".
                if out["choices"][0]["finish_reason"] == "length":
                    done.append(len(ids) // CHUNK_TOKENS)
            except OSError:
                pass  # aborted by the stop
            answered.set()

        threads = [threading.Thread(target=send, args=(ids,), daemon=True) for ids in prompts]
        for t in threads:
            t.start()
        # Stop once every request reached the engine (a CI run on a busy
        # machine stopped with 2 of 8 there: the API server aborted the other
        # 6 before they were computed, and their chunks never existed).
        admitted = time.monotonic() + 120
        while not answered.is_set() and time.monotonic() < admitted and server.requests_in_engine() < len(prompts):
            time.sleep(0.05)
        answered.wait(300)
        seconds = _stop_leaving_no_staging(server, signal.SIGTERM)
        chunks, temps = _chunk_files(store)
        outcome[label] = {
            "answered_in_full": len(done),
            "their_chunks": sum(done),
            "chunks": chunks,
            "temps": temps,
            "stop_s": round(seconds, 1),
        }
    print(f"[shutdown] {len(prompts)} requests, {expected} chunks in all: {outcome}", file=sys.stderr)
    timed = outcome["timeout"]
    # Every chunk of every request computed in full is on disk (all of them
    # when all reached the engine before the stop, the usual case).
    assert timed["answered_in_full"] >= 1 and timed["chunks"] >= timed["their_chunks"], f"{outcome}\n{server.pykvcache_lines()}"
    if timed["answered_in_full"] == len(prompts):
        assert timed["chunks"] == expected, outcome
    assert outcome["timeout"]["temps"] == 0, outcome
