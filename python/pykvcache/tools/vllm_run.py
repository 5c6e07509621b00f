"""Run vLLM engines through scripted phases in one child process; print JSON.

Used by ``pykvcache demo`` and the ``memory`` benchmark part. Importing vLLM
costs seconds and starting an engine tens of seconds here, so one scenario
holds several engines (one after another: a run without pykvcache, then one
with it) and pays the import once::

    python -m pykvcache.tools.vllm_run scenario.json

Scenario keys: ``model`` (or ``tiny_model``: build one here), ``engine`` (``vllm.LLM`` keyword arguments shared by
every run), ``runs`` (each: ``name``, optional ``kv_transfer_config``,
``phases``). Phase ops:

  generate            ``prompts`` (texts) -> token ids, num_cached_tokens, metrics
  reset_prefix_cache  empties vLLM's device prefix cache (pykvcache keeps its data)
  settle              waits until pykvcache has no disk writes in flight

Every phase and run carries wall-clock ``t0``/``t1`` (``time.time()``) so a
sampler in the parent can attribute its samples. The last stdout line is
``RESULT <json>``.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pykvcache.tools import vllm_adapter

if TYPE_CHECKING:
    from vllm.inputs import TokensPrompt

RESULT_PREFIX = "RESULT "
#: ``PROGRESS <run> <phase>`` lines on stdout before each step, for a live status.
PROGRESS_PREFIX = "PROGRESS "
#: Metric name prefixes reported per phase (pykvcache's own and vLLM's offload/prefix-cache ones).
METRIC_PREFIXES = ("vllm:pykvcache_", "vllm:kv_offload_", "vllm:prefix_cache")


def child_env() -> dict[str, str]:
    """Environment for the child: offline, no core binding fights on small machines."""
    return dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        TOKENIZERS_PARALLELISM="false",
    )


def metrics(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        if not metric.name.startswith(METRIC_PREFIXES):
            continue
        value = getattr(metric, "value", None)
        if value is None:
            value = getattr(metric, "sum", None)
        if isinstance(value, (int, float)):
            out[metric.name] = out.get(metric.name, 0) + value
    return out


def _settle(llm: Any, tokenizer: Any, timeout: float = 30.0) -> bool:
    """Let pending disk writes finish: the engine keeps stepping while pykvcache
    has I/O in flight; a one-token request collects the final stats."""
    from vllm import SamplingParams

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        llm.generate([{"prompt_token_ids": tokenizer("settle").input_ids}], SamplingParams(max_tokens=1), use_tqdm=False)
        if metrics(llm).get("vllm:pykvcache_staging_slots_pinned", 0) == 0:
            return True
        time.sleep(0.2)
    return False


def _progress(run: str, step: str) -> None:
    print(f"{PROGRESS_PREFIX}{run} {step}", flush=True)


def _run_engine(model: str, engine: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    t0 = time.time()
    kv = run.get("kv_transfer_config")
    _progress(run["name"], "start")
    llm = LLM(model=model, **engine, **({"kv_transfer_config": kv} if kv else {}))
    tokenizer = llm.get_tokenizer()
    result: dict[str, Any] = {"name": run["name"], "t0": t0, "startup_s": round(time.time() - t0, 2), "phases": []}
    for phase in run["phases"]:
        _progress(run["name"], phase.get("name", phase["op"]))
        entry: dict[str, Any] = {"op": phase["op"], "name": phase.get("name", phase["op"]), "t0": time.time()}
        if phase["op"] == "generate":
            params = SamplingParams(temperature=0.0, max_tokens=phase.get("max_tokens", 16), ignore_eos=True)
            prompts: list[TokensPrompt] = [{"prompt_token_ids": tokenizer(p).input_ids} for p in phase["prompts"]]
            outs = llm.generate(prompts, params, use_tqdm=False)
            entry["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
            entry["num_cached_tokens"] = [o.num_cached_tokens or 0 for o in outs]
            entry["prompt_lens"] = [len(p["prompt_token_ids"]) for p in prompts]
            if kv and phase.get("settle", True):
                entry["settled"] = _settle(llm, tokenizer)
            entry["metrics"] = metrics(llm)
        elif phase["op"] == "reset_prefix_cache":
            entry["ok"] = bool(llm.reset_prefix_cache())
        elif phase["op"] == "settle":
            entry["settled"] = _settle(llm, tokenizer) if kv else True
            entry["metrics"] = metrics(llm)
        else:
            raise ValueError(f"unknown phase op {phase['op']!r}")
        entry["t1"] = time.time()
        entry["seconds"] = round(entry["t1"] - entry["t0"], 3)
        result["phases"].append(entry)
    _progress(run["name"], "shutdown")
    # Explicit shutdown: pykvcache flushes pending writes and unlinks its
    # staging region before the next engine starts.
    vllm_adapter.shutdown(llm)
    del llm
    gc.collect()
    result["t1"] = time.time()
    return result


def scenario_model(scenario: dict[str, Any]) -> str:
    """``model`` as given, or a tiny model built here (``tiny_model``: ``dir``
    and ``spec``, the fields of :class:`TinyModelSpec`)."""
    if "model" in scenario:
        return str(scenario["model"])
    from pykvcache.testing.tiny_model import TinyModelSpec, build_tiny_model

    tiny = scenario["tiny_model"]
    return str(build_tiny_model(tiny["dir"], TinyModelSpec(**tiny.get("spec", {}))))


def run_scenario(scenario: dict[str, Any]) -> dict[str, Any]:
    model = scenario_model(scenario)
    runs = [_run_engine(model, scenario.get("engine", {}), run) for run in scenario["runs"]]
    return {"model": model, "runs": runs}


class ChildFailed(RuntimeError):
    """The vLLM child exited without a result; the message ends with its log tail."""


def start_child(scenario: dict[str, Any], workdir: Path, name: str, in_process_engine: bool = False) -> tuple[subprocess.Popen[str], Path]:
    """Start ``python -m pykvcache.tools.vllm_run`` on ``scenario``; vLLM's
    logs go to ``<workdir>/<name>.log``. Returns the process and the log path.
    ``in_process_engine``: vLLM's EngineCore runs in the child itself
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): each engine starts in seconds
    instead of ~25 s here, for runs whose subject is not the process layout."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / f"{name}.json"
    path.write_text(json.dumps(scenario))
    log = workdir / f"{name}.log"
    with open(log, "w") as logf:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pykvcache.tools.vllm_run", str(path)],
            stdout=subprocess.PIPE, stderr=logf, text=True,
            env={**child_env(), **({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if in_process_engine else {})},
        )  # fmt: skip
    return proc, log


def wait_child(
    proc: subprocess.Popen[str], log: Path, on_progress: Callable[[str, str], None] | None = None, timeout: float = 900
) -> dict[str, Any]:
    """Read the child's stdout to the end (``PROGRESS`` lines go to
    ``on_progress(run, step)``) and return its result."""
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    result = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(PROGRESS_PREFIX) and on_progress:
                run, _, step = line[len(PROGRESS_PREFIX) :].strip().partition(" ")
                on_progress(run, step)
            elif line.startswith(RESULT_PREFIX):
                result = json.loads(line[len(RESULT_PREFIX) :])
        proc.wait()
    finally:
        timer.cancel()
    if proc.returncode != 0 or result is None:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        why = "timed out" if proc.returncode == -9 else f"exit status {proc.returncode}"
        raise ChildFailed(f"vLLM child failed ({why}); see {log}; last lines:\n{tail}")
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m pykvcache.tools.vllm_run scenario.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        scenario = json.load(f)
    print(RESULT_PREFIX + json.dumps(run_scenario(scenario)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
