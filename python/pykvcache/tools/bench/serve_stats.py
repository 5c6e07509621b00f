"""Statistics of the serve part's runs: percentiles, per-run TTFT and
throughput, where prompt tokens came from, outputs compared with recompute's,
and the formatting the tables share (pure: unit-tested on synthetic runs)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

#: Reused-prefix buckets of the TTFT split (tokens; lower bounds).
BUCKETS = (0, 1, 256, 1024, 2048)


def metric_delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    keys = [
        k
        for k in after
        if k.startswith(
            (
                "vllm:pykvcache_",
                "vllm:prefix_cache",
                "vllm:prompt_tokens",
                "vllm:external_prefix_cache",
                "vllm:generation_tokens",
                "vllm:kv_offload",
                "vllm:request_queue_time_seconds",
                "vllm:request_prefill_time_seconds",
                "vllm:time_to_first_token_seconds",
                "vllm:num_preemptions",
            )
        )
    ]

    def counter(k: str) -> bool:  # prometheus_client: counters end in _total, histograms in _sum/_count/_bucket
        return k.split("{")[0].endswith(("_total", "_sum", "_count", "_bucket"))

    # Counters: what this window added; gauges (the gate's learnt bandwidth, ...): the value at its end.
    return {k: after[k] - before.get(k, 0.0) if counter(k) else after[k] for k in keys if not k.endswith("_created")}


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


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}" if x >= 0.1 else f"{x * 1e3:.1f}"


def spread(values: Sequence[float | None], fmt: str = "{:.2f}") -> str:
    xs = [x for x in values if x is not None]
    if not xs:
        return "-"
    med = statistics.median(xs)
    if len(xs) == 1:
        return fmt.format(med)
    return f"{fmt.format(med)} ({fmt.format(min(xs))}–{fmt.format(max(xs))})"


def ok_records(entry: dict[str, Any], level: int | None = None) -> list[dict[str, Any]]:
    out = []
    for lv in entry.get("levels", []):
        if level is None or lv["concurrency"] == level:
            out += [r for r in lv["records"] if r["error"] is None]
    return out


def run_stats(entry: dict[str, Any], level: int | None = None) -> dict[str, Any]:
    """TTFT percentiles, throughput and cache shares of one server's run."""
    recs = ok_records(entry, level)
    levels = [lv for lv in entry.get("levels", []) if level is None or lv["concurrency"] == level]
    ttft = [r["ttft_s"] for r in recs]
    wall = sum(lv["wall_s"] for lv in levels)
    out_tokens = sum(r["output_tokens"] for r in recs)
    later = [r["ttft_s"] for r in recs if r["turn"] >= 2]
    long_shared = [r["ttft_s"] for r in recs if r["turn"] == 1 and r["reused_tokens"] >= 1024]
    errors = sum(1 for lv in levels for r in lv["records"] if r["error"] is not None)
    return {
        "requests": len(recs),
        "errors": errors,
        "p50": pct(ttft, 50),
        "p90": pct(ttft, 90),
        "p99": pct(ttft, 99),
        "p50_turn2plus": pct(later, 50),
        "p50_long_shared": pct(long_shared, 50),
        "itl_p50": pct([x for r in recs for x in r["itl_s"]], 50),
        "itl_p99": pct([x for r in recs for x in r["itl_s"]], 99),
        "req_per_s": len(recs) / wall if wall else None,
        "out_tok_per_s": out_tokens / wall if wall else None,
    }


def tier_shares(metrics: dict[str, float], bytes_per_token: int) -> dict[str, float]:
    """Prompt tokens by where they came from: the device prefix cache, a
    connector (pykvcache: staging or disk; disk tokens = verified disk bytes
    read / KV bytes per token, so preloads count as disk), or computed."""
    prompt = metrics.get("vllm:prompt_tokens_total", 0.0)
    device = metrics.get("vllm:prompt_tokens_cached_by_source_total{source=device}", metrics.get("vllm:prefix_cache_hits_total", 0.0))
    external = metrics.get("vllm:prompt_tokens_by_source_total{source=external_kv_transfer}", 0.0)
    disk = min(external, metrics.get("vllm:pykvcache_disk_read_bytes_total", 0.0) / bytes_per_token)
    if not prompt:
        return {}
    return {
        "device": device / prompt,
        "staging": max(0.0, external - disk) / prompt,
        "disk": disk / prompt,
        "computed": max(0.0, prompt - device - external) / prompt,
    }


def output_mismatches(entry: dict[str, Any], base: dict[str, Any]) -> tuple[int, int]:
    """(requests whose greedy text differs from the same request in the
    recompute run of the same repeat, requests compared)."""
    ref = {
        (lv.get("phase"), lv["concurrency"], r["session"], r["turn"]): r["text"]
        for lv in base.get("levels", [])
        for r in lv["records"]
        if r["error"] is None
    }
    diff = total = 0
    for lv in entry.get("levels", []):
        for r in lv["records"]:
            key = (lv.get("phase"), lv["concurrency"], r["session"], r["turn"])
            if r["error"] is None and key in ref:
                total += 1
                diff += r["text"] != ref[key]
    return diff, total


def why_line(why: str) -> str:
    """The line of an error text that says what went wrong (the raised exception)."""
    lines = why.splitlines() if why else ["-"]
    raised = [ln for ln in lines if ln.startswith("raised: ")]
    return (raised[0][len("raised: ") :] if raised else lines[0])[:300].replace("|", "/")


def ran_ok(entry: dict[str, Any]) -> bool:
    return "error" not in entry and "unavailable" not in entry


def paired_ratios(per_rep: dict[str, dict[int, dict[str, Any]]], this: str, base: str, key: str) -> list[float]:
    """``base``'s ``key`` over ``this``'s, per repeat both ran (> 1 for a
    latency: ``this`` is faster)."""
    a, b = per_rep.get(this, {}), per_rep.get(base, {})
    return [b[r][key] / a[r][key] for r in a if r in b and a[r][key] and b[r][key]]
