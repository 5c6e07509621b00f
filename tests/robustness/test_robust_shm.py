"""Shared staging memory: never left behind, never a SIGBUS.

* A named ``/dev/shm`` pool larger than the free space of /dev/shm (Docker's
  ``--shm-size``) fails at creation with one error, in a private mount
  namespace with an 8 MiB tmpfs on /dev/shm; before, creation succeeded
  (tmpfs files are sparse) and the first write to a slot past the free space
  killed the process with SIGBUS.
* vLLM's staging region is a memfd: it does not use /dev/shm at all (so a
  small /dev/shm does not limit it), it is gone when the process that created
  it dies, however it dies, and a size memory cannot hold is one ConfigError
  naming ``staging_bytes``.

The vLLM-level checks build ``NvmeOffloadingSpec`` from a real
``OffloadingConfig`` (no engine): that is what vLLM's scheduler does in
``get_manager``. Engine start/stop cycles are in tests/e2e/test_vllm_shutdown.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from proc_fds import fd_links

REPO_PY = str(Path(__file__).resolve().parents[2] / "python")
CHILDREN = str(Path(__file__).resolve().parents[1] / "children")  # offloading_configs

needs_unshare = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and unshare(1) for a private mount namespace",
)


def _run_py(code: str, *, small_shm_mib: int | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter, optionally in a private mount
    namespace where /dev/shm is a tmpfs of ``small_shm_mib`` MiB (the
    namespace and its mount vanish with the process)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO_PY, CHILDREN, os.environ.get("PYTHONPATH", "")]), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-c", textwrap.dedent(code)]
    if small_shm_mib is not None:
        script = f'mount -t tmpfs -o size={small_shm_mib}m tmpfs /dev/shm && exec "$@"'
        cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def _result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, (
        f"rc={proc.returncode} ({'SIGBUS' if proc.returncode == -signal.SIGBUS else 'error'})\n{proc.stdout}\n{proc.stderr[-4000:]}"
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout + proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


@needs_unshare
def test_named_pool_larger_than_dev_shm_is_an_error_not_a_sigbus():
    result = _result(
        _run_py(
            """
        import json, os
        from pykvcache._core import StagingPool, StoreError
        MiB = 1 << 20
        out = {}
        # Fits: reserved in full at creation (the free space drops by its size).
        before = os.statvfs("/dev/shm")
        small = StagingPool(MiB, 4, shm_name="pykvcache-test-fits")
        after = os.statvfs("/dev/shm")
        out["reserved"] = (before.f_bavail - after.f_bavail) * after.f_frsize
        out["fits_total"] = small.total_bytes
        small.close()
        try:
            pool = StagingPool(MiB, 16, shm_name="pykvcache-test-big")
        except StoreError as exc:
            out["error"] = str(exc)
            out["errno"] = exc.errno
        else:
            # Before the fix: created sparse; writing every slot faults (SIGBUS).
            for slot in range(pool.num_slots):
                s = pool.acquire()
                view = pool.view(s)
                view[:] = b"x" * len(view)
                view.release()
                pool.release(s)
            out["error"] = None
        out["left"] = sorted(os.listdir("/dev/shm"))
        print("RESULT " + json.dumps(out))
    """,
            small_shm_mib=8,
        )
    )
    assert result["reserved"] >= result["fits_total"] - 4096
    msg = result["error"]
    assert msg is not None, "a 16 MiB pool on an 8 MiB /dev/shm was created"
    assert result["errno"] == 28  # ENOSPC
    for fragment in ("16.", "MiB", "free on /dev/shm", "--shm-size", "--ipc=host", "smaller staging pool"):
        assert fragment in msg, (fragment, msg)
    assert result["left"] == [], "a failed creation leaves nothing in /dev/shm"


SPEC_SNIPPET = """
    import json, os, sys
    from offloading_configs import tiny_offloading_config
    from pykvcache.vllm.spec import NvmeOffloadingSpec

    def spec(store, staging_bytes, bytes_per_block=65536):
        # register_buffers off: pinning a region bigger than memory (what an
        # unreserved, sparse region let through) would wake the OOM killer.
        extra = {"storage_dirs": [store], "capacity_bytes": 64 << 20,
                 "staging_bytes": staging_bytes, "register_buffers": False}
        config = tiny_offloading_config(extra, engine_id="shm-test-%d" % os.getpid(),
                                        bytes_per_block=bytes_per_block)
        return NvmeOffloadingSpec(config)

    def memfds():
        found = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                link = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if link.startswith("/memfd:pykvcache-"):
                found.append(link)
        return found
"""


def _memfd_holders(prefix: str = "/memfd:pykvcache-shm-test-") -> list[str]:
    """Every ``/proc/<pid>/fd`` entry on this host that is a test's staging memfd."""
    return [f"{pid}/{fd}" for pid, fd, _ in fd_links(prefix)]


@needs_unshare
def test_vllm_staging_is_a_memfd_a_small_dev_shm_does_not_limit(tmp_path):
    """16 MiB of staging with an 8 MiB /dev/shm (Docker's default is 64 MiB,
    vLLM's default staging 1 GiB): every slot is written, nothing appears in
    /dev/shm, and a worker process (a child, as vLLM's are) maps the same bytes."""
    result = _result(
        _run_py(
            SPEC_SNIPPET
            + f"""
    import subprocess
    s = spec({str(tmp_path / "kv")!r}, 16 << 20)
    manager = s.get_manager()
    pool = manager.pool
    region = pool.region()
    for slot in range(pool.num_slots):
        off = pool.payload_offset(slot)
        region[off:off + pool.slot_bytes] = bytes([slot % 251]) * pool.slot_bytes
    region.release()
    child_code = ("from pykvcache._core import StagingPool\\n"
                  "p = StagingPool.attach_memfd(%r)\\n"
                  "r = p.region()\\n"
                  "print(sum(r[p.payload_offset(s)] == s %% 251 for s in range(p.num_slots)))\\n"
                  % s.shm_name)
    child = subprocess.run([sys.executable, "-c", child_code], capture_output=True, text=True)
    out = {{"slots": pool.num_slots, "is_memfd": pool.is_memfd, "total": pool.total_bytes,
            "dev_shm": sorted(os.listdir("/dev/shm")), "memfds": memfds(),
            "child": child.stdout.strip(), "child_err": child.stderr[-2000:]}}
    manager.shutdown()
    print("RESULT " + json.dumps(out))
    """,
            small_shm_mib=8,
        )
    )
    assert result["total"] > 8 << 20
    assert result["is_memfd"] and result["dev_shm"] == []
    assert len(result["memfds"]) == 1
    assert result["child"] == str(result["slots"]), result["child_err"]


def test_vllm_staging_beyond_free_memory_is_one_config_error(tmp_path):
    """staging_bytes twice the machine's memory: refused with the settings' other problems
    (when the spec reads them, before the model loads) in a ConfigError naming the key, the size
    and the host's memory, before a page is allocated (allocating it would wake the OOM killer)."""
    mem_total = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemTotal:"))
    staging = 2 * mem_total
    block = max(65536, staging // 4000 // 2 // 4096 * 4096)  # ~4000 slots
    result = _result(
        _run_py(
            SPEC_SNIPPET
            + f"""
    from pykvcache.vllm.config import ConfigError
    try:
        s = spec({str(tmp_path / "kv")!r}, {staging}, bytes_per_block={block})
        s.get_manager()
    except ConfigError as exc:
        out = {{"error": str(exc)}}
    else:
        out = {{"error": None, "dev_shm": os.path.exists("/dev/shm/" + s.shm_name)}}
        if out["dev_shm"]:
            os.unlink("/dev/shm/" + s.shm_name)
    out["memfds"] = memfds()
    print("RESULT " + json.dumps(out))
    """
        )
    )
    msg = result["error"]
    assert msg is not None, f"staging_bytes={staging} was accepted"
    for fragment in (f"staging_bytes ({staging} bytes", "GiB", "more than this host's memory"):
        assert fragment in msg, (fragment, msg)
    assert result["memfds"] == []


def test_failed_start_up_after_the_manager_is_created_leaves_nothing(tmp_path):
    """The EngineCore fails after get_manager (here: an exception right after
    it) and exits the way a forked multiprocessing child does, os._exit, with
    no destructor run: /dev/shm is as before and no process holds the region."""
    before = sorted(os.listdir("/dev/shm"))
    proc = _run_py(
        SPEC_SNIPPET
        + f"""
    import multiprocessing

    def engine_core():
        s = spec({str(tmp_path / "kv")!r}, 8 << 20)
        s.get_manager()
        print("HELD " + json.dumps(memfds()), flush=True)
        raise RuntimeError("start-up fails after the manager exists")

    p = multiprocessing.get_context("fork").Process(target=engine_core)
    p.start()
    p.join()
    print("RESULT " + json.dumps({{"exitcode": p.exitcode}}))
    """
    )
    result = _result(proc)
    assert result["exitcode"] == 1
    leaked = sorted(set(os.listdir("/dev/shm")) - set(before))
    for name in leaked:  # leave the machine clean even when the test fails
        if name.startswith("pykvcache-shm-test-"):
            os.unlink(f"/dev/shm/{name}")
    # This test's names only: other tests (another xdist worker) create and remove theirs meanwhile.
    assert [n for n in leaked if n.startswith("pykvcache-shm-test-")] == []
    assert _memfd_holders() == []
    held = [line for line in proc.stdout.splitlines() if line.startswith("HELD ")]
    assert held and len(json.loads(held[0][5:])) == 1, "the region existed while the manager did"
