"""Tenants at rest under vLLM (decision 0083): a request's ``cache_salt`` is the
tenant its chunks are sealed for, and the encryption keys are settings of the
integration, checked before any model loads.

Through the real manager on real files (no engine): the tenant recorded in a
request's ``ReqContext`` by ``request_tenant`` reaches the store's puts and
gets; a chunk stored for one tenant cannot be opened for another (nor for
none) even under the same chunk key; the key files are refused in the
engine's words, all problems at once. The path from vLLM's request to the
manager (PyKvCacheConnector.on_new_request) runs in tests/e2e/test_vllm_sealed.py.
"""

from __future__ import annotations

import os
import time

import pytest
from pykvcache import BlockStore, StagingPool
from pykvcache.vllm.config import ConfigError, kv_transfer_config, store_keywords, validate_extra_config
from pykvcache.vllm.scheduler.tenants import MAX_TENANT_BYTES, tenant_of_salt
from test_vllm_manager import LAYOUT, Harness, LookupResult, ReqContext, _key, _payload


def key_file(directory, name="key", mode=0o600, data=None) -> str:
    path = os.path.join(directory, name)
    with open(path, "wb") as f:
        f.write(os.urandom(32) if data is None else data)
    os.chmod(path, mode)
    return path


def _arrive(harness, req_id: str, salt: str | None) -> ReqContext:
    """vLLM's order: the manager sees the request's context, then the connector its salt."""
    ctx = ReqContext(req_id=req_id)
    harness.manager.on_new_request(ctx)
    harness.manager.request_tenant(req_id, tenant_of_salt(salt))
    return ctx


def _store(harness, ctx, keys):
    out = harness.manager.prepare_store(keys, ctx)
    assert out is not None and out.keys_to_store == keys
    for key, slot in zip(out.keys_to_store, out.store_spec.block_ids):
        with harness.pool.view(int(slot)) as view:
            view[:] = _payload(int.from_bytes(key[:32], "big"))
    harness.manager.complete_store(out.keys_to_store, ctx)
    harness.settle()


def _lookup(harness, ctx, key, timeout=10.0):
    deadline = time.monotonic() + timeout
    while (result := harness.manager.lookup(key, ctx)) not in (LookupResult.HIT, LookupResult.MISS):
        assert time.monotonic() < deadline, result
        harness.step()
        time.sleep(0.001)
    return result


def test_a_salted_requests_chunks_open_only_for_its_tenant(tmp_path):
    key = key_file(tmp_path)
    h = Harness(tmp_path / "kv", encryption_key_file=key)
    try:
        _store(h, _arrive(h, "a-1", "tenant-a"), [_key(1), _key(2)])
        assert h.manager.store.stats()["sealed_puts"] == 2
    finally:
        h.close()
    # Another store on the directory with the same key: the chunks open for
    # tenant-a only; for another tenant, or none, the file is kept, unopened.
    pool = StagingPool(LAYOUT.payload_bytes, 2)
    slot = pool.acquire()
    with BlockStore([str(tmp_path / "kv")], pool, namespace="test-ns", capacity_bytes=1 << 30, encryption_key_file=key) as store:
        ok = store.get(_key(1), slot, tenant=b"tenant-a").wait(10)
        assert ok.ok, ok
        with pool.view(slot) as view:
            assert bytes(view[: LAYOUT.payload_bytes]) == _payload(1)
        for other in (b"tenant-b", b""):
            r = store.get(_key(2), slot, tenant=other).wait(10)
            assert (r.status, r.miss_kind) == ("miss", "kept"), (other, r)
        assert store.contains(_key(2)), "a chunk of another tenant is never deleted"


def test_the_same_chunk_key_is_never_served_across_tenants(tmp_path):
    """vLLM's chunk keys already differ by salt; this is the defence against a
    hash or indexing bug: under one key, tenant-b's lookup neither takes
    tenant-a's chunk from staging nor opens its file, and tenant-a's still hits."""
    h = Harness(tmp_path / "kv", num_slots=4, encryption_key_file=key_file(tmp_path))
    try:
        _store(h, _arrive(h, "a-1", "tenant-a"), [_key(1)])
        b = _arrive(h, "b-1", "tenant-b")
        assert _lookup(h, b, _key(1)) is LookupResult.MISS  # staged for tenant-a
        assert h.manager.metrics.totals["tenant_mismatches"] == 1
        # Out of staging: the next lookups read the file.
        _store(h, _arrive(h, "fill", None), [_key(i) for i in range(10, 14)])
        assert _key(1) not in h.manager.cache
        b2 = _arrive(h, "b-2", "tenant-b")
        assert _lookup(h, b2, _key(1)) is LookupResult.MISS  # read, not opened: kept
        assert h.manager.metrics.totals["kept_chunks"] >= 1
        h.manager.on_request_finished(b2)
        h.manager.disk.presence._unreadable.clear()  # the kept verdict's 30 s back-off, for tenant-a's read now
        a = _arrive(h, "a-2", "tenant-a")
        assert _lookup(h, a, _key(1)) is LookupResult.HIT
        out = h.manager.prepare_load([_key(1)], a)
        h.settle()
        assert h.slot_bytes(out.block_ids[0]) == _payload(1)
        h.manager.complete_load([_key(1)], a)
    finally:
        h.close()


def test_salts_become_tenants_the_engine_takes():
    assert tenant_of_salt(None) == tenant_of_salt("") == b""
    assert tenant_of_salt("acme") == b"acme"
    long = tenant_of_salt("x" * (MAX_TENANT_BYTES + 1))
    assert len(long) <= MAX_TENANT_BYTES and long != tenant_of_salt("x" * (MAX_TENANT_BYTES + 2))


def test_encryption_keys_are_settings_checked_before_the_model_loads(tmp_path):
    good, old = key_file(tmp_path, "current"), key_file(tmp_path, "previous")
    config = validate_extra_config(
        {"storage_dirs": [str(tmp_path / "kv")], "capacity_bytes": "1GiB", "encryption_key_file": good, "encryption_previous_key_file": old}
    )
    keywords = store_keywords(config)
    assert (keywords["encryption_key_file"], keywords["encryption_previous_key_file"]) == (good, old)
    assert store_keywords(validate_extra_config({"storage_dirs": [str(tmp_path)], "capacity_bytes": "1GiB"}))["encryption_key_file"] is None
    # Every problem in one error, each in the engine's words with its fix.
    readable = key_file(tmp_path, "readable", mode=0o640)
    short = key_file(tmp_path, "short", data=b"x" * 31)
    with pytest.raises(ConfigError) as err:
        kv_transfer_config(
            [str(tmp_path / "kv")], "1GiB", encryption_key_file=readable, encryption_previous_key_file=short, staging_bytes="1TiB"
        )
    problems = err.value.problems
    assert any("encryption_key_file" in p and "chmod 600" in p and readable in p for p in problems), problems
    assert any("encryption_previous_key_file" in p and "31 bytes" in p for p in problems), problems
    assert any("staging_bytes" in p for p in problems), problems
    with pytest.raises(ConfigError, match="without encryption_key_file"):
        kv_transfer_config([str(tmp_path / "kv")], "1GiB", encryption_previous_key_file=old)
    with pytest.raises(ConfigError, match="hold the same key"):
        kv_transfer_config([str(tmp_path / "kv")], "1GiB", encryption_key_file=good, encryption_previous_key_file=good)
    with pytest.raises(ConfigError, match="cannot open it"):
        kv_transfer_config([str(tmp_path / "kv")], "1GiB", encryption_key_file=str(tmp_path / "missing"))
