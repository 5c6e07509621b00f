"""A/B of decision 0055 on the tiny model: a prefix read back from disk with
the stock OffloadingConnector (lookups answer HIT_PENDING while its reads are
in flight) and with PyKvCacheConnector (HIT, the worker's copy waits).

Each engine (tests/children/driver.py, in-process EngineCore) stores three
~880-token prompts, then `--cycles` times: device cache reset, three filler
prompts that push the prefix out of the 24-slot staging, one prompt of the
prefix with max_tokens=1 (its time is about its time to first token).
Lookahead preloads are off, so every read starts at a lookup. Engines
alternate, `--repeats` each. Prints per engine the repeat times and the
deferred lookups / in-flight hits of the repeats.

    PYTHONPATH=python .venv/bin/python scripts/in_flight_ab.py --out /tmp/ab
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
sys.path.insert(0, str(ROOT / "tests" / "children"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--cycles", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    from engine_driver import run_driver

    from pykvcache.testing.tiny_model import build_tiny_model, synthetic_text
    from pykvcache.vllm.config import kv_transfer_config

    out = Path(args.out or tempfile.mkdtemp(prefix="in-flight-ab-"))
    out.mkdir(parents=True, exist_ok=True)
    model = str(build_tiny_model(out / "models"))
    prefix = synthetic_text(250, seed=100)
    xs = [f"{prefix} {synthetic_text(12, seed=200 + i)}" for i in range(3)]
    fillers = [[synthetic_text(250, seed=300 + 10 * c + i) for i in range(3)] for c in range(args.cycles)]
    slot = 2 * 2 * 2 * 64 * 4 * 64 + 4096
    results: dict[str, list] = {"stock": [], "in_flight": []}
    for rep in range(args.repeats):
        for mode in ("stock", "in_flight") if rep % 2 == 0 else ("in_flight", "stock"):
            store = out / f"store-{mode}-{rep}"
            extra = dict(staging_bytes=24 * slot, block_size=64)
            if mode == "in_flight":
                extra.update(lookahead_bytes=0, lookahead_requests=0)
            config = kv_transfer_config([str(store)], 1 << 30, lookahead=mode == "in_flight", **extra)
            phases = [{"op": "generate", "name": "first", "prompts": xs, "max_tokens": 1}]
            for c in range(args.cycles):
                phases += [{"op": "reset_prefix_cache"},
                           {"op": "generate", "name": f"fillers{c}", "prompts": fillers[c], "max_tokens": 1},
                           {"op": "generate", "name": f"repeat{c}", "prompts": [xs[c % 3]], "max_tokens": 1}]
            result, _ = run_driver(str(ROOT / "tests" / "children" / "driver.py"),
                                   {"model": model, "llm": {"kv_transfer_config": config}, "phases": phases},
                                   out, f"{mode}-{rep}")
            by = {p["name"]: p for p in result["phases"]}

            def m(phase, name):
                return phase["metrics"].get("vllm:pykvcache_" + name, 0)

            for c in range(args.cycles):
                rp, fp = by[f"repeat{c}"], by[f"fillers{c}"]
                results[mode].append({
                    "s": rp["generate_s"], "cached": rp["num_cached_tokens"][0],
                    "deferred": m(rp, "lookups_deferred") - m(fp, "lookups_deferred"),
                    "in_flight_hits": m(rp, "lookup_in_flight_hits") - m(fp, "lookup_in_flight_hits"),
                    "disk_reads": m(rp, "disk_reads") - m(fp, "disk_reads"),
                })
    (out / "ab.json").write_text(json.dumps(results, indent=1))
    for mode, rows in results.items():
        times = [r["s"] for r in rows]
        print(f"{mode:9s} repeat (max_tokens=1) median {statistics.median(times) * 1e3:.0f} ms "
              f"[{', '.join(f'{t * 1e3:.0f}' for t in times)}]; deferred lookups "
              f"{[r['deferred'] for r in rows]}; in-flight hits {[r['in_flight_hits'] for r in rows]}; "
              f"disk reads {[r['disk_reads'] for r in rows]}; cached {[r['cached'] for r in rows]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
