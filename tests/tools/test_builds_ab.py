"""scripts/builds_ab.py: two builds of the package on one local directory, one run
(here the same build twice, one round, little data): a row per case and figure, each
with one ratio per round."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "builds_ab.py"


def test_two_builds_are_compared_case_by_case(tmp_path):
    args = ["--build", "a=", "--build", "b=", "--dir", str(tmp_path), "--rounds", "1", "--mib", "28"]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "MiB, QD" in line]
    assert len(rows) == 9, proc.stdout  # 3 cases x (puts, gets, misses)
    for row in rows:
        ratios = row.split("|")[3].split(" / ")
        assert len(ratios) == 1 and all(float(r) > 0 for r in ratios), row
    assert not list(tmp_path.iterdir()), "the measured directories stay behind"
    ok = subprocess.run([sys.executable, str(SCRIPT), "--build", "a="], capture_output=True, text=True, timeout=60)
    assert ok.returncode != 0 and "exactly two" in ok.stderr
