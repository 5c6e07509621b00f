"""One timed phase (a store or a load of many chunks) and how results are combined.

Numbers on a shared virtio disk move by up to 2x between runs, so phases are
repeated with the systems interleaved and the report quotes medians and ratios
measured side by side.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, TypedDict

from .cpu_meter import CpuPerGb


@dataclass
class PhaseResult(CpuPerGb):
    system: str  # "pykvcache", "fs_tier", "fio"
    direction: str  # "write" | "read"
    chunk_bytes: int
    chunks: int
    bytes: int
    seconds: float
    cpu_user_s: float
    cpu_sys_s: float
    # Free-form shape of the run: queue depth, job shape, contention, repeat.
    params: dict[str, Any] = field(default_factory=dict)
    threads_s: dict[str, float] = field(default_factory=dict)
    disk: dict[str, int] | None = None
    cold: bool | None = None
    errors: int = 0
    info: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def measured(
        cls,
        system: str,
        direction: str,
        chunk_bytes: int,
        chunks: int,
        cpu: Any,
        params: dict[str, Any],
        delta: Any,
        cold: bool | None,
        errors: list[str],
        info: dict[str, Any],
    ) -> PhaseResult:
        """A phase timed by a CpuMeter (``cpu``) with a device-stat ``delta``."""
        return cls(
            system=system,
            direction=direction,
            chunk_bytes=chunk_bytes,
            chunks=chunks,
            bytes=chunks * chunk_bytes,
            seconds=cpu.wall_s,
            cpu_user_s=cpu.user_s,
            cpu_sys_s=cpu.sys_s,
            params=params,
            threads_s=cpu.threads_s,
            disk=delta.to_dict() if delta else None,
            cold=cold,
            errors=len(errors),
            info={**info, "first_errors": errors[:3]},
        )

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def device_fraction(self) -> float | None:
        """Device bytes / payload bytes: ~1 proves the bytes hit the device."""
        if not self.disk or not self.bytes:
            return None
        key = "read_bytes" if self.direction == "read" else "write_bytes"
        return self.disk.get(key, 0) / self.bytes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(gbps=self.gbps, cpu_s=self.cpu_s, cpu_s_per_gb=self.cpu_s_per_gb, device_fraction=self.device_fraction)
        return d


class Medians(TypedDict):
    """The repeats of one configuration: ``median_by``'s value."""

    gbps: float
    gbps_min: float
    gbps_max: float
    cpu_s_per_gb: float | None
    repeats: int
    errors: int


def median_by(phases: Iterable[PhaseResult], key: Callable[[PhaseResult], tuple[Any, ...]]) -> dict[tuple[Any, ...], Medians]:
    """Group repeats by ``key`` and take medians of bandwidth and CPU per GB."""
    groups: dict[tuple[Any, ...], list[PhaseResult]] = defaultdict(list)
    for p in phases:
        groups[key(p)].append(p)
    out: dict[tuple[Any, ...], Medians] = {}
    for k, ps in groups.items():
        cpus = [p.cpu_s_per_gb for p in ps if p.cpu_s_per_gb is not None]
        out[k] = {
            "gbps": statistics.median(p.gbps for p in ps),
            "gbps_min": min(p.gbps for p in ps),
            "gbps_max": max(p.gbps for p in ps),
            "cpu_s_per_gb": statistics.median(cpus) if cpus else None,
            "repeats": len(ps),
            "errors": sum(p.errors for p in ps),
        }
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b
