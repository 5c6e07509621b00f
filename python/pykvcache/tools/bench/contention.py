"""CPU contention: one busy-loop process per core, as a serving engine keeps its
cores busy. A tier whose I/O path needs many runnable threads degrades here;
one that needs little CPU per byte does not."""

from __future__ import annotations

import os
import subprocess
import sys
import time

_BUSY_LOOP = "while True:\n    pass\n"


class CpuContention:
    """``with CpuContention(): ...`` keeps every core busy inside the block."""

    def __init__(self, processes: int | None = None, enabled: bool = True):
        self.processes = processes if processes is not None else (os.cpu_count() or 1)
        self.enabled = enabled
        self._procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> CpuContention:
        if not self.enabled:
            return self
        for _ in range(self.processes):
            self._procs.append(
                subprocess.Popen(
                    [sys.executable, "-S", "-c", _BUSY_LOOP],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        # Let the loops reach steady state before anything is timed.
        time.sleep(0.3)
        dead = [p for p in self._procs if p.poll() is not None]
        if dead:
            self.__exit__(None, None, None)
            raise RuntimeError("a CPU contention process exited right after start")
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.kill()
        for p in self._procs:
            p.wait(timeout=10)
        self._procs.clear()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]
