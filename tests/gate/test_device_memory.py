"""The learnt device model kept beside the namespace (decision 0073): a
restarted gate starts from it; anything wrong with the file is ignored."""

from __future__ import annotations

import json

import pytest
from pykvcache.gate import LoadCost, OnlineLoadModel, device_memory

PRIOR = LoadCost(fixed_s=1e-3, disk_bytes_per_s=1e9, h2d_bytes_per_s=1e10)
CHUNK = 2 << 20


def _learnt(bytes_per_s: float = 25e6, loads: int = 6) -> OnlineLoadModel:
    online = OnlineLoadModel(PRIOR)
    for i in range(loads):
        nbytes = (i % 3 + 1) * 8 * CHUNK
        online.observe(nbytes, 2e-3 + nbytes / bytes_per_s)
    return online


def test_a_restarted_gate_prices_reads_as_the_last_one_learnt(tmp_path):
    before = _learnt()
    path = tmp_path / device_memory.FILE_NAME
    assert device_memory.save(path, before)
    after = OnlineLoadModel(PRIOR)
    assert after.disk_bytes_per_s == 1e9
    assert device_memory.restore(path, after) == (6, None)
    assert after.disk_bytes_per_s == pytest.approx(before.disk_bytes_per_s, rel=1e-6)
    assert after.disk_bytes_per_s == pytest.approx(25e6, rel=0.01)
    assert after.samples == 6
    assert [p.name for p in tmp_path.iterdir()] == [device_memory.FILE_NAME]  # no temporary left


def test_nothing_learnt_writes_nothing(tmp_path):
    path = tmp_path / device_memory.FILE_NAME
    assert not device_memory.save(path, OnlineLoadModel(PRIOR))
    assert not path.exists()
    assert device_memory.restore(path, OnlineLoadModel(PRIOR)) == (0, "no saved device model")


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ("{not json", "unreadable"),
        (json.dumps({"format": "something-else/1", "saved_at": 0, "points": []}), "not a pykvcache-gate-device/1 file"),
        (json.dumps({"format": device_memory.FORMAT, "points": [[1, 1]]}), "no save time"),
        (json.dumps({"format": device_memory.FORMAT, "saved_at": 1.0, "points": "many"}), "saved"),
        (json.dumps({"format": device_memory.FORMAT, "saved_at": "now", "points": []}), "no save time"),
    ],
)
def test_a_file_that_is_not_a_recent_device_model_is_ignored(tmp_path, content, why):
    path = tmp_path / device_memory.FILE_NAME
    path.write_text(content)
    online = OnlineLoadModel(PRIOR)
    restored, reason = device_memory.restore(path, online)
    assert restored == 0 and reason.startswith(why), reason
    assert online.samples == 0 and online.disk_bytes_per_s == 1e9


def test_an_old_save_is_not_trusted_and_bad_loads_are_rejected(tmp_path):
    path = tmp_path / device_memory.FILE_NAME
    device_memory.save(path, _learnt(), wall_now=1000.0)
    online = OnlineLoadModel(PRIOR)
    restored, reason = device_memory.restore(path, online, wall_now=1000.0 + 8 * 86400)
    assert restored == 0 and "days ago" in reason
    data = json.loads(path.read_text())
    data["points"] = [[-5, 1.0], [CHUNK, float("nan")], ["x", 1], [CHUNK, 0.1], [2 * CHUNK, 0.2]]
    path.write_text(json.dumps(data))
    restored, reason = device_memory.restore(path, online, wall_now=1000.0)
    assert (restored, reason) == (2, None)
    assert online.rejected == 2
