"""The engine's limits: defined once in Rust, exported as
``_core.ENGINE_LIMITS`` beside ``ENGINE_DEFAULTS`` and enforced by one
``StoreConfig::validate`` (the vLLM layer reads them: tests/vllm/test_vllm_config.py). And
``io_deadline`` above ``FOREVER_S`` means what every other timeout means."""

from __future__ import annotations

import math

import pytest
from pykvcache import _core

MiB = 1 << 20


def make_store(path, pool, **kw):
    kw.setdefault("namespace", "limits")
    kw.setdefault("capacity_bytes", 1 << 30)
    return _core.BlockStore([str(path)], pool, **kw)


def test_io_deadline_above_forever_means_no_deadline(store_dir):
    # Before: io_deadline=1e10 became None in the binding ("forever", as for
    # every other timeout) and the engine read None as "derive it from the
    # slot size": the store quietly got the ~2 s default deadline.
    pool = _core.StagingPool(MiB, 2)
    try:
        for huge in (1e10, 1e300, math.inf):
            with make_store(store_dir, pool, io_deadline=huge) as store:
                assert store.stats()["io_deadline_s"] == math.inf, huge
        with make_store(store_dir, pool) as store:
            assert store.stats()["io_deadline_s"] == 2.0, "None: the default, derived from the slot size"
        for seconds in (0.5, 3600.0):
            with make_store(store_dir, pool, io_deadline=seconds) as store:
                assert store.stats()["io_deadline_s"] == seconds
        for bad in (0, 0.0, -1.0, math.nan):
            with pytest.raises(ValueError, match="io_deadline"):
                make_store(store_dir, pool, io_deadline=bad)
    finally:
        pool.close()


def test_limits_are_exported_beside_the_defaults():
    limits = _core.ENGINE_LIMITS
    assert limits["queue_depth"] == (1, 4096)
    assert limits["max_inflight"] == (1, 1 << 16)
    assert limits["io_threads"] == (0, 1024) and limits["chunk_workers"] == (0, 1024)
    assert limits["num_slots"] == (1, 65535)
    assert _core.FOREVER_S == 1e9
    for name in ("queue_depth", "max_inflight", "io_threads", "chunk_workers"):
        assert name in _core.ENGINE_DEFAULTS, name
        lo, hi = limits[name]
        assert lo <= _core.ENGINE_DEFAULTS[name] <= hi, name


def test_each_limit_is_enforced_and_named(store_dir):
    pool = _core.StagingPool(MiB, 2)
    try:
        for name in ("queue_depth", "max_inflight", "io_threads", "chunk_workers"):
            lo, hi = _core.ENGINE_LIMITS[name]
            with pytest.raises(ValueError, match=rf"{name} must be in {lo}\.\.={hi}.*, got {hi + 1}"):
                make_store(store_dir, pool, **{name: hi + 1})
            if lo > 0:
                with pytest.raises(ValueError, match=rf"{name} must be in {lo}\.\.={hi}, got {lo - 1}"):
                    make_store(store_dir, pool, **{name: lo - 1})
        lo, hi = _core.ENGINE_LIMITS["num_slots"]
        with pytest.raises(ValueError, match=rf"num_slots must be in {lo}\.\.={hi}"):
            _core.StagingPool(4096, hi + 1)
    finally:
        pool.close()
