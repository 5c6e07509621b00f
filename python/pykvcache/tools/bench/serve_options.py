"""The serve part's options: configurations, presets, ``--serve-set`` and the
long-context sweep's sizing (what each sweep point's server admits and holds).

Everything here is pure: the part (serve_part.py), its runs (serve_run.py) and
analyses (serve_analysis.py, serve_sweep.py) read these options, never the
other way round.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from .config import BenchConfig
from .read_throttle import unavailable as read_throttle_unavailable

NAME = "serve"

TITLE = "Serving: a real vLLM OpenAI server, multi-turn sessions over shared long contexts"

ALL_CONFIGS = ("recompute", "pykvcache", "gate_off", "lookahead_off", "verify_header", "lmcache", "native")

#: pykvcache's defaults served from another tree's package (``variant_path``):
#: two code versions side by side in the same rounds, as ratios in one run.
#: Never in the defaults: it needs that tree.
VARIANT = "variant"
#: pykvcache's defaults with a gate profile calibrated before the first round
#: on the run's disk and read cap (serve_calibrate.py). Not in the defaults.
CALIBRATED = "calibrated"
#: pykvcache's defaults on a server started where a predecessor of the same
#: configuration stopped (serve_restart.py). Not in the defaults.
RESTARTED = "restarted"
#: pykvcache's defaults with every chunk sealed (AES-256-GCM) under a key made beside the
#: server's store (``serve-encryption.key``): what encryption at rest costs a server.
#: Not in the defaults.
SEALED = "sealed"
KNOWN_CONFIGS = (*ALL_CONFIGS, VARIANT, CALIBRATED, RESTARTED, SEALED)
PYKVCACHE_CONFIGS: dict[str, dict[str, Any]] = {
    "pykvcache": {},
    "gate_off": {"gate": False},
    "lookahead_off": {"lookahead_bytes": 0},
    "verify_header": {"verify": "header"},
    VARIANT: {},  # pykvcache's defaults, from variant_path (server_config)
    CALIBRATED: {},  # pykvcache's defaults with calibrated_profile (server_config)
    RESTARTED: {},  # pykvcache's defaults, after a predecessor on the same storage (run_server)
    SEALED: {},  # pykvcache's defaults with encryption_key_file (server_config)
}

LMCACHE_PATH_ENV = "PYKVCACHE_LMCACHE_PATH"

#: vLLM's CPU backend keeps a few blocks of the KV budget for itself: with
#: exactly max_model_len tokens it refuses to start ("the estimated maximum
#: model length is 992" for 1024).
KV_MARGIN_TOKENS = 128
PHASES = ("cold", "steady")

#: Prompt tokens beyond the document: "Document N.", the question and answer
#: headers, word pieces overshooting their token count by up to a word.
_PROMPT_SLACK = 32


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
        problems.append(
            f"configuration {CALIBRATED}: calibrated_profile={opts.calibrated_profile} is not a file "
            "(leave it unset to calibrate before the first round)"
        )
    return problems


def variant_problem(path: str | None) -> str | None:
    """Why ``path`` cannot serve the variant (None: it can)."""
    if not path:
        return "set variant_path=DIR (a directory holding another build of the pykvcache package)"
    package = Path(path) / "pykvcache"
    if not (package / "__init__.py").is_file():
        return f"variant_path={path} holds no pykvcache package ({package}/__init__.py)"
    if not any(package.glob("_core*.so")):
        return (
            f"variant_path={path}: pykvcache there has no built _core extension (run `make develop` in that "
            f"tree, or copy this build's _core*.so into {package} when only Python differs)"
        )
    return None


def quick_options() -> ServeOptions:
    """CI size: the tiny model, two configurations, one repeat, one level."""
    # 3 documents of 512 tokens + 6 sessions' histories ~ 2.5x the 1024-token
    # device cache; 1 MiB of staging (8 chunks of 128 KiB) holds one document:
    # the shared prefixes come back from disk.
    return ServeOptions(
        model="tiny",
        configs=["recompute", "pykvcache"],
        repeats=1,
        concurrency=[3],
        max_num_seqs=2,
        max_model_len=1024,
        kv_cache_tokens=1024,
        staging_bytes=1 << 20,
        chunk_tokens=64,
        sessions=6,
        turns=2,
        documents=3,
        doc_tokens=512,
        question_tokens=24,
        answer_tokens=24,
        output_tokens=8,
        think_s=0.05,
        pr_prompts=0,
        preset="quick",
    )


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
    return ServeOptions(
        model="llama3-geometry-32k",
        configs=["recompute", "pykvcache", "lookahead_off"],
        repeats=2,
        concurrency=[4],
        max_num_seqs=4,
        max_model_len=0,
        kv_cache_tokens=0,
        staging_bytes=0,
        chunk_tokens=64,
        sessions=6,
        turns=2,
        documents=4,
        doc_tokens=0,
        question_tokens=32,
        answer_tokens=32,
        output_tokens=8,
        think_s=0.2,
        pr_prompts=0,
        preset="long-context",
        contexts=[1024, 4096, 8192, 16384],
        read_caps=[0.0, 25.0],
        phases=["cold", "steady"],
    )


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
        return sweep_steps(opts)
    per_server = 2 + len(opts.concurrency) + (1 if opts.pr_prompts else 0)
    calibrating = CALIBRATED in opts.configs and not opts.calibrated_profile
    predecessors = opts.repeats * (RESTARTED in opts.configs)
    return opts.repeats * len(opts.configs) * per_server + int(calibrating) + predecessors


def steps(cfg: BenchConfig) -> int:
    return steps_for(options_from(cfg))


# The long-context sweep's points and sizes.
def longest_prompt(opts: ServeOptions, context: int) -> int:
    """Tokens of the workload's longest request (last turn, with its output)."""
    return context + opts.turns * (opts.question_tokens + opts.answer_tokens + 8) + opts.output_tokens + _PROMPT_SLACK


def advised_staging_bytes(max_model_len: int, chunk_tokens: int, bytes_per_token: int) -> int:
    """What pykvcache's start-up check recommends for this engine (its own
    ``staging_sizing``: 3 full-length prefixes of chunk-file-sized slots)."""
    from pykvcache import HEADER_BYTES
    from pykvcache.vllm.staging_sizing import staging_sizing

    payload = chunk_tokens * bytes_per_token
    slot = HEADER_BYTES + -(-payload // 4096) * 4096
    sizing = staging_sizing(slots=0, slot_bytes=slot, lookahead_slots=0, max_model_len=max_model_len, chunk_tokens=chunk_tokens, groups=1)
    return sizing.recommended_bytes


def sized_for(opts: ServeOptions, context: int, read_mbps: float, bytes_per_token: int) -> ServeOptions:
    """The options of one sweep point: derived sizes where the preset left 0."""
    max_len = opts.max_model_len or -(-longest_prompt(opts, context) // 32) * 32
    return replace(
        opts,
        doc_tokens=context,
        read_mbps=read_mbps,
        max_model_len=max_len,
        kv_cache_tokens=opts.kv_cache_tokens or max_len,
        staging_bytes=opts.staging_bytes or advised_staging_bytes(max_len, opts.chunk_tokens, bytes_per_token),
    )


def sweep_points(opts: ServeOptions) -> list[tuple[int, float]]:
    return [(c, cap) for c in opts.contexts for cap in (opts.read_caps or [opts.read_mbps])]


def point_name(context: int, cap: float) -> str:
    return f"ctx{context}" + (f"-read{cap:g}" if cap else "")


def regime(cap: float) -> str:
    return f"reads capped {cap:g} MB/s" if cap else "quiet"


def without_unavailable_caps(opts: ServeOptions) -> tuple[ServeOptions, str | None]:
    """The options without the read caps this host cannot apply (the throttle
    needs root and cgroup-v1 blkio), and why they were dropped: ``make
    bench-serve`` then still runs the quiet sweep where the capped one cannot."""
    from . import read_throttle

    caps = opts.read_caps or [opts.read_mbps]
    why = read_throttle.unavailable() if max(caps) > 0 else None
    if why is None:
        return opts, None
    kept = [c for c in caps if c == 0]
    dropped = ", ".join(f"{c:g} MB/s" for c in caps if c > 0)
    return replace(opts, read_caps=kept or [0.0], read_mbps=0.0), f"read caps {dropped} not run: {why}"


def check_sweep(opts: ServeOptions) -> list[str]:
    problems = []
    problems += check_configs(opts)
    for name in (CALIBRATED, RESTARTED):
        if name not in opts.configs:
            continue
        problems.append(
            f"configuration {name}: the session workload only (the sweep would need a profile per "
            "read cap and context range, or a predecessor per point)"
        )
    if "recompute" not in opts.configs:
        problems.append("the long-context sweep needs the recompute configuration (every ratio is against it)")
    if not opts.phases or any(p not in PHASES for p in opts.phases):
        problems.append(f"phases must be one or more of {', '.join(PHASES)}")
    if min(opts.contexts) <= 0:
        problems.append("contexts must be positive token counts")
    if min(opts.read_caps or [opts.read_mbps]) < 0:
        problems.append("read caps must be >= 0 MB/s")  # one the host cannot apply is dropped at run time
    if opts.max_model_len and opts.max_model_len < longest_prompt(opts, max(opts.contexts)):
        problems.append(
            f"max_model_len {opts.max_model_len} is below the longest prompt "
            f"(~{longest_prompt(opts, max(opts.contexts))} tokens); 0 sizes it per context"
        )
    if opts.kv_cache_tokens and opts.kv_cache_tokens < (opts.max_model_len or longest_prompt(opts, max(opts.contexts))):
        problems.append("kv_cache_tokens must be >= max_model_len (vLLM refuses to start otherwise); 0 = max_model_len")
    if opts.chunk_tokens % 32:
        problems.append("chunk_tokens must be a multiple of vLLM's CPU block size (32)")
    if opts.repeats <= 0 or not opts.concurrency or min(opts.concurrency) <= 0:
        problems.append("repeats and concurrency must be positive")
    if opts.busy_cores < 0:
        problems.append("busy_cores must be >= 0")
    return problems


def sweep_steps(opts: ServeOptions) -> int:
    per_server = 2 + len(opts.phases) + (0 if "cold" in opts.phases else 1)
    return opts.repeats * len(sweep_points(opts)) * len(opts.configs) * per_server
