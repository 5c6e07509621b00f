"""scripts/gpu_bench.py must skip cleanly (exit 0, a clear message) where there is no GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_bench.py"


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(_has_cuda(), reason="a GPU is present: run scripts/gpu_bench.py itself")
def test_gpu_bench_skips_without_gpu(tmp_path):
    out = tmp_path / "gpu-out"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("skipped: no GPU ("), proc.stdout
    assert not out.exists()  # nothing measured, nothing written
