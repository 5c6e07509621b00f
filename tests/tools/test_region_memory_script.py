"""scripts/region_memory_bench.py (cited by docs/performance.md) runs as documented, at a tiny
size: every kind of memory, puts and gets, a figure per cell. Nothing is timed here."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_region_memory_bench_measures_every_kind(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "region_memory_bench.py"),
            "--dir",
            str(tmp_path),
            "--chunk-mib",
            "2",
            "--chunks",
            "2",
            "--rounds",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("round 1 ")]
    kinds = {line.split()[2] for line in rows}
    assert kinds == {"slots", "region-private-huge", "region-private-4k", "region-shared-4k"}, out.stdout
    for line in rows:
        assert len(re.findall(r"[\d.]+ GB/s [\d.]+ CPU-s/GB", line)) >= 2, line
    assert list(tmp_path.iterdir()) == [], "the scratch store was not removed"
