"""Crash during writes: a writer is SIGKILLed at random moments, 50 times, on
both publish paths (O_TMPFILE + linkat, and temp file + rename where the
filesystem lacks O_TMPFILE). After every kill the store is reopened: whatever
reads as present verifies byte for byte, no temporary file survives the open,
and the store keeps serving."""

import fcntl
import os
import random
import signal
import subprocess
import sys
import time

import pykvcache as kv
from child_paths import child
from robust_chunkfmt import chunk_files, get_bytes, payload_for, put_bytes, temp_files
from robust_crash_params import CAPACITY, KEYS, MAX_PAYLOAD, NAMESPACE

KILLS = 50


def start_writer(store_dir, mode: str, seed: int) -> subprocess.Popen:
    cmd = [sys.executable, child("robust_crash_writer.py"), str(store_dir), mode, str(seed)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready = p.stdout.readline().strip()
    if ready != "ready tmpfile=%d" % (mode == "tmpfile"):
        p.kill()
        raise AssertionError(f"writer did not start as {mode}: {ready!r} {p.communicate()[1]}")
    return p


def wait_until_unlocked(paths, timeout: float = 5.0) -> float:
    """Waits for the kernel to drop a dead writer's file locks; returns the wait.

    io_uring tears a killed process's ring down asynchronously and holds its
    files (and their flocks) until in-flight I/O ends: a few milliseconds."""
    t0 = time.monotonic()
    for path in paths:
        while True:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            except FileNotFoundError:
                break
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.monotonic() - t0 < timeout, f"{path} stays locked after its writer died"
                time.sleep(0.001)
            finally:
                os.close(fd)
    return time.monotonic() - t0


def verify_every_key(store, pool, slot) -> dict:
    """Reads every key the writer could have stored, straight from disk."""
    seen = {"ok": 0, "miss": 0}
    for key in KEYS:
        r, data = get_bytes(store, pool, slot, key)
        assert r.status in seen, f"{key!r}: {r.status} {r.message}"
        seen[r.status] += 1
        if r.ok:
            assert data == payload_for(key, MAX_PAYLOAD), f"{key!r} served wrong bytes"
    return seen


def test_sigkill_during_writes_leaves_only_whole_chunks(tmp_path):
    rng = random.Random(6)
    dirs = {"tmpfile": tmp_path / "tmpfile", "rename": tmp_path / "rename"}
    for d in dirs.values():
        d.mkdir(mode=0o700)
    pool = kv.StagingPool(MAX_PAYLOAD, 1)
    slot = pool.acquire()
    report = {
        m: {"kills": 0, "puts_before_kill": 0, "temps_left_by_kill": 0, "max_lock_release_s": 0.0, "hits": 0, "misses": 0} for m in dirs
    }
    for i in range(KILLS):
        mode = "tmpfile" if i % 2 == 0 else "rename"
        d, rep = dirs[mode], report[mode]
        writer = start_writer(d, mode, seed=i)
        time.sleep(rng.uniform(0.0, 0.25))
        writer.send_signal(signal.SIGKILL)
        out, err = writer.communicate(timeout=30)
        assert writer.returncode == -signal.SIGKILL, f"writer died on its own: {err}"
        puts = [line for line in out.splitlines() if line.startswith("put ")]
        assert all(line.endswith(" ok") for line in puts), puts
        rep["kills"] += 1
        rep["puts_before_kill"] += len(puts)
        left = temp_files(d)
        rep["temps_left_by_kill"] += len(left)
        rep["max_lock_release_s"] = max(rep["max_lock_release_s"], round(wait_until_unlocked(left), 4))

        store = kv.BlockStore([str(d)], pool, namespace=NAMESPACE, capacity_bytes=CAPACITY)
        assert temp_files(d) == [], "opening a store must remove temporary files of dead writers"
        seen = verify_every_key(store, pool, slot)
        rep["hits"] += seen["ok"]
        rep["misses"] += seen["miss"]
        assert len(chunk_files(d)) == seen["ok"], "every chunk file on disk is a verified chunk"
        assert store.stats()["corrupt_chunks"] == 0
        # Serving goes on in the same directory.
        key = KEYS[i]
        assert put_bytes(store, pool, slot, key, payload_for(key, MAX_PAYLOAD)).ok
        r, data = get_bytes(store, pool, slot, key)
        assert r.ok and data == payload_for(key, MAX_PAYLOAD)
        store.close()
    print("crash report:", report)
    for mode, rep in report.items():
        assert rep["kills"] == KILLS // 2 and rep["hits"] > 0, (mode, rep)
    # The kills really landed on the rename path with files half written.
    assert report["rename"]["temps_left_by_kill"] > 0, report
