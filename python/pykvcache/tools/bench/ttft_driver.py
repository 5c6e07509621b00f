"""Child process of the ``ttft`` benchmark part: one vLLM engine, TTFT per mode.

    python -m pykvcache.tools.bench.ttft_driver scenario.json

Run in its own process so that vLLM (its import, engine, shared memory and
worker process) never touches the benchmark's process. The EngineCore runs
in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the part) so the
driver can reach pykvcache's manager between requests: one engine then
measures every mode, and the gate can be switched off (forced load), set to
the calibrated cost model, or to a synthetic slow-storage one without paying
an engine start (~30 s here) per configuration.

For each prefix length and repeat a fresh random prefix ``P`` is used:

* ``recompute``  ``P + s1``: nothing anywhere (no device, staging or disk hit);
                 pykvcache stores ``P``'s chunks (staging, then disk).
* ``staging``    device prefix cache reset; ``P + s2`` loads ``P`` from staging.
* ``disk``       device cache and staging reset (``reset_connector`` with
                 ``wipe_on_reset: false`` keeps the files); the gate is off, so
                 every chunk is read from disk (checked with ``disk_reads``).
* ``gated``      same reset; the gate with the calibrated cost model decides.
* ``slow_disk`` / ``slow_gated``  as ``disk`` / ``gated`` with every disk read
                 completing ``slow_delay_s`` late (an emulated slow device, see
                 :class:`SlowReads`) and a gate whose fixed cost includes it.

The order of the modes after ``recompute`` rotates over repeats and lengths
alternate direction, so drift and background load hit every mode alike. The
TTFT is the engine's own arrival -> first token interval (client-side wall
time when vLLM reports no timestamps). Progress lines ``PROGRESS <text>`` and a
final ``RESULT <json>`` go to stdout.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from typing import Any

from .. import vllm_adapter

RESULT_PREFIX = "RESULT "
PROGRESS_PREFIX = "PROGRESS "

#: Mode orders after ``recompute``: ``staging`` must directly follow a mode
#: that leaves the prefix in staging (``recompute`` stores it; ``disk`` reads it).
BASE_ORDERS = (
    ("staging", "disk", "gated"),
    ("disk", "staging", "gated"),
    ("gated", "disk", "staging"),
    ("staging", "gated", "disk"),
)
SLOW_ORDERS = (("slow_disk", "slow_gated"), ("slow_gated", "slow_disk"))
DISK_MODES = ("disk", "gated", "slow_disk", "slow_gated")


def progress(text: str) -> None:
    print(PROGRESS_PREFIX + text, flush=True)


# ----------------------------------------------------------------------
# Emulated slow storage
# ----------------------------------------------------------------------
class _SlowResult:
    """The engine's result of a read, with the emulated delay in its latency
    (the gate's online refinement then learns the slow device)."""

    def __init__(self, result: Any, extra_s: float) -> None:
        self._result = result
        self.latency_s = (result.latency_s or 0.0) + extra_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._result, name)


class _SlowHandle:
    def __init__(self, handle: Any, delay_s: float) -> None:
        self._handle = handle
        self._ready_at = time.monotonic() + delay_s
        self._delay_s = delay_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)

    def done(self) -> bool:
        return time.monotonic() >= self._ready_at and self._handle.done()

    def wait(self, timeout: float | None = None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = self._ready_at - time.monotonic()
        if pause > 0:
            if deadline is not None and time.monotonic() + pause > deadline:
                time.sleep(max(0.0, deadline - time.monotonic()))
                raise TimeoutError("emulated slow read not complete")
            time.sleep(pause)
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        return _SlowResult(self._handle.wait(remaining), self._delay_s)


class SlowReads:
    """The manager's real store, whose reads complete ``delay_s`` after they
    were submitted at the earliest. The bytes still come from the disk through
    the engine; only the completion the scheduler sees is late, as on a device
    with a higher per-request latency (a network filesystem, a busy SSD). The
    reads of one request are submitted together, so a load pays the delay
    once, like the gate's fixed cost."""

    def __init__(self, store: Any, delay_s: float) -> None:
        self._store = store
        self.delay_s = delay_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def __len__(self) -> int:
        return len(self._store)

    def get(self, key: bytes, slot: int, *, tenant: bytes = b"") -> _SlowHandle:
        return _SlowHandle(self._store.get(key, slot, tenant=tenant), self.delay_s)

    def prefetch(self, key: bytes, slot: int, *, tenant: bytes = b"") -> _SlowHandle:
        return _SlowHandle(self._store.prefetch(key, slot, tenant=tenant), self.delay_s)


# ----------------------------------------------------------------------
# Engine and manager
# ----------------------------------------------------------------------
def _engine_ttft(out: Any) -> float | None:
    m = getattr(out, "metrics", None)
    first = getattr(m, "first_token_ts", 0) if m is not None else 0
    queued = getattr(m, "queued_ts", 0) if m is not None else 0
    return first - queued if first and queued and first > queued else None


class Gates:
    """Gate objects swapped into the manager per mode. Each keeps its own
    online refinement across requests, as a serving engine would."""

    def __init__(self, manager: Any, chunk_tokens: int) -> None:
        self.manager = manager
        self.chunk_tokens = chunk_tokens
        self._pairs: dict[str, tuple[Any, Any]] = {}

    def add(self, name: str, model: Any, *, enabled: bool, online: bool) -> None:
        from pykvcache.gate import AdmissionGate, OnlineLoadModel

        refine = OnlineLoadModel(model.load) if online else None
        gate = AdmissionGate(model, chunk_tokens=self.chunk_tokens, online=refine, enabled=enabled)
        # The preloader decides with a gate of its own (its decisions are not
        # counted as requests'), sharing the model and the refinement.
        preload = AdmissionGate(model, chunk_tokens=self.chunk_tokens, online=refine, enabled=enabled)
        self._pairs[name] = (gate, preload)

    def use(self, name: str) -> Any:
        gate, preload = self._pairs[name]
        vllm_adapter.use_gates(self.manager, gate, preload)
        return gate

    def online(self, name: str) -> Any:
        """The online refinement of gate ``name`` (None: not added, or no refinement)."""
        pair = self._pairs.get(name)
        return pair[0].online if pair else None


# ----------------------------------------------------------------------
# Cost models
# ----------------------------------------------------------------------
def calibrate(llm: Any, manager: Any, scenario: dict[str, Any], vocab: int, gates: Gates) -> dict[str, Any]:
    """What ``pykvcache calibrate`` measures, with its own functions, on this
    engine and the benchmark's storage directory."""
    from pathlib import Path

    from ..calibrate import measure as cal
    from ..calibrate.fit import fit_cost_model

    ct = scenario["chunk_tokens"]
    cal_lengths = scenario["calibrate_lengths"]
    repeats = scenario["calibrate_repeats"]
    count = [0]

    def tick(description: str = "") -> None:
        count[0] += 1
        progress(f"calibrate {description}")

    points, timing = cal.measure_prefill(llm, cal_lengths, repeats, vocab, scenario["seed"] + 7, tick)
    chunk_bytes = manager.layout.payload_bytes
    chunk_counts = sorted({max(1, math.ceil(n / ct)) for n in cal_lengths})
    storage = cal.measure_storage(
        [Path(scenario["storage_dir"])],
        chunk_bytes,
        chunk_counts,
        repeats,
        cal.StorageOptions(budget_mib=256),
        tick,
        lambda text: print(text, file=sys.stderr),
    )
    copy = cal.measure_copy(chunk_bytes, repeats)
    # The load path through this engine: loads from staging with the gate off.
    gates.use("load")

    def reset() -> bool:
        manager.flush()
        return bool(llm.reset_prefix_cache())

    def reset_staging() -> bool:
        manager.flush()
        return bool(llm.reset_prefix_cache(reset_connector=True))  # files stay (wipe_on_reset off)

    path = cal.measure_load_path(
        llm,
        cal_lengths,
        repeats,
        vocab,
        scenario["seed"] + 11,
        tick,
        suffix_tokens=scenario["suffix_tokens"],
        reset=reset,
        reset_staging=reset_staging,
    )
    try:
        model, prefill_source = fit_cost_model(points, path, storage["points"], copy["bytes_per_s"], chunk_bytes / ct)
    except ValueError as exc:
        raise RuntimeError(
            f"the calibration cannot be fitted ({exc}); medians: prefill "
            + ", ".join(f"{p.x} tokens {p.median * 1e3:.1f} ms" for p in points)
            + "; reads "
            + ", ".join(f"{p.x} B {p.median * 1e3:.2f} ms" for p in storage["points"])
            + ". Is the machine busy? More repeats help."
        ) from exc
    return {
        "model": model,
        "source": "calibrated in this run (pykvcache calibrate's measurements)",
        "timing": timing,
        "prefill_points": [p.as_dict("tokens") for p in points],
        "load_points": [p.as_dict("bytes") for p in storage["points"]],
        "path_points": [p.as_dict("tokens") for p in path["points"]],
        "disk_minus_staging_points": [p.as_dict("tokens") for p in path["disk_extra_points"]],
        "recompute_points": [p.as_dict("tokens") for p in path["recompute_points"]],
        "prefill_fitted_to": prefill_source,
        "storage": {k: v for k, v in storage.items() if k != "points"},
        "copy_bytes_per_s": copy["bytes_per_s"],
    }


def profile_model(manager: Any, path: str) -> dict[str, Any]:
    """The model the engine built from ``gate_profile`` (its spec validated the
    profile against the running engine and fell back to the conservative
    default when it did not match)."""
    from pykvcache.gate import GateProfile

    model = vllm_adapter.request_gate(manager).model
    try:
        used = GateProfile.read(path).cost_model() == model
    except Exception as exc:  # noqa: BLE001 - reported, the engine's default is used
        used, why = False, str(exc)
    else:
        why = "measured for another model/dtype/hardware (see the engine log)"
    source = f"profile {path}" if used else f"conservative default: profile {path} not used ({why})"
    return {"model": model, "source": source}


def slow_target(lengths: list[int], break_even: float) -> float | None:
    """Where the slow variant's break-even goes: between two measured lengths
    (their geometric mean), from the middle up, well above the calibrated one
    (4x: the emulated delay is then several ms, and the TTFT curves cross at
    a steep angle, so noise moves the measured crossover little)."""
    for k in range(max(0, len(lengths) // 2 - 1), len(lengths) - 1):
        target = math.sqrt(lengths[k] * lengths[k + 1])
        if target > 4 * break_even:
            return target
    return None


def slow_model(model: Any, break_even_tokens: float) -> tuple[Any, float]:
    """The calibrated model with the fixed load cost raised so that the
    break-even lands at ``break_even_tokens``; returns it and the added delay."""
    from pykvcache.gate.cost_model import LoadCost

    n = float(break_even_tokens)
    extra = model.recompute_time(n) - model.load_time(n)
    if extra <= 0:
        raise ValueError(f"loading {n:.0f} tokens already costs more than computing them; no slow variant")
    load = LoadCost(
        model.load.fixed_s + extra, model.load.disk_bytes_per_s, model.load.h2d_bytes_per_s, model.load.step_s, model.load.disk_step_s
    )
    return model.with_load(load), extra


def describe_model(model: Any) -> dict[str, Any]:
    be = model.break_even_tokens()
    return {
        "prefill": {"a": model.prefill.a, "b": model.prefill.b, "c": model.prefill.c},
        "load": {
            "fixed_s": model.load.fixed_s,
            "disk_bytes_per_s": model.load.disk_bytes_per_s,
            "h2d_bytes_per_s": model.load.h2d_bytes_per_s,
            "step_s": model.load.step_s,
            "disk_step_s": model.load.disk_step_s,
        },
        "bytes_per_token": model.bytes_per_token,
        "break_even_tokens": None if math.isinf(be) else be,
    }


# ----------------------------------------------------------------------
# The measurement
# ----------------------------------------------------------------------
class Bench:
    def __init__(self, llm: Any, manager: Any, gates: Gates, scenario: dict[str, Any], vocab: int) -> None:
        from vllm import SamplingParams

        self.llm = llm
        self.manager = manager
        self.gates = gates
        self.scenario = scenario
        self.real_store = vllm_adapter.store_of(manager)
        self.slow_store: SlowReads | None = None
        self.params = SamplingParams(max_tokens=1, temperature=0.0)
        self.rng = random.Random(scenario["seed"])
        self.low = min(10, vocab - 1)  # clear of special tokens
        self.vocab = vocab
        self.records: list[dict[str, Any]] = []

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.low, self.vocab) for _ in range(n)]

    def settle(self, stored_before: int, chunks: int, timeout_s: float = 30.0) -> None:
        """Wait until the last request's ``chunks`` are on disk. vLLM submits a
        finished request's store on the engine's next step, which a returned
        ``generate`` never takes: a short prompt (below one chunk, nothing
        stored) gives it that step."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.manager.flush()
            stored = len(vllm_adapter.store_of(self.manager)) - stored_before
            if stored >= chunks:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{chunks} chunks were not stored within {timeout_s:.0f} s ({stored} were)")
            prompt = {"prompt_token_ids": self.tokens(max(1, self.scenario["chunk_tokens"] // 4))}
            self.llm.generate([prompt], self.params, use_tqdm=False)

    def reset(self, staging: bool) -> None:
        # Writes finish first: a disk mode must find every chunk on disk, and
        # no write may share the device with a timed read.
        self.manager.flush()
        if not self.llm.reset_prefix_cache(reset_connector=staging):
            raise RuntimeError("vLLM refused to reset its prefix cache")

    def run_mode(self, mode: str, prefix: list[int], length: int, repeat: int) -> dict[str, Any]:
        if mode == "recompute":
            self.manager.flush()
            stored_before = len(vllm_adapter.store_of(self.manager))
            self.gates.use("load")
        elif mode == "staging":
            self.reset(staging=False)
            self.gates.use("load")
        else:
            self.reset(staging=True)
            self.gates.use({"disk": "load", "slow_disk": "load"}.get(mode, mode))
        vllm_adapter.use_store(self.manager, self.slow_store if mode.startswith("slow") else self.real_store)
        gate = vllm_adapter.request_gate(self.manager)
        counts_before = dict(gate.totals)
        # Reads counted by the engine itself: with reads in flight answered HIT
        # (decision 0055) the manager collects a read's completion, and vLLM's
        # metrics report it, at a step after the request's last one, so the
        # metric would be charged to the next mode measured.
        reads_before = self.real_store.stats()["read_hits"]
        prompt = {"prompt_token_ids": prefix + self.tokens(self.scenario["suffix_tokens"])}
        # Same settling for every mode: the file system finishes what the
        # previous request's writes left (extent conversion, write-back), so a
        # read is not timed behind it.
        os.sync()
        time.sleep(self.scenario.get("pause_s", 0.05))
        t0 = time.perf_counter()
        out = self.llm.generate([prompt], self.params, use_tqdm=False)[0]
        wall = time.perf_counter() - t0
        vllm_adapter.use_store(self.manager, self.real_store)
        reads_after = self.real_store.stats()["read_hits"]
        engine = _engine_ttft(out)
        decided_load = gate.totals["gate_decisions_load"] - counts_before["gate_decisions_load"]
        decided_recompute = gate.totals["gate_decisions_recompute"] - counts_before["gate_decisions_recompute"]
        rec = {
            "mode": mode,
            "prefix_tokens": length,
            "repeat": repeat,
            "prompt_tokens": len(prompt["prompt_token_ids"]),
            "ttft_s": engine if engine is not None else wall,
            "timing": "engine" if engine is not None else "wall",
            "wall_s": wall,
            "cached_tokens": out.num_cached_tokens or 0,
            "disk_reads": reads_after - reads_before,
            "gate_choice": "load" if decided_load else "recompute" if decided_recompute else None,
            "gate_tokens_loaded": gate.totals["gate_tokens_loaded"] - counts_before["gate_tokens_loaded"],
        }
        self.records.append(rec)
        if mode == "recompute":
            self.settle(stored_before, length // self.scenario["chunk_tokens"])
        return rec

    def warm_up(self) -> None:
        """First requests pay one-off costs (allocator, lazy init, first read
        and copy paths): run every mode once at two lengths, not recorded."""
        lengths = self.scenario["lengths"]
        for n in {lengths[0], lengths[-1]}:
            prefix = self.tokens(n)
            for mode in ("recompute", "staging", "disk", "gated"):
                self.run_mode(mode, prefix, n, -1)
        self.records.clear()

    def measure(self) -> None:
        lengths = self.scenario["lengths"]
        repeats = self.scenario["repeats"]
        slow = self.slow_store is not None
        for r in range(repeats):
            order = lengths if r % 2 == 0 else lengths[::-1]
            for n in order:
                prefix = self.tokens(n)
                # Over the repeats each length sees every order of the modes.
                j = r + lengths.index(n)
                modes = ["recompute", *BASE_ORDERS[j % len(BASE_ORDERS)]]
                if slow:
                    modes += SLOW_ORDERS[j % len(SLOW_ORDERS)]
                for mode in modes:
                    rec = self.run_mode(mode, prefix, n, r)
                    progress(f"repeat {r + 1}/{repeats} {n} tokens {mode}: {rec['ttft_s'] * 1e3:.1f} ms")


def prepare(scenario: dict[str, Any]) -> dict[str, Any]:
    """Resolve the model (the tiny test model, built offline, by default) and
    size the engine: KV cache (CPU) and staging hold several longest prompts."""
    import torch
    from transformers import AutoConfig

    from ..calibrate.measure import default_model_cache, kv_bytes_per_token_per_rank

    s = dict(scenario)
    tiny = not s.get("model")
    if tiny:
        from pykvcache.testing.tiny_model import build_tiny_model

        s["model"] = str(build_tiny_model(default_model_cache()))
    llm = dict(s.get("llm") or {})
    llm.setdefault("dtype", "float32" if tiny else "auto")
    hf = AutoConfig.from_pretrained(s["model"])
    text = getattr(hf, "text_config", None) or hf
    dtype = llm["dtype"] if llm["dtype"] != "auto" else str(getattr(text, "torch_dtype", None) or "float32")
    per_token = kv_bytes_per_token_per_rank(hf, dtype, int(llm.get("tensor_parallel_size", 1)))
    ct = s["chunk_tokens"]
    longest = max(s["lengths"]) + s["suffix_tokens"]
    on_gpu = torch.cuda.is_available()
    llm.setdefault("max_model_len", longest + ct)
    # One step per prompt: chunked prefill would split the long ones.
    llm.setdefault("max_num_batched_tokens", max(2048, longest + ct))
    llm.setdefault("enforce_eager", not on_gpu)
    if not on_gpu:
        llm.setdefault("block_size", 32)  # the CPU attention backend needs multiples of 32
        llm.setdefault("kv_cache_memory_bytes", max(64 << 20, 4 * (longest + 64) * per_token))
    chunk_bytes = per_token * ct + 4096
    # Staging is a cache: older prefixes are evicted, the current one must fit many times.
    s["staging_bytes"] = max(64 << 20, 6 * (longest // ct + 1) * chunk_bytes)
    # Nothing stored in the run may be evicted: a disk mode must find its prefix.
    stored_tokens = s["repeats"] * sum(s["lengths"]) + 2 * max(s["lengths"]) + (s["calibrate_repeats"] + 1) * sum(s["calibrate_lengths"])
    s["capacity_bytes"] = max(1 << 30, 2 * (stored_tokens // ct + 1) * chunk_bytes)
    s["llm"] = llm
    s["tiny"] = tiny
    return s


def _start_engine(scenario: dict[str, Any]) -> Any:
    from vllm import LLM

    from pykvcache.vllm.config import kv_transfer_config

    extra = {
        "staging_bytes": scenario["staging_bytes"],
        "block_size": scenario["chunk_tokens"],
        # reset_prefix_cache(reset_connector=True) then empties staging and
        # keeps the chunk files: the "load from disk" state in one engine.
        "wipe_on_reset": False,
    }
    if scenario.get("profile"):
        extra["gate_profile"] = scenario["profile"]
    kv = kv_transfer_config([scenario["storage_dir"]], scenario["capacity_bytes"], lookahead=True, **extra)
    return LLM(
        model=scenario["model"], kv_transfer_config=kv, enable_prefix_caching=True, disable_log_stats=False, seed=0, **scenario["llm"]
    )


def run(scenario: dict[str, Any]) -> dict[str, Any]:
    progress("preparing the model")
    scenario = prepare(scenario)
    started = time.monotonic()
    llm = _start_engine(scenario)
    startup_s = time.monotonic() - started
    manager = vllm_adapter.pykvcache_manager(llm)
    if not vllm_adapter.gate_wired(manager):
        raise RuntimeError("pykvcache's gate is not wired into the manager")
    vcfg = vllm_adapter.engine_config(llm)
    hf = vcfg.model_config.hf_config
    vocab = int((getattr(hf, "text_config", None) or hf).vocab_size)
    ct = scenario["chunk_tokens"]
    gates = Gates(manager, ct)
    bench = Bench(llm, manager, gates, scenario, vocab)
    # The engine's own gate until a model is chosen: every mode needs one.
    engine_gate = vllm_adapter.request_gate(manager)
    gates.add("load", engine_gate.model, enabled=False, online=False)
    gates.add("gated", engine_gate.model, enabled=True, online=True)
    progress(f"vLLM started in {startup_s:.0f} s; warm-up")
    bench.warm_up()

    if scenario.get("profile"):
        cost = profile_model(manager, scenario["profile"])
    else:
        cost = calibrate(llm, manager, scenario, vocab, gates)
    model = cost.pop("model")
    gates.add("gated", model, enabled=True, online=True)
    slow: dict[str, Any] | None = None
    target = slow_target(scenario["lengths"], model.break_even_tokens()) if scenario.get("slow") else None
    if scenario.get("slow") and target is None:
        slow = {"skipped": "the calibrated break-even is not below the middle of the measured lengths"}
    elif target is not None:
        try:
            smodel, delay = slow_model(model, target)
        except ValueError as exc:
            slow = {"skipped": str(exc)}
        else:
            gates.add("slow_gated", smodel, enabled=True, online=True)
            bench.slow_store = SlowReads(vllm_adapter.store_of(manager), delay)
            slow = {"delay_s": delay, "model": describe_model(smodel)}

    measure_started = time.monotonic()
    bench.measure()
    result = {
        "startup_s": round(startup_s, 2),
        "measure_s": round(time.monotonic() - measure_started, 2),
        "model": scenario["model"],
        "tiny_model": scenario["tiny"],
        "llm": scenario["llm"],
        "staging_bytes": scenario["staging_bytes"],
        "dtype": str(vcfg.model_config.dtype).removeprefix("torch."),
        "block_size": int(vcfg.cache_config.block_size),
        "chunk_tokens": ct,
        "chunk_bytes": manager.layout.payload_bytes,
        "direct_io": bool(getattr(vllm_adapter.store_of(manager), "direct_io", False)),
        "backend": str(getattr(vllm_adapter.store_of(manager), "backend", "")),
        "cost": {**cost, "model": describe_model(model)},
        "slow": slow,
        "gate_online": {name: _online_state(gates, name) for name in ("gated", "slow_gated")},
        "records": bench.records,
    }
    vllm_adapter.shutdown(llm)
    return result


def _online_state(gates: Gates, name: str) -> dict[str, float] | None:
    online = gates.online(name)
    return None if online is None else {"fixed_s": online.fixed_s, "disk_bytes_per_s": online.disk_bytes_per_s, "samples": online.samples}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m pykvcache.tools.bench.ttft_driver scenario.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        scenario = json.load(f)
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        print("ttft_driver: set VLLM_ENABLE_V1_MULTIPROCESSING=0 (the manager must live in this process)", file=sys.stderr)
        return 2
    print(RESULT_PREFIX + json.dumps(run(scenario)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
