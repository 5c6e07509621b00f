"""Micro-benchmark of decision 0057's first step: a load whose chunks are all
being read (HIT for reads in flight, decision 0055) copies each chunk into the
KV pages as its read ends, instead of after the last read.

Engine-free, as vLLM wires it: pykvcache's manager (scheduler side) and its
real worker (CPU platform copier) on one memfd staging region, the store on a
fresh directory (O_DIRECT where the filesystem allows it). `--chunks` chunks
of `--chunk-mib` are stored once; each round, in alternating order:

* ``as_reads_end`` / ``after_all_reads``: every chunk dropped from staging (on
  disk only), then the lookups (the reads start), ``prepare_load``, the
  worker's ``submit_load`` and its ``get_finished`` polled back to back (as
  vLLM's steps poll it, decision 0065): seconds from the first lookup until
  the load is reported with every page copied, with the copy pipelined and
  without;
* ``copy_only``: the same load with every chunk still verified in staging
  (no read): what the copy alone costs.

Prints a JSON summary (medians, ratios).

    PYTHONPATH=python .venv/bin/python scripts/pipelined_copy_bench.py --rounds 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from vllm.v1.kv_offload import base

from pykvcache import BlockStore, StagingPool
from pykvcache.vllm.layout import ChunkLayout
from pykvcache.vllm.manager import NvmeOffloadingManager
from pykvcache.vllm.worker import StagingWorker

MiB = 1 << 20


def _gpu(blocks):
    return base.GPULoadStoreSpec(blocks, group_sizes=[len(blocks)], block_indices=[0])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None, help="parent of the store directory (default: the system's temp dir)")
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--chunk-mib", type=int, default=2)
    ap.add_argument("--blocks-per-chunk", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()

    bpc, n = args.blocks_per_chunk, args.chunks
    page = args.chunk_mib * MiB // (2 * bpc)  # two tensors (K, V): one page each per block
    layout = ChunkLayout(bpc, bytes_per_block=2 * page, world_size=1)
    num_blocks = 2 * n * bpc + 1
    tensors = [base.CanonicalKVCacheTensor(tensor=torch.randint(-128, 127, (num_blocks, page), dtype=torch.int8),
                                           page_size_bytes=page) for _ in range(2)]
    refs = [[base.CanonicalKVCacheRef(tensor_idx=t, page_size_bytes=page) for t in (0, 1)]]
    kv = base.CanonicalKVCaches(tensors=tensors, group_data_refs=refs)
    src = list(range(1, n * bpc + 1))
    dst = list(range(n * bpc + 1, 2 * n * bpc + 1))
    keys = [(11).to_bytes(32, "big") + i.to_bytes(4, "big") for i in range(n)]

    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        name = f"pykvcache-bench-pipelined-{os.getpid()}"
        pool = StagingPool(layout.payload_bytes, n + 2, shm_name=name, memfd=True)
        store = BlockStore([directory], pool, namespace="pipelined", capacity_bytes=1 << 40)
        manager = NvmeOffloadingManager(pool=pool, store=store, layout=layout)
        manager.enable_in_flight_hits()
        worker = StagingWorker(kv, layout, name, rank=0)
        writer = base.ReqContext(req_id="writer")
        out = manager.prepare_store(keys, writer)
        assert worker.submit_store(1, _gpu(src), out.store_spec)
        worker.get_finished()
        manager.complete_store(out.keys_to_store, writer)
        manager.flush(timeout=120)
        expected = [t.tensor[1:n * bpc + 1].clone() for t in kv.tensors]

        def load(job: int, from_disk: bool, pipelined: bool) -> float:
            if from_disk:
                for key in keys:
                    manager.cache.remove(key)
            for t in kv.tensors:
                t.tensor[n * bpc + 1:] = 0
            worker.copy_as_reads_end = pipelined
            ctx = base.ReqContext(req_id=f"r{job}")
            start = time.perf_counter()
            assert all(manager.lookup(k, ctx) is base.LookupResult.HIT for k in keys)
            spec = manager.prepare_load(keys, ctx)
            assert worker.submit_load(job, spec, _gpu(dst))
            # Polled as vLLM's steps do (decision 0065), here without compute between polls.
            while not worker.get_finished():
                time.sleep(0.0002)
            took = time.perf_counter() - start
            assert worker.take_failed_loads() == set()
            manager.poll_io()
            manager.complete_load(keys, ctx)
            for t, want in zip(kv.tensors, expected):
                assert torch.equal(t.tensor[n * bpc + 1:], want), "wrong bytes loaded"
            return took

        modes = {"as_reads_end": (True, True), "after_all_reads": (True, False), "copy_only": (False, True)}
        times: dict[str, list[float]] = {m: [] for m in modes}
        job = 10
        for r in range(args.rounds):
            order = list(modes) if r % 2 == 0 else list(reversed(modes))
            for mode in order:
                job += 1
                times[mode].append(load(job, *modes[mode]))
        worker.shutdown()
        manager.shutdown()

    med = {m: statistics.median(v) for m, v in times.items()}
    summary = {
        "chunks": n, "chunk_bytes": layout.payload_bytes, "rounds": args.rounds,
        "direct_io": store.direct_io if hasattr(store, "direct_io") else None,
        "median_ms": {m: round(v * 1e3, 2) for m, v in med.items()},
        "after_all_reads_over_as_reads_end": round(med["after_all_reads"] / med["as_reads_end"], 3),
        "copy_share_of_after_all_reads": round(med["copy_only"] / med["after_all_reads"], 3),
        "all_ms": {m: [round(x * 1e3, 1) for x in v] for m, v in times.items()},
    }
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
