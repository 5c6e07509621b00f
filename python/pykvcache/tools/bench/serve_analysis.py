"""The session workload's analysis (``--serve-preset sessions``): tables,
ratios against recompute, targets and figures of one serve run (pure:
unit-tested on synthetic runs)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from .parts import Figure, PartOutput, Table
from .serve_calibrate import summary as calibration_summary
from .serve_options import CALIBRATED, NAME, TITLE, VARIANT, ServeOptions
from .serve_stats import (
    BUCKETS,
    bucket_of,
    ms,
    ok_records,
    output_mismatches,
    paired_ratios,
    pct,
    ran_ok,
    run_stats,
    spread,
    tier_shares,
    why_line,
)


def analyse(runs: list[dict[str, Any]], opts: ServeOptions, model_info: dict[str, Any]) -> PartOutput:
    out = PartOutput(name=NAME, title=TITLE)
    bpt = model_info["bytes_per_token"]
    configs = [c for c in opts.configs]
    by_cfg: dict[str, list[dict[str, Any]]] = {c: [r for r in runs if r["config"] == c] for c in configs}
    ok_cfg = {c: [r for r in rs if ran_ok(r)] for c, rs in by_cfg.items()}
    top = max(opts.concurrency)
    per_rep: dict[str, dict[int, dict[str, Any]]] = {c: {r["repeat"]: run_stats(r, top) for r in rs} for c, rs in ok_cfg.items()}

    # Headline: every configuration, at the top concurrency level, pooled over repeats.
    rows = []
    for c in configs:
        rs = ok_cfg[c]
        if not rs:
            why = next((r.get("unavailable") or r.get("error", "") for r in by_cfg[c]), "not run")
            rows.append([c, "unavailable" if any("unavailable" in r for r in by_cfg[c]) else "**failed**", why_line(why), *["-"] * 11])
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
        rows.append(
            [
                c,
                f"{len(rs)}/{len(by_cfg[c])}",
                f"{ms(s['p50'])} / {ms(s['p90'])} / {ms(s['p99'])}",
                ms(s["p50_turn2plus"]),
                ms(s["p50_long_shared"]),
                f"{ms(s['itl_p50'])} / {ms(s['itl_p99'])}",
                spread([per_rep[c][r]["req_per_s"] for r in per_rep[c]]),
                spread([per_rep[c][r]["out_tok_per_s"] for r in per_rep[c]], "{:.1f}"),
                " / ".join(f"{shares.get(k, 0) * 100:.0f}%" for k in ("device", "staging", "disk")) if shares else "-",
                f"{rd / len(rs) / 1e6:.0f}",
                f"{wr / len(rs) / 1e6:.0f}",
                f"{wr / rd:.2f}" if rd else "-",
                "-" if cpu is None else f"{cpu:.0f}",
                f"{rss / 2**30:.2f}",
            ]
        )
    out.tables.append(
        Table(
            title=f"Multi-turn sessions at {top} concurrent users (max_num_seqs {opts.max_num_seqs}), all repeats pooled",
            header=[
                "configuration",
                "runs ok",
                "TTFT p50 / p90 / p99 ms",
                "p50 turn >= 2 ms",
                "p50 turn 1, shared doc >= 1k ms",
                "ITL p50 / p99 ms",
                "requests/s (spread)",
                "output tok/s (spread)",
                "cached device / staging / disk",
                "disk read MB/run",
                "disk written MB/run",
                "written per byte read",
                "server CPU-s/run",
                "peak RSS GiB (server tree)",
            ],
            rows=rows,
            note="TTFT = client send -> first streamed token. Cached shares from vLLM's prompt-token counters; "
            "the staging/disk split from pykvcache's verified disk bytes (preloads count as disk). Written per "
            "byte read = SSD wear per hit byte. CPU-s: the whole server process tree over the run.",
        )
    )

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

        rr = {
            "p50": ratios("p50"),
            "p99": ratios("p99"),
            "p50_turn2plus": ratios("p50_turn2plus"),
            "p50_long_shared": ratios("p50_long_shared"),
            "throughput": ratios("out_tok_per_s", inverse=True),
        }
        ratio_raw[c] = rr
        ratio_rows.append(
            [
                c,
                spread(rr["p50"]),
                spread(rr["p99"]),
                spread(rr["p50_turn2plus"]),
                spread(rr["p50_long_shared"]),
                spread(rr["throughput"]),
                str(len(reps)),
            ]
        )
    if ratio_rows:
        out.tables.append(
            Table(
                title=f"Against recompute, same repeat (median, min–max over repeats), {top} users",
                header=[
                    "configuration",
                    "p50 TTFT gain (recompute / this)",
                    "p99 TTFT gain",
                    "p50 gain, turns >= 2",
                    "p50 gain, turn 1 on a shared doc >= 1k",
                    "throughput ratio (this / recompute)",
                    "repeats",
                ],
                rows=ratio_rows,
                note="> 1 = better than recompute.",
            )
        )

    # Lookahead share, and the targets.
    la = None
    if per_rep.get("pykvcache") and per_rep.get("lookahead_off"):
        la = paired_ratios(per_rep, "pykvcache", "lookahead_off", "p50")
        out.notes.append(
            f"Lookahead on vs off, p50 TTFT at {top} users (> max_num_seqs {opts.max_num_seqs}: a "
            f"waiting queue): gain {spread(la)} (lookahead-off p50 / lookahead-on p50, per repeat)."
        )
    if per_rep.get("pykvcache") and per_rep.get(VARIANT):
        for key in ("p50", "p99"):
            vs = paired_ratios(per_rep, VARIANT, "pykvcache", key)
            out.notes.append(
                f"Variant ({opts.variant_path}) vs pykvcache, {key} TTFT at {top} users: gain "
                f"{spread(vs)} (pykvcache / variant, per repeat; > 1: the variant is faster)."
            )
    if "pykvcache" in ratio_raw:
        rr = ratio_raw["pykvcache"]

        def worst(values: list[float | None]) -> float | None:
            xs = [x for x in values if x is not None]
            return min(xs) if xs else None

        for key, label in (
            ("p50_turn2plus", "pykvcache p50 TTFT for turns >= 2 lower than recompute's"),
            ("p99", "pykvcache p99 TTFT not worse than recompute's (every repeat)"),
            ("throughput", "pykvcache throughput >= recompute's (every repeat)"),
        ):
            w = worst(rr[key])
            out.targets[label] = (w is not None and w >= 1.0, f"{spread(rr[key])}x, worst repeat " + ("-" if w is None else f"{w:.2f}x"))
        if la:
            out.targets["lookahead on vs off: p50 TTFT gain > 1 with a waiting queue"] = (statistics.median(la) > 1.0, f"{spread(la)}x")

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
        out.tables.append(
            Table(title="Greedy outputs identical to recompute's (per request)", header=["configuration", "repeat", "identical"], rows=mism)
        )
        bad = [row for row in mism if row[2].split("/")[0] != row[2].split("/")[1]]
        out.targets["greedy outputs identical to recompute's in every configuration"] = (
            not bad,
            "all identical" if not bad else "; ".join(f"{r[0]} #{r[1]}: {r[2]}" for r in bad),
        )

    out.tables += [_time_table(ok_cfg, configs, top), _turn_table(ok_cfg, configs, top), _bucket_table(ok_cfg, configs, top)]
    if ok_cfg.get("pykvcache") and ok_cfg.get("recompute"):
        out.tables.append(_tail_table(ok_cfg, top))
    if len(opts.concurrency) > 1:
        out.tables.append(_concurrency_table(ok_cfg, configs, opts.concurrency))
    if opts.pr_prompts:
        out.tables.append(_prefix_rep_table(ok_cfg, configs, opts))

    failures = [
        [r["config"], str(r["repeat"] + 1), (r.get("unavailable") or r.get("error", "")).replace("\n", "<br>")[:3000]]
        for r in runs
        if not ran_ok(r)
    ]
    if failures:
        out.tables.append(
            Table(
                title="Configurations that did not run (error text, server log tail)",
                header=["configuration", "repeat", "why"],
                rows=failures,
            )
        )
    out.figures += [_cdf_figure(ok_cfg, configs, top), _reuse_figure(ok_cfg, configs, top)]
    if len(opts.concurrency) > 1:
        out.figures.append(_throughput_figure(ok_cfg, configs, opts.concurrency))
    out.notes += _notes(opts, model_info)
    out.raw = {"options": opts.to_dict(), "model": model_info, "runs": runs, "ratios": ratio_raw, "lookahead_gain": la}
    return out


def _tail_table(ok_cfg: dict[str, list], top: int, share: float = 0.1) -> Table:
    """The slowest requests of the default configuration next to the same
    request (same repeat, session, turn) under recompute: where the tail comes from."""
    rows = []
    for e in ok_cfg["pykvcache"]:
        base = next((b for b in ok_cfg["recompute"] if b["repeat"] == e["repeat"]), None)
        if base is None:
            continue
        ref = {(r["session"], r["turn"]): r for r in ok_records(base, top)}
        recs = sorted(ok_records(e, top), key=lambda r: -r["ttft_s"])
        for r in recs[: max(1, int(len(recs) * share))]:
            b = ref.get((r["session"], r["turn"]))
            rows.append(
                [
                    str(e["repeat"] + 1),
                    f"{r['session']}/{r['turn']}",
                    str(r["prompt_tokens"]),
                    str(r["reused_tokens"]),
                    str(r["cached_tokens"]),
                    ms(r["ttft_s"]),
                    "-" if b is None else ms(b["ttft_s"]),
                    "-" if b is None else str(b["cached_tokens"]),
                ]
            )
    return Table(
        title=f"Where pykvcache's tail comes from: its slowest {share:.0%} of requests ({top} users)",
        header=[
            "repeat",
            "session/turn",
            "prompt tokens",
            "reusable",
            "cached (pykvcache)",
            "TTFT ms (pykvcache)",
            "TTFT ms (recompute, same request)",
            "cached (recompute)",
        ],
        rows=rows,
    )


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
            return spread([m.get(name, 0.0) for m in ms], "{:.0f}")

        def per_run_mean(name: str) -> str:
            return spread([None if (x := mean(m, name)) is None else x * 1e3 for m in ms], "{:.0f}")

        pyk = c not in ("recompute", "lmcache", "native")
        rows.append(
            [
                c,
                per_run_mean("vllm:request_queue_time_seconds"),
                per_run_mean("vllm:request_prefill_time_seconds"),
                per_run("vllm:num_preemptions_total"),
                per_run("vllm:kv_offload_lookup_async_delay_seconds_count") if pyk else "-",
                per_run_mean("vllm:kv_offload_lookup_async_delay_seconds") if pyk else "-",
                per_run("vllm:pykvcache_lookups_deferred_total") if pyk else "-",
                per_run("vllm:pykvcache_lookup_ready_requests_total") if pyk else "-",
                per_run("vllm:pykvcache_lookup_hold_cap_retries_total") if pyk else "-",
                per_run("vllm:pykvcache_staging_full_misses_total") if pyk else "-",
                per_run("vllm:pykvcache_store_deferred_total") if pyk else "-",
                spread([m.get("vllm:pykvcache_lookahead_preload_bytes_total", 0.0) / 1e6 for m in ms], "{:.0f}") if pyk else "-",
                per_run("vllm:pykvcache_lookahead_budget_stops_total") if pyk else "-",
                spread([m.get("vllm:pykvcache_lookahead_wasted_bytes_total", 0.0) / 1e6 for m in ms], "{:.0f}") if pyk else "-",
                per_run("vllm:pykvcache_gate_decisions_load_total")
                + " / "
                + per_run("vllm:pykvcache_gate_decisions_recompute_total")
                + " / "
                + per_run("vllm:pykvcache_gate_decisions_explore_total")
                if pyk
                else "-",
                per_run("vllm:pykvcache_gate_loads_forgotten_total") if pyk else "-",
                spread([m.get("vllm:pykvcache_gate_disk_bandwidth_mbps") for m in ms], "{:.0f}") if pyk else "-",
            ]
        )
    return Table(
        title=f"Where the time to first token goes ({top} users; server-side, per run: median (min–max) over repeats)",
        header=[
            "configuration",
            "queue ms (mean)",
            "prefill ms (mean)",
            "preemptions",
            "deferred lookups",
            "deferred ms (mean)",
            "pykvcache's own deferred lookups (HIT_PENDING / RETRY)",
            "requests all staged at first lookup",
            "lookup RETRYs (staging held by others)",
            "staging-full misses",
            "stores deferred",
            "preloaded MB",
            "lookahead budget stops",
            "preloaded MB wasted",
            "gate: load / recompute / explore decisions",
            "gate: loads forgotten",
            "gate: disk MB/s learnt",
        ],
        rows=rows,
        note="queue = vLLM's request_queue_time (arrival -> first scheduled; a deferred lookup keeps a request "
        "queued); prefill = first scheduled -> first token; preemptions: vLLM's (a request whose KV blocks were "
        "taken back, to be recomputed or loaded again). Deferred lookups: vLLM's "
        "kv_offload_lookup_async_delay: requests whose lookup was deferred, by pykvcache (HIT_PENDING or "
        "RETRY: a chunk still being stored, staging held by others) or by vLLM itself, which delays a request "
        "while another request's load of the same chunks is in flight; pykvcache's own deferred lookups "
        "(lookups_deferred) beside it. "
        "Gate: its decisions per run, the loads it forgot (two explored loads well faster than its model, or "
        "a storage outage: it fell back to its prior) and the disk bandwidth it had learnt at the end (gauge).",
    )


def _turn_table(ok_cfg: dict[str, list], configs: list[str], top: int) -> Table:
    turns = sorted({r["turn"] for rs in ok_cfg.values() for e in rs for r in ok_records(e, top)})
    rows = []
    for c in configs:
        recs = [r for e in ok_cfg.get(c, []) for r in ok_records(e, top)]
        if recs:
            rows.append(
                [c]
                + [
                    f"{ms(pct([r['ttft_s'] for r in recs if r['turn'] == t], 50))} / "
                    f"{ms(pct([r['ttft_s'] for r in recs if r['turn'] == t], 99))}"
                    for t in turns
                ]
            )
    return Table(title=f"TTFT p50 / p99 ms by turn ({top} users)", header=["configuration", *[f"turn {t}" for t in turns]], rows=rows)


def _bucket_table(ok_cfg: dict[str, list], configs: list[str], top: int) -> Table:
    names = [bucket_of(b) for b in BUCKETS]
    rows = []
    for c in configs:
        recs = [r for e in ok_cfg.get(c, []) for r in ok_records(e, top)]
        if recs:
            cells = []
            for b in names:
                xs = [r["ttft_s"] for r in recs if bucket_of(r["reused_tokens"]) == b]
                cells.append(f"{ms(pct(xs, 50))} / {ms(pct(xs, 99))} (n={len(xs)})" if xs else "-")
            rows.append([c, *cells])
    return Table(
        title=f"TTFT p50 / p99 ms by reusable prefix length ({top} users)",
        header=["configuration", *[f"{b} tokens" for b in names]],
        rows=rows,
        note="reusable prefix: the longest block-aligned prefix of the prompt that an earlier request sent "
        "(what some cache could hold; whether it did is the configuration's business).",
    )


def _concurrency_table(ok_cfg: dict[str, list], configs: list[str], levels: list[int]) -> Table:
    rows = []
    for c in configs:
        if ok_cfg.get(c):
            cells = []
            for lv in levels:
                st = [run_stats(e, lv) for e in ok_cfg[c]]
                cells.append(
                    f"{spread([s['out_tok_per_s'] for s in st], '{:.1f}')} tok/s, p50 "
                    f"{ms(statistics.median([s['p50'] for s in st if s['p50'] is not None] or [0]))} ms"
                )
            rows.append([c, *cells])
    return Table(title="Throughput vs concurrent users", header=["configuration", *[f"{lv} users" for lv in levels]], rows=rows)


def _prefix_rep_table(ok_cfg: dict[str, list], configs: list[str], opts: ServeOptions) -> Table:
    rows = []
    for c in configs:
        res = [e["prefix_repetition"] for e in ok_cfg.get(c, []) if "prefix_repetition" in e]
        if res:
            rows.append(
                [
                    c,
                    spread([r.get("median_ttft_ms") for r in res], "{:.0f}"),
                    spread([r.get("p99_ttft_ms") for r in res], "{:.0f}"),
                    spread([r.get("request_throughput") for r in res]),
                    spread([r.get("output_throughput") for r in res], "{:.1f}"),
                    spread([r.get("cpu_s") for r in res], "{:.0f}"),
                    str(sum(r.get("failed") or 0 for r in res)),
                ]
            )
    return Table(
        title=(
            f"vLLM's own `bench serve`, dataset prefix_repetition ({opts.pr_num_prefixes} prefixes of "
            f"{opts.pr_prefix_len} tokens, {opts.pr_prompts} prompts, {max(opts.concurrency)} in flight)"
        ),
        header=["configuration", "median TTFT ms", "p99 TTFT ms", "requests/s", "output tok/s", "server CPU-s", "failed"],
        rows=rows,
        note="numbers as vllm.benchmarks.serve computes them; median (min–max) over repeats.",
    )


def _cdf_figure(ok_cfg: dict[str, list], configs: list[str], top: int) -> Figure:
    def draw(fig: Any) -> None:
        ax = fig.subplots()
        for c in configs:
            xs = sorted(r["ttft_s"] * 1e3 for e in ok_cfg.get(c, []) for r in ok_records(e, top))
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=c, drawstyle="steps-post")
        ax.set_xscale("log")
        ax.set_xlabel("TTFT ms")
        ax.set_ylabel("share of requests")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)

    return Figure("serve_ttft_cdf.png", f"TTFT CDF per configuration ({top} concurrent users, multi-turn)", draw, (9.0, 4.5))


def _reuse_figure(ok_cfg: dict[str, list], configs: list[str], top: int) -> Figure:
    names = [bucket_of(b) for b in BUCKETS]

    def draw(fig: Any) -> None:
        ax = fig.subplots()
        for c in configs:
            recs = [r for e in ok_cfg.get(c, []) for r in ok_records(e, top)]
            pts = [(i, pct([r["ttft_s"] for r in recs if bucket_of(r["reused_tokens"]) == b], 50)) for i, b in enumerate(names)]
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
                ys = [statistics.median([s["out_tok_per_s"] or 0 for s in (run_stats(e, lv) for e in ok_cfg[c])]) for lv in levels]
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
        + (
            " (Llama-3's KV geometry per layer, few layers and a small hidden size so that a run fits 2 cores)"
            if mi["name"] == "llama3-geometry"
            else ""
        )
        + ".",
        f"Server: vLLM OpenAI API server (`python -m vllm.entrypoints.openai.api_server`), max_model_len "
        f"{opts.max_model_len}, device KV cache {opts.kv_cache_tokens} tokens "
        f"({opts.kv_cache_tokens * mi['bytes_per_token'] / 2**20:.0f} MiB), max_num_seqs {opts.max_num_seqs}, "
        f"block 32, prefix caching on; pykvcache chunk {opts.chunk_tokens} tokens, staging "
        f"{opts.staging_bytes / 2**20:.0f} MiB, "
        + (
            f"gate profile {Path(opts.gate_profile).name}."
            if opts.gate_profile
            else "no gate profile (the gate's conservative default, break-even 256 tokens)."
        )
        + (
            f" Configuration {CALIBRATED}: the gate profile `pykvcache calibrate --quick` measured before the first "
            f"round on the same disk{' under the same read cap' if opts.read_mbps else ''} ("
            f"{calibration_summary(opts.calibrated_profile)})."
            if CALIBRATED in opts.configs and opts.calibrated_profile
            else ""
        ),
        f"Workload (ours, `serve_workload.py`): {opts.sessions} sessions x {opts.turns} turns over {opts.documents} "
        f"shared documents of ~{opts.doc_tokens} tokens; each turn adds a {opts.question_tokens}-token question to "
        f"the conversation so far (with {opts.answer_tokens}-token fixed answers); {opts.output_tokens} output "
        f"tokens, greedy; think time {opts.think_s} s (exponential); concurrency levels {opts.concurrency}. "
        f"Working set ~{(opts.documents * opts.doc_tokens + opts.sessions * opts.turns * (opts.question_tokens + opts.answer_tokens))} "
        f"tokens per level vs a {opts.kv_cache_tokens}-token device cache. vLLM's part: the server, `vllm bench "
        "serve` (prefix_repetition) and every server-side counter.",
        f"Configurations {', '.join(opts.configs)}; {opts.repeats} repeats, round-robin, order rotated per repeat; "
        "each server fresh (empty storage)."
        + (
            f" {opts.busy_cores} busy-loop process(es) ran beside every configuration's measurement (other work sharing the cores)."
            if opts.busy_cores
            else ""
        )
        + (
            f" The server's disk reads were capped at {opts.read_mbps:g} MB/s (cgroup-v1 blkio throttle on the "
            "storage disk: a device slow next to compute, as on a GPU host)."
            if opts.read_mbps
            else ""
        ),
    ]
