"""Progress bars of the tools (rich), shared by ``bench``, ``demo`` and ``calibrate``.

rich is imported when a bar is made: it is a tools dependency (the ``tools``
extra), never one of the product's.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID


class RichProgress:
    """Progress bars for benchmark parts (one bar per part)."""

    def __init__(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._p = Progress(
            TextColumn("[bold]{task.fields[part]:<9}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
            transient=False,
        )

    def __enter__(self) -> RichProgress:
        self._p.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._p.__exit__(exc_type, exc, tb)

    def part(self, name: str, total: int) -> RichStep:
        return RichStep(self._p, self._p.add_task("", total=total, part=name))


class RichStep:
    def __init__(self, progress: Progress, task: TaskID) -> None:
        self._p, self._t = progress, task

    def advance(self, description: str = "") -> None:
        self._p.update(self._t, advance=1, description=description)


class PhaseProgress:
    """A rich progress bar per phase, or plain lines without a terminal."""

    def __init__(self, enabled: bool, name: str = "calibrate") -> None:
        self._p = None
        self._name = name
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._p = Progress(
                TextColumn("[bold]{task.fields[phase]:<8}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.description}"),
            )

    def __enter__(self) -> PhaseProgress:
        if self._p is not None:
            self._p.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._p is not None:
            self._p.__exit__(exc_type, exc, tb)

    def phase(self, name: str, total: int) -> Callable[..., None]:
        if self._p is None:
            print(f"{self._name}: {name} ({total} measurements)", file=sys.stderr, flush=True)
            return lambda description="": None
        progress = self._p
        task = progress.add_task("", total=total, phase=name)
        return lambda description="": progress.update(task, advance=1, description=description)

    def log(self, text: str) -> None:
        if self._p is not None:
            self._p.console.print(text)
        else:
            print(text, file=sys.stderr, flush=True)
