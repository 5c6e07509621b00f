"""CPU time spent by this process during a timed window, in total and per thread.

On fast NVMe arrays CPU per byte is what limits a tier, so every phase reports
user+sys CPU-seconds per GB. The process total comes from getrusage (includes
threads that exited, and the kernel's io_uring workers, which are threads of
this process); the per-thread split comes from /proc/self/task/*/schedstat
(nanoseconds) so the ring thread, Python's thread and pool threads can be told
apart.
"""

from __future__ import annotations

import os
import re
import resource
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

_TASKS = Path("/proc/self/task")
# Thread names that differ only by a trailing index are one group (pool_l3 -> pool_l#).
_INDEX = re.compile(r"\d+$")


def _thread_times() -> dict[int, tuple[str, int]]:
    """tid -> (comm, on-CPU nanoseconds)."""
    out: dict[int, tuple[str, int]] = {}
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return out
    for tid in tids:
        base = _TASKS / tid
        try:
            comm = (base / "comm").read_text().strip()
            ns = int((base / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        out[int(tid)] = (comm, ns)
    return out


def _rusage_s() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


class CpuPerGb:
    """CPU figures of a result with ``cpu_user_s``, ``cpu_sys_s`` and ``bytes``
    (the engine's phases and fio's jobs are compared on the same terms)."""

    cpu_user_s: float
    cpu_sys_s: float
    bytes: int

    @property
    def cpu_s(self) -> float:
        return self.cpu_user_s + self.cpu_sys_s

    @property
    def cpu_s_per_gb(self) -> float | None:
        return self.cpu_s / (self.bytes / 1e9) if self.bytes else None


@dataclass
class CpuSample:
    wall_s: float
    user_s: float
    sys_s: float
    threads_s: dict[str, float] = field(default_factory=dict)

    @property
    def cpu_s(self) -> float:
        return self.user_s + self.sys_s

    def per_gb(self, nbytes: int) -> float | None:
        return self.cpu_s / (nbytes / 1e9) if nbytes > 0 else None

    def to_dict(self) -> dict:
        return {
            "wall_s": self.wall_s,
            "user_s": self.user_s,
            "sys_s": self.sys_s,
            "cpu_s": self.cpu_s,
            "threads_s": dict(self.threads_s),
        }


class CpuMeter:
    """``with CpuMeter() as m: ...`` then ``m.result``."""

    def __init__(self) -> None:
        self.result: CpuSample | None = None

    def __enter__(self) -> CpuMeter:
        self._threads0 = _thread_times()
        self._ru0 = _rusage_s()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        t1 = time.perf_counter()
        ru1 = _rusage_s()
        threads1 = _thread_times()
        groups: dict[str, float] = defaultdict(float)
        for tid, (comm, ns) in threads1.items():
            ns0 = self._threads0.get(tid, (comm, 0))[1]
            if ns > ns0:
                groups[_INDEX.sub("#", comm)] += (ns - ns0) / 1e9
        user, sys_ = ru1[0] - self._ru0[0], ru1[1] - self._ru0[1]
        accounted = sum(groups.values())
        # Threads that ended inside the window are in getrusage but not in /proc.
        if user + sys_ - accounted > 0.005:
            groups["(exited threads)"] += user + sys_ - accounted
        self.result = CpuSample(
            wall_s=t1 - self._t0,
            user_s=user,
            sys_s=sys_,
            threads_s={k: round(v, 6) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
        )
