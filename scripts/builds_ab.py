"""Two builds of the package against each other on one local directory, in one run.

    python scripts/builds_ab.py --build old=PYTHONPATH --build new=PYTHONPATH [--dir DIR]
        [--rounds 3] [--mib 512]

Each build is a directory Python imports ``pykvcache`` from (an unpacked wheel:
``python -m zipfile -e dist/pykvcache-*.whl DIR``). Per round and case (2 MiB at
queue depth 1 and 8, 28 MiB at 8) each build, in a child process of its own and
in turn (the order swapped every round), puts ``--mib`` MiB, reads it back through
a store opened afresh, and looks up 2000 absent keys. Prints, per case and
figure, the second build's ratio to the first, round by round: ratios of one
run on a noisy machine, not absolute figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shared_fs_ops import run_queue  # noqa: E402

CASES = ((2, 1), (2, 8), (28, 8))
MISSES = 2000


def child(directory: str, n: int, chunk: int, qd: int) -> dict:
    """One build, one case: GB/s of the puts and the gets, absent keys per second."""
    import pykvcache as kv

    payload = os.urandom(chunk)
    out = {}
    for phase in ("put", "get", "miss"):
        pool = kv.StagingPool(chunk, qd)
        store = kv.BlockStore([directory], pool, namespace="builds-ab", capacity_bytes=4 * n * chunk)
        slots = [pool.acquire() for _ in range(qd)]
        try:
            if phase == "put":
                for s in slots:
                    with pool.view(s) as v:
                        v[:] = payload
                out["put GB/s"] = n * chunk / run_queue(lambda i: store.put(b"c-%06d" % i, slots[i % qd], chunk), n, qd) / 1e9
            elif phase == "get":
                out["get GB/s"] = n * chunk / run_queue(lambda i: store.get(b"c-%06d" % i, slots[i % qd]), n, qd) / 1e9
            else:
                out["misses/s"] = MISSES / run_queue(lambda i: store.get(b"absent-%06d" % i, slots[i % qd]), MISSES, qd, expect_ok=False)
        finally:
            for s in slots:
                pool.release(s)
            store.close()
            pool.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", action="append", required=True, metavar="NAME=PYTHONPATH", help="exactly two")
    ap.add_argument("--dir", help="a local directory to measure in (default: a temporary one)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        d, n, chunk, qd = args.child
        print(json.dumps(child(d, int(n), int(chunk), int(qd))))
        return
    builds = dict(b.split("=", 1) for b in args.build)
    if len(builds) != 2:
        ap.error("give exactly two --build NAME=PYTHONPATH")
    base = args.dir or tempfile.mkdtemp(prefix="builds-ab-")
    results: dict = {}
    for rnd in range(args.rounds):
        for chunk_mib, qd in CASES:
            for name in list(builds) if rnd % 2 == 0 else list(reversed(builds)):
                d = os.path.join(base, f"{name}-{rnd}-{chunk_mib}-{qd}")
                os.makedirs(d, mode=0o700)
                chunk = chunk_mib << 20
                env = dict(os.environ, PYTHONPATH=builds[name])
                cmd = [
                    sys.executable,
                    __file__,
                    "--build",
                    "x=",
                    "--build",
                    "y=",
                    "--child",
                    d,
                    str((args.mib << 20) // chunk),
                    str(chunk),
                    str(qd),
                ]
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
                shutil.rmtree(d, ignore_errors=True)
                if proc.returncode != 0:
                    sys.exit(f"{name}, {chunk_mib} MiB at QD {qd}: {proc.stderr[-2000:]}")
                results.setdefault((chunk_mib, qd), {}).setdefault(name, []).append(json.loads(proc.stdout.splitlines()[-1]))
    first, second = builds
    print(f"| case | figure | {second} / {first}, round by round | {first} |")
    print("|---|---|---|---|")
    for (chunk_mib, qd), by in results.items():
        for figure in by[first][0]:
            ratios = " / ".join(f"{b[figure] / a[figure]:.2f}" for a, b in zip(by[first], by[second]))
            print(f"| {chunk_mib} MiB, QD {qd} | {figure} | {ratios} | {' / '.join(f'{a[figure]:.2f}' for a in by[first])} |")


if __name__ == "__main__":
    main()
