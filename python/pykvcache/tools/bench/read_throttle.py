"""A slower storage device for one process tree: a cgroup-v1 blkio group whose
``blkio.throttle.read_bps_device`` caps the tree's reads from the disk that
holds a directory.

Why: on this 2-core host a 1.5k-token prefix reads in ~40 ms while its prefill
takes ~250 ms, so disk reads are a small share of a request's time. On a GPU
host prefill is tens of times faster and storage is the slower side; a read
cap on the server recreates that ratio (the kernel throttles the real
O_DIRECT reads; nothing is simulated above it). Writes are not capped.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

from ..proc_memory import descendants

BLKIO = Path("/sys/fs/cgroup/blkio")


def unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (a blkio cgroup)"
    if not (BLKIO / "blkio.throttle.read_bps_device").exists():
        return "no cgroup-v1 blkio throttle (/sys/fs/cgroup/blkio/blkio.throttle.read_bps_device)"
    return None


def disk_of(path: Path) -> str:
    """``major:minor`` of the whole disk holding ``path`` (blk-throttle rules
    name the disk; a partition's reads are throttled on its disk)."""
    dev = os.stat(path).st_dev
    sysdir = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if not sysdir.exists():
        raise RuntimeError(f"{path} is not on a block device (st_dev {os.major(dev)}:{os.minor(dev)})")
    if (sysdir / "partition").exists():
        sysdir = sysdir.resolve().parent
    return (sysdir / "dev").read_text().strip()


class ReadThrottle:
    """``with ReadThrottle(pid, directory, bytes_per_s): ...``: ``pid`` and every
    process below it read the disk of ``directory`` at most ``bytes_per_s``."""

    def __init__(self, root_pid: int, directory: Path, bytes_per_s: int) -> None:
        if bytes_per_s <= 0:
            raise ValueError("bytes_per_s must be positive")
        self.root_pid = root_pid
        self.directory = Path(directory)
        self.bytes_per_s = int(bytes_per_s)
        self.cgroup = BLKIO / f"pykvcache-bench-{os.getpid()}-{root_pid}"
        self.moved: list[int] = []

    def __enter__(self) -> ReadThrottle:
        why = unavailable()
        if why:
            raise RuntimeError(f"read throttle: {why}")
        self.cgroup.mkdir()
        try:
            rule = f"{disk_of(self.directory)} {self.bytes_per_s}"
            (self.cgroup / "blkio.throttle.read_bps_device").write_text(rule)
            # cgroup.procs moves a process with all of its threads (the ring
            # thread and the workers that submit the reads included).
            for pid in descendants(self.root_pid):
                try:
                    (self.cgroup / "cgroup.procs").write_text(str(pid))
                    self.moved.append(pid)
                except ProcessLookupError:
                    continue
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for pid in self.moved:
            try:
                (BLKIO / "cgroup.procs").write_text(str(pid))
            except (ProcessLookupError, OSError):
                continue  # exited meanwhile
        self.moved.clear()
        # A group whose last task just left may refuse its removal for a
        # moment (EBUSY, once in a clean-clone CI run on a busy machine; not
        # reproduced here, also not with an unreaped child): a bounded retry,
        # then the error.
        deadline = time.monotonic() + 2.0
        while True:
            try:
                self.cgroup.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
