"""Cold-read discipline: flush and drop caches before a read phase, and prove
from the block device's own counters that the bytes came from the device.

O_DIRECT bypasses the page cache for data, but a file-per-chunk layout also
depends on dentry/inode caches, and a read of never-written extents returns
zeros without touching the disk. The device counters catch both.

By default only the page cache is dropped: a serving store's dentries and
inodes are cached (its open-time scan stats every chunk file, and it keeps
using them), so a cold *data* read is the case that matters. With
``metadata=True`` (``pykvcache bench --cold-metadata``) dentries and inodes go
too, and each chunk read also pays an inode read from the device: measured on
the development VM at 2-3x the engine's CPU per GB with ``verify="header"``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

SECTOR = 512
#: Pause after each flush; smoke runs (tiny sizes, nothing to settle) set it to 0.
PAUSE_S = 0.2


def settle(pause_s: float | None = None) -> None:
    """Flush dirty data and give `discard` of deleted files time to finish, so
    the previous phase does not leak into the next timed window."""
    os.sync()
    time.sleep(PAUSE_S if pause_s is None else pause_s)


def drop_caches(metadata: bool = False) -> bool:
    """Drop the page cache (and dentry/inode caches with ``metadata``). Needs
    root; returns whether it happened."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n" if metadata else "1\n")
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class DiskSample:
    read_bytes: int
    write_bytes: int
    read_ios: int
    write_ios: int


@dataclass(frozen=True)
class DiskDelta:
    read_bytes: int
    write_bytes: int
    read_ios: int
    write_ios: int

    def to_dict(self) -> dict[str, int]:
        return {
            "read_bytes": self.read_bytes,
            "write_bytes": self.write_bytes,
            "read_ios": self.read_ios,
            "write_ios": self.write_ios,
        }


class DiskCounter:
    """Reads /sys/block/<dev>/stat (fields: reads, merged, sectors read, ms,
    writes, merged, sectors written, ...)."""

    def __init__(self, sysfs_dir: str | None):
        self.path = Path(sysfs_dir) / "stat" if sysfs_dir else None
        if self.path is not None and not self.path.exists():
            self.path = None

    @property
    def available(self) -> bool:
        return self.path is not None

    def sample(self) -> DiskSample | None:
        if self.path is None:
            return None
        f = [int(x) for x in self.path.read_text().split()]
        return DiskSample(read_bytes=f[2] * SECTOR, write_bytes=f[6] * SECTOR, read_ios=f[0], write_ios=f[4])

    @staticmethod
    def delta(before: DiskSample | None, after: DiskSample | None) -> DiskDelta | None:
        if before is None or after is None:
            return None
        return DiskDelta(
            read_bytes=after.read_bytes - before.read_bytes,
            write_bytes=after.write_bytes - before.write_bytes,
            read_ios=after.read_ios - before.read_ios,
            write_ios=after.write_ios - before.write_ios,
        )


def device_fraction(delta: DiskDelta | None, payload_bytes: int, direction: str) -> float | None:
    """Device bytes / payload bytes for a phase: ~1.0 means the data really
    went to or came from the device; far below 1 means a cache answered."""
    if delta is None or payload_bytes <= 0:
        return None
    moved = delta.read_bytes if direction == "read" else delta.write_bytes
    return moved / payload_bytes
