"""The direct API as a hostile first-time user met it: one store awaited from two event loops, one handle
waited for from many threads, negative slot indices, and the slot size that a
too-large chunk's miss names.

Each scenario that hung before the fix is bounded by a timeout, so that a
regression fails instead of hanging the suite.
"""

import asyncio
import gc
import threading
import time
import weakref

import pykvcache as kv
import pykvcache.aio
import pytest
from fault_marks import NEEDS_FAULT_INJECTION

MiB = 1 << 20


def slow_store(directory, slot_bytes: int, num_slots: int = 2):
    """A store whose transfers move 4 KiB at a time, so that operations are
    still in flight when they are waited for."""
    pool = kv.StagingPool(slot_bytes, num_slots)
    store = kv.BlockStore([str(directory)], pool, namespace="first-contact", capacity_bytes=1 << 30, _fault_max_transfer=4096)
    return store, pool


# ---- finding 5: one store, one event loop per thread


@NEEDS_FAULT_INJECTION
def test_aio_wait_from_two_event_loops_on_two_threads_completes(store_dir):
    # Before: both loops had a reader on the store's one eventfd; whichever
    # drained it took the wake-up, and the other loop's awaited handle never
    # resolved (3 of 3 runs hung).
    store, pool = slow_store(store_dir, 2 * MiB, num_slots=2)
    rounds = 8
    barrier = threading.Barrier(2)
    outcomes: dict[int, object] = {}
    loops: list[weakref.ref] = []

    def worker(n: int) -> None:
        slot = pool.acquire(timeout=5)

        async def main():
            loops.append(weakref.ref(asyncio.get_running_loop()))
            done = 0
            for i in range(rounds):
                barrier.wait(10)  # both loops have an operation in flight together
                handle = store.put(b"t%d-%d" % (n, i), slot, 2 * MiB)
                result = await asyncio.wait_for(pykvcache.aio.wait(store, handle), 15)
                assert result.ok, result
                done += 1
            return done

        try:
            outcomes[n] = asyncio.run(main())
        except BaseException as exc:  # reported by the main thread
            outcomes[n] = exc
            barrier.abort()
        finally:
            pool.release(slot)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a loop is still waiting"
    assert outcomes == {0: rounds, 1: rounds}, outcomes
    store.close()
    gc.collect()
    assert [ref() for ref in loops] == [None, None]  # the readers keep no loop alive


# ---- finding 7: one handle, many waiting threads


@NEEDS_FAULT_INJECTION
def test_one_handle_waited_from_many_threads_gives_every_waiter_the_result(store_dir):
    # Before: wait() held a mutable borrow of the handle while it slept, so
    # concurrent waiters raised "RuntimeError: Already borrowed" (83 of 320).
    store, pool = slow_store(store_dir, 8 * MiB)
    slot = pool.acquire()
    for attempt in range(3):
        handle = store.put(b"k%d" % attempt, slot, 8 * MiB)  # 2048 transfers: waited for
        start = threading.Barrier(17)
        results, errors = [], []
        ticks = 0
        stop = threading.Event()

        def waiter():
            start.wait(10)
            try:
                results.append(handle.wait(timeout=30))  # noqa: F821 - bound until the `del` after the threads end
            except BaseException as exc:  # noqa: BLE001 - the test reports it
                errors.append(exc)

        def ticker():
            # Runs Python code while the others wait: proof the GIL is released.
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                time.sleep(0.001)

        threads = [threading.Thread(target=waiter) for _ in range(16)]
        tick_thread = threading.Thread(target=ticker)
        tick_thread.start()
        for t in threads:
            t.start()
        start.wait(10)
        for t in threads:
            t.join(60)
        stop.set()
        tick_thread.join()
        assert not errors, errors[:3]
        assert len(results) == 16 and all(r.ok and r.length == 8 * MiB for r in results)
        assert ticks > 0
        assert handle.done() and handle.wait(0).ok  # the cached result, again
        del handle
    assert store.inflight() == 0
    store.close()


@NEEDS_FAULT_INJECTION
def test_a_handle_dropped_while_other_threads_wait_frees_its_entry(store_dir):
    store, pool = slow_store(store_dir, 4 * MiB)
    slot = pool.acquire()
    handle = store.put(b"k", slot, 4 * MiB)
    got = []
    threads = [threading.Thread(target=lambda: got.append(handle.wait(30))) for _ in range(4)]  # noqa: F821 - `del` comes after
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(got) == 4 and len({id(r) for r in got}) == 1  # one result object for all
    del handle, got
    # The entry is back and the slot free for the next operation.
    assert store.inflight() == 0
    assert store.get(b"k", slot).wait(30).ok
    store.close()


# ---- finding 8: slot indices


@pytest.mark.parametrize("slot", [-1, -(2**70), 2**64])
def test_out_of_range_slot_indices_are_value_errors_naming_the_slot(store_dir, slot):
    pool = kv.StagingPool(4096, 2)
    store = kv.BlockStore([str(store_dir)], pool, namespace="slots", capacity_bytes=1 << 30)
    calls = {
        "put": lambda: store.put(b"k", slot, 16),
        "get": lambda: store.get(b"k", slot),
        "prefetch": lambda: store.prefetch(b"k", slot),
        "release": lambda: pool.release(slot),
        "view": lambda: pool.view(slot),
        "payload_offset": lambda: pool.payload_offset(slot),
        "exports": lambda: pool.exports(slot),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match="slot") as info:
            call()
        assert not isinstance(info.value, OverflowError), name
    store.close()


def test_a_chunk_larger_than_the_slot_names_the_slot_size(tmp_path):
    # Before: "chunk of 12288 bytes does not fit a 8192-byte slot" for a
    # 4096-byte slot (the largest file such a slot takes, named as the slot).
    big_pool = kv.StagingPool(8192, 1)
    writer = kv.BlockStore([str(tmp_path)], big_pool, namespace="sizes", capacity_bytes=1 << 30)
    s = big_pool.acquire()
    assert writer.put(b"big", s, 8192).wait(10).ok
    writer.close()
    small_pool = kv.StagingPool(4096, 1)
    reader = kv.BlockStore([str(tmp_path)], small_pool, namespace="sizes", capacity_bytes=1 << 30)
    r = reader.get(b"big", small_pool.acquire()).wait(10)
    assert r.status == "miss"
    assert "4096-byte slot" in r.message and "8192 bytes of payload" in r.message, r.message
    reader.close()
