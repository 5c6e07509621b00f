"""Benchmarks that characterize pykvcache on the machine they run on:
the engine against fio (the physical limit) and against vLLM's own
filesystem tier, with CPU cost, written up as Markdown + PNG + JSON.

Entry point: :func:`run_bench` (used by ``pykvcache bench``).
"""

from .config import BenchConfig, quick, smoke
from .parts import PARTS, Part, PartOutput, register_part
from .runner import BenchRun, run_bench

__all__ = ["PARTS", "BenchConfig", "BenchRun", "Part", "PartOutput", "quick", "register_part", "run_bench", "smoke"]
