"""Sample the memory of a process tree from /proc while it runs.

vLLM serves from several processes (the EngineCore scheduler, one worker per
rank) that a driver process spawns. The sampler walks the driver's
descendants a few times per second and records, per process, what
/proc/<pid>/status says (VmRSS, VmHWM = the kernel's own peak, RssAnon,
RssFile, RssShmem) and what /proc/<pid>/smaps_rollup says (Pss, Pss_Shmem).

RSS counts a shared page in every process that maps it: pykvcache's staging
region is one shared-memory mapping seen by the scheduler and every worker,
so it appears once per process in RSS (as RssShmem) but only once in the sum
of PSS. Both views are kept.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

_STATUS_KEYS = {"VmRSS": "rss", "VmHWM": "hwm", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}
_ROLLUP_KEYS = {"Pss": "pss", "Pss_Shmem": "pss_shmem"}


@dataclass
class MemSample:
    t: float
    pid: int
    sweep: int = 0  # samples of one pass over the tree share it
    rss: int = 0
    hwm: int = 0
    anon: int = 0
    file: int = 0
    shmem: int = 0
    pss: int | None = None
    pss_shmem: int | None = None


@dataclass
class ProcInfo:
    pid: int
    ppid: int
    depth: int  # 0 = the root, 1 = its children, ...
    cmdline: str
    first_seen: float
    last_seen: float = 0.0


def _read_kib_fields(path: str, keys: dict[str, str]) -> dict[str, int] | None:
    try:
        with open(path) as f:
            text = f.read()
    except OSError:  # the process exited, or /proc hides it from us
        return None
    out: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in keys:
            parts = rest.split()
            if parts:
                out[keys[name]] = int(parts[0]) * 1024
    return out


def read_memory(pid: int, with_pss: bool = True) -> MemSample | None:
    """One sample of ``pid``; None when it is gone."""
    status = _read_kib_fields(f"/proc/{pid}/status", _STATUS_KEYS)
    if not status or "rss" not in status:
        return None  # gone, or a zombie (no memory fields left)
    sample = MemSample(t=time.time(), pid=pid, **status)
    if with_pss:
        rollup = _read_kib_fields(f"/proc/{pid}/smaps_rollup", _ROLLUP_KEYS)
        if rollup:
            sample.pss = rollup.get("pss")
            sample.pss_shmem = rollup.get("pss_shmem")
    return sample


def _parent_map() -> dict[int, int]:
    out: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name may contain spaces and parentheses: fields start after the last ')'.
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1:
            out[int(entry)] = int(fields[1])
    return out


def descendants(root: int) -> dict[int, tuple[int, int]]:
    """pid -> (ppid, depth) for ``root`` and every process below it."""
    parents = _parent_map()
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    out = {root: (parents.get(root, 0), 0)}
    frontier = [root]
    while frontier:
        nxt = []
        for pid in frontier:
            for child in children.get(pid, []):
                if child not in out:
                    out[child] = (pid, out[pid][1] + 1)
                    nxt.append(child)
        frontier = nxt
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


@dataclass
class TreeSampler:
    """Samples ``root`` and its descendants every ``interval`` seconds in a thread."""

    root: int
    interval: float = 0.2
    with_pss: bool = True
    samples: list[MemSample] = field(default_factory=list)
    procs: dict[int, ProcInfo] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._sweep = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pykvcache-memsampler", daemon=True)

    def start(self) -> TreeSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> TreeSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def sample_once(self) -> None:
        now = time.time()
        self._sweep += 1
        for pid, (ppid, depth) in descendants(self.root).items():
            s = read_memory(pid, self.with_pss)
            if s is None:
                continue
            s.sweep = self._sweep
            info = self.procs.get(pid)
            if info is None:
                info = self.procs[pid] = ProcInfo(pid, ppid, depth, "", now)
            # Re-read: a spawned child shows its parent's command line until it execs.
            info.cmdline = _cmdline(pid) or info.cmdline
            info.last_seen = now
            self.samples.append(s)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample_once()
            self._stop.wait(self.interval)
