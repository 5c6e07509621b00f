"""One server of the serve part: the model, each configuration's server
settings, and every workload against one fresh vLLM OpenAI server (the
session workload per concurrency level, the long-context sweep's phases,
vLLM's own ``bench serve``), with its metrics, CPU and memory."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from pykvcache.keys import write_key_file

from ..vllm_server import Server, ServerConfig, ServerFailed, log_tail
from .contention import CpuContention
from .parts import Step
from .read_throttle import ReadThrottle
from .serve_options import CALIBRATED, KV_MARGIN_TOKENS, LMCACHE_PATH_ENV, PYKVCACHE_CONFIGS, RESTARTED, SEALED, VARIANT, ServeOptions
from .serve_restart import restored as restored_device
from .serve_restart import run_predecessor
from .serve_stats import metric_delta
from .serve_workload import ReuseIndex, Workload, run_sessions


def resolve_model(name: str, cache: Path) -> tuple[str, dict[str, Any], bool]:
    """(model directory, its config.json, generated?)."""
    from pykvcache.testing.tiny_model import SPECS, build_tiny_model

    if name in SPECS:
        path, generated = build_tiny_model(cache, SPECS[name]), True
    else:
        path, generated = Path(name), False
    return str(path), json.loads((Path(path) / "config.json").read_text()), generated


def kv_bytes_per_token(cfg: dict[str, Any]) -> int:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * 4  # K and V, float32


def lmcache_location(opts: ServeOptions) -> tuple[list[str], str | None]:
    """(PYTHONPATH entries for a private LMCache install, reason it cannot run)."""
    path = opts.lmcache_path or os.environ.get(LMCACHE_PATH_ENV)
    if path:
        if not (Path(path) / "lmcache").is_dir():
            return [], f"{LMCACHE_PATH_ENV}={path} holds no lmcache package"
        return [path], None
    if importlib.util.find_spec("lmcache") is not None:
        return [], None
    return [], (
        f"lmcache is not installed (install it into a private directory, e.g. `pip install "
        f"--target DIR lmcache`, and set {LMCACHE_PATH_ENV}=DIR; never into vLLM's venv)"
    )


def lmcache_degraded(log: Path) -> str | None:
    """LMCache's own statement that it runs without a KV path (it starts,
    logs the error and recomputes everything), with the exception it caught."""
    try:
        text = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text(errors="replace"))  # its coloured log
    except OSError:
        return None
    if "degraded mode" not in text:
        return None
    raised = [
        ln.strip()
        for ln in text.splitlines()
        if ln.startswith(("RuntimeError", "ImportError", "ValueError", "NotImplementedError", "ModuleNotFoundError"))
    ]
    said = [ln.strip() for ln in text.splitlines() if "degraded mode" in ln]
    return (
        "LMCache started but has no KV transfer path on this platform: "
        + "; ".join(dict.fromkeys(raised[:2]))
        + " — LMCache: '"
        + said[0].lstrip(". ").split(" (manager")[0][:120]
        + "'"
    )


def run_key(path: Path) -> Path:
    """The sealed configuration's key: made once and then kept (a server restarted on the
    same store must open what it sealed: a new key would make those chunks misses of
    another key)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        return write_key_file(path)
    except FileExistsError:
        return path


def server_config(name: str, model: str, opts: ServeOptions, bytes_per_token: int, storage: Path) -> ServerConfig:
    args = [
        "--dtype",
        "float32",
        "--block-size",
        "32",
        "--enforce-eager",
        "--max-model-len",
        str(opts.max_model_len),
        "--kv-cache-memory-bytes",
        str((opts.kv_cache_tokens + KV_MARGIN_TOKENS) * bytes_per_token),
        "--max-num-seqs",
        str(opts.max_num_seqs),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--seed",
        "0",
    ]
    cfg = ServerConfig(name=name, model=model, args=args)
    if name in PYKVCACHE_CONFIGS:
        extra = {
            "storage_dirs": [str(storage)],
            "capacity_bytes": "8GiB",
            "staging_bytes": opts.staging_bytes,
            "block_size": opts.chunk_tokens,
            **PYKVCACHE_CONFIGS[name],
        }
        if name == VARIANT:
            # Ahead of this install (an editable install is a .pth entry, after PYTHONPATH).
            assert opts.variant_path, "check_configs requires variant_path for the variant"
            cfg.python_path = [str(Path(opts.variant_path).resolve())]
        if opts.gate_profile:
            extra["gate_profile"] = opts.gate_profile
        if name == CALIBRATED:
            assert opts.calibrated_profile, "run_with calibrates before the first round"
            extra["gate_profile"] = opts.calibrated_profile
        if name == SEALED:
            extra["encryption_key_file"] = str(run_key(storage.parent / "serve-encryption.key"))
        if opts.gate_trace:
            extra["gate_trace"] = str(storage.parent / "gate-trace.jsonl")
        cfg.kv_transfer_config = {
            "kv_connector": "PyKvCacheConnector",
            "kv_connector_module_path": "pykvcache.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    elif name == "lmcache":
        cfg.python_path, _ = lmcache_location(opts)
        cfg.kv_transfer_config = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
        # LMCache's disk tier behind a CPU buffer the size of pykvcache's staging.
        cfg.env = {
            "LMCACHE_CHUNK_SIZE": str(opts.chunk_tokens),
            "LMCACHE_LOCAL_CPU": "True",
            "LMCACHE_MAX_LOCAL_CPU_SIZE": f"{opts.staging_bytes / 2**30:.3f}",
            "LMCACHE_LOCAL_DISK": f"file://{storage}/",
            "LMCACHE_MAX_LOCAL_DISK_SIZE": "8",
            "LMCACHE_USE_EXPERIMENTAL": "True",
        }
    elif name == "native":
        # vLLM's own CPU offloading (OffloadingConnector with its CPU spec), host
        # memory the size of pykvcache's staging.
        cfg.args += ["--kv-offloading-size", f"{opts.staging_bytes / 2**30:.4f}", "--kv-offloading-backend", "native"]
    return cfg


def run_vllm_bench(url: str, model: str, opts: ServeOptions, concurrency: int, seed: int, work: Path) -> dict[str, Any]:
    from .serve_vllm_bench import RESULT_PREFIX, prefix_repetition_args

    args = prefix_repetition_args(
        url,
        model,
        prompts=opts.pr_prompts,
        prefix_len=opts.pr_prefix_len,
        suffix_len=opts.pr_suffix_len,
        num_prefixes=opts.pr_num_prefixes,
        output_len=opts.output_tokens,
        concurrency=concurrency,
        seed=seed,
    )
    args.append("--save-detailed")
    path = work / f"vllm-bench-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(args))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, "-m", "pykvcache.tools.bench.serve_vllm_bench", str(path)], capture_output=True, text=True, env=env, timeout=1800
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    raise RuntimeError(
        f"vllm bench serve exited with {proc.returncode} and no result:\n" + "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
    )


def run_server(
    name: str, rep: int, model: str, opts: ServeOptions, bytes_per_token: int, work: Path, step: Step, point: str = ""
) -> dict[str, Any]:
    """One configuration, one repeat: every workload against one fresh server.
    ``point``: the sweep point (``ctx8192-read25``) in file names."""
    tag = f"{name}-{point + '-' if point else ''}{rep}"
    storage = work / tag / "kv"
    storage.mkdir(parents=True, exist_ok=True)
    cfg = server_config(name, model, opts, bytes_per_token, storage)
    log = work / "logs" / f"{tag}.log"
    entry: dict[str, Any] = {"config": name, "repeat": rep, "log": str(log), "levels": [], "command": None}
    if name == "lmcache":
        _, reason = lmcache_location(opts)
        if reason:
            step.advance(f"{name} unavailable")
            return {**entry, "unavailable": reason}
    server = Server(cfg, log, opts.start_timeout_s)
    busy: CpuContention | None = None
    throttle: ReadThrottle | None = None
    entry["command"] = " ".join(server.command())
    if trace := (cfg.kv_transfer_config or {}).get("kv_connector_extra_config", {}).get("gate_trace"):
        entry["trace"] = trace  # kept with the logs (_keep_logs)
    if name == RESTARTED:
        step.advance(f"{name} #{rep + 1}: its predecessor")
        try:
            entry["predecessor"] = run_predecessor(
                cfg, model, opts, bytes_per_token, storage, work / "logs" / f"{tag}-predecessor.log", str(Path(model) / "tokenizer.json")
            )
        except ServerFailed as e:
            return {**entry, "error": f"predecessor: {e}"}
    step.advance(f"{name} #{rep + 1}: starting")
    try:
        server.start()
    except ServerFailed as e:
        return {**entry, "error": str(e)}
    try:
        entry["startup_s"] = round(server.startup_s or 0.0, 1)
        if name == RESTARTED:
            entry["predecessor"]["restored"] = restored_device(log)
        if name == "lmcache" and (why := lmcache_degraded(log)):
            # LMCache answers requests even when it cannot move KV (it says it
            # falls back to recompute); measuring that would be measuring nothing.
            entry["unavailable"] = why
            return entry
        tokenizer_json = str(Path(model) / "tokenizer.json")
        # Warm-up (not measured): the first requests of a fresh server pay
        # one-time costs (allocations, the tokenizer's first calls).
        warm = Workload(
            sessions=2,
            turns=1,
            documents=2,
            doc_tokens=64,
            question_tokens=8,
            answer_tokens=8,
            output_tokens=2,
            concurrency=2,
            think_s=0.0,
            seed=opts.seed + 99_999,
        )
        run_sessions(server.url, model, warm, tokenizer_json)
        if opts.read_mbps and server.proc is not None:
            throttle = ReadThrottle(server.proc.pid, storage, int(opts.read_mbps * 1e6))
            throttle.__enter__()
        busy = CpuContention(opts.busy_cores, enabled=opts.busy_cores > 0)
        busy.__enter__()  # the warm-up above ran on quiet cores; the measurement does not
        cpu0, m0 = server.cpu_seconds(), server.metrics()
        if opts.phases and opts.contexts:
            run_phases(server, model, opts, tokenizer_json, entry, step, log)
        for li, conc in enumerate([] if opts.contexts else opts.concurrency):
            step.advance(f"{name} #{rep + 1}: sessions x{conc}")
            w = Workload(
                sessions=opts.sessions,
                turns=opts.turns,
                documents=opts.documents,
                doc_tokens=opts.doc_tokens,
                question_tokens=opts.question_tokens,
                answer_tokens=opts.answer_tokens,
                output_tokens=opts.output_tokens,
                concurrency=conc,
                think_s=opts.think_s,
                seed=opts.seed + 1000 * li,
                block_tokens=32,
            )
            before, c0 = server.metrics(), server.cpu_seconds()
            records, wall = run_sessions(server.url, model, w, tokenizer_json)
            after, c1 = server.metrics(), server.cpu_seconds()
            entry["levels"].append(
                {
                    "concurrency": conc,
                    "wall_s": wall,
                    "cpu_s": c1 - c0,
                    "metrics": metric_delta(after, before),
                    "records": [r.to_dict() for r in records],
                }
            )
            if not server.alive():
                raise ServerFailed(f"the server died during the workload:\n{log_tail(log)}")
        if opts.pr_prompts:
            step.advance(f"{name} #{rep + 1}: vllm bench serve prefix_repetition")
            before, c0 = server.metrics(), server.cpu_seconds()
            res = run_vllm_bench(server.url, model, opts, max(opts.concurrency), opts.seed + 7, work)
            after, c1 = server.metrics(), server.cpu_seconds()
            entry["prefix_repetition"] = {**res, "cpu_s": c1 - c0, "metrics": metric_delta(after, before)}
        entry["cpu_s"] = server.cpu_seconds() - cpu0
        entry["metrics"] = metric_delta(server.metrics(), m0)
    except Exception as e:  # reported with the server's log, the other configurations go on
        entry["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}\n{log_tail(log, 25)}"
    finally:
        if busy is not None:
            busy.__exit__(None, None, None)
        if throttle is not None:
            throttle.__exit__(None, None, None)
        step.advance(f"{name} #{rep + 1}: stopping")
        server.stop()
        entry["memory"] = server.peak_rss()
        entry["unreaped_cpu_s"] = round(server.unreaped_cpu_s, 1)
    return entry


def _workload(opts: ServeOptions, **over: Any) -> Workload:
    base = dict(
        sessions=opts.sessions,
        turns=opts.turns,
        documents=opts.documents,
        doc_tokens=opts.doc_tokens,
        question_tokens=opts.question_tokens,
        answer_tokens=opts.answer_tokens,
        output_tokens=opts.output_tokens,
        concurrency=max(opts.concurrency),
        think_s=opts.think_s,
        seed=opts.seed,
        block_tokens=32,
    )
    return Workload(**{**base, **over})


def run_phases(server: Server, model: str, opts: ServeOptions, tokenizer_json: str, entry: dict[str, Any], step: Step, log: Path) -> None:
    """The sweep's phases against one server, each a level of ``entry`` with its ``phase``."""
    index = ReuseIndex(32)
    if "cold" not in opts.phases:
        # Each document computed once, not measured: the steady state's premise.
        step.advance(f"{entry['config']}: computing each document once")
        prime = _workload(opts, sessions=opts.documents, turns=1, output_tokens=1, think_s=0.0, question_seed=opts.seed + 50)
        records, wall = run_sessions(server.url, model, prime, tokenizer_json, index=index)
        entry["prime"] = {"wall_s": wall, "errors": sum(r.error is not None for r in records)}
    for i, phase in enumerate(opts.phases):
        step.advance(f"{entry['config']}: {phase}")
        w = _workload(opts, question_seed=opts.seed + 100 * (i + 1))
        before, c0 = server.metrics(), server.cpu_seconds()
        records, wall = run_sessions(server.url, model, w, tokenizer_json, index=index)
        after, c1 = server.metrics(), server.cpu_seconds()
        entry["levels"].append(
            {
                "phase": phase,
                "concurrency": w.concurrency,
                "wall_s": wall,
                "cpu_s": c1 - c0,
                "metrics": metric_delta(after, before),
                "records": [r.to_dict() for r in records],
            }
        )
        if not server.alive():
            raise ServerFailed(f"the server died during the {phase} phase:\n{log_tail(log)}")
