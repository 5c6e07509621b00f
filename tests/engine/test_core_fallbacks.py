"""Every fallback forced for real: io_uring refused by seccomp, buffer
registration refused by RLIMIT_MEMLOCK, O_DIRECT refused by the filesystem,
and the thread-pool backend by configuration."""

import json
import os
import subprocess
import sys
import textwrap

import pykvcache as kv
import pytest

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "children")  # sandbox.py


def run_child(code: str, store_dir) -> dict:
    """Runs `code` in a fresh interpreter (restrictions are per process)."""
    prelude = textwrap.dedent(
        f"""
        import json, os, sys, logging
        sys.path.insert(0, {HERE!r})
        import sandbox
        logging.basicConfig(level=logging.WARNING)
        STORE_DIR = {str(store_dir)!r}
        """
    )
    out = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return {"result": json.loads(out.stdout.strip().splitlines()[-1]), "stderr": out.stderr}


ROUND_TRIP = """
import pykvcache as kv
pool = kv.StagingPool(16 << 20, 2)
store = kv.BlockStore([STORE_DIR], pool, namespace="fb", capacity_bytes=1 << 30, **KW)
a, b = pool.acquire(), pool.acquire()
with pool.view(a) as v:
    v[:] = os.urandom(16 << 20)
ok1 = store.put(b"k", a, 16 << 20).wait(30).ok
ok2 = store.get(b"k", b).wait(30).ok
with pool.view(a) as va, pool.view(b) as vb:
    same = bytes(va) == bytes(vb)
s = store.stats()
print(json.dumps({"ok": ok1 and ok2 and same, "backend": s["backend"], "fixed": s["fixed_buffers"],
                  "direct": s["direct_io"], "fallbacks": s["fallbacks"]}))
"""


def test_io_uring_refused_by_seccomp_falls_back_to_threads(store_dir):
    out = run_child("sandbox.refuse_io_uring()\nKW = {}\n" + ROUND_TRIP, store_dir)
    r = out["result"]
    assert r["ok"] and r["backend"] == "threads"
    assert any("io_uring unavailable" in f for f in r["fallbacks"])
    assert "io_uring unavailable" in out["stderr"], "the fallback is logged"


def test_io_uring_required_but_refused_is_a_clear_error(store_dir):
    code = """
    sandbox.refuse_io_uring()
    import pykvcache as kv
    pool = kv.StagingPool(1 << 20, 1)
    try:
        kv.BlockStore([STORE_DIR], pool, namespace="fb", capacity_bytes=1 << 30, backend="io_uring")
        print(json.dumps({"raised": None}))
    except kv.BackendUnavailable as e:
        print(json.dumps({"raised": str(e), "errno_attr": e.errno}))
    """
    r = run_child(code, store_dir)["result"]
    assert r["raised"] and "io_uring unavailable" in r["raised"]


def test_memlock_limit_falls_back_to_non_fixed_buffers(store_dir):
    out = run_child("sandbox.limit_locked_memory(64 << 10)\nKW = {}\n" + ROUND_TRIP, store_dir)
    r = out["result"]
    assert r["ok"] and r["backend"] == "io_uring" and r["fixed"] is False
    assert any("buffer registration failed" in f for f in r["fallbacks"])


def test_buffered_fallback_where_o_direct_is_refused(mounted):
    ramfs = mounted("ramfs")
    pool = kv.StagingPool(1 << 20, 2)
    with pytest.raises(kv.BackendUnavailable, match="refuses O_DIRECT"):
        kv.BlockStore([str(ramfs)], pool, namespace="fb", capacity_bytes=1 << 30, direct_io="required")
    store = kv.BlockStore([str(ramfs)], pool, namespace="fb", capacity_bytes=1 << 30, direct_io="optional")
    assert store.direct_io is False
    assert any("O_DIRECT refused" in f for f in store.stats()["fallbacks"])
    a, b = pool.acquire(), pool.acquire()
    with pool.view(a) as v:
        v[:5] = b"hello"
    assert store.put(b"k", a, 5).wait(10).ok
    assert store.get(b"k", b).wait(10).ok
    with pool.view(b) as v:
        assert bytes(v[:5]) == b"hello"


@pytest.mark.parametrize("kw", [{"backend": "threads"}, {"register_buffers": False}, {"direct_io": "disabled"}])
def test_configured_alternatives_round_trip(store_dir, kw):
    r = run_child(f"KW = {kw!r}\n" + ROUND_TRIP, store_dir)["result"]
    assert r["ok"]
    if "backend" in kw:
        assert r["backend"] == "threads"
    if "register_buffers" in kw:
        assert r["fixed"] is False
    if "direct_io" in kw:
        assert r["direct"] is False


def test_second_process_shares_the_directory(store_dir):
    pool = kv.StagingPool(1 << 20, 2)
    store = kv.BlockStore([str(store_dir)], pool, namespace="shared", capacity_bytes=1 << 30)
    code = """
    import pykvcache as kv
    pool = kv.StagingPool(1 << 20, 1)
    store = kv.BlockStore([STORE_DIR], pool, namespace="shared", capacity_bytes=1 << 30)
    s = pool.acquire()
    for i in range(10):
        with pool.view(s) as v:
            v[:4] = i.to_bytes(4, "little")
        assert store.put(b"from-child-%d" % i, s, 4).wait(10).ok
    print(json.dumps({"n": len(store)}))
    """
    assert run_child(code, store_dir)["result"]["n"] == 10
    s = pool.acquire()
    # Not in this process's index yet, but on disk: a get finds and verifies it.
    assert not store.contains(b"from-child-3")
    assert store.get(b"from-child-3", s).wait(10).ok
    with pool.view(s) as v:
        assert int.from_bytes(v[:4], "little") == 3
    assert store.rescan() == 10 and store.contains(b"from-child-9")


def test_probe_finds_chunks_published_by_another_process(store_dir):
    pool = kv.StagingPool(1 << 20, 1)
    store = kv.BlockStore([str(store_dir)], pool, namespace="probe", capacity_bytes=1 << 30)
    code = """
    import pykvcache as kv
    pool = kv.StagingPool(1 << 20, 1)
    store = kv.BlockStore([STORE_DIR], pool, namespace="probe", capacity_bytes=1 << 30)
    s = pool.acquire()
    assert store.put(b"late", s, 4096).wait(10).ok
    print(json.dumps({"ok": True}))
    """
    assert not store.probe(b"late")
    run_child(code, store_dir)
    assert not store.contains(b"late"), "the index alone does not know it yet"
    assert store.probe(b"late") and store.contains(b"late")
    assert store.used_bytes == 4096 + 4096
    assert not store.probe(b"never-written")
