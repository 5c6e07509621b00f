"""What a finished ``pykvcache demo`` must have left in its output directory.

`make demo` runs once in the suite, as a user types it
(tests/docs/test_readme_commands.py); these checks on its ``demo.json`` and
store are the ones ``tests/tools/test_demo.py`` used to make on a second run of
the demo's vLLM part (dropped: one engine pair less per suite)."""

from __future__ import annotations

import glob
import json
from pathlib import Path

from pykvcache.tools.demo import CHUNK_TOKENS, DEMO_JSON, KV_BYTES_PER_TOKEN

#: Planted in the store before the run: the demo's store must start empty.
LEFT_OVER = "left-over"


def plant_left_over(out: Path) -> Path:
    store = out / "store"
    store.mkdir(parents=True, exist_ok=True)
    marker = store / LEFT_OVER
    marker.write_text("from an earlier run")
    return marker


def check_demo_output(out: Path) -> dict:
    data = json.loads((out / DEMO_JSON).read_text())
    assert data["ok"], data["checks"]
    assert data["prefix_tokens"] >= 800
    # Stored: at least every whole chunk of the prefix went to disk.
    assert data["stored"]["disk_write_bytes"] >= (data["prefix_tokens"] // CHUNK_TOKENS) * CHUNK_TOKENS * KV_BYTES_PER_TOKEN
    assert glob.glob(str(out / "store" / "**" / "*.kvc"), recursive=True)
    assert not (out / "store" / LEFT_OVER).exists()  # the demo's store starts empty
    rep = data["repeat"]
    assert rep["cached_tokens_without"] == 0  # vLLM alone recomputes it
    assert rep["cached_tokens_with"] >= data["prefix_tokens"] - CHUNK_TOKENS
    assert rep["disk_reads"] >= rep["cached_tokens_with"] // CHUNK_TOKENS
    assert rep["disk_read_bytes"] >= rep["disk_reads"] * CHUNK_TOKENS * KV_BYTES_PER_TOKEN
    assert all(p["tokens_identical"] for p in data["phases"].values())
    assert Path(data["log"]).stat().st_size > 0
    return data
