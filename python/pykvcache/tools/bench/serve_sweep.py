"""The serve part's long-context sweep (``--serve-preset long-context``):
time to first token vs context length, against recompute, on real servers.

Per repeat, per context length (the shared documents' tokens), per read cap
(``read_caps``: 0 = quiet, else the server's disk reads capped, MB/s) and per
configuration (recompute measured in the same round, order rotated per
repeat) a fresh vLLM OpenAI server is started, sized for that length:
``max_model_len`` admits the longest prompt of the workload, the device KV
cache holds one such request (the working set, ``documents`` documents and
the conversations over them, is several times larger) and pykvcache's
staging is what its start-up check advises (``staging_sizing.py``: three
full-length prefixes, fewer than the documents, so prefixes come back from
disk). Against each server the session workload runs in phases:

* ``cold``: the sessions from an empty cache; the first request on each
  document computes it (a cold start, measured);
* ``steady``: new conversations over the same documents, each computed once
  before (by the cold phase, or without it by an unmeasured pass that sends
  each document once).

The analysis is the serving-level counterpart of a TTFT-vs-prefix figure:
recompute's p50 and p99 TTFT over each configuration's, per length, regime
and phase, as a table and a plot (``serve_crossover.png``, with the gate's
break-even marked), plus ``lookups_deferred`` per run and greedy outputs
compared with recompute's request by request.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

from .parts import BenchContext, Figure, PartOutput, Step, Table
from .serve_options import NAME, TITLE, VARIANT, ServeOptions, point_name, regime, sized_for, sweep_points
from .serve_run import run_server
from .serve_stats import output_mismatches, ran_ok, run_stats, spread

DEFERRED = "vllm:pykvcache_lookups_deferred_total"
BREAK_EVEN_GAUGE = "vllm:pykvcache_gate_break_even_tokens"
CROSSOVER_MD = "serve_crossover.md"
CROSSOVER_PNG = "serve_crossover.png"
_ADVICE = re.compile(r"pykvcache: (staging holds .*|lookahead's budget .*)")


# ----------------------------------------------------------------------
# Options and sizing
# ----------------------------------------------------------------------


# ----------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------


def staging_advice(log: Path) -> list[str]:
    """pykvcache's start-up advice on staging, as the server logged it (none = big enough)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    return list(dict.fromkeys(m.group(1).strip() for m in _ADVICE.finditer(text)))


def check_model(opts: ServeOptions, model_info: dict[str, Any]) -> None:
    limit = model_info["config"].get("max_position_embeddings")
    need = max(sized_for(opts, c, 0.0, model_info["bytes_per_token"]).max_model_len for c in opts.contexts)
    if limit and need > limit:
        raise ValueError(
            f"serve options: the longest prompt needs max_model_len {need} but the model "
            f"{opts.model} admits {limit} positions (max_position_embeddings); use "
            "--serve-model llama3-geometry-32k or shorter contexts"
        )


def run_sweep(
    ctx: BenchContext, opts: ServeOptions, model: str, model_info: dict[str, Any], work: Path, step: Step
) -> list[dict[str, Any]]:
    check_model(opts, model_info)
    bpt = model_info["bytes_per_token"]
    runs = []
    for rep in range(opts.repeats):
        order = opts.configs[rep % len(opts.configs) :] + opts.configs[: rep % len(opts.configs)]
        for context, cap in sweep_points(opts):
            sub = sized_for(opts, context, cap, bpt)
            for name in order:
                entry = run_server(name, rep, model, sub, bpt, work, step, point=point_name(context, cap))
                entry.update(
                    context_tokens=context,
                    read_mbps=cap,
                    sizing={"max_model_len": sub.max_model_len, "kv_cache_tokens": sub.kv_cache_tokens, "staging_bytes": sub.staging_bytes},
                    staging_advice=staging_advice(Path(entry["log"])),
                )
                runs.append(entry)
                ctx.unreaped_cpu_s += entry.get("unreaped_cpu_s", 0.0)
    return runs


# ----------------------------------------------------------------------
# Analysis (pure: unit-tested on synthetic runs)
# ----------------------------------------------------------------------
def phase_stats(entry: dict[str, Any], phase: str) -> dict[str, Any]:
    return run_stats({"levels": [lv for lv in entry.get("levels", []) if lv.get("phase") == phase]})


def phase_metric(entry: dict[str, Any], phase: str, name: str) -> float | None:
    lv = next((lv for lv in entry.get("levels", []) if lv.get("phase") == phase), None)
    return None if lv is None else lv.get("metrics", {}).get(name, 0.0)


def _cell(entries: dict[tuple, dict[str, Any]], context: int, cap: float, config: str, rep: int) -> dict | None:
    e = entries.get((context, cap, config, rep))
    return e if e is not None and ran_ok(e) else None


def crossover(runs: list[dict[str, Any]], opts: ServeOptions) -> list[dict[str, Any]]:
    """One row per (context, read cap, phase, configuration other than
    recompute): per-repeat ratios against recompute of the same round
    (p50/p99: recompute's over this one's; throughput: this one's over
    recompute's), lookups deferred per run, greedy outputs compared."""
    entries = {(r["context_tokens"], r["read_mbps"], r["config"], r["repeat"]): r for r in runs}
    reps = sorted({r["repeat"] for r in runs})
    rows = []
    for context, cap in sweep_points(opts):
        for phase in opts.phases:
            for c in opts.configs:
                if c == "recompute":
                    continue
                row: dict[str, Any] = {
                    "context": context,
                    "read_mbps": cap,
                    "phase": phase,
                    "config": c,
                    "p50": [],
                    "p99": [],
                    "throughput": [],
                    "p50_ms": [],
                    "p50_ms_recompute": [],
                    "p99_ms": [],
                    "p99_ms_recompute": [],
                    "deferred": [],
                    "identical": 0,
                    "compared": 0,
                    "runs_ok": 0,
                    "break_even": [],
                    "failed_requests": 0,
                    "cores": [],
                    "cores_recompute": [],
                }
                for rep in reps:
                    e, b = _cell(entries, context, cap, c, rep), _cell(entries, context, cap, "recompute", rep)
                    if e is None:
                        continue
                    row["runs_ok"] += 1
                    if (d := phase_metric(e, phase, DEFERRED)) is not None:
                        row["deferred"].append(d)
                    if (be := e.get("metrics", {}).get(BREAK_EVEN_GAUGE)) is not None and be >= 0:
                        row["break_even"].append(be)
                    if b is None:
                        continue
                    s, r = phase_stats(e, phase), phase_stats(b, phase)
                    row["failed_requests"] += s["errors"] + r["errors"]
                    for key, run in (("cores", e), ("cores_recompute", b)):
                        lv = next((lv for lv in run["levels"] if lv.get("phase") == phase), None)
                        if lv is not None and lv.get("wall_s"):
                            row[key].append(lv.get("cpu_s", 0.0) / lv["wall_s"])
                    if s["p50"] and r["p50"]:
                        row["p50"].append(r["p50"] / s["p50"])
                        row["p50_ms"].append(s["p50"] * 1e3)
                        row["p50_ms_recompute"].append(r["p50"] * 1e3)
                    if s["p99"] and r["p99"]:
                        row["p99"].append(r["p99"] / s["p99"])
                        row["p99_ms"].append(s["p99"] * 1e3)
                        row["p99_ms_recompute"].append(r["p99"] * 1e3)
                    if s["out_tok_per_s"] and r["out_tok_per_s"]:
                        row["throughput"].append(s["out_tok_per_s"] / r["out_tok_per_s"])
                    phased = {"levels": [lv for lv in e["levels"] if lv.get("phase") == phase]}
                    base = {"levels": [lv for lv in b["levels"] if lv.get("phase") == phase]}
                    diff, total = output_mismatches(phased, base)
                    row["identical"] += total - diff
                    row["compared"] += total
                rows.append(row)
    return rows


def lookahead_gain(runs: list[dict[str, Any]], opts: ServeOptions) -> list[dict[str, Any]]:
    """lookahead_off's p50 and p99 over pykvcache's (lookahead on), per repeat."""
    return paired_gain(runs, opts, "pykvcache", "lookahead_off")


def paired_gain(runs: list[dict[str, Any]], opts: ServeOptions, this: str, base: str) -> list[dict[str, Any]]:
    """``base``'s p50 and p99 over ``this``'s, per repeat (> 1: ``this`` is faster)."""
    if not {this, base} <= set(opts.configs):
        return []
    entries = {(r["context_tokens"], r["read_mbps"], r["config"], r["repeat"]): r for r in runs}
    out = []
    for context, cap in sweep_points(opts):
        for phase in opts.phases:
            p50, p99 = [], []
            for rep in sorted({r["repeat"] for r in runs}):
                on, off = (_cell(entries, context, cap, c, rep) for c in (this, base))
                if on is None or off is None:
                    continue
                a, b = phase_stats(on, phase), phase_stats(off, phase)
                if a["p50"] and b["p50"]:
                    p50.append(b["p50"] / a["p50"])
                if a["p99"] and b["p99"]:
                    p99.append(b["p99"] / a["p99"])
            out.append({"context": context, "read_mbps": cap, "phase": phase, "p50": p50, "p99": p99})
    return out


def load_vs_prefill(runs: list[dict[str, Any]], opts: ServeOptions, bytes_per_token: int) -> list[dict[str, Any]]:
    """Per point: a document's KV bytes, its read time at the cap, and
    recompute's mean server-side prefill time in the steady phase (vLLM's
    request_prefill_time): how a load compares with the prefill it replaces."""
    out = []
    for context, cap in sweep_points(opts):
        prefill = []
        for r in runs:
            if r["config"] == "recompute" and r["context_tokens"] == context and r["read_mbps"] == cap and ran_ok(r):
                for lv in r["levels"]:
                    m = lv.get("metrics", {})
                    n = m.get("vllm:request_prefill_time_seconds_count", 0.0)
                    if lv.get("phase") == opts.phases[-1] and n:
                        prefill.append(m.get("vllm:request_prefill_time_seconds_sum", 0.0) / n)
        mb = context * bytes_per_token / 1e6
        out.append(
            {
                "context": context,
                "read_mbps": cap,
                "kv_mb": mb,
                "read_s": mb / cap if cap else None,
                "prefill_s": statistics.median(prefill) if prefill else None,
            }
        )
    return out


def configured_break_even(opts: ServeOptions) -> tuple[float | None, str]:
    """The gate's break-even the pykvcache servers started with, and where it came from."""
    if opts.gate_profile:
        try:
            be = json.loads(Path(opts.gate_profile).read_text()).get("break_even_tokens")
        except (OSError, ValueError):
            return None, f"gate profile {opts.gate_profile} (unreadable)"
        return be, f"gate profile {Path(opts.gate_profile).name}"
    from pykvcache.gate.profile import DEFAULT_BREAK_EVEN_TOKENS

    return float(DEFAULT_BREAK_EVEN_TOKENS), "the gate's default (no profile)"


def _sp(xs: list[float], fmt: str = "{:.2f}") -> str:
    return spread(list(xs), fmt)


def crossover_table(rows: list[dict[str, Any]], phase: str, title: str) -> Table:
    body = []
    for r in rows:
        if r["phase"] != phase:
            continue
        body.append(
            [
                f"{r['context']}",
                regime(r["read_mbps"]),
                r["config"],
                _sp(r["p50"]) + "×" if r["p50"] else "-",
                _sp(r["p99"]) + "×" if r["p99"] else "-",
                _sp(r["throughput"]) + "×" if r["throughput"] else "-",
                f"{_sp(r['p50_ms_recompute'], '{:.0f}')} / {_sp(r['p50_ms'], '{:.0f}')}",
                f"{_sp(r['p99_ms_recompute'], '{:.0f}')} / {_sp(r['p99_ms'], '{:.0f}')}",
                " / ".join(f"{d:.0f}" for d in r["deferred"]) or "-",
                f"{r['identical']}/{r['compared']}" + (f" ({r['failed_requests']} request(s) failed)" if r["failed_requests"] else ""),
                f"{_sp(r['cores_recompute'])} / {_sp(r['cores'])}",
            ]
        )
    return Table(
        title=title,
        header=[
            "context tokens",
            "regime",
            "configuration",
            "p50 TTFT gain (recompute / this)",
            "p99 TTFT gain",
            "throughput gain (this / recompute)",
            "p50 ms recompute / this",
            "p99 ms recompute / this",
            "deferred lookups per run",
            "greedy outputs identical",
            "server cores used recompute / this",
        ],
        rows=body,
        note="gains: median (min–max) over repeats, each repeat against recompute measured in the "
        "same round on its own fresh server; > 1 = better than recompute. Deferred lookups: "
        "the engine's lookups_deferred (HIT_PENDING or RETRY), one number per run. Cores "
        "used: the server tree's CPU-seconds over the phase's wall time (below 2 on this "
        "2-core host when other work took the cores, or while the server waited).",
    )


def _lookahead_table(rows: list[dict[str, Any]]) -> Table:
    return _gain_table("Lookahead on vs off (lookahead-off TTFT / lookahead-on TTFT, per repeat)", rows, "> 1: lookahead helped.")


def _gain_table(title: str, rows: list[dict[str, Any]], note: str) -> Table:
    return Table(
        title=title,
        header=["context tokens", "regime", "phase", "p50 gain", "p99 gain"],
        rows=[
            [str(r["context"]), regime(r["read_mbps"]), r["phase"], _sp(r["p50"]) if r["p50"] else "-", _sp(r["p99"]) if r["p99"] else "-"]
            for r in rows
        ],
        note=note,
    )


def _regime_table(rows: list[dict[str, Any]]) -> Table:
    body = [
        [
            str(r["context"]),
            regime(r["read_mbps"]),
            f"{r['kv_mb']:.0f}",
            "-" if r["read_s"] is None else f"{r['read_s']:.1f}",
            "-" if r["prefill_s"] is None else f"{r['prefill_s']:.1f}",
            "-" if r["read_s"] is None or not r["prefill_s"] else f"{r['read_s'] / r['prefill_s']:.2f}",
        ]
        for r in rows
    ]
    return Table(
        title="A load against its prefill, per point",
        header=[
            "context tokens",
            "regime",
            "document KV MB",
            "its read at the cap s",
            "recompute's mean prefill s (server)",
            "read / prefill",
        ],
        rows=body,
        note="prefill: vLLM's request_prefill_time (first scheduled -> first token) of recompute's "
        "requests in the last phase, mean, median over repeats; it includes queueing behind other "
        "requests' chunks in the same steps. Quiet: the disk's own speed.",
    )


def _sizing_table(runs: list[dict[str, Any]], opts: ServeOptions, bytes_per_token: int) -> Table:
    body, seen = [], set()
    for r in runs:
        if r["config"] == "recompute" or (r["context_tokens"], r["read_mbps"]) in seen or "sizing" not in r:
            continue
        seen.add((r["context_tokens"], r["read_mbps"]))
        sz = r["sizing"]
        work = opts.documents * r["context_tokens"] + opts.sessions * opts.turns * (opts.question_tokens + opts.answer_tokens)
        body.append(
            [
                str(r["context_tokens"]),
                regime(r["read_mbps"]),
                str(sz["max_model_len"]),
                str(sz["kv_cache_tokens"]),
                f"{work}",
                f"{work / sz['kv_cache_tokens']:.1f}",
                f"{sz['staging_bytes'] / 2**20:.0f}",
                f"{sz['staging_bytes'] / (sz['max_model_len'] * bytes_per_token):.1f}",
                "; ".join(r.get("staging_advice") or []) or "none",
            ]
        )
    return Table(
        title="Sizes per point",
        header=[
            "context tokens",
            "regime",
            "max_model_len",
            "device KV tokens",
            "working set tokens",
            "working set / device cache",
            "staging MiB",
            "staging / one full-length prefix",
            "pykvcache's start-up advice (server log)",
        ],
        rows=body,
    )


def _targets(out: PartOutput, runs: list[dict[str, Any]], rows: list[dict[str, Any]], la: list[dict[str, Any]]) -> None:
    compared = sum(r["compared"] for r in rows)
    same = sum(r["identical"] for r in rows)
    if compared:
        out.targets["greedy outputs identical to recompute's for every request"] = (
            same == compared,
            f"{same}/{compared} requests identical",
        )
        failed = sum(rec["error"] is not None for e in runs for lv in e.get("levels", []) for rec in lv["records"])
        out.targets["every request answered (no client or server error)"] = (
            failed == 0,
            f"{failed} request(s) failed, every configuration counted",
        )
    steady = [r for r in rows if r["config"] == "pykvcache" and r["phase"] == "steady"]
    deferred = [d for r in steady for d in r["deferred"]]
    if deferred:
        out.targets["deferred lookups per run: 0 (pykvcache, steady state, staging as advised)"] = (
            max(deferred) == 0,
            f"{', '.join(f'{d:.0f}' for d in deferred)} per run",
        )
    for r in steady:
        if r["context"] == 8192 and not r["read_mbps"] and r["p50"]:
            worst = {k: min(r[k]) for k in ("p50", "p99", "throughput") if r[k]}
            out.targets["steady state at 8k, quiet: p50 >= 8x, p99 >= 5x, throughput >= 5x recompute's"] = (
                worst.get("p50", 0) >= 8 and worst.get("p99", 0) >= 5 and worst.get("throughput", 0) >= 5,
                f"p50 {_sp(r['p50'])}x, p99 {_sp(r['p99'])}x, throughput {_sp(r['throughput'])}x",
            )
        if r["read_mbps"] and r["p50"]:
            out.targets[f"reads capped {r['read_mbps']:g} MB/s, {r['context']} tokens: p50 >= 3x recompute's"] = (
                min(r["p50"]) >= 3,
                f"{_sp(r['p50'])}x",
            )
    for g in la:
        if g["read_mbps"] and g["phase"] == "steady" and g["p50"]:
            out.targets[
                f"lookahead on vs off, reads capped {g['read_mbps']:g} MB/s, {g['context']} tokens: p50 >= 1.2x, p99 never worse"
            ] = (min(g["p50"]) >= 1.2 and min(g["p99"] or [0]) >= 1.0, f"p50 {_sp(g['p50'])}x, p99 {_sp(g['p99'])}x")


def crossover_figure(rows: list[dict[str, Any]], opts: ServeOptions, break_even: float | None, learnt: dict[float, float]) -> Figure:
    def draw(fig: Any) -> None:
        from matplotlib.ticker import FixedLocator, NullFormatter, ScalarFormatter

        axes = fig.subplots(1, 2, sharey=True)
        styles: dict[str, dict[str, Any]] = {"steady": dict(linestyle="-", marker="o"), "cold": dict(linestyle=":", marker="x", alpha=0.7)}
        for ax, key, label in ((axes[0], "p50", "median TTFT"), (axes[1], "p99", "p99 TTFT")):
            for c, cap, phase in dict.fromkeys((r["config"], r["read_mbps"], r["phase"]) for r in rows):
                pts = [
                    (r["context"], statistics.median(r[key]))
                    for r in rows
                    if (r["config"], r["read_mbps"], r["phase"]) == (c, cap, phase) and r[key]
                ]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"{c}, {regime(cap)}, {phase}", **styles.get(phase, {}))
            ax.axhline(1.0, color="black", linewidth=0.8)
            if break_even:
                ax.axvline(break_even, color="grey", linestyle="--", linewidth=1)
                ax.annotate(
                    f"gate break-even\n{break_even:.0f} tokens",
                    (break_even, 1.0),
                    fontsize=7,
                    xytext=(3, 6),
                    textcoords="offset points",
                    color="grey",
                )
            for cap, be in learnt.items():
                be = max(1.0, be)  # below one token: loading any prefix pays
                ax.axvline(be, color="tab:red" if cap else "tab:green", linestyle=":", linewidth=1)
                ax.annotate(
                    f"learnt, {regime(cap)}: {be:.0f}",
                    (be, 1.0),
                    fontsize=7,
                    rotation=90,
                    xytext=(2, 12),
                    textcoords="offset points",
                    color="tab:red" if cap else "tab:green",
                )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(FixedLocator([0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128]))
            ax.yaxis.set_major_formatter(ScalarFormatter())
            ax.yaxis.set_minor_formatter(NullFormatter())
            marks = [*([break_even] if break_even else []), *learnt.values()]
            ticks = sorted(set(opts.contexts) | {max(1, round(m)) for m in marks if m >= 0})
            ax.set_xticks(ticks, [f"{t / 1024:g}k" if t >= 1024 else str(t) for t in ticks], fontsize=7)
            ax.set_xlim(min(ticks) / 1.5, max(ticks) * 1.5)
            ax.set_xlabel("reused context (tokens)")
            ax.set_title(f"{label}: recompute / configuration", fontsize=9)
            ax.grid(alpha=0.3, which="both")
        axes[0].set_ylabel("TTFT gain (> 1: faster than recompute)")
        axes[1].legend(fontsize=7)

    return Figure(
        CROSSOVER_PNG,
        "The crossover at serving level: TTFT gain against recompute vs context length "
        f"({max(opts.concurrency)} users; solid: steady state, dotted: cold start)",
        draw,
        (12.0, 4.8),
    )


def analyse_sweep(runs: list[dict[str, Any]], opts: ServeOptions, model_info: dict[str, Any]) -> PartOutput:
    out = PartOutput(name=NAME, title=TITLE + " — long-context sweep")
    bpt = model_info["bytes_per_token"]
    rows = crossover(runs, opts)
    la = lookahead_gain(runs, opts)
    lvp = load_vs_prefill(runs, opts, bpt)
    be, be_from = configured_break_even(opts)
    learnt: dict[float, float] = {}
    for cap in dict.fromkeys(r["read_mbps"] for r in rows):
        xs = [b for r in rows if r["read_mbps"] == cap and r["config"] == "pykvcache" for b in r["break_even"]]
        if xs:
            learnt[cap] = statistics.median(xs)
    for phase, what in (
        ("steady", "steady state (each context computed once before the measured window)"),
        ("cold", "cold start (empty caches: the first request on each document computes it)"),
    ):
        if phase in opts.phases:
            out.tables.append(crossover_table(rows, phase, f"TTFT vs context length, {what}"))
    if la:
        out.tables.append(_lookahead_table(la))
    variant = paired_gain(runs, opts, VARIANT, "pykvcache")
    if variant:
        out.tables.append(
            _gain_table(
                f"Variant ({opts.variant_path}) vs pykvcache (pykvcache TTFT / variant TTFT, per repeat)",
                variant,
                "> 1: the variant is faster.",
            )
        )
    out.tables += [_regime_table(lvp), _sizing_table(runs, opts, bpt)]
    failures = [
        [
            r["config"],
            point_name(r["context_tokens"], r["read_mbps"]),
            str(r["repeat"] + 1),
            (r.get("unavailable") or r.get("error", "")).replace("\n", "<br>")[:2000],
        ]
        for r in runs
        if not ran_ok(r)
    ]
    if failures:
        out.tables.append(
            Table(
                title="Servers that did not run (error text, server log tail)",
                header=["configuration", "point", "repeat", "why"],
                rows=failures,
            )
        )
    out.figures.append(crossover_figure(rows, opts, be, learnt))
    _targets(out, runs, rows, la)
    out.notes += sweep_notes(opts, model_info, be, be_from, learnt)
    out.raw = {
        "options": opts.to_dict(),
        "model": model_info,
        "runs": runs,
        "crossover": rows,
        "lookahead": la,
        "variant": variant,
        "load_vs_prefill": lvp,
        "break_even": {"configured": be, "source": be_from, "learnt": learnt},
    }
    return out


def sweep_notes(opts: ServeOptions, mi: dict[str, Any], be: float | None, be_from: str, learnt: dict[float, float]) -> list[str]:
    c = mi["config"]
    return [
        f"Model: {mi['name']} (generated, random weights): {c['num_hidden_layers']} layers, hidden "
        f"{c['hidden_size']}, {c.get('num_key_value_heads')} KV heads x head_dim {c.get('head_dim')}, float32: "
        f"{mi['bytes_per_token'] / 1024:.0f} KiB of KV per token; {c.get('max_position_embeddings')} positions.",
        f"Workload per server: {max(opts.concurrency)} users (max_num_seqs {opts.max_num_seqs}), {opts.sessions} "
        f"sessions x {opts.turns} turns over {opts.documents} shared documents of the point's context length; "
        f"{opts.question_tokens}-token questions, {opts.answer_tokens}-token fixed answers, {opts.output_tokens} "
        f"output tokens, greedy; think time {opts.think_s} s; phases {', '.join(opts.phases)}"
        + ("" if "cold" in opts.phases else " (each document computed once before, not measured)")
        + ".",
        f"Configurations {', '.join(opts.configs)}; {opts.repeats} repeat(s); per repeat, point and configuration a "
        "fresh vLLM OpenAI server (empty storage), recompute in the same round, order rotated per repeat. Sizes "
        "per point in 'Sizes per point'; chunk "
        f"{opts.chunk_tokens} tokens.",
        f"Gate break-even marked: {'-' if be is None else f'{be:.0f} tokens'} ({be_from})"
        + (
            "; learnt by the pykvcache servers at the end of their runs (gauge gate_break_even_tokens, median): "
            + ", ".join(f"{regime(k)} {v:.0f}" for k, v in learnt.items())
            if learnt
            else ""
        )
        + ".",
    ]


def write_crossover(out: PartOutput, out_dir: Path) -> Path:
    """The crossover tables as their own markdown file beside the report (the
    plot is written with the report's figures)."""
    from .report import markdown_table

    out_dir.mkdir(parents=True, exist_ok=True)
    parts = [f"# {out.title}", "", f"![crossover]({CROSSOVER_PNG})", ""]
    for t in out.tables:
        parts += [markdown_table(t), ""]
    parts += ["## Targets", ""] + [f"- {'met' if ok else '**not met**'}: {k} ({why})" for k, (ok, why) in out.targets.items()]
    parts += ["", "## Notes", ""] + [f"- {n}" for n in out.notes]
    path = out_dir / CROSSOVER_MD
    path.write_text("\n".join(parts) + "\n")
    return path
