"""What a chunk costs on a shared filesystem: bandwidth against fio on the same
mounts, and the filesystem operations per chunk that are not data.

    sudo .venv/bin/python scripts/shared_fs_ops.py [--chunks 2,8,28] [--qd 1,8] [--mib 112] [--repeats 2]
        [--engine NAME=PYTHONPATH ...] [--store KEY=VALUE ...] [--json OUT]

Sets up the GlusterFS test fixture (tests/helpers/glusterfs.py: one brick,
two FUSE clients in their own network namespaces, strict consistency,
O_DIRECT to the brick) with the clients' io-stats counting every operation
(``diagnostics.count-fop-hits``). For each repeat, chunk size and queue
depth, in this order on the same mounts: the engine puts ``--mib`` MiB of
chunks through mount A (a fresh store, verify="full"), a fresh store on
mount B gets and verifies them all; fio writes the same bytes through mount A
and reads them through mount B (one preallocated file, blocks of the chunk
size, the same queue depth, io_uring, O_DIRECT). Around each phase the
client's counters are dumped (``setfattr -n trusted.io-stats-dump``), so
each row says how many operations per chunk went to the network besides
READ and WRITE, and which. ``--engine`` names builds of the package to compare
in the same run (an unzipped wheel: ``before=/tmp/old``), case by case,
alternating, each with ``BlockStore`` keywords of its own after a ``;``
(``--engine files= --engine "segments=;segment_files=true"``: one build, two
layouts); by default the one this script imports.

``--holes`` answers, once, what a layout of segment files relies on
(decision 0086): whether a hole punched through mount A frees the brick's
blocks and reads as zeros through mount B, and whether B reads a file A
unlinked through a descriptor B opened before.

``--layouts`` adds, in each case and on the same mounts, what no store
can beat, as rows of their own: ``named``, chunks written one after another
into one preallocated file held open, each published by one symbolic link
naming its place (the fewest operations a chunk found by its own name costs),
read back on node B by ``readlink`` and ``pread``; ``unnamed``, the same
without the links (a chunk found by an index held in memory); ``logged``,
unnamed plus a 4 KiB index block rewritten at the file's start after each
chunk, one writer at a time (a log-structured layout's publication, not
batched); and ``fio again``, a second fio run (the fixture's repeatability). They write and read
with ``--qd`` threads, without a header, a checksum or a capacity: bounds,
not stores.

A 2-core VM runs the brick, both clients and the measured process: the
fixture is CPU-bound, so every operation a put saves is CPU the brick and the
clients give to the data. A functional stand-in, not a figure for Lustre.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "helpers"))

MiB = 1 << 20
#: Chunks per case and phase at least: what a case's setup costs (fio's create) spread thin.
MIN_CHUNKS = 16
#: A store's capacity in chunks of a case: ample (no eviction), as a cache that is not full.
CAPACITY_CHUNKS = 64
#: Not counted as metadata: the data, and FORGET (the kernel dropping an inode: no round trip).
NOT_METADATA = {"READ", "WRITE", "FORGET"}
#: The volume options that make the clients count every operation.
COUNTING = ("diagnostics.count-fop-hits", "diagnostics.latency-measurement")
#: The rows ``--layouts`` adds (see the module's docs).
BOUNDS = ("named", "unnamed", "logged", "fio again")
#: Where a FUSE client writes the dump named by the extended attribute's value (``<value>.<volume>``).
DUMP_DIR = Path("/var/run/gluster")


def fop_counts(mount: Path, tag: str) -> dict[str, int]:
    """The client's cumulative call count per operation since it mounted."""
    name = f"pykvcache-ops-{os.getpid()}-{tag}.txt"
    subprocess.run(["setfattr", "-n", "trusted.io-stats-dump", "-v", name, str(mount)], check=True, capture_output=True)
    deadline = time.monotonic() + 10
    while not (found := sorted(DUMP_DIR.glob(name + "*"))) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not found:
        raise RuntimeError(f"the client of {mount} wrote no io-stats dump {DUMP_DIR / name}.*")
    text = found[0].read_text()
    for path in found:
        path.unlink(missing_ok=True)
    # The cumulative section comes first; its operation table ends at the
    # next section ("Interval ... Stats").
    cumulative = text.split("Interval", 1)[0]
    counts: dict[str, int] = {}
    for m in re.finditer(r"^\s*([A-Z][A-Z_]+)\s+(\d+)\s+[\d.]+\s*us", cumulative, re.M):
        counts[m.group(1)] = counts.get(m.group(1), 0) + int(m.group(2))
    if not counts:
        raise RuntimeError(f"the client of {mount} counts no operations: set {' and '.join(COUNTING)} on its volume")
    return counts


class Counted:
    """Counts the operations a mount's client sends while the block runs."""

    def __init__(self, mount: Path, tag: str) -> None:
        self.mount, self.tag = mount, tag
        self.ops: dict[str, int] = {}

    def __enter__(self) -> Counted:
        self._before = fop_counts(self.mount, self.tag + "-0")
        return self

    def __exit__(self, *exc) -> None:
        after = fop_counts(self.mount, self.tag + "-1")
        self.ops = {k: v - self._before.get(k, 0) for k, v in after.items() if v - self._before.get(k, 0) > 0}


def run_queue(submit, n: int, qd: int, expect_ok: bool = True) -> float:
    """Seconds for ``n`` operations ``submit(i)`` with ``qd`` in flight; each Ok
    unless ``expect_ok`` is off (lookups of absent keys). Also scripts/builds_ab.py's."""
    t0 = time.monotonic()
    inflight = []
    for i in range(n):
        if len(inflight) == qd:
            r = inflight.pop(0).wait()
            assert r.ok or not expect_ok, (r.status, r.message)
        inflight.append(submit(i))
    for h in inflight:
        r = h.wait()
        assert r.ok or not expect_ok, (r.status, r.message)
    return time.monotonic() - t0


def engine_case(mounts: dict[str, Path], run_dir: str, n: int, chunk: int, qd: int, tag: str, store_kw: dict | None = None) -> dict:
    import pykvcache as kv

    payload = os.urandom(chunk)
    out: dict = {}
    for node, phase in (("a", "put"), ("b", "get")):
        pool = kv.StagingPool(chunk, qd)
        store = kv.BlockStore(
            [str(mounts[node] / run_dir)], pool, namespace="shared-fs-ops", capacity_bytes=CAPACITY_CHUNKS * n * chunk, **(store_kw or {})
        )
        slots = [pool.acquire() for _ in range(qd)]
        try:
            if phase == "put":
                for s in slots:
                    with pool.view(s) as v:
                        v[:] = payload
            with Counted(mounts[node], f"{tag}-{phase}") as c:
                if phase == "put":
                    dt = run_queue(lambda i: store.put(b"chunk-%06d" % i, slots[i % qd], chunk), n, qd)
                else:
                    dt = run_queue(lambda i: store.get(b"chunk-%06d" % i, slots[i % qd]), n, qd)
            if phase == "get":
                with pool.view(slots[(n - 1) % qd]) as v:
                    assert bytes(v[:chunk]) == payload
            out[phase] = {"gbps": n * chunk / dt / 1e9, "ops": c.ops}
        finally:
            for s in slots:
                pool.release(s)
            store.close()
            pool.close()
    return out


def engine_in_child(pythonpath: str, mounts: dict[str, Path], run_dir: str, n: int, chunk: int, qd: int, tag: str, store_kw: dict) -> dict:
    """``engine_case`` in a child process importing the package from ``pythonpath``."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    job = {"mounts": {k: str(v) for k, v in mounts.items()}, "run_dir": run_dir, "n": n, "chunk": chunk, "qd": qd, "tag": tag}
    args = json.dumps({**job, "store_kw": store_kw})
    proc = subprocess.run([sys.executable, __file__, "--child", args], env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"engine case failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.splitlines()[-1])


def _timed_phase(mount: Path, tag: str, qd: int, each, n: int, chunk: int, first=None) -> dict:
    """``each(i)`` for every chunk with ``qd`` threads (after ``first()``), timed and
    counted on ``mount``: GB/s and the operations the client sent."""
    with Counted(mount, tag) as c, ThreadPoolExecutor(qd) as pool:
        t0 = time.monotonic()
        if first is not None:
            first()
        list(pool.map(each, range(n)))
        dt = time.monotonic() - t0
    return {"gbps": n * chunk / dt / 1e9, "ops": c.ops}


def layout_case(mounts: dict[str, Path], run_dir: str, n: int, chunk: int, qd: int, tag: str, layout: str) -> dict:
    """A layout's bound (see the module's docs): node A writes ``n`` chunks of
    ``chunk`` bytes and a 4 KiB header block each, ``qd`` at a time, into one
    file preallocated beforehand; node B reads them all."""
    image = chunk + 4096
    data = mmap.mmap(-1, image)  # page-aligned, as O_DIRECT needs
    data.write(os.urandom(image))
    named = layout == "named"
    # ``logged``: the chunks start after an index block, which each put rewrites under a lock.
    start = 4096 if layout == "logged" else 0
    index_block = mmap.mmap(-1, 4096)
    index_lock = threading.Lock()
    (mounts["a"] / run_dir / "names").mkdir()
    out: dict = {}
    fd = os.open(mounts["a"] / run_dir / "chunks", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    names = os.open(mounts["a"] / run_dir / "names", os.O_PATH | os.O_DIRECTORY)
    try:
        os.posix_fallocate(fd, 0, start + n * image)

        def put(i: int) -> None:
            if os.pwritev(fd, [data], start + i * image) != image:
                raise OSError(f"short write of chunk {i}")
            if start:
                with index_lock:
                    index_block[(i % 256) * 16 : (i % 256) * 16 + 8] = i.to_bytes(8, "little")
                    if os.pwritev(fd, [index_block], 0) != 4096:
                        raise OSError(f"short write of the index after chunk {i}")
            if named:
                os.symlink(f"chunks:{i * image}:{image}", f"c{i:06d}", dir_fd=names)

        out["put"] = _timed_phase(mounts["a"], f"{tag}-put", qd, put, n, chunk)
    finally:
        os.close(names)
        os.close(fd)
    fd = os.open(mounts["b"] / run_dir / "chunks", os.O_RDONLY | os.O_DIRECT)
    names = os.open(mounts["b"] / run_dir / "names", os.O_PATH | os.O_DIRECTORY)
    buffers = [mmap.mmap(-1, image) for _ in range(qd)]
    own = threading.local()
    lock = threading.Lock()
    try:

        def get(i: int) -> None:
            if not hasattr(own, "buf"):
                with lock:
                    own.buf = buffers.pop()
            offset, length = start + i * image, image
            if named:
                _, at, size = os.readlink(f"c{i:06d}", dir_fd=names).split(":")
                offset, length = int(at), int(size)
            if os.preadv(fd, [own.buf], offset) != length or own.buf[:16] != data[:16]:
                raise OSError(f"chunk {i} read back wrong")

        def learn_index() -> None:  # the reader reads the index once, timed with the gets
            if start and os.preadv(fd, [index_block], 0) != 4096:
                raise OSError("short read of the index")

        out["get"] = _timed_phase(mounts["b"], f"{tag}-get", qd, get, n, chunk, first=learn_index)
    finally:
        os.close(names)
        os.close(fd)
    return out


def holes_probe(mounts: dict[str, Path], brick: Path | None) -> list[str]:
    """``--holes``: one table row per question (see the module's docs)."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    size, hole = 8 * MiB, (2 * MiB, 4 * MiB)
    data = mmap.mmap(-1, size)
    data.write(os.urandom(size))
    name = f"holes-{os.getpid()}.dat"
    on_brick = (lambda: os.stat(brick / name).st_blocks * 512 / MiB) if brick else (lambda: float("nan"))
    rows = []
    fd = os.open(mounts["a"] / name, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        if os.pwritev(fd, [data], 0) != size:
            raise OSError("short write")
        before = on_brick()
        t0 = time.monotonic()
        # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
        if libc.fallocate(fd, 3, ctypes.c_long(hole[0]), ctypes.c_long(hole[1])) != 0:
            err = ctypes.get_errno()
            return [f"| punch a hole through mount A | refused: {os.strerror(err)} |"]
        dt = time.monotonic() - t0
        rows.append(
            f"| punch {hole[1] // MiB} MiB through mount A | {dt * 1e3:.1f} ms; the brick's blocks {before:.1f} -> {on_brick():.1f} MiB |"
        )
        fdb = os.open(mounts["b"] / name, os.O_RDONLY | os.O_DIRECT)
        try:
            back = mmap.mmap(-1, size)
            os.preadv(fdb, [back], 0)
            zeros = back[hole[0] : hole[0] + hole[1]] == bytes(hole[1])
            kept = back[: hole[0]] == data[: hole[0]] and back[hole[0] + hole[1] :] == data[hole[0] + hole[1] :]
            rows.append(f"| read through mount B | hole all zeros: {zeros}; the rest unchanged: {kept} |")
            # Where a store looks before it punches a slot, and whether a segment is empty.
            try:
                seen = (os.lseek(fdb, hole[0], os.SEEK_DATA) // MiB, os.lseek(fdb, 0, os.SEEK_HOLE) // MiB)
                rows.append(f"| SEEK_DATA from the hole's start, SEEK_HOLE from 0, through mount B | {seen[0]} MiB, {seen[1]} MiB |")
            except OSError as e:
                rows.append(f"| SEEK_DATA/SEEK_HOLE through mount B | refused: {e.strerror} |")
            os.close(fd)
            fd = -1
            os.unlink(mounts["a"] / name)
            got = os.preadv(fdb, [back], 0)
            rows.append(
                f"| mount B reads after mount A unlinked it, through a descriptor opened before | {got} of {size} bytes, right: {back[: hole[0]] == data[: hole[0]]} |"
            )
        finally:
            os.close(fdb)
    finally:
        if fd >= 0:
            os.close(fd)
        (mounts["a"] / name).unlink(missing_ok=True)
    return rows


def fio_case(mounts: dict[str, Path], run_dir: str, n: int, chunk: int, qd: int, tag: str) -> dict:
    out: dict = {}
    for node, rw in (("a", "write"), ("b", "read")):
        cmd = [
            "fio",
            "--name=shared",
            f"--filename={mounts[node] / run_dir / 'fio.dat'}",
            f"--rw={rw}",
            f"--bs={chunk}",
            f"--size={n * chunk}",
            "--ioengine=io_uring",
            f"--iodepth={qd}",
            "--direct=1",
            "--numjobs=1",
            "--output-format=json",
        ]
        with Counted(mounts[node], f"{tag}-fio-{rw}") as c:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"fio failed: {proc.stderr.strip()}")
        side = json.loads(proc.stdout[proc.stdout.index("{") :])["jobs"][0][rw]
        out["put" if rw == "write" else "get"] = {"gbps": side["io_bytes"] / (side["runtime"] / 1000) / 1e9, "ops": c.ops}
    return out


def per_chunk(ops: dict[str, int], n: int) -> tuple[float, str]:
    """Non-data operations per chunk, and the three most frequent."""
    meta = {k: v for k, v in ops.items() if k not in NOT_METADATA}
    top = sorted(meta.items(), key=lambda kv: -kv[1])[:3]
    return sum(meta.values()) / n, ", ".join(f"{k} {v / n:.1f}" for k, v in top)


def measure(
    mounts: dict[str, Path],
    chunks: list[int],
    qds: list[int],
    mib: int,
    repeats: int,
    engines: dict[str, str],
    store_kw: dict | None = None,
    layouts: bool = False,
) -> list[dict]:
    """Every case: each engine (in turn, the order swapped every repeat), then
    fio; with ``layouts``, then the two layouts' bounds and fio again."""
    rows = []
    for rep in range(repeats):
        order = list(engines) if rep % 2 == 0 else list(reversed(engines))
        for chunk_mib in chunks:
            for qd in qds:
                chunk = chunk_mib * MiB
                n = max(mib // chunk_mib, 2 * qd, MIN_CHUNKS)
                results = {}
                for name in order:
                    run_dir = f"ops-{os.getpid()}-{rep}-{chunk_mib}-{qd}-{name}"
                    (mounts["a"] / run_dir).mkdir(mode=0o700)
                    tag = f"{rep}-{chunk_mib}-{qd}-{name}"
                    try:
                        path, _, own = engines[name].partition(";")
                        own_kw = {k: _store_value(v) for k, v in (kv.split("=", 1) for kv in own.split(",") if kv)}
                        results[name] = engine_in_child(path, mounts, run_dir, n, chunk, qd, tag, {**(store_kw or {}), **own_kw})
                        if name == order[-1]:
                            results["fio"] = fio_case(mounts, run_dir, n, chunk, qd, tag)
                    finally:
                        shutil.rmtree(mounts["a"] / run_dir, ignore_errors=True)
                for name in BOUNDS if layouts else ():
                    run_dir = f"ops-{os.getpid()}-{rep}-{chunk_mib}-{qd}-{name.replace(' ', '-')}"
                    (mounts["a"] / run_dir).mkdir(mode=0o700)
                    tag = f"{rep}-{chunk_mib}-{qd}-{name.replace(' ', '-')}"
                    try:
                        if name == "fio again":
                            results[name] = fio_case(mounts, run_dir, n, chunk, qd, tag)
                        else:
                            results[name] = layout_case(mounts, run_dir, n, chunk, qd, tag, name)
                    finally:
                        shutil.rmtree(mounts["a"] / run_dir, ignore_errors=True)
                for name in [*engines, *(BOUNDS if layouts else ())]:
                    rows.append(
                        {
                            "repeat": rep,
                            "chunk_mib": chunk_mib,
                            "qd": qd,
                            "chunks": n,
                            "engine": name,
                            "pykvcache": results[name],
                            "fio": results["fio"],
                        }
                    )
                    print(format_row(rows[-1]), flush=True)
    return rows


def format_row(r: dict) -> str:
    e, f, n = r["pykvcache"], r["fio"], r["chunks"]
    cells = [r["engine"], f"{r['chunk_mib']} MiB", str(r["qd"])]
    for phase in ("put", "get"):
        ratio = e[phase]["gbps"] / f[phase]["gbps"]
        ops, top = per_chunk(e[phase]["ops"], n)
        fio_ops, _ = per_chunk(f[phase]["ops"], n)
        cells += [f"{e[phase]['gbps']:.3f} / {f[phase]['gbps']:.3f} = **{ratio:.2f}**", f"{ops:.1f} ({top}); fio {fio_ops:.1f}"]
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| engine | chunk | QD | put GB/s: pykvcache / fio write | put: non-data ops per chunk (top 3) | "
    "get GB/s: pykvcache / fio read | get: non-data ops per chunk (top 3) |\n|---|---|---|---|---|---|---|"
)


def _store_value(text: str) -> int | bool | str:
    """A ``--store`` value as the keyword takes it: a number, a boolean, or the text."""
    if text.isdigit():
        return int(text)
    return {"true": True, "false": False}.get(text.lower(), text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", default="2,8,28", help="chunk sizes in MiB, comma-separated")
    ap.add_argument("--qd", default="1,8", help="queue depths, comma-separated")
    ap.add_argument("--mib", type=int, default=112, help="MiB per case and phase (at least 2 x QD chunks)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="NAME=PYTHONPATH[;KEY=VALUE,...]",
        help="a build to measure, with BlockStore keywords of its own (repeatable): files= segments=;segment_files=true",
    )
    ap.add_argument(
        "--store", action="append", default=[], metavar="KEY=VALUE", help="a BlockStore keyword for every engine (verify=header)"
    )
    ap.add_argument("--holes", action="store_true", help="answer what segment files rely on (see above), then stop")
    ap.add_argument("--layouts", action="store_true", help="also measure what no store can beat (see above)")
    ap.add_argument("--mount-a", type=Path, help="node A's mount of a GlusterFS volume counting operations (COUNTING on)")
    ap.add_argument("--mount-b", type=Path, help="node B's mount of the same volume")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        c = json.loads(args.child)
        mounts = {k: Path(v) for k, v in c["mounts"].items()}
        print(json.dumps(engine_case(mounts, c["run_dir"], c["n"], c["chunk"], c["qd"], c["tag"], c["store_kw"])))
        return 0
    engines = dict(e.split("=", 1) for e in args.engine) or {"pykvcache": ""}
    store_kw = {k: _store_value(v) for k, v in (kv.split("=", 1) for kv in args.store)}
    for tool in ("fio", "setfattr"):
        if shutil.which(tool) is None:
            print(f"{tool} is not installed (apt-get install fio attr)", file=sys.stderr)
            return 2
    chunks, qds = [int(c) for c in args.chunks.split(",")], [int(q) for q in args.qd.split(",")]
    if args.holes:
        print("| question | answer |\n|---|---|")
        if args.mount_a:
            rows_h = holes_probe({"a": args.mount_a, "b": args.mount_b or args.mount_a}, None)
        else:
            import glusterfs

            fixture = glusterfs.start()
            try:
                rows_h = holes_probe(fixture.mounts, fixture.brick)
            finally:
                fixture.teardown()
        print("\n".join(rows_h))
        return 0
    if args.mount_a:
        print(HEADER, flush=True)
        rows = measure(
            {"a": args.mount_a, "b": args.mount_b or args.mount_a}, chunks, qds, args.mib, args.repeats, engines, store_kw, args.layouts
        )
    else:
        import glusterfs

        fixture = glusterfs.start()
        try:
            for key in COUNTING:
                fixture.cli("volume", "set", glusterfs.VOLUME, key, "on")
            time.sleep(2)  # the clients switch to the new graph
            print(HEADER, flush=True)
            rows = measure(fixture.mounts, chunks, qds, args.mib, args.repeats, engines, store_kw, args.layouts)
        finally:
            fixture.teardown()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
