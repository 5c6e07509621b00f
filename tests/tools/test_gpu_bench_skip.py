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


def test_crossover_arithmetic_at_storage_bandwidths():
    """The crossover is the gate's break-even: prefill b*n (c = 0 here) equals
    fixed + n*bpt/BW_disk + n*bpt/BW_copy at n = fixed / (b - bpt/BW_disk - bpt/BW_copy)."""
    import math

    from pykvcache.gate.cost_model import LoadCost, PrefillCurve
    from pykvcache.tools.gpu_crossover import SHAPES, at_bandwidths, crossover, fmt_tokens

    bpt = SHAPES["llama-3.1-8b"].kv_bytes_per_token()
    assert bpt == 131072  # 2 x 32 layers x 8 KV heads x 128 x bf16
    assert SHAPES["llama-3.2-3b"].kv_bytes_per_token() == 114688 and SHAPES["qwen3-4b"].kv_bytes_per_token() == 147456
    prefill = PrefillCurve(0.0, 1e-4, 0.0)
    load = LoadCost(fixed_s=1e-3, disk_bytes_per_s=2e9, h2d_bytes_per_s=50e9)
    got = at_bandwidths(prefill, load, bpt)
    for gbps, n in got.items():
        assert n == pytest.approx(1e-3 / (1e-4 - bpt / (gbps * 1e9) - bpt / 50e9))
    assert got[7.0] > got[14.0] > got[28.0]
    # At the measured 2 GB/s a token costs 65.5 us to read + 2.6 to copy: still below 100 us to compute.
    assert crossover(prefill, load, bpt) == pytest.approx(1e-3 / (1e-4 - bpt / 2e9 - bpt / 50e9))
    # Slower than computing per token: loading never pays.
    slow = LoadCost(fixed_s=1e-3, disk_bytes_per_s=1e9, h2d_bytes_per_s=50e9)
    assert crossover(prefill, slow, bpt) == math.inf and fmt_tokens(math.inf) == "never"
    # With attention's quadratic term loading wins eventually even then.
    assert math.isfinite(crossover(PrefillCurve(0.0, 1e-4, 1e-8), slow, bpt))


def test_gpu_bench_crossover_part_runs_on_the_cpu(tmp_path):
    """--device cpu --tiny: the transformers prefill, the engine's disk reads
    and the worker's copy path (CpuCopier) end to end, no GPU and no vLLM needed."""
    import json

    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--out", str(out)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    [result] = json.loads((out / "crossover.json").read_text())
    assert result["model"] == "tiny-llama" and len(result["prefill"]) == len(result["load"]["rows"]) == 4
    assert all(r["load_s"] > 0 and r["bytes"] > 0 for r in result["load"]["rows"])
    assert result["load"]["copy_path"] == "CpuCopier"
    assert "Prefill vs load from disk" in (out / "crossover.md").read_text()
    assert not (out / "crossover-store").exists()


def test_the_copy_path_and_crossover_import_without_vllm():
    """A GPU host often has torch and transformers but no vLLM: the copiers,
    the slot map and the crossover module must import with vLLM unimportable."""
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "import pykvcache.vllm.worker.cuda_copy, pykvcache.vllm.worker.cpu_copy, pykvcache.tools.gpu_crossover\n"
        "print('ok')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
