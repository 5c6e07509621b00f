"""The memory part's measuring side: /proc sampling of a real process tree,
attribution of processes to runs and roles, and the bound it checks.

The full part (two vLLM engines, ~1.5 minutes) runs in ``pykvcache bench``;
here real processes map real shared and private memory, so the sampler's
numbers can be checked against what was allocated.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
from pykvcache.tools.bench.config import BenchConfig, MiB
from pykvcache.tools.bench.memory_part import OVERHEAD_CONSTANT, analyse, peaks
from pykvcache.tools.proc_memory import MemSample, ProcInfo, TreeSampler, descendants, read_memory

SHARED = 48 * MiB
PRIVATE = 24 * MiB

# The child maps the parent's shared-memory file and touches every page.
CHILD = f"""
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
m = mmap.mmap(fd, {SHARED}, mmap.MAP_SHARED)
total = sum(m[i] for i in range(0, {SHARED}, 4096))
print("child ready", flush=True)
sys.stdin.read()
"""
# The parent maps a shared-memory file and private memory, touches both, then
# starts the child. Both wait for stdin to close.
TREE = f"""
import mmap, os, subprocess, sys
name = "/dev/shm/pykvcache-memtest-%d" % os.getpid()
fd = os.open(name, os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, {SHARED})
shared = mmap.mmap(fd, {SHARED}, mmap.MAP_SHARED)
shared.write(b"x" * {SHARED})
private = bytearray(b"y" * {PRIVATE})
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
child.stdout.readline()
os.unlink(name)
print("ready", flush=True)
sys.stdin.read()
child.stdin.close()
child.wait()
"""


@pytest.fixture
def tree():
    proc = subprocess.Popen([sys.executable, "-c", TREE, CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    yield proc
    proc.stdin.close()
    proc.wait(timeout=30)


def test_sampler_finds_the_tree_and_counts_shared_memory_once_in_pss(tree):
    sampler = TreeSampler(tree.pid)
    sampler.sample_once()
    sampler.sample_once()
    depths = {info.depth for info in sampler.procs.values()}
    assert depths == {0, 1}, sampler.procs
    child = next(p for p, info in sampler.procs.items() if info.depth == 1)
    assert set(descendants(tree.pid)) == {tree.pid, child}
    last = {s.pid: s for s in sampler.samples if s.sweep == 2}
    root, kid = last[tree.pid], last[child]
    # RSS counts the shared mapping in both processes...
    assert root.shmem >= SHARED and kid.shmem >= SHARED
    assert root.anon >= PRIVATE and kid.anon < PRIVATE
    assert root.hwm >= root.rss
    # ... PSS splits it between them: the sum counts it once.
    if root.pss_shmem is None:
        pytest.skip("this kernel's smaps_rollup has no Pss_Shmem")
    assert SHARED * 0.95 <= root.pss_shmem + kid.pss_shmem <= SHARED * 1.05


def test_sampler_thread_collects_until_stopped(tree):
    with TreeSampler(tree.pid, interval=0.05) as sampler:
        time.sleep(0.4)
    sweeps = {s.sweep for s in sampler.samples}
    assert len(sweeps) >= 3
    assert read_memory(2**22 + 12345) is None  # no such process: nothing, no error


def _s(pid: int, sweep: int, rss: int, hwm: int, shmem: int = 0, pss: int | None = None) -> MemSample:
    return MemSample(t=0.0, pid=pid, sweep=sweep, rss=rss, hwm=hwm, anon=rss - shmem, shmem=shmem, pss=pss if pss is not None else rss)


def test_peaks_use_the_kernel_high_water_mark_and_attribute_by_run_and_depth():
    procs = {
        1: ProcInfo(1, 0, 0, "python -m pykvcache.tools.vllm_run s.json", 0.0),
        2: ProcInfo(2, 1, 1, "python -c from multiprocessing.resource_tracker import main", 1.0),
        3: ProcInfo(3, 1, 1, "python -c from multiprocessing.spawn import spawn_main", 1.5),
        4: ProcInfo(4, 3, 2, "python -c from multiprocessing.spawn import spawn_main", 2.0),
        5: ProcInfo(5, 1, 1, "python -c from multiprocessing.spawn import spawn_main", 11.0),  # the next run's
    }
    samples = [
        _s(1, 1, 900, 900), _s(2, 1, 10, 10), _s(3, 1, 500, 700), _s(4, 1, 300, 350, shmem=40),
        _s(3, 2, 600, 700), _s(4, 2, 320, 360, shmem=40), _s(5, 3, 5000, 5000),
    ]  # fmt: skip
    p = peaks(samples, procs, t0=0.5, t1=10.0)
    assert set(p["pids"]) == {"3", "4"}  # not the driver, the tracker or the next run's process
    assert p["roles"]["engine_core"]["hwm"] == 700  # VmHWM, above every sampled RSS
    assert p["roles"]["worker"]["hwm"] == 360
    assert p["roles"]["worker"]["shmem"] == 40
    assert p["total_hwm"] == 1060
    assert p["total_rss"] == 920  # the largest sum within one sampling pass
    assert p["total_pss"] == 920


def _mem(core_hwm: int, worker_hwm: int, pss: int) -> dict:
    role = {"processes": 1, "anon": 0, "shmem": 0, "pss": 0}
    return {
        "roles": {"engine_core": {**role, "hwm": core_hwm}, "worker": {**role, "hwm": worker_hwm}},
        "total_pss": pss,
        "total_hwm": core_hwm + worker_hwm,
    }


def _result(read_bytes: float, same_tokens: bool = True) -> dict:
    def run(name: str, tokens: list) -> dict:
        return {
            "name": name,
            "startup_s": 1.0,
            "phases": [
                {"op": "generate", "name": "store", "tokens": [[1]], "metrics": {}},
                {"op": "generate", "name": "reuse", "tokens": tokens, "prompt_lens": [1000] * 16,
                 "num_cached_tokens": [0] * 16,
                 "metrics": {"vllm:pykvcache_disk_read_bytes": read_bytes, "vllm:pykvcache_disk_write_bytes": 200 * MiB}},
            ],
        }  # fmt: skip

    return {"runs": [run("without", [[2]]), run("with", [[2]] if same_tokens else [[3]])]}


@pytest.mark.parametrize(
    ("growth", "met"),
    [(32 * MiB + OVERHEAD_CONSTANT - MiB, True), (32 * MiB + OVERHEAD_CONSTANT + MiB, False)],
)
def test_bound_is_staging_budget_plus_the_stated_constant(tmp_path, growth, met):
    cfg = BenchConfig(out=tmp_path, directory=tmp_path, memory_staging_bytes=32 * MiB)
    base = _mem(800 * MiB, 1100 * MiB, 1500 * MiB)
    grown = _mem(800 * MiB + growth, 1100 * MiB + 10 * MiB, 1500 * MiB + growth)
    out = analyse(_result(50 * MiB), {"without": base, "with": grown}, cfg)
    verdicts = {name.split(" <=")[0]: ok for name, (ok, _) in out.targets.items()}
    assert verdicts["peak RSS of each serving process"] is met
    assert verdicts["combined PSS of the serving processes"] is met
    assert out.tables[0].rows[0][3] == f"{growth / MiB:+.0f}"


def test_targets_fail_when_the_disk_tier_was_idle_or_tokens_differ(tmp_path):
    cfg = BenchConfig(out=tmp_path, directory=tmp_path, memory_staging_bytes=32 * MiB)
    same = _mem(800 * MiB, 1100 * MiB, 1500 * MiB)
    out = analyse(_result(0, same_tokens=False), {"without": same, "with": same}, cfg)
    verdicts = {name: ok for name, (ok, _) in out.targets.items()}
    assert verdicts["tokens identical with and without pykvcache"] is False
    assert [ok for name, ok in verdicts.items() if name.startswith("the load went through the disk tier")] == [False]


def test_part_skips_with_a_reason_where_vllm_is_missing(tmp_path):
    # A child interpreter in which `import vllm` fails, as on a machine without it.
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["vllm"] = None
        from pathlib import Path
        from pykvcache.tools.bench.config import BenchConfig
        from pykvcache.tools.bench.parts import BenchContext, NoProgress
        from pykvcache.tools.bench.memory_part import run
        cfg = BenchConfig(out=Path({str(tmp_path)!r}), directory=Path({str(tmp_path)!r}))
        out = run(BenchContext(cfg, None, None, NoProgress()))
        print("SKIPPED", out.skipped)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "SKIPPED vLLM is not installed" in proc.stdout


def test_roles_follow_vllm_process_titles_before_tree_depth():
    from pykvcache.tools.bench.memory_part import role

    assert role(ProcInfo(9, 1, 1, "VLLM::Worker_TP0", 0.0)) == "worker"
    assert role(ProcInfo(9, 1, 2, "VLLM::EngineCore", 0.0)) == "engine_core"
    assert role(ProcInfo(9, 1, 2, "python -c from multiprocessing.spawn import spawn_main", 0.0)) == "worker"
    assert role(ProcInfo(9, 1, 0, "VLLM::EngineCore", 0.0)) is None  # the driver itself
