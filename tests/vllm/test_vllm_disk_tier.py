"""The disk tier both ways into vLLM share (``pykvcache.vllm.scheduler.disk_tier``,
decision 0058): the standalone spec and the tier of vLLM's tiering framework
open the store, create its root and classify read results the same way.
Built from real vLLM configs, no engine process."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

VLLM_PACKAGE = Path(__file__).resolve().parents[2] / "python" / "pykvcache" / "vllm"


def _spec(tmp_path, root, **extra):
    from offloading_configs import tiny_offloading_config
    from pykvcache.vllm.spec import NvmeOffloadingSpec

    extra = {"storage_dirs": [str(root)], "capacity_bytes": "1GiB", "staging_bytes": "8MiB", "fingerprint_weights": False, **extra}
    return NvmeOffloadingSpec(tiny_offloading_config(extra, bytes_per_block=65536))


def _tier_manager(tmp_path, root):
    from test_vllm_tier import _spec as tiering_spec

    return tiering_spec(tmp_path, storage_dirs=[str(root)]).get_manager()


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _open_and_close(way, tmp_path, root):
    if way == "spec":
        _spec(tmp_path, root).get_manager().shutdown()
    else:
        _tier_manager(tmp_path, root).shutdown()


@pytest.mark.parametrize("way", ["spec", "tier"])
def test_the_engine_creates_a_missing_root_private(tmp_path, umask_022, way):
    """The root and its missing parents are the engine's: mode 0o700 whatever
    the umask (Python creating them first gave 0o755)."""
    root = tmp_path / "new" / "kv"
    _open_and_close(way, tmp_path, root)
    for made in (root, root.parent):
        assert stat.S_IMODE(made.stat().st_mode) == 0o700, (made, oct(made.stat().st_mode))


def test_a_root_the_engine_cannot_create_names_the_entry(tmp_path):
    """Valid when checked, then a file took the root's name: the store does
    not open, and the error says which storage_dirs entry is unusable (the
    spec's start-up; the tier opens its store with the same open_store)."""
    from pykvcache import StagingPool
    from pykvcache.vllm.config import ConfigError
    from pykvcache.vllm.scheduler.disk_tier import open_store

    root = tmp_path / "kv"
    spec = _spec(tmp_path, root)
    root.write_bytes(b"not a directory")
    with pytest.raises(ConfigError, match=f"storage_dirs entry {root} is unusable"):
        spec.get_manager()
    good = tmp_path / "good"
    settings = dataclasses.replace(spec.settings, storage_dirs=(str(good), str(root)))
    pool = StagingPool(4096, 2)
    with pytest.raises(ConfigError, match=f"storage_dirs entry {root} is unusable.*File exists"):
        open_store(settings, pool, "ns", close_pool_on_failure=True)
    assert good.is_dir()
    with pytest.raises(Exception, match="closed"):
        pool.acquire()


def test_the_tier_does_not_import_the_standalone_spec():
    """What the two share lives in disk_tier, not in either entry point."""
    for module in ("tier.py", "scheduler/disk_tier.py"):
        tree = ast.parse((VLLM_PACKAGE / module).read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        imported |= {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
        assert not imported & {"pykvcache.vllm.spec", "pykvcache.vllm.scheduler.manager"}, (module, imported)


@pytest.mark.parametrize(
    ("status", "miss_kind", "counter", "hidden_for"),
    [
        ("miss", "absent", "vanished_chunks", None),
        ("miss", "kept", "kept_chunks", "kept"),
        ("miss", "unavailable", "unavailable_reads", "unavailable"),
        ("corrupt", "corrupt", "corrupt_chunks", None),
        ("error", "unavailable", "read_errors", "unavailable"),
    ],
)
def test_one_classification_of_a_failed_read(tmp_path, status, miss_kind, counter, hidden_for):
    """A read that served nothing: counted by the engine's verdict, and the key
    not read again for a while where the file stays; nothing is deleted."""
    from pykvcache import BlockStore, StagingPool
    from pykvcache.vllm.scheduler.disk_tier import DiskTier

    pool = StagingPool(4096, 2)
    store = BlockStore([str(tmp_path / "kv")], pool, namespace="ns", capacity_bytes=1 << 30)
    disk = DiskTier(store, pool)  # no gate
    key = b"k" * 36
    slot = pool.acquire()
    assert store.put(key, slot, 4096).wait(10).ok
    pool.release(slot)
    try:
        assert disk.on_disk(key)
        result = SimpleNamespace(status=status, miss_kind=miss_kind, latency_s=0.001, length=0, message="test", errno=None)
        assert disk.read_finished(key, result) is False
        assert disk.metrics.totals[counter] == 1
        assert store.contains(key), "the file is the engine's to remove"
        assert disk.on_disk(key) is (hidden_for is None)
    finally:
        disk.shutdown(lambda: None)
    assert disk.closed
    disk.shutdown(lambda: pytest.fail("shut down twice"))
