"""The configured storage directory: a symlink to a directory is followed
once, at open (what an operator means by ``/data/kv -> /mnt/nvme0/kv``);
symlinks *inside* the store stay refused (tests/robustness/test_robust_corruption.py)."""

import os

import pykvcache as kv
import pytest

MiB = 1 << 20


def test_a_symlinked_storage_directory_is_resolved(tmp_path):
    real = tmp_path / "nvme0" / "kv"
    real.mkdir(parents=True, mode=0o700)
    link = tmp_path / "kv-link"
    os.symlink(real, link)
    pool = kv.StagingPool(MiB, 1)
    store = kv.BlockStore([str(link)], pool, namespace="ns", capacity_bytes=1 << 30)
    [ns_dir] = store.namespace_dir
    assert os.path.dirname(ns_dir) == str(real), "the store works under the resolved path"
    slot = pool.acquire()
    with pool.view(slot) as v:
        v[:5] = b"hello"
    assert store.put(b"k", slot, 5).wait(10).ok
    store.close()
    # A second open through the link finds the chunk.
    store = kv.BlockStore([str(link)], pool, namespace="ns", capacity_bytes=1 << 30)
    assert store.contains(b"k")
    store.close()


def test_a_symlink_to_a_file_or_nowhere_is_still_refused(tmp_path):
    pool = kv.StagingPool(MiB, 1)
    a_file = tmp_path / "file"
    a_file.write_bytes(b"x")
    to_file = tmp_path / "to-file"
    os.symlink(a_file, to_file)
    with pytest.raises(kv.StoreError):
        kv.BlockStore([str(to_file)], pool, namespace="ns", capacity_bytes=1 << 30)
    dangling = tmp_path / "dangling"
    os.symlink(tmp_path / "missing" / "deeper", dangling)
    with pytest.raises(kv.StoreError):
        kv.BlockStore([str(dangling)], pool, namespace="ns", capacity_bytes=1 << 30)


def test_a_symlink_to_a_world_writable_directory_is_judged_by_its_target(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    link = tmp_path / "link"
    os.symlink(open_dir, link)
    pool = kv.StagingPool(MiB, 1)
    with pytest.raises(ValueError, match="world-writable.*allow_insecure_root"):
        kv.BlockStore([str(link)], pool, namespace="ns", capacity_bytes=1 << 30)
    kv.BlockStore([str(link)], pool, namespace="ns", capacity_bytes=1 << 30, allow_insecure_root=True).close()
