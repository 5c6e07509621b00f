"""A load's copy into KV pages when the worker's threads share one core.

During a disk hit the scheduler process's threads (reads, checksums, the
engine loop) hold the other core of a 2-core host. torch's ``copy_`` splits
each copy of more than 32 KiB over the worker's OpenMP threads, whose barrier
spins until every thread got a core: an 8 MiB chunk took 30-660 ms instead
of ~1 ms, and a fresh server's first disk hit paid it (decision 0082). The
copier copies each page with one single-threaded memcpy instead.

A child process with two torch threads (the worker's OpenMP pool), then
pinned to one CPU (one core left to run on), loads 64 MiB from a real memfd staging
pool through pykvcache's worker, as its own step would; the copy must run at
memcpy speed and the KV pages must hold the stored bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM is not installed")

CHILD = textwrap.dedent("""
    import json, os, sys, time
    import torch
    torch.set_num_threads(2)
    torch.ones(1 << 22).sum()  # the OpenMP pool's threads run, as after a forward pass
    # Then one core is left to the whole process (the other one is busy elsewhere).
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    from vllm.v1.kv_offload import base
    from pykvcache import StagingPool
    from pykvcache.vllm.layout import ChunkLayout
    from pykvcache.vllm.transfer_spec import StagingSlotsSpec
    from pykvcache.vllm.worker.staging_worker import StagingWorker

    PAGE, BPC, CHUNKS, LAYERS = 256 * 1024, 8, 16, 2   # 16 chunks of 4 MiB: 64 MiB
    blocks = CHUNKS * BPC + 1
    tensors = [base.CanonicalKVCacheTensor(tensor=torch.zeros(blocks, PAGE, dtype=torch.int8),
                                           page_size_bytes=PAGE) for _ in range(LAYERS)]
    refs = [[base.CanonicalKVCacheRef(tensor_idx=t, page_size_bytes=PAGE) for t in range(LAYERS)]]
    kv = base.CanonicalKVCaches(tensors=tensors, group_data_refs=refs)
    gen = torch.Generator().manual_seed(3)
    for t in tensors:
        t.tensor.copy_(torch.randint(-128, 127, t.tensor.shape, dtype=torch.int8, generator=gen))
    layout = ChunkLayout(BPC, bytes_per_block=LAYERS * PAGE, world_size=1)
    name = f"pykvcache-test-onecore-{os.getpid()}"
    pool = StagingPool(layout.payload_bytes, CHUNKS, shm_name=name, memfd=True)
    worker = StagingWorker(kv, layout, name, rank=0)
    slots = StagingSlotsSpec(list(range(CHUNKS)))
    stored = base.GPULoadStoreSpec(list(range(1, blocks)), group_sizes=[blocks - 1], block_indices=[0])
    worker.submit_store(1, stored, slots)
    original = [t.tensor.clone() for t in tensors]
    copier = worker.copier
    seconds, same = [], True
    for _ in range(8):  # torch's copy_ was slow in 1 to 4 loads of 6 (bimodal)
        for t in tensors:
            t.tensor.zero_()
        # The load's chunks were read (verified in staging): one wave of them
        # all, through the path a load with reads in flight takes.
        # CPU time of the whole process: OpenMP threads spinning at a barrier
        # burn it, while time the core spent on other processes (a busy
        # host) does not count.
        began = time.process_time()
        prepared = copier.prepare(stored, slots.block_ids)
        copied = copier.load_wave(prepared, set(range(CHUNKS)))
        seconds.append(time.process_time() - began)
        same = same and all(torch.equal(t.tensor[1:], o[1:]) for t, o in zip(tensors, original))  # block 0: null
    print(json.dumps({"seconds": seconds, "bytes": copied, "same": same}))
""")


def test_a_load_copies_at_memcpy_speed_on_one_core():
    env = dict(os.environ, OMP_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["same"], "the KV pages do not hold the stored bytes"
    assert result["bytes"] == 64 << 20
    # memcpy moves 64 MiB in 24-37 ms here; torch's copy_ over two OpenMP
    # threads sharing the core took 0.04-2.7 s, over 0.25 s in 3 loads of 6
    # (2026-12-06, 2-core VM). Measured in CPU time, so a busy host's
    # preemption (one load took 1.46 s of wall time under CI) does not count.
    slowest = max(result["seconds"])
    assert slowest < 0.4, f"64 MiB copied in {slowest:.2f} s of CPU on one core (each load: {result['seconds']})"
