"""pykvcache and fio on a shared filesystem, node A writing and node B reading,
against the local disk in the same run.

    sudo .venv/bin/python scripts/shared_fs_bench.py [--mib 512] [--chunk-mib 8] [--qd 8] [--json OUT]

Sets up the GlusterFS test fixture (tests/helpers/glusterfs.py: one brick on
the local disk, two FUSE clients in their own network namespaces; strict
consistency, O_DIRECT to the brick), or uses given mounts (``--mount-a``,
``--mount-b``, with ``--cpu-pids`` of the FUSE clients and brick to count).
For each of "local disk" (a directory beside the brick) and "shared": the
engine writes ``--mib`` MiB of chunks through mount A (``--qd`` puts in
flight, verify=full), a fresh store on mount B reads and verifies them all;
fio writes the same amount through mount A and reads it through mount B (one
job, ``--chunk-mib`` blocks, QD ``--qd``, io_uring, O_DIRECT). Prints GB/s and
CPU seconds per GB (this process or fio; and with the FUSE clients' and the
brick's CPU time, which on a shared filesystem is part of the price) and the
ratio of shared to local. A functional proof on a 2-core VM, not a figure for
Lustre or Weka: the fixture is CPU-bound (brick and clients share 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "helpers"))

MiB = 1 << 20
CLK_TCK = os.sysconf("SC_CLK_TCK")


def _proc_cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime
        except (OSError, IndexError, ValueError):
            pass
    return total


def _self_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def engine_case(dir_a: Path, dir_b: Path, total: int, chunk: int, qd: int, pids: list[int]) -> dict:
    import pykvcache as kv

    n = total // chunk
    payload = os.urandom(chunk)
    out = {}
    pool_a = kv.StagingPool(chunk, qd)
    store_a = kv.BlockStore([str(dir_a)], pool_a, namespace="shared-fs-bench", capacity_bytes=4 * total)
    slots = [pool_a.acquire() for _ in range(qd)]
    for s in slots:
        with pool_a.view(s) as v:
            v[:] = payload
    t0, c0, e0 = time.monotonic(), _self_cpu_s(), _proc_cpu_s(pids)
    inflight = []
    for i in range(n):
        if len(inflight) == qd:
            r = inflight.pop(0).wait()
            assert r.ok, (r.status, r.message)
        inflight.append(store_a.put(b"chunk-%06d" % i, slots[i % qd], chunk))
    for h in inflight:
        assert h.wait().ok
    dt, cpu, ext = time.monotonic() - t0, _self_cpu_s() - c0, _proc_cpu_s(pids) - e0
    out["write"] = {
        "gbps": n * chunk / dt / 1e9,
        "cpu_s_per_gb": cpu / (n * chunk / 1e9),
        "cpu_s_per_gb_all": (cpu + ext) / (n * chunk / 1e9),
        "seconds": dt,
    }
    for s in slots:
        pool_a.release(s)
    store_a.close()
    pool_a.close()
    pool_b = kv.StagingPool(chunk, qd)
    store_b = kv.BlockStore([str(dir_b)], pool_b, namespace="shared-fs-bench", capacity_bytes=4 * total)
    slots = [pool_b.acquire() for _ in range(qd)]
    t0, c0, e0 = time.monotonic(), _self_cpu_s(), _proc_cpu_s(pids)
    inflight = []
    for i in range(n):
        if len(inflight) == qd:
            r = inflight.pop(0).wait()
            assert r.ok, (r.status, r.message)
        inflight.append(store_b.get(b"chunk-%06d" % i, slots[i % qd]))
    for h in inflight:
        assert h.wait().ok
    dt, cpu, ext = time.monotonic() - t0, _self_cpu_s() - c0, _proc_cpu_s(pids) - e0
    with pool_b.view(slots[(n - 1) % qd]) as v:
        assert bytes(v[:chunk]) == payload
    out["read"] = {
        "gbps": n * chunk / dt / 1e9,
        "cpu_s_per_gb": cpu / (n * chunk / 1e9),
        "cpu_s_per_gb_all": (cpu + ext) / (n * chunk / 1e9),
        "seconds": dt,
    }
    out["direct_io"] = store_b.direct_io
    for s in slots:
        pool_b.release(s)
    store_b.close()
    pool_b.close()
    return out


def fio_case(dir_a: Path, dir_b: Path, total: int, chunk: int, qd: int, pids: list[int]) -> dict:
    out = {}
    for rw, directory in (("write", dir_a), ("read", dir_b)):
        cmd = [
            "fio",
            "--name=shared",
            f"--filename={directory / 'fio.dat'}",
            f"--rw={rw}",
            f"--bs={chunk}",
            f"--size={total}",
            "--ioengine=io_uring",
            f"--iodepth={qd}",
            "--direct=1",
            "--numjobs=1",
            "--output-format=json",
        ]
        e0 = _proc_cpu_s(pids)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        ext = _proc_cpu_s(pids) - e0
        if proc.returncode != 0:
            raise RuntimeError(f"fio failed: {proc.stderr.strip()}")
        job = json.loads(proc.stdout[proc.stdout.index("{") :])["jobs"][0]
        side = job[rw]
        seconds = side["runtime"] / 1000
        gb = side["io_bytes"] / 1e9
        cpu = (job["usr_cpu"] + job["sys_cpu"]) / 100 * seconds
        out[rw] = {"gbps": gb / seconds, "cpu_s_per_gb": cpu / gb, "cpu_s_per_gb_all": (cpu + ext) / gb, "seconds": seconds}
    (dir_a / "fio.dat").unlink(missing_ok=True)
    return out


def measure(mount_a: Path, mount_b: Path, local: Path, total: int, chunk: int, qd: int, pids: list[int]) -> dict:
    results = {}
    for where, (a, b, p) in {"local disk": (local, local, []), "shared": (mount_a, mount_b, pids)}.items():
        run_dir = f"bench-{os.getpid()}"
        (a / run_dir).mkdir(mode=0o700)
        try:
            results[where] = {
                "pykvcache": engine_case(a / run_dir, b / run_dir, total, chunk, qd, p),
                "fio": fio_case(a / run_dir, b / run_dir, total, chunk, qd, p),
            }
        finally:
            shutil.rmtree(a / run_dir, ignore_errors=True)
    return results


def table(results: dict, label: str) -> str:
    rows = [
        "| setup | tool | store (A writes) GB/s | load (B reads) GB/s | CPU-s/GB store / load "
        "(process; + FUSE clients and brick) | vs local disk (store / load) |",
        "|---|---|---|---|---|---|",
    ]
    for tool in ("pykvcache", "fio"):
        for where in ("local disk", "shared"):
            r = results[where][tool]
            loc = results["local disk"][tool]
            ratio = (
                f"{r['write']['gbps'] / loc['write']['gbps']:.2f} / {r['read']['gbps'] / loc['read']['gbps']:.2f}"
                if where == "shared"
                else "1 / 1"
            )
            name = label if where == "shared" else "local ext4 (virtio), same run"
            rows.append(
                f"| {name} | {tool} | {r['write']['gbps']:.2f} | {r['read']['gbps']:.2f} | "
                f"{r['write']['cpu_s_per_gb']:.2f} / {r['read']['cpu_s_per_gb']:.2f} "
                f"({r['write']['cpu_s_per_gb_all']:.2f} / {r['read']['cpu_s_per_gb_all']:.2f}) | {ratio} |"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="MiB written and read per case")
    ap.add_argument("--chunk-mib", type=int, default=8)
    ap.add_argument("--qd", type=int, default=8)
    ap.add_argument("--mount-a", type=Path)
    ap.add_argument("--mount-b", type=Path)
    ap.add_argument("--local", type=Path, help="local-disk directory (default: beside the brick / in /tmp)")
    ap.add_argument("--cpu-pids", type=int, nargs="*", default=[], help="FUSE client and brick pids (with --mount-a)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if shutil.which("fio") is None:
        print("fio is not installed (apt-get install fio)", file=sys.stderr)
        return 2
    total, chunk = args.mib * MiB, args.chunk_mib * MiB
    fixture = None
    local = args.local or Path(tempfile.mkdtemp(prefix="pykvcache-local-bench-", dir="/tmp"))
    try:
        if args.mount_a:
            mount_a, mount_b, pids = args.mount_a, args.mount_b or args.mount_a, args.cpu_pids
        else:
            import glusterfs

            fixture = glusterfs.start()
            mount_a, mount_b = fixture.mounts["a"], fixture.mounts["b"]
            pids = list(fixture.client_pids.values()) + fixture.server_pids()
        results = measure(mount_a, mount_b, local, total, chunk, args.qd, pids)
    finally:
        if fixture is not None:
            fixture.teardown()
        if args.local is None:
            shutil.rmtree(local, ignore_errors=True)
    label = "shared filesystem (GlusterFS over veth, 2-core VM)"
    print(f"{args.mib} MiB per case, {args.chunk_mib} MiB chunks/blocks, QD {args.qd}; node A writes, node B reads")
    print(table(results, label))
    if args.json:
        args.json.write_text(json.dumps({"mib": args.mib, "chunk_mib": args.chunk_mib, "qd": args.qd, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
