"""Small files written off the scheduler's thread: the gate's device model
(decision 0073).

Why: writing it ends with a rename over the previous file, which frees that
file's blocks, and on ext4 mounted with ``discard`` the renaming thread waits
for the discard at the device, behind every read queued there. A restarted
server saves at its first lesson, which its first disk hit teaches while the
rest of that hit's chunks are being read: the engine's scheduler thread
stood still 41-62 ms in the middle of the load (2026-12-06, 2-core VM;
decision 0082). A shared filesystem can stall any call for seconds.

One daemon thread writes, in order; a job still waiting when a newer one
comes is replaced by it (only the latest state is worth keeping).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable


class LatestWriter:
    def __init__(self, name: str, log: logging.Logger) -> None:
        self.name = name
        self._log = log
        self._cond = threading.Condition()
        self._job: Callable[[], object] | None = None
        self._busy = False
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], object]) -> None:
        """Run ``job`` on the writer's thread (after the one running, instead
        of one still waiting)."""
        with self._cond:
            self._job = job
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until every submitted job ran, at most ``timeout`` seconds;
        False when one is still waiting or running (a stalled filesystem)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._job is None and not self._busy, timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._job is not None)
                job = self._job
                assert job is not None  # wait_for returns once a job is set
                self._job, self._busy = None, True
            try:
                job()
            except Exception as exc:  # noqa: BLE001 - a hint for the next start, never a failure
                self._log.warning("pykvcache: %s failed: %s", self.name, exc)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
