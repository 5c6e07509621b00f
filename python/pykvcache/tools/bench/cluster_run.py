"""One configuration of the cluster part: a fresh cluster (:class:`Cluster`, what ``pykvcache
cluster`` runs), driven through its router phase by phase, with every member's counters.

prime   each document once, one at a time, through the router (what the cluster has seen
        before the measurement: the cold prefills are not the steady state);
steady  multi-turn sessions over the documents, ``concurrency`` users at once;
where   one probe per document, one at a time: the node whose prompt counter moved holds
        it (how the loss phase knows which documents the lost node had);
loss    new conversations over the same documents; the node holding the most documents is
        SIGKILLed once ``kill_after`` of them were answered and taken out of the router at
        once (``Cluster.watch``); each request is classed as sent before or after the kill;
join    a new node joins the store; each document (a new question) goes to it directly, one
        at a time, then one document no node ever saw: its recompute, the same length.

Prompts are token ids: vllm-router's ``cache_aware`` keeps a prefix tree of the ids it
routed and routes text prompts by load alone (decision 0085).
"""

from __future__ import annotations

import json
import threading
import time
import traceback
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..cluster.cluster import Cluster
from ..cluster.spec import ClusterSpec
from ..vllm_server import ServerFailed, free_port, log_tail, parse_metrics
from .parts import Step
from .serve_options import KV_MARGIN_TOKENS
from .serve_stats import metric_delta
from .serve_workload import Record, Workload, build_sessions, run_sessions

#: Configuration -> (router policy, shared pykvcache store?). The issue's (a)-(d). The router
#: with the store runs cache_aware: kv_aware credits no prefix with vLLM 0.32 (decision 0085).
CONFIGS: dict[str, tuple[str, bool]] = {
    "round_robin": ("round_robin", False),
    "cache_aware": ("cache_aware", False),
    "round_robin+store": ("round_robin", True),
    "cache_aware+store": ("cache_aware", True),
}


@dataclass
class ClusterOptions:
    model: str = "llama3-geometry-32k"  # a TinyModelSpec name or a model directory (8k documents need > 8192 positions)
    configs: list[str] = field(default_factory=lambda: list(CONFIGS))
    nodes: int = 2
    documents: int = 4
    doc_tokens: int = 8192
    sessions: int = 8
    turns: int = 2
    question_tokens: int = 64
    answer_tokens: int = 32
    output_tokens: int = 16
    concurrency: int = 4
    think_s: float = 0.2
    # Per node: 1.5 documents of 8k, so the documents' KV (4 of them) is more than the two
    # nodes' device caches hold together.
    kv_cache_tokens: int = 12288
    max_num_seqs: int = 2
    max_model_len: int = 8704
    staging_bytes: str = "1GiB"
    chunk_tokens: int = 256
    kill_after: int = 2
    # vllm-router's cache_aware sends a request to the node holding its prefix until that node
    # has this many more requests in flight than the least loaded one (and 1.5x as many);
    # its default, 64, keeps a small cluster's every shared document on one node.
    balance_abs_threshold: int = 1
    kv_options: str = ""  # JSON object of more kv_connector_extra_config keys for every node
    # The bench directory (--dir) as other mounts of its filesystem on this host show it (a
    # second client of one GlusterFS volume): node i reaches the store through the i-th of
    # [--dir, *these], so that each node has its own filesystem client.
    store_mounts: list[str] = field(default_factory=list)
    router_path: str = ""  # PYTHONPATH of a private vllm-router install ("": the installed one)
    seed: int = 0
    start_timeout_s: float = 900.0

    def check(self) -> list[str]:
        problems = []
        if unknown := [c for c in self.configs if c not in CONFIGS]:
            problems.append(f"configs {', '.join(unknown)}: unknown; known: {', '.join(CONFIGS)}")
        if self.nodes < 2:
            problems.append(f"nodes={self.nodes}: the loss phase needs 2 or more")
        if self.chunk_tokens % 32:
            problems.append(f"chunk_tokens={self.chunk_tokens}: a multiple of the block size, 32")
        if not 0 < self.kill_after < self.sessions * self.turns:
            problems.append(f"kill_after={self.kill_after}: within 1..{self.sessions * self.turns - 1} (the loss phase's requests)")
        longest = self.doc_tokens + self.turns * (self.question_tokens + self.answer_tokens + 8) + self.output_tokens + 32
        if self.max_model_len < longest:
            problems.append(f"max_model_len={self.max_model_len}: the longest request takes ~{longest} tokens")
        if self.kv_cache_tokens < self.max_model_len:
            problems.append(
                f"kv_cache_tokens={self.kv_cache_tokens}: vLLM wants a device cache of max_model_len ({self.max_model_len}) or more"
            )
        if missing := [m for m in self.store_mounts if not Path(m).is_dir()]:
            problems.append(f"store_mounts {', '.join(missing)}: not a directory")
        try:
            if not isinstance(json.loads(self.kv_options or "{}"), dict):
                problems.append("kv_options: a JSON object")
        except ValueError as exc:
            problems.append(f"kv_options: not JSON ({exc})")
        return problems

    def workload(self, **changes: Any) -> Workload:
        w = Workload(
            sessions=self.sessions,
            turns=self.turns,
            documents=self.documents,
            doc_tokens=self.doc_tokens,
            question_tokens=self.question_tokens,
            answer_tokens=self.answer_tokens,
            output_tokens=self.output_tokens,
            concurrency=self.concurrency,
            think_s=self.think_s,
            seed=self.seed,
            block_tokens=32,
            token_prompts=True,
        )
        return replace(w, **changes)


def spec_for(name: str, opts: ClusterOptions, model: str, bytes_per_token: int, storage: list[Path], logs: Path) -> ClusterSpec:
    """``storage``: where the store directory goes (under the bench's ``--dir``), then the same
    directory as each of ``store_mounts`` shows it; ``logs``: the members' logs (under
    ``--out``, kept with the report)."""
    policy, with_store = CONFIGS[name]
    views = [s / name / "kv" for s in storage] if with_store else []
    store = views[0] if views else None
    if store is not None:
        store.mkdir(parents=True, exist_ok=True)
    args = ["--dtype", "float32", "--enforce-eager", "--max-model-len", str(opts.max_model_len), "--seed", "0"]
    args += ["--kv-cache-memory-bytes", str((opts.kv_cache_tokens + KV_MARGIN_TOKENS) * bytes_per_token)]
    args += ["--max-num-seqs", str(opts.max_num_seqs), "--enable-prompt-tokens-details"]
    return ClusterSpec(
        model=model,
        store=store,
        store_views=views if len(views) > 1 else [],
        nodes=opts.nodes,
        policy=policy,
        staging_bytes=opts.staging_bytes,
        chunk_tokens=opts.chunk_tokens,
        vllm_args=args,
        extra_config=json.loads(opts.kv_options or "{}"),
        router_path=opts.router_path or None,
        router_metrics_port=free_port(),
        router_extra_args=[f"--balance-abs-threshold={opts.balance_abs_threshold}"],
        log_dir=logs / name,
    )


def _get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def router_counters(port: int, host: str) -> dict[str, float]:
    """The router's Prometheus counters, summed per name and kept per label set."""
    out: dict[str, float] = {}
    for line in _get_text(f"http://{host}:{port}/metrics").splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        try:
            v = float(value)
        except ValueError:
            continue
        name = head.partition("{")[0]
        out[name] = out.get(name, 0.0) + v
        if "{" in head:
            out[head] = v
    return out


def _node_metrics(cluster: Cluster) -> dict[str, dict[str, float]]:
    return {n.name: parse_metrics(_get_text(n.url + "/metrics")) for n in cluster.live_nodes()}


def _deltas(after: dict[str, dict[str, float]], before: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    return {name: metric_delta(m, before.get(name, {})) for name, m in after.items()}


def _complete(url: str, model: str, ids: list[int], max_tokens: int) -> None:
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as r:
        r.read()


def _records(records: list[Record]) -> list[dict[str, Any]]:
    return [r.to_dict() for r in records]


def where_documents(cluster: Cluster, model: str, opts: ClusterOptions, tokenizer_json: str) -> dict[int, str | None]:
    """Document -> the node the router sent its probe to (None: no node's counter moved)."""
    from tokenizers import Tokenizer

    assert cluster.router is not None
    tok = Tokenizer.from_file(tokenizer_json)
    docs, _ = build_sessions(opts.workload(), tokenizer_json)
    out: dict[int, str | None] = {}
    for d, doc in enumerate(docs):
        before = _node_metrics(cluster)
        _complete(cluster.router.url, model, tok.encode(doc + " Which", add_special_tokens=False).ids, 1)
        after = _node_metrics(cluster)
        moved = [n for n in after if after[n].get("vllm:prompt_tokens_total", 0.0) > before.get(n, {}).get("vllm:prompt_tokens_total", 0.0)]
        out[d] = moved[0] if len(moved) == 1 else None
    return out


class _Phase:
    """One phase's records, wall time and counters (nodes' and the router's)."""

    def __init__(self, cluster: Cluster, spec: ClusterSpec) -> None:
        self.cluster, self.spec = cluster, spec
        self.nodes0 = _node_metrics(cluster)
        self.router0 = router_counters(spec.router_metrics_port or 0, spec.host)

    def end(self, records: list[Record], wall: float, **more: Any) -> dict[str, Any]:
        router = router_counters(self.spec.router_metrics_port or 0, self.spec.host)
        return {
            "wall_s": wall,
            "records": _records(records),
            "nodes": _deltas(_node_metrics(self.cluster), self.nodes0),
            "router": {k: v - self.router0.get(k, 0.0) for k, v in router.items() if k.split("{")[0].endswith("_total")},
            **more,
        }


def run_config(
    name: str, opts: ClusterOptions, model: str, bytes_per_token: int, storage: list[Path], logs: Path, step: Step
) -> dict[str, Any]:
    """Every phase against one fresh cluster of configuration ``name``."""
    spec = spec_for(name, opts, model, bytes_per_token, storage, logs)
    events: list[str] = []
    entry: dict[str, Any] = {"config": name, "policy": spec.policy, "store": spec.store is not None, "events": events, "phases": {}}
    cluster = Cluster(spec, report=events.append, start_timeout_s=opts.start_timeout_s)
    tokenizer_json = str(Path(model) / "tokenizer.json")
    step.advance(f"{name}: starting {opts.nodes} nodes and the router")
    t0 = time.monotonic()
    try:
        cluster.start()
    except ServerFailed as exc:
        cluster.stop()
        return {**entry, "error": str(exc)}
    entry["startup_s"] = round(time.monotonic() - t0, 1)
    phases = entry["phases"]
    try:
        assert cluster.router is not None
        router_url = cluster.router.url
        warm = opts.workload(sessions=2, turns=1, documents=2, doc_tokens=64, question_tokens=8, output_tokens=2, think_s=0.0)
        for node in cluster.nodes:  # first-request costs (compiles, allocations) out of the measurement
            run_sessions(node.url, model, replace(warm, seed=opts.seed + 99_999), tokenizer_json)

        step.advance(f"{name}: prime, steady state")
        phase = _Phase(cluster, spec)
        prime = opts.workload(sessions=opts.documents, turns=1, concurrency=1, think_s=0.0, question_seed=opts.seed + 3000)
        records, wall = run_sessions(router_url, model, prime, tokenizer_json)
        phases["prime"] = phase.end(records, wall)
        phase = _Phase(cluster, spec)
        records, wall = run_sessions(router_url, model, opts.workload(), tokenizer_json)
        phases["steady"] = phase.end(records, wall)
        where = where_documents(cluster, model, opts, tokenizer_json)
        entry["where"] = {str(d): n for d, n in where.items()}

        step.advance(f"{name}: node loss")
        phases["loss"] = _loss_phase(cluster, spec, model, opts, tokenizer_json, victim(where, cluster))

        step.advance(f"{name}: node join")
        phase = _Phase(cluster, spec)
        t0 = time.monotonic()
        node = cluster.join()
        join_s = time.monotonic() - t0
        known = opts.workload(sessions=opts.documents, turns=1, concurrency=1, think_s=0.0, question_seed=opts.seed + 2000)
        records, wall = run_sessions(node.url, model, known, tokenizer_json)
        unseen = opts.workload(sessions=1, turns=1, documents=1, concurrency=1, think_s=0.0, seed=opts.seed + 5000)
        fresh, _ = run_sessions(node.url, model, unseen, tokenizer_json)
        phases["join"] = phase.end(records, wall, node=node.name, join_s=round(join_s, 1), recompute=_records(fresh))
    except Exception as exc:  # reported with the members' logs; the other configurations go on
        tails = "\n".join(f"{n.name}: {log_tail(n.server.log_path, 12)}" for n in cluster.nodes)
        entry["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}\n{tails}"
    finally:
        entry["left_behind"] = cluster.stop()
        # The engine processes init reaped, whose CPU the run's own accounting never sees.
        entry["unreaped_cpu_s"] = round(sum(n.server.unreaped_cpu_s for n in cluster.nodes), 1)
    return entry


def victim(where: dict[int, str | None], cluster: Cluster) -> str:
    """The node holding the most documents (the last node when none holds any)."""
    held = {n.name: sum(1 for node in where.values() if node == n.name) for n in cluster.live_nodes()}
    return max(reversed(list(held)), key=lambda name: held[name])


def _loss_phase(cluster: Cluster, spec: ClusterSpec, model: str, opts: ClusterOptions, tokenizer_json: str, victim: str) -> dict[str, Any]:
    assert cluster.router is not None
    phase = _Phase(cluster, spec)
    answered = 0
    killed: list[float] = []
    removed: list[float] = []
    killers: list[threading.Thread] = []

    def kill() -> None:
        killed.append(time.time())
        cluster.kill(victim)
        cluster.watch()  # reported and taken out of the router at once
        # Until now the router still sent requests to it: those are in flight on the killed
        # node (the window is its exit, the report and /remove_worker; on a FUSE mount a
        # killed process may first wait for its filesystem calls to return).
        removed.append(time.time())

    def on_request(rec: Record) -> None:
        nonlocal answered
        answered += 1
        if answered == opts.kill_after:
            killers.append(threading.Thread(target=kill, name="kill"))
            killers[-1].start()

    loss = opts.workload(question_seed=opts.seed + 1000)
    records, wall = run_sessions(cluster.router.url, model, loss, tokenizer_json, on_request=on_request)
    for t in killers:
        t.join()
    return phase.end(records, wall, killed_at=killed[0] if killed else None, removed_at=removed[0] if removed else None, victim=victim)
