"""What the weights identity in the namespace costs at start-up: every byte of
the weights is digested on a node's first start, a digest cache spares the
reading on later starts (decision 0052).

Writes a checkpoint of random bytes (``--gib``, in ``--shards`` safetensors-
named files) under ``--dir`` and measures three starts:

* cold:   the files evicted from the page cache first (``posix_fadvise``
          DONTNEED on these files only): the disk's speed;
* warm:   the files in the page cache, as right after vLLM loaded them (the
          digest runs in the scheduler after the model load), no digest cache;
* cached: a second start on the same files: a stat per file.

and extrapolates to a 16 GB checkpoint. Usage::

    python scripts/weights_identity_cost.py [--gib 2] [--shards 4] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from pykvcache.vllm.identity.digest_cache import RACY_WINDOW_NS, DigestCache
from pykvcache.vllm.identity.model_identity import WeightsIdentity, weights_identity
from pykvcache.vllm.identity.weights_digest import DIGEST_THREADS

EXTRAPOLATE_BYTES = 16e9


def build_checkpoint(directory: Path, total_bytes: int, shards: int) -> int:
    """Random-content shards (plus a config.json); returns the bytes written."""
    per = total_bytes // shards
    block = os.urandom(1 << 20)
    for s in range(shards):
        with open(directory / f"model-{s + 1:05d}-of-{shards:05d}.safetensors", "wb") as f:
            left = per
            while left:
                n = min(left, len(block))
                # A fresh first byte per MiB: no two MiB alike, cheaply.
                f.write(os.urandom(1) + block[1:n])
                left -= n
            f.flush()
            os.fsync(f.fileno())
    (directory / "config.json").write_text("{}")
    return per * shards


def evict(directory: Path) -> None:
    """Drops these files' clean pages from the page cache (no root needed)."""
    for path in directory.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def describe(name: str, ident: WeightsIdentity) -> str:
    rate = ident.bytes_hashed / max(ident.seconds, 1e-9)
    line = (
        f"{name:>6}: {ident.bytes_hashed / 1e9:.2f} GB hashed, {ident.files_cached}/{ident.files} "
        f"files from the digest cache, {ident.seconds:.3f} s"
    )
    if ident.bytes_hashed:
        line += f" = {rate / 1e6:.0f} MB/s -> 16 GB in {EXTRAPOLATE_BYTES / rate:.1f} s"
    return line


def measure(directory: Path, cache_path: Path) -> dict[str, WeightsIdentity]:
    # Only files older than the racy window are cached: wait it out once.
    newest = max(max(p.stat().st_mtime_ns, p.stat().st_ctime_ns) for p in directory.iterdir())
    time.sleep(max(0.0, (newest + RACY_WINDOW_NS - time.time_ns()) / 1e9) + 0.1)
    evict(directory)
    out = {"cold": weights_identity(directory, cache=None)}
    out["warm"] = weights_identity(directory, cache=DigestCache(cache_path))
    out["cached"] = weights_identity(directory, cache=DigestCache(cache_path))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--dir", default=None, help="where the checkpoint is written (default: the temp dir)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pykvcache-weights-", dir=args.dir) as tmp:
        ckpt = Path(tmp) / "ckpt"
        ckpt.mkdir()
        size = build_checkpoint(ckpt, int(args.gib * (1 << 30)), args.shards)
        print(f"checkpoint: {size / 1e9:.2f} GB in {args.shards} shards; {DIGEST_THREADS} digest threads")
        results = measure(ckpt, Path(tmp) / "digests.json")
    for name, ident in results.items():
        print(describe(name, ident))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
