"""A real slow block device for e2e tests: reads throttled by the kernel.

A loop device over a file on this machine's disk, ext4 on it (O_DIRECT works),
and a cgroup-v1 ``blkio`` group whose ``blkio.throttle.read_bps_device``
limits reads from that device. Processes started with :meth:`preexec` (and
their children: vLLM's EngineCore and workers) run in the group, so every
read pykvcache's engine makes there (io_uring, O_DIRECT) is served at the
throttled rate. Writes are not throttled. Nothing here is emulated: the bytes
come from the device, the kernel delays them.

Needs root, ``losetup``, ``mkfs.ext4``, ``mount`` and a cgroup-v1 blkio
hierarchy with the throttle files (not the unified cgroup-v2-only layout).
:meth:`ThrottledDevice.unavailable` says why not, for a skip reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

BLKIO = Path("/sys/fs/cgroup/blkio")


class ThrottledDevice:
    def __init__(self, workdir: Path, read_bytes_per_s: int, size_mib: int = 256) -> None:
        self.workdir = Path(workdir)
        self.read_bytes_per_s = int(read_bytes_per_s)
        self.size_mib = size_mib
        self.image = self.workdir / "slowdev.img"
        self.mount = self.workdir / "slowmnt"
        self.cgroup = BLKIO / f"pykvcache-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.loop: str | None = None
        self._mounted = False

    @staticmethod
    def unavailable() -> str | None:
        if os.geteuid() != 0:
            return "needs root (loop device, mount, blkio cgroup)"
        for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
            if shutil.which(tool) is None:
                return f"{tool} is not installed"
        if not (BLKIO / "blkio.throttle.read_bps_device").exists():
            return "no cgroup-v1 blkio throttle (/sys/fs/cgroup/blkio/blkio.throttle.read_bps_device)"
        if not Path("/dev/loop-control").exists():
            return "no loop device support (/dev/loop-control)"
        return None

    def _run(self, *cmd: str) -> str:
        return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()

    def setup(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.image, "wb") as f:
            f.truncate(self.size_mib << 20)
        self.loop = self._run("losetup", "--find", "--show", "--direct-io=on", str(self.image))
        self._run("mkfs.ext4", "-q", "-F", self.loop)
        self.mount.mkdir(exist_ok=True)
        self._run("mount", self.loop, str(self.mount))
        self._mounted = True
        st = os.stat(self.loop)
        self.cgroup.mkdir()
        (self.cgroup / "blkio.throttle.read_bps_device").write_text(
            f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)} {self.read_bytes_per_s}\n"
        )

    @contextlib.contextmanager
    def read_rate(self, read_bytes_per_s: int):
        """The throttle at ``read_bytes_per_s`` for the ``with`` block, then back."""
        st = os.stat(self.loop)
        knob = self.cgroup / "blkio.throttle.read_bps_device"
        knob.write_text(f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)} {int(read_bytes_per_s)}\n")
        try:
            yield
        finally:
            knob.write_text(f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)} {self.read_bytes_per_s}\n")

    def preexec(self) -> None:
        """``preexec_fn`` of a subprocess: join the throttled group."""
        (self.cgroup / "cgroup.procs").write_text(str(os.getpid()))

    def measured_read_rate(self, nbytes: int = 2 << 20) -> float:
        """Bytes/s of an O_DIRECT read of a fresh file, from inside the group
        (checks that the throttle bites before a test relies on it)."""
        probe = self.mount / "probe.bin"
        with open(probe, "wb") as f:
            f.write(os.urandom(nbytes))
            f.flush()
            os.fsync(f.fileno())
        t0 = time.monotonic()
        subprocess.run(
            ["dd", f"if={probe}", "of=/dev/null", "bs=1M", "iflag=direct"], check=True, capture_output=True, preexec_fn=self.preexec
        )
        elapsed = time.monotonic() - t0
        probe.unlink()
        return nbytes / elapsed

    def cleanup(self) -> None:
        if self._mounted:
            if subprocess.run(["umount", str(self.mount)], capture_output=True).returncode:
                # Still busy (a server's last files closing): detach it now,
                # or every run leaves a mount and a loop device behind.
                subprocess.run(["umount", "-l", str(self.mount)], capture_output=True)
            self._mounted = False
        if self.loop:
            subprocess.run(["losetup", "-d", self.loop], capture_output=True)
            self.loop = None
        for _ in range(20):  # the group empties once its last process has exited
            try:
                self.cgroup.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.25)
        self.image.unlink(missing_ok=True)
