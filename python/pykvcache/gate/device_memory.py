"""The device model the gate learnt, kept beside the namespace (decision 0073).

A restarted server would price its first reads at the prior (on a disk
capped at 25 MB/s, 40x too fast for 4-7 s): the window of ``(bytes, seconds)``
loads is replayed at start instead. The file is small JSON beside the chunks
(``<namespace dir>/gate-device.json``; the engine's scan ignores it), written
atomically by whoever saves last. It is a hint: a missing, unreadable, foreign
or old file (``MAX_AGE_S``) is ignored. Pure file I/O: no vLLM.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from pykvcache.gate.online import OnlineLoadModel

FILE_NAME = "gate-device.json"
FORMAT = "pykvcache-gate-device/1"
#: A saved window older than this is not trusted: the device may have changed.
MAX_AGE_S = 7 * 86400.0


def save(path: str | os.PathLike[str], online: OnlineLoadModel | list[tuple[float, float]], *, wall_now: float | None = None) -> bool:
    """Write ``online``'s window (or a window taken from it) to ``path``; False when there is nothing to keep."""
    points = online.window() if isinstance(online, OnlineLoadModel) else online
    if not points:
        return False
    path = Path(path)
    data = {
        "format": FORMAT,
        "saved_at": time.time() if wall_now is None else wall_now,
        "points": [[round(b), s] for b, s in points],
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return True


def restore(path: str | os.PathLike[str], online: OnlineLoadModel, *, wall_now: float | None = None) -> tuple[int, str | None]:
    """Replay the window saved at ``path`` into ``online`` (before it has
    observed anything). Returns ``(loads restored, why none were)``; the
    reason is None when the file was used."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return 0, "no saved device model"
    except (OSError, ValueError) as exc:
        return 0, f"unreadable ({exc})"
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return 0, f"not a {FORMAT} file"
    saved_at = data.get("saved_at")
    now = time.time() if wall_now is None else wall_now
    if not isinstance(saved_at, (int, float)) or not math.isfinite(saved_at):
        return 0, "no save time"
    age = now - saved_at
    if age > MAX_AGE_S:
        return 0, f"saved {age / 86400:.1f} days ago (older than {MAX_AGE_S / 86400:.1f})"
    points = data.get("points")
    if not isinstance(points, list):
        return 0, "no loads in it"
    before = online.samples
    for point in points:
        if isinstance(point, list) and len(point) == 2 and all(isinstance(v, (int, float)) for v in point):
            online.observe(float(point[0]), float(point[1]), whole=True)  # a bad value is rejected and counted
    restored = online.samples - before
    return restored, None if restored else "no usable loads in it"
