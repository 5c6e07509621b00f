"""``run_bench``: measure the selected parts on one machine and write the report."""

from __future__ import annotations

import shutil
import tempfile
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

from .cold_cache import DiskCounter
from .config import BenchConfig
from .machine import ForeignLoad, describe_machine
from .parts import BenchContext, NoProgress, PartOutput, Progress, resolve_parts
from .report import PART_ELAPSED, write_report


@dataclass
class BenchRun:
    report: Path
    outputs: list[PartOutput]
    elapsed_s: float

    @property
    def failed(self) -> list[PartOutput]:
        return [o for o in self.outputs if o.raw.get("error")]


def run_bench(config: BenchConfig, progress: Progress | None = None) -> BenchRun:
    """Run every part in ``config.parts`` and write report.md, PNGs and
    results.json into ``config.out``. A part that fails is reported (with its
    traceback in results.json) and the others still run."""
    parts = resolve_parts(config.parts)
    progress = progress or NoProgress()
    config.out = Path(config.out)
    config.out.mkdir(parents=True, exist_ok=True)
    # The benchmark writes and deletes its own subdirectory only: a user's
    # directory is never emptied.
    base = Path(config.directory)
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="pykvcache-bench-", dir=base))
    run_config = replace(config, directory=work)
    machine = describe_machine(work, config.argv)
    ctx = BenchContext(run_config, machine, DiskCounter(machine.device.sysfs if machine.device else None), progress)
    t0 = time.perf_counter()
    outputs: list[PartOutput] = []
    foreign = ForeignLoad().__enter__()
    try:
        for part in parts:
            started = time.perf_counter()
            try:
                out = part.run(ctx)
            except Exception as e:  # one broken part must not lose the others' results
                out = PartOutput(
                    name=part.name,
                    title=part.description,
                    skipped=f"failed: {type(e).__name__}: {e}",
                    raw={"error": traceback.format_exc()},
                )
            # What each part costs, so the default preset can be kept to a few minutes.
            out.raw[PART_ELAPSED] = round(time.perf_counter() - started, 1)
            outputs.append(out)
    finally:
        foreign.own_extra_s = ctx.unreaped_cpu_s
        foreign.__exit__(None, None, None)
        shutil.rmtree(work, ignore_errors=True)
    machine.foreign_cores = foreign.cores
    elapsed = time.perf_counter() - t0
    report = write_report(config.out, machine, config, outputs, elapsed)
    return BenchRun(report=report, outputs=outputs, elapsed_s=elapsed)
