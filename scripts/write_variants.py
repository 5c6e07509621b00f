"""Engine write variants against fio, interleaved round by round on one disk.

    python scripts/write_variants.py DIR [--rounds 6] [--chunk-mib 28] [--qd 8]

Each round runs, in an order that alternates between rounds: fio's best write
shapes on preconditioned files (1 job QD 32, 4 jobs QD 4, 1 job at the engine
QD), fio writing fresh chunk files and over them, and the engine case
(fresh write, read, writes into the full store with and without recycling) for
every variant below. Prints medians of GB/s and each figure's ratio to the
best fio figure of the same round. This is the measurement behind the
write-path decision (docs/decisions/0013-writes-into-files-that-exist.md); `pykvcache bench --parts
storage` gives the same ratios with fewer repeats.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from pykvcache.tools.bench.config import MiB
from pykvcache.tools.bench.engine_bench import EngineCase, run_engine_case
from pykvcache.tools.bench.fio_runner import FioJob, FioRunner

VARIANTS = {
    "whole-chunk writes (default)": {},
    "4 MiB write segments": {"write_segment_bytes": 4 * MiB},
    "no preallocation": {"preallocate": False},
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--chunk-mib", type=int, default=28)
    ap.add_argument("--qd", type=int, default=8)
    ap.add_argument("--total-mib", type=int, default=512)
    a = ap.parse_args()
    chunk, qd = a.chunk_mib * MiB, a.qd
    work = a.dir / "write-variants"
    runner = FioRunner(work / "fio", 256 * MiB, 4)
    nfiles = max(qd, a.total_mib * MiB // chunk)
    fio_jobs = {
        "fio best: 1 job QD 32": FioJob("write", chunk, 32, 1, 0.5),
        "fio best: 4 jobs QD 4": FioJob("write", chunk, 4, 4, 0.5),
        f"fio 1 job QD {qd}": FioJob("write", chunk, qd, 1, 0.5),
        f"fio chunk files, fresh, QD {qd}": FioJob("write", chunk, qd, 1, 0, chunk_files=nfiles),
        f"fio chunk files, overwrite, QD {qd}": FioJob("write", chunk, qd, 1, 0, chunk_files=nfiles, overwrite=True),
    }
    gbps: dict[str, list[float]] = defaultdict(list)
    ratios: dict[str, list[float]] = defaultdict(list)
    try:
        runner.precondition()
        for rnd in range(a.rounds):
            this: dict[str, float] = {}

            def fio_block() -> None:
                for name, job in fio_jobs.items():
                    this[name] = runner.run(job).gbps

            def engine_block() -> None:
                names = list(VARIANTS) if rnd % 2 == 0 else list(reversed(VARIANTS))
                for name in names:
                    case = EngineCase(chunk, qd, a.total_mib * MiB, VARIANTS[name], overwrite=True)
                    for p in run_engine_case(case, work / "engine", cold=False, repeat=rnd):
                        if p.direction != "read":
                            this[f"engine {p.direction}, {name}"] = p.gbps

            for block in (fio_block, engine_block) if rnd % 2 == 0 else (engine_block, fio_block):
                block()
            best = max(v for k, v in this.items() if k.startswith("fio best"))
            for k, v in this.items():
                gbps[k].append(v)
                ratios[k].append(v / best)
            print(f"round {rnd + 1}/{a.rounds}: best fio {best:.2f} GB/s", file=sys.stderr)
    finally:
        runner.cleanup()
        shutil.rmtree(work, ignore_errors=True)
    print(f"{a.chunk_mib} MiB chunks, QD {qd}, {a.rounds} rounds (medians)")
    print(f"{'figure':58} {'GB/s':>6} {'x best fio (same round)':>24}")
    for k in gbps:
        print(f"{k:58} {statistics.median(gbps[k]):6.2f} {statistics.median(ratios[k]):24.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
