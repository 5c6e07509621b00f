"""Benchmark parts: each measures one thing and returns tables, figures and raw data.

A part is one function registered under a name; ``pykvcache bench --parts``
selects them. A later part (end-to-end TTFT with vLLM, memory) is a new module
``pykvcache/tools/bench/<name>_part.py`` that calls ``register_part(Part(...))`` at
import: its ``run(ctx)`` returns a PartOutput (tables, figures, targets, raw
data) and ``steps(config)`` sizes its progress bar. Nothing else changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from .cold_cache import DiskCounter
from .config import BenchConfig
from .machine import MachineInfo


class Step(Protocol):
    """Progress of one part: ``advance`` once per finished step."""

    def advance(self, description: str = "") -> None: ...


class Progress(Protocol):
    def part(self, name: str, total: int) -> Step: ...


class _NoStep:
    def advance(self, description: str = "") -> None:
        pass


class NoProgress:
    def part(self, name: str, total: int) -> Step:
        return _NoStep()


@dataclass
class Figure:
    """A plot to save: ``draw(ax_or_fig)`` gets a matplotlib Figure."""

    filename: str
    title: str
    draw: Callable[[Any], None]
    size: tuple[float, float] = (10.0, 4.5)


@dataclass
class Table:
    title: str
    header: list[str]
    rows: list[list[str]]
    note: str = ""


@dataclass
class PartOutput:
    name: str
    title: str
    tables: list[Table] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    # Target name -> (met?, one-line statement with the measured value).
    targets: dict[str, tuple[bool, str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)
    skipped: str | None = None


@dataclass
class BenchContext:
    config: BenchConfig
    machine: MachineInfo
    disk: DiskCounter
    progress: Progress
    # CPU seconds of processes this run started but the kernel will never
    # charge to it (grandchildren killed before their parent reaped them:
    # a vLLM server's EngineCore and workers); not "other processes".
    unreaped_cpu_s: float = 0.0


@dataclass(frozen=True)
class Part:
    name: str
    description: str
    run: Callable[[BenchContext], PartOutput]
    steps: Callable[[BenchConfig], int]
    default: bool = True


PARTS: dict[str, Part] = {}


def register_part(part: Part) -> Part:
    if part.name in PARTS:
        raise ValueError(f"benchmark part {part.name!r} registered twice")
    PARTS[part.name] = part
    return part


def load_builtin_parts() -> None:
    """Import every ``pykvcache/tools/bench/*_part.py``: each registers itself, so a
    new part (e.g. ``e2e_part.py`` for vLLM TTFT) is one new module, nothing else."""
    import importlib
    import pkgutil

    from . import __path__ as package_path

    for mod in pkgutil.iter_modules(package_path):
        if mod.name.endswith("_part"):
            importlib.import_module(f"{__package__}.{mod.name}")


def resolve_parts(names: list[str] | None) -> list[Part]:
    load_builtin_parts()
    if not names:
        return [p for p in PARTS.values() if p.default]
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        raise ValueError(f"unknown benchmark part(s) {', '.join(unknown)}; known: {', '.join(PARTS)}")
    return [PARTS[n] for n in names]
