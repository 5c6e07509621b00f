"""Several writer processes (tests/children/shared_capacity_worker.py) on one
storage directory at once, and what they hold on disk meanwhile: shared by the
local-directory and the GlusterFS tests of the shared capacity (decision 0053)."""

import json
import os
import selectors
import subprocess
import sys

from child_paths import child


def held_bytes(root, allocated: bool = False) -> int:
    """Bytes of every file in the namespace directories under ``root`` (chunks and
    visible temporary files), each inode once (a file renamed during the walk is one);
    ``allocated``: the blocks each holds, not its size (sparse segment files, whose
    evicted slots are holes)."""
    seen, total = set(), 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != ".writers"]
        if os.path.samefile(dirpath, root):
            continue  # the root's own files: the ledger, no chunk
        for name in filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_blocks * 512 if allocated else st.st_size
    return total


def run_writers(dirs, capacity, seconds, rate, sample, min_puts=0, env=None):
    """One writer process per entry of ``dirs`` (each its own namespace) writes for
    ``seconds`` at ``rate`` bytes/s (0: full speed), and at least ``min_puts`` puts;
    all close together. ``sample()``
    is read at 10 Hz meanwhile and after each close. Returns (samples while writing,
    samples after each close, what each writer reported)."""
    procs = []
    for i, d in enumerate(dirs):
        cmd = [
            sys.executable,
            child("shared_capacity_worker.py"),
            str(d),
            f"writer-{i}",
            f"w{i}",
            str(min_puts),
            str(capacity),
            str(seconds),
            str(rate),
        ]
        procs.append(
            subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}
            )
        )
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready", p.stderr.read()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        during, reports = [], [None] * len(procs)
        sel = selectors.DefaultSelector()
        for i, p in enumerate(procs):
            sel.register(p.stdout, selectors.EVENT_READ, i)
        while any(r is None for r in reports):
            during.append(sample())
            for key, _ in sel.select(timeout=0.1):
                line = key.fileobj.readline()
                assert line, procs[key.data].stderr.read()
                reports[key.data] = json.loads(line)
                sel.unregister(key.fileobj)
        for p in procs:  # all close at once: nobody walks after the others
            p.stdin.close()
        after = []
        for p in procs:
            assert p.stdout.readline().strip() == "closed", p.stderr.read()
            after.append(sample())
            p.wait(timeout=30)
        after.append(sample())
        for p, report in zip(procs, reports):
            if report.get("errors"):  # the failed puts' messages (the worker prints each)
                report["messages"] = p.stderr.read().strip().splitlines()[-5:]
        return during, after, reports
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
