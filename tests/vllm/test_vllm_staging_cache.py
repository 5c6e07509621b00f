"""The staging cache's bookkeeping over a real StagingPool (no vLLM process)."""

from __future__ import annotations

import pytest
from pykvcache import StagingPool
from pykvcache.vllm.scheduler.staging_cache import EntryState, Origin, StagingCache


@pytest.fixture
def pool():
    p = StagingPool(4096, 4)
    yield p
    p.close()


def _key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 9


def _ready(cache: StagingCache, i: int):
    entry = cache.insert(_key(i), EntryState.STORING, Origin.HOST)
    assert entry is not None
    cache.mark_ready(_key(i))
    return entry


def test_fills_then_evicts_least_recently_used(pool):
    cache = StagingCache(pool)
    slots = {_ready(cache, i).slot for i in range(4)}
    assert slots == set(range(4)) and pool.free_slots == 0
    cache.touch(_key(0))  # 1 is now the least recently used
    entry = cache.insert(_key(9), EntryState.READING, Origin.DISK)
    assert entry is not None
    assert _key(1) not in cache and _key(0) in cache
    assert cache.evictions == 1
    assert len(cache) == 4


def test_in_flight_and_pinned_entries_are_never_evicted(pool):
    cache = StagingCache(pool)
    cache.insert(_key(0), EntryState.STORING, Origin.HOST)
    cache.insert(_key(1), EntryState.READING, Origin.DISK)
    _ready(cache, 2)
    cache.pin(_key(2))
    _ready(cache, 3)
    cache.hold("req-a", _key(3))
    assert cache.allocatable() == 0
    assert cache.insert(_key(4), EntryState.READING, Origin.DISK) is None
    assert len(cache) == 4
    cache.unpin(_key(2))
    assert cache.allocatable() == 1
    assert cache.insert(_key(4), EntryState.READING, Origin.DISK) is not None
    assert _key(2) not in cache
    cache.release_owner("req-a")
    assert cache.allocatable() == 1
    assert cache.insert(_key(5), EntryState.READING, Origin.DISK) is not None
    assert _key(3) not in cache


def test_hold_is_idempotent_per_owner_and_counts_owners(pool):
    cache = StagingCache(pool)
    _ready(cache, 0)
    cache.hold("a", _key(0))
    cache.hold("a", _key(0))
    cache.hold("b", _key(0))
    cache.release_owner("a")
    assert not cache.get(_key(0)).evictable
    assert cache.held_by("b") == {_key(0)}
    cache.release_owner("b")
    assert cache.get(_key(0)).evictable


def test_remove_returns_slot_to_pool_and_forgets_owners(pool):
    cache = StagingCache(pool)
    entry = cache.insert(_key(0), EntryState.READING, Origin.DISK)
    cache.hold("a", _key(0))
    assert pool.free_slots == 3
    assert cache.remove(_key(0)) is entry
    assert pool.free_slots == 4
    assert cache.held_by("a") == frozenset()
    assert cache.remove(_key(0)) is None
    cache.unpin(_key(0))  # a late unpin of a removed entry is harmless


def test_unbalanced_unpin_and_double_insert_are_errors(pool):
    cache = StagingCache(pool)
    _ready(cache, 0)
    with pytest.raises(RuntimeError, match="unbalanced"):
        cache.unpin(_key(0))
    with pytest.raises(KeyError):
        cache.insert(_key(0), EntryState.READING, Origin.DISK)


def test_clear_releases_everything(pool):
    cache = StagingCache(pool)
    for i in range(3):
        _ready(cache, i)
    cache.pin(_key(0))
    cache.hold("x", _key(1))
    cache.clear()
    assert len(cache) == 0 and pool.free_slots == 4 and cache.allocatable() == 4


def test_mark_ready_records_origin(pool):
    cache = StagingCache(pool)
    cache.insert(_key(0), EntryState.READING, Origin.DISK)
    assert not cache.get(_key(0)).evictable
    cache.mark_ready(_key(0), Origin.DISK)
    entry = cache.get(_key(0))
    assert entry.state is EntryState.READY and entry.origin is Origin.DISK and entry.evictable


def test_the_cache_is_the_one_book_of_who_holds_what(pool):
    from pykvcache.vllm.scheduler.staging_cache import LOAD, LOOKAHEAD, LOOKUP, owner

    cache = StagingCache(pool)
    for i in range(3):
        _ready(cache, i)
    cache.hold(owner(LOOKUP, "r1"), _key(0))
    cache.hold(owner(LOOKUP, "r2"), _key(0))  # a shared prefix counts once
    cache.hold(owner(LOOKUP, "r2"), _key(1))
    cache.hold(owner(LOOKAHEAD, "r3"), _key(2))
    cache.hold(owner(LOAD, "r1"), _key(0))
    assert cache.count_held(LOOKUP) == 2 and cache.keys_held(LOOKUP) == {_key(0), _key(1)}
    assert cache.is_held(_key(2), LOOKAHEAD) and not cache.is_held(_key(2), LOOKUP)
    assert cache.held_by(owner(LOOKUP, "r2")) == {_key(0), _key(1)}
    cache.release_owner(owner(LOOKUP, "r1"))
    assert cache.count_held(LOOKUP) == 2  # r2 still holds key 0
    cache.release(owner(LOAD, "r1"), _key(0))
    cache.release_owner(owner(LOOKUP, "r2"))
    assert cache.count_held(LOOKUP) == 0 and cache.count_held(LOAD) == 0
    # Nothing holds 0 and 1 any more: they are evictable again; 2 is not.
    assert cache.allocatable() == 1 + 2
    cache.remove(_key(2))  # removal forgets its holders too
    assert cache.count_held(LOOKAHEAD) == 0 and not cache.held_by(owner(LOOKAHEAD, "r3"))
