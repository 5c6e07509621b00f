"""Bounded-time fuzzing of whole chunk files through the public API (the
header decoder alone is property-tested in rust/src/disk/format.rs). Runs in a
child process, so that a crash of the engine is a failed test, not a dead
test run. ROBUST_FUZZ_EXAMPLES raises the budget for a longer local run."""

import json
import os
import subprocess
import sys

from child_paths import child
from robust_chunkfmt import HEADER_BYTES, parse_header

EXAMPLES = int(os.environ.get("ROBUST_FUZZ_EXAMPLES", "600"))


def test_arbitrary_chunk_files_never_crash_and_are_served_only_when_valid(store_dir, tmp_path):
    last = tmp_path / "last-input.bin"
    out = subprocess.run(
        [sys.executable, child("robust_fuzz_chunks.py"), str(store_dir), str(EXAMPLES), str(last)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if out.returncode < 0:
        data = last.read_bytes()
        head = parse_header(data[:HEADER_BYTES]) if len(data) >= HEADER_BYTES else data.hex()
        raise AssertionError(f"the engine crashed (signal {-out.returncode}) reading a {len(data)}-byte file: {head}")
    assert out.returncode == 0, out.stderr[-6000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    print("fuzz report:", seen)
    assert seen["ok"] > 0 and seen["corrupt"] > 0 and seen["error"] == 0
