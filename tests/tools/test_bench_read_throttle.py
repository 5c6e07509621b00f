"""The serve part's read cap (tools/bench/read_throttle.py) on the real kernel:
a process tree moved into a cgroup-v1 blkio group whose read_bps rule names
the disk of the storage directory; O_DIRECT reads of a child go through it
(the group's own byte counter says so) and everything is undone on exit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pykvcache.tools.bench.read_throttle import ReadThrottle, disk_of, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

_READER = """
import os, sys, mmap
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECT)
buf = mmap.mmap(-1, 1 << 20)
sys.stdin.readline()  # wait until the parent has moved us
n = 0
while True:
    got = os.preadv(fd, [buf], n)
    if got <= 0:
        break
    n += got
print(n, flush=True)
"""


def _read_bytes(cgroup: Path, disk: str) -> int:
    text = (cgroup / "blkio.throttle.io_service_bytes").read_text()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == disk and parts[1] == "Read":
            return int(parts[2])
    return 0


def test_a_child_reads_through_the_capped_group_and_is_moved_back(tmp_path):
    try:
        disk = disk_of(tmp_path)
    except RuntimeError as exc:
        pytest.skip(f"pytest's tmp_path is not on a disk: {exc}")
    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(8 << 20))
    os.sync()
    child = subprocess.Popen([sys.executable, "-c", _READER, str(data)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        with ReadThrottle(child.pid, tmp_path, 400_000_000) as throttle:
            group = throttle.cgroup
            assert (group / "blkio.throttle.read_bps_device").read_text().split() == [disk, "400000000"]
            assert str(child.pid) in (group / "cgroup.procs").read_text().split()
            child.stdin.write("go\n")
            child.stdin.flush()
            assert int(child.stdout.readline()) == 8 << 20
            # O_DIRECT: every byte came from the disk, through this group.
            assert _read_bytes(group, disk) >= 8 << 20
    finally:
        child.kill()
        child.wait()
    assert not group.exists()


def test_a_path_not_on_a_block_device_is_refused_with_its_reason():
    with pytest.raises(RuntimeError, match="not on a block device"):
        disk_of(Path("/proc/self"))
