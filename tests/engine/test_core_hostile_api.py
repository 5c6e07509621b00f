"""The direct API under hostile arguments and races.

Each test replays the reported scenario. Those that hung before the fix run
in a subprocess with a timeout, so that a regression fails instead of hanging
the suite.
"""

import asyncio
import gc
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pykvcache as kv
import pykvcache.aio
import pytest
from fault_marks import NEEDS_FAULT_INJECTION

MiB = 1 << 20
PYTHON_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "python")


def make_store(path, pool, **kw):
    kw.setdefault("namespace", "hostile")
    kw.setdefault("capacity_bytes", 1 << 30)
    return kv.BlockStore([str(path)], pool, **kw)


def slow_store(directory, slot_bytes: int):
    """A store in a new ``directory`` whose transfers move 4 KiB at a time
    (an 8 MiB put is 2048 of them: slow enough to be waited for)."""
    directory.mkdir(mode=0o700)
    pool = kv.StagingPool(slot_bytes, 2)
    # 2048 small transfers can outlast the default deadline (2 s) on a loaded CI disk; these
    # tests are about waiting, not deadlines: a bound with margin (the awaits time out first).
    return make_store(directory, pool, _fault_max_transfer=4096, io_deadline=120), pool


def run_isolated(code: str, store_dir, timeout: float = 60) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter (`store_dir` is its sys.argv[1]); a hang is a test failure."""
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        return subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code), str(store_dir)], capture_output=True, text=True, timeout=timeout, env=env
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"hung for {timeout} s; output so far: {e.stdout!r} {e.stderr!r}")


# ---- item 5: size arithmetic


@pytest.mark.parametrize("slot_bytes", [2**64 - 1, 2**64 - 4097, 2**63, 2**62])
def test_pool_sizes_that_wrap_the_stride_are_refused(slot_bytes):
    # Before: 2**64-1 gave a 4096-byte stride and 2**64-4097 a stride of 0
    # (every slot aliasing the same memory); a later put segfaulted.
    with pytest.raises(ValueError, match="slot_bytes"):
        kv.StagingPool(slot_bytes, 2)


@pytest.mark.parametrize(
    ("kw", "name"),
    [
        ({"slot_bytes": 2**64, "num_slots": 2}, "slot_bytes"),
        ({"slot_bytes": -1, "num_slots": 2}, "slot_bytes"),
        ({"slot_bytes": 0, "num_slots": 2}, "slot_bytes"),
        ({"slot_bytes": 4096, "num_slots": 2**64}, "num_slots"),
        ({"slot_bytes": 4096, "num_slots": -2}, "num_slots"),
        ({"slot_bytes": 4096, "num_slots": 0}, "num_slots"),
        ({"slot_bytes": 4096, "num_slots": 65536}, "num_slots"),
    ],
)
def test_out_of_range_pool_arguments_are_value_errors_naming_them(kw, name):
    with pytest.raises(ValueError, match=name):
        kv.StagingPool(**kw)


def test_view_length_is_the_slot_size_for_every_slot():
    # Before: len(view) of the wrapped pool raised SystemError.
    pool = kv.StagingPool(3 * 4096 + 1, 3)
    for _ in range(3):
        s = pool.acquire()
        with pool.view(s) as v:
            assert len(v) == pool.slot_bytes == 3 * 4096 + 1
            v[-1] = 7  # the last payload byte is inside the slot
    assert pool.slot_stride == kv.HEADER_BYTES + 4 * 4096


def test_store_sizes_and_put_lengths_are_checked(store_dir):
    pool = kv.StagingPool(MiB, 2)
    for kw, name in [
        ({"segment_bytes": 2**64}, "segment_bytes"),
        ({"segment_bytes": -4096}, "segment_bytes"),
        ({"write_segment_bytes": 2**64}, "write_segment_bytes"),
        ({"queue_depth": 2**64}, "queue_depth"),
        ({"queue_depth": 2**40}, "queue_depth"),
        ({"capacity_bytes": 2**64}, "capacity_bytes"),
        ({"capacity_bytes": -1}, "capacity_bytes"),
        ({"io_threads": 2**20}, "io_threads"),
        ({"chunk_workers": 2**20}, "chunk_workers"),
    ]:
        with pytest.raises(ValueError, match=name):
            make_store(store_dir, pool, **kw)
    with make_store(store_dir, pool) as store:
        s = pool.acquire()
        for length in (2**64, -1, MiB + 1, 2**63):
            with pytest.raises(ValueError, match="length"):
                store.put(b"k", s, length)
        assert store.inflight() == 0
        assert store.put(b"k", s, MiB).wait(10).ok
        pool.release(s)


# ---- item 6: a refused get/put leaked its op-table entry


REFUSED_OPS = """
    import sys, time
    import pykvcache as kv
    d = sys.argv[1]
    pool = kv.StagingPool(32 << 20, 2)
    # One slow put (8192 transfers of 4 KiB on one I/O thread) keeps slot a busy.
    store = kv.BlockStore([d], pool, namespace="n", capacity_bytes=1 << 30, backend="threads", io_threads=1,
                          _fault_max_transfer=4096, max_inflight=4, submit_timeout=0.5)
    a, b = pool.acquire(), pool.acquire()
    slow = store.put(b"slow", a, 32 << 20)
    refused = 0
    for i in range(3 * 4):  # more refusals than max_inflight
        try:
            (store.get if i % 2 else store.put)(b"x", a, *([] if i % 2 else [4096]))
        except kv.PoolExhausted as e:
            sys.exit(f"op table leaked: refusal {i} found it full: {e}")
        except kv.PykvcacheError as e:
            assert "in flight" in str(e), e
            refused += 1
    assert not slow.done(), "the slow put finished early: the scenario did not happen"
    assert slow.wait(60).ok
    del slow
    print("refused", refused, "inflight", store.inflight(), flush=True)
    assert store.inflight() == 0
    assert store.get(b"slow", b).wait(10).ok  # the table still has room
    pool.release(b)
    pool.release(a)
"""


@NEEDS_FAULT_INJECTION
def test_refused_operations_release_their_entry_and_close_completes(store_dir):
    r = run_isolated(
        REFUSED_OPS
        + """
    t0 = time.monotonic()
    store.close()
    print("closed in", round(time.monotonic() - t0, 3))
    """,
        store_dir,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    assert "refused 12 inflight 0" in r.stdout and "closed in" in r.stdout, r.stdout


@NEEDS_FAULT_INJECTION
def test_interpreter_exit_after_refused_operations_does_not_hang(store_dir):
    # The store is never closed: its destructor runs at interpreter exit.
    r = run_isolated(
        REFUSED_OPS
        + """
    print("exiting", flush=True)
    """,
        store_dir,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    assert "exiting" in r.stdout


# ---- item 7: asyncio with a store opened after another was closed


@NEEDS_FAULT_INJECTION
def test_aio_wait_works_on_stores_opened_after_others_closed_in_one_loop(tmp_path):
    # Before: the second or third store reused the first one's eventfd number
    # (and often its id()); the loop kept the dead registration and the
    # await never completed.
    async def main():
        fds = []
        for i in range(4):
            # Slow enough (2048 transfers) that the await really waits for the eventfd.
            store, pool = slow_store(tmp_path / f"s{i}", 8 * MiB)
            fds.append(store.completion_fd)
            s = pool.acquire()
            h = store.put(b"k", s, 8 * MiB)
            r = await asyncio.wait_for(pykvcache.aio.wait(store, h), 60)
            assert r.ok
            r = await asyncio.wait_for(pykvcache.aio.wait(store, store.get(b"k", s)), 60)
            assert r.ok and r.length == 8 * MiB
            store.close()
            pool.release(s)
            del store, h, r
            gc.collect()
            await asyncio.sleep(0)  # lets the reader of the gone store be dropped
        return fds

    fds = asyncio.run(main())
    assert len(set(fds)) < len(fds), f"no fd number was reused ({fds}): the scenario did not happen"


@NEEDS_FAULT_INJECTION
def test_aio_two_open_stores_share_a_loop(tmp_path):
    async def main():
        stores = []
        for i in range(2):
            stores.append(slow_store(tmp_path / f"s{i}", 4 * MiB))
        hs = []
        for store, pool in stores:
            hs.append(pykvcache.aio.wait(store, store.put(b"k", pool.acquire(), 4 * MiB)))
        rs = await asyncio.wait_for(asyncio.gather(*hs), 60)
        assert all(r.ok for r in rs)
        for store, _ in stores:
            store.close()

    asyncio.run(main())


# ---- item 8: close() racing a put that waits for an op entry


def test_close_fails_a_put_waiting_for_an_entry_and_unpins_nothing(store_dir):
    for _ in range(3):
        pool = kv.StagingPool(MiB, 2)
        store = make_store(store_dir, pool, max_inflight=1, submit_timeout=30)
        a, b = pool.acquire(), pool.acquire()
        first = store.put(b"a", a, 4096)  # holds the only entry until waited
        out = {}

        def second_put():
            try:
                out["handle"] = store.put(b"b", b, 4096)
            except Exception as e:  # noqa: BLE001 - the error is the result
                out["error"] = e

        t = threading.Thread(target=second_put)
        t.start()
        time.sleep(0.3)  # the second put is now waiting for the entry
        t0 = time.monotonic()
        store.close()
        t.join(10)
        assert not t.is_alive()
        # Before: it took the entry once `first` was released after the close,
        # pinned slot b and went to the stopped backend: never completed.
        assert first.wait(10).ok
        del first
        assert "handle" not in out, "a put admitted after close never completes"
        assert isinstance(out.get("error"), kv.PykvcacheError) and "closed" in str(out["error"])
        assert time.monotonic() - t0 < 10
        pool.release(b)  # not pinned
        pool.release(a)
        assert pool.free_slots == 2


# ---- item 9: timeouts and counts


def test_huge_timeouts_mean_forever_and_nan_or_negative_are_value_errors(store_dir):
    pool = kv.StagingPool(MiB, 2)
    # Before: 1e300 raised pyo3's PanicException (a BaseException).
    s = pool.acquire(timeout=1e300)
    s2 = pool.acquire(timeout=math.inf)
    got = []
    t = threading.Thread(target=lambda: got.append(pool.acquire(timeout=1e300)))
    t.start()
    time.sleep(0.3)
    assert t.is_alive() and not got, "a huge timeout is 'forever', not 'now'"
    pool.release(s2)
    t.join(10)
    assert got == [s2]
    for bad in (math.nan, -1.0, -math.inf):
        with pytest.raises(ValueError, match="timeout"):
            pool.acquire(timeout=bad)
        with pytest.raises(ValueError, match="submit_timeout"):
            make_store(store_dir, pool, submit_timeout=bad)
    with make_store(store_dir, pool, submit_timeout=1e300, background_scan=True) as store:
        assert store.wait_scan(timeout=1e300)
        for bad in (math.nan, -0.5):
            with pytest.raises(ValueError, match="timeout"):
                store.wait_scan(timeout=bad)
        h = store.put(b"k", s, 4096)
        with pytest.raises(ValueError, match="timeout"):
            h.wait(math.nan)
        assert h.wait(timeout=1e300).ok
        assert store.get(b"k", s).wait(math.inf).ok
    pool.release(s)
    pool.release(got[0])


def test_max_inflight_out_of_range_is_a_value_error_not_sigabrt(store_dir):
    # Before: 2**33 entries were allocated up front and the process aborted.
    r = run_isolated(
        """
    import sys
    import pykvcache as kv
    d = sys.argv[1]
    pool = kv.StagingPool(1 << 20, 2)
    for n in (2**33, 2**64, 0, -1, 65537):
        try:
            kv.BlockStore([d], pool, namespace="n", capacity_bytes=1 << 30, max_inflight=n)
        except ValueError as e:
            assert "max_inflight" in str(e), e
            print("refused", n, e, flush=True)
        else:
            raise SystemExit(f"max_inflight={n} accepted")
    with kv.BlockStore([d], pool, namespace="n", capacity_bytes=1 << 30, max_inflight=65536) as store:
        print("max ok", store.inflight())
    """,
        store_dir,
    )
    assert r.returncode != -signal.SIGABRT, "aborted (SIGABRT)"
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("refused") == 5 and "max ok 0" in r.stdout
