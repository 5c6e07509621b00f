"""The servers and requests of the ``disk_hit`` part (disk_hit_part.py).

Per document length, on one storage directory: a server computes the
document and stores it (stopped cleanly: every chunk on disk); a second
server meets it first (the gate's first contact with the device, which it
then saves beside the chunks: decision 0073) and is reported apart; then
every sample is a fresh server, as after a restart (device cache and staging
empty, the device model restored): a warm-up prompt of its own (computed and
stored), the wait for its writes, the document (served from disk: the disk
hit) and the document again (served from vLLM's device cache), with fio's
O_DIRECT read bandwidth on the same directory measured just before.
"""

from __future__ import annotations

import json
import random
import statistics
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..vllm_server import Server, ServerConfig, ServerFailed, log_tail
from .disk_hit_trace import breakdown
from .fio_runner import FioJob, FioRunner
from .serve_options import KV_MARGIN_TOKENS

READ_BYTES = "vllm:pykvcache_disk_read_bytes_total"
WRITE_BYTES = "vllm:pykvcache_disk_write_bytes_total"


@dataclass
class DiskHitOptions:
    model: str = "llama3-geometry-32k"  # a TinyModelSpec name or a model directory
    doc_tokens: list[int] = field(default_factory=lambda: [8192, 16384])
    samples: int = 7
    warm_tokens: int = 4096
    chunk_tokens: int = 256  # pykvcache's block_size
    # Device-cache TTFT: the median of this many requests per server.
    device_repeats: int = 3
    # fio's O_DIRECT reads: one job at these depths, the best is the bandwidth.
    fio_depths: list[int] = field(default_factory=lambda: [1, 4, 16])
    fio_block_bytes: int = 4 << 20
    fio_runtime_s: float = 1.0
    fio_file_bytes: int = 512 << 20
    # A server that meets the stored document first (the gate's first contact) before the samples.
    first_contact: bool = True
    # The break-even gate (the default); off, every sample loads whatever the host's load makes
    # a load cost (the CI size: its subject is the path, and a busy CI host can make the tiny
    # model's recompute the cheaper choice, which the gate then rightly takes).
    gate: bool = True
    start_timeout_s: float = 600.0
    seed: int = 0

    def check(self) -> list[str]:
        problems = []
        if self.samples < 1 or self.device_repeats < 1:
            problems.append("samples and device_repeats must be >= 1")
        if not self.doc_tokens or any(n < 2 * self.chunk_tokens for n in self.doc_tokens):
            problems.append(f"doc_tokens must each be at least two chunks ({2 * self.chunk_tokens} tokens)")
        if self.chunk_tokens % 32:
            problems.append("chunk_tokens must be a multiple of vLLM's CPU block size (32)")
        return problems


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{") or line.startswith(name + " "))


def ttft(url: str, model: str, prompt: list[int]) -> float:
    """Seconds from sending ``prompt`` (token ids, streamed, greedy) to its first token."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0.0, "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    began = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=900) as r:
        for line in r:
            if first is None and line.startswith(b"data: ") and b'"text"' in line:
                first = time.perf_counter() - began
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return first


def token_ids(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab - 1) for _ in range(n)]


def settle_writes(url: str, quiet_s: float = 0.3, timeout_s: float = 60.0, at_least: float = 0.0) -> None:
    """Returns once the server wrote ``at_least`` bytes to disk and its writes
    stopped growing for ``quiet_s`` (a request's chunks are written after its
    response; on a busy host the first write can start later than ``quiet_s``)."""
    last, since, end = -1.0, time.monotonic(), time.monotonic() + timeout_s
    while time.monotonic() < end:
        now = _metric(url, WRITE_BYTES)
        if now != last:
            last, since = now, time.monotonic()
        elif now >= at_least and time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.05)


def server_config(tag: str, model: str, opts: DiskHitOptions, doc: int, bytes_per_token: int, storage: Path, trace: Path) -> ServerConfig:
    longest = max(doc, opts.warm_tokens) + 64
    tokens = doc + opts.warm_tokens + KV_MARGIN_TOKENS
    args = [
        "--dtype",
        "float32",
        "--block-size",
        "32",
        "--enforce-eager",
        "--max-model-len",
        str(longest),
        "--kv-cache-memory-bytes",
        str(tokens * bytes_per_token),
        "--max-num-seqs",
        "4",
        "--enable-prefix-caching",
        "--seed",
        "0",
    ]
    # Staging for 2.5 documents (what pykvcache's start-up check asks for).
    extra = {
        "storage_dirs": [str(storage)],
        "capacity_bytes": "16GiB",
        "block_size": opts.chunk_tokens,
        "staging_bytes": int(2.5 * doc * bytes_per_token) + (64 << 20),
        "gate_trace": str(trace),
        "gate": opts.gate,
    }
    return ServerConfig(
        name=tag,
        model=model,
        args=args,
        kv_transfer_config={
            "kv_connector": "PyKvCacheConnector",
            "kv_connector_module_path": "pykvcache.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        },
    )


def fio_read_bps(directory: Path, opts: DiskHitOptions) -> float:
    runner = FioRunner(directory=directory, file_bytes=opts.fio_file_bytes, max_numjobs=1)
    return max(
        runner.run(FioJob(rw="read", block_bytes=opts.fio_block_bytes, iodepth=d, numjobs=1, runtime_s=opts.fio_runtime_s)).bw_bytes_s
        for d in opts.fio_depths
    )


def one_server(
    cfg: ServerConfig,
    log: Path,
    model: str,
    doc_ids: list[int],
    warm_ids: list[int] | None,
    opts: DiskHitOptions,
    *,
    device: bool = True,
    stores: float = 0.0,
) -> dict[str, Any]:
    """A fresh server: warm-up, its writes, the document (disk), the document
    again (device). ``stores``: bytes of the document's chunks it must have
    written before it stops (the storing server: vLLM's default stop drops
    writes still queued)."""
    server = Server(cfg, log, opts.start_timeout_s)
    server.start()
    try:
        out: dict[str, Any] = {"startup_s": round(server.startup_s or 0.0, 1)}
        if warm_ids is not None:
            out["warm_s"] = ttft(server.url, model, warm_ids)
            settle_writes(server.url)
        read0 = _metric(server.url, READ_BYTES)
        out["disk_s"] = ttft(server.url, model, doc_ids)
        out["read_bytes"] = _metric(server.url, READ_BYTES) - read0
        if stores:
            settle_writes(server.url, quiet_s=0.5, at_least=stores)
        if device:
            out["device_all_s"] = sorted(ttft(server.url, model, doc_ids) for _ in range(opts.device_repeats))
            out["device_s"] = statistics.median(out["device_all_s"])
        if not server.alive():
            raise ServerFailed(f"the server died:\n{log_tail(log)}")
        return out
    finally:
        server.stop()


def run_length(
    model: str, vocab: int, opts: DiskHitOptions, doc: int, bytes_per_token: int, work: Path, directory: Path, step
) -> dict[str, Any]:
    """Every server of one document length; samples carry their limit and ratio."""
    storage = directory / f"ctx{doc}" / "kv"
    storage.mkdir(parents=True, exist_ok=True)
    logs = work / "logs"
    doc_ids = token_ids(doc, opts.seed + doc, vocab)
    result: dict[str, Any] = {"doc_tokens": doc, "samples": []}

    def cfg(tag: str) -> tuple[ServerConfig, Path]:
        return server_config(tag, model, opts, doc, bytes_per_token, storage, work / f"trace-{tag}.jsonl"), logs / f"{tag}.log"

    step.advance(f"ctx {doc}: computing and storing the document")
    c, log = cfg(f"ctx{doc}-store")
    # Every whole chunk but the last (vLLM may keep the one that ends on the last prompt token).
    stores = max(0, doc // opts.chunk_tokens - 1) * opts.chunk_tokens * bytes_per_token
    seeded = one_server(c, log, model, doc_ids, None, opts, device=False, stores=stores)
    result["store_s"] = seeded["disk_s"]  # a recompute: nothing was on disk yet
    result["first_contact"] = None
    if opts.first_contact:
        step.advance(f"ctx {doc}: first contact")
        c, log = cfg(f"ctx{doc}-first")
        first = one_server(c, log, model, doc_ids, token_ids(opts.warm_tokens, opts.seed + 7 * doc, vocab), opts)
        result["first_contact"] = {**first, "trace": breakdown(work / f"trace-ctx{doc}-first.jsonl", doc)}
    for i in range(opts.samples):
        step.advance(f"ctx {doc}: sample {i + 1}/{opts.samples}")
        bps = fio_read_bps(directory / f"ctx{doc}" / "fio", opts)
        tag = f"ctx{doc}-{i}"
        c, log = cfg(tag)
        s = one_server(c, log, model, doc_ids, token_ids(opts.warm_tokens, opts.seed + 1000 * (i + 1) + doc, vocab), opts)
        limit = s["device_s"] + s["read_bytes"] / bps
        result["samples"].append(
            {
                **s,
                "fio_read_bps": bps,
                "limit_s": limit,
                "ratio": s["disk_s"] / limit,
                "trace": breakdown(work / f"trace-{tag}.jsonl", doc),
                "log": str(log),
            }
        )
    return result
