"""Worker copies between KV pages and staging slots (no vLLM process).

Uses vLLM's own transfer-spec and KV-cache description classes and a real
named staging pool the worker attaches to, as in a vLLM worker process.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
base = pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM is not installed")

from pykvcache import StagingPool  # noqa: E402
from pykvcache.vllm.layout import ChunkLayout  # noqa: E402
from pykvcache.vllm.transfer_spec import StagingSlotsSpec  # noqa: E402
from pykvcache.vllm.worker.slot_map import SlotMap  # noqa: E402
from pykvcache.vllm.worker.staging_worker import StagingWorker  # noqa: E402

NUM_BLOCKS = 16
PAGE = 256
BPC = 2


def _kv_caches(num_tensors=2, groups=((0, 1),), pad=0):
    tensors = []
    for _ in range(num_tensors):
        storage = torch.zeros(NUM_BLOCKS, PAGE + pad, dtype=torch.int8)
        tensors.append(base.CanonicalKVCacheTensor(tensor=storage, page_size_bytes=PAGE + pad))
    refs = [[base.CanonicalKVCacheRef(tensor_idx=t, page_size_bytes=PAGE) for t in g] for g in groups]
    return base.CanonicalKVCaches(tensors=tensors, group_data_refs=refs)


def _fill(kv, seed):
    gen = torch.Generator().manual_seed(seed)
    for t in kv.tensors:
        t.tensor.copy_(torch.randint(-128, 127, t.tensor.shape, dtype=torch.int8, generator=gen))


@pytest.fixture(autouse=True, params=["vectorised", "per_page"])
def copy_path(request, monkeypatch):
    """Every copy test through both of the CPU copier's paths (pages below
    ``PAGE_LOOP_MIN_BYTES`` are gathered at once, larger ones copied one by one)."""
    import pykvcache.vllm.worker.cpu_copy as cpu_copy

    monkeypatch.setattr(cpu_copy, "PAGE_LOOP_MIN_BYTES", 1 << 40 if request.param == "vectorised" else 0)
    return request.param


@pytest.fixture
def shm_name():
    name = f"pykvcache-test-{os.getpid()}"
    yield name


def _pool(layout, shm_name, slots=8):
    # As the spec creates it: a memfd the worker finds through /proc.
    return StagingPool(layout.payload_bytes, slots, shm_name=shm_name, memfd=True)


def test_store_then_load_mid_chunk_roundtrip(shm_name):
    kv = _kv_caches()
    _fill(kv, 1)
    layout = ChunkLayout(BPC, bytes_per_block=2 * PAGE, world_size=1)
    pool = _pool(layout, shm_name)
    try:
        worker = StagingWorker(kv, layout, shm_name, rank=0)
        # Store chunks (blocks 3,4) and (5,6) into slots 5 and 2.
        src = base.GPULoadStoreSpec([3, 4, 5, 6], group_sizes=[4], block_indices=[0])
        assert worker.submit_store(7, src, StagingSlotsSpec([5, 2]))
        original = [t.tensor.clone() for t in kv.tensors]
        for t in kv.tensors:
            t.tensor.zero_()
        # Load starting at the second block of the first chunk (block index 1),
        # i.e. blocks 4, 5, 6 of the original into blocks 10, 11, 12.
        dst = base.GPULoadStoreSpec([10, 11, 12], group_sizes=[3], block_indices=[1])
        assert worker.submit_load(8, StagingSlotsSpec([5, 2]), dst, expedited=True)
        done = {r.job_id: r for r in worker.get_finished()}
        assert set(done) == {7, 8} and all(r.success for r in done.values())
        assert done[7].transfer_size == 4 * 2 * PAGE and done[8].transfer_size == 3 * 2 * PAGE
        for t, orig in zip(kv.tensors, original):
            assert torch.equal(t.tensor[10:13], orig[4:7])
            assert not t.tensor[13].any() and not t.tensor[9].any()
        # Slot layout: refs one after the other, each with BPC sub-blocks.
        region = pool.region()
        off = pool.payload_offset(5)
        assert bytes(region[off : off + PAGE]) == original[0][3].numpy().tobytes()
        assert bytes(region[off + PAGE : off + 2 * PAGE]) == original[0][4].numpy().tobytes()
        assert bytes(region[off + 2 * PAGE : off + 3 * PAGE]) == original[1][3].numpy().tobytes()
        region.release()
        worker.shutdown()
        del worker
    finally:
        import gc

        gc.collect()
        pool.close()


def test_each_rank_writes_only_its_own_row(shm_name):
    layout = ChunkLayout(BPC, bytes_per_block=2 * PAGE, world_size=2)
    pool = _pool(layout, shm_name)
    try:
        kv0, kv1 = _kv_caches(), _kv_caches()
        _fill(kv0, 2)
        _fill(kv1, 3)
        w0 = StagingWorker(kv0, layout, shm_name, rank=0)
        w1 = StagingWorker(kv1, layout, shm_name, rank=1)
        spec = base.GPULoadStoreSpec([1, 2], group_sizes=[1 * 2], block_indices=[0])
        w0.submit_store(1, spec, StagingSlotsSpec([3]))
        w1.submit_store(1, spec, StagingSlotsSpec([3]))
        region = pool.region()
        row0 = pool.payload_offset(3)
        row1 = row0 + layout.row_stride
        assert bytes(region[row0 : row0 + PAGE]) == kv0.tensors[0].tensor[1].numpy().tobytes()
        assert bytes(region[row1 : row1 + PAGE]) == kv1.tensors[0].tensor[1].numpy().tobytes()
        region.release()
        for t in kv1.tensors:
            t.tensor.zero_()
        load = base.GPULoadStoreSpec([5, 6], group_sizes=[2], block_indices=[0])
        w1.submit_load(2, StagingSlotsSpec([3]), load)
        assert torch.equal(kv1.tensors[1].tensor[5], _kv_after_fill(3)[1][1])
        del w0, w1
    finally:
        import gc

        gc.collect()
        pool.close()


def _kv_after_fill(seed):
    kv = _kv_caches()
    _fill(kv, seed)
    return [t.tensor for t in kv.tensors]


def test_several_groups_use_their_own_refs_and_zero_the_row_tail(shm_name):
    # Group 0 has both tensors, group 1 only tensor 1 (a shorter row).
    kv = _kv_caches(groups=((0, 1), (1,)))
    _fill(kv, 4)
    layout = ChunkLayout(BPC, bytes_per_block=2 * PAGE, world_size=1)
    pool = _pool(layout, shm_name)
    try:
        region = pool.region()
        off = pool.payload_offset(1)
        region[off : off + layout.row_stride] = b"\x55" * layout.row_stride  # stale bytes
        region.release()
        worker = StagingWorker(kv, layout, shm_name, rank=0)
        spec = base.GPULoadStoreSpec([2, 3, 4, 5], group_sizes=[2, 2], block_indices=[0, 0])
        worker.submit_store(1, spec, StagingSlotsSpec([0, 1]))
        region = pool.region()
        tail = bytes(region[off + BPC * PAGE : off + layout.row_stride])
        assert tail == bytes(len(tail))
        assert bytes(region[off : off + PAGE]) == kv.tensors[1].tensor[4].numpy().tobytes()
        region.release()
        del worker
    finally:
        import gc

        gc.collect()
        pool.close()


def test_slot_map_rejects_inconsistent_specs():
    kv = _kv_caches()
    layout = ChunkLayout(BPC, bytes_per_block=2 * PAGE, world_size=1)
    smap = SlotMap(kv.group_data_refs, layout)
    spec = base.GPULoadStoreSpec([1, 2, 3], group_sizes=[3], block_indices=[0])
    with pytest.raises(ValueError):
        list(smap.transfers(spec, np.array([0])))  # 3 blocks need 2 slots
    null = base.GPULoadStoreSpec([0, 2], group_sizes=[2], block_indices=[0])
    (part,) = smap.transfers(null, np.array([4]))
    assert list(part.block_ids) == [2] and list(part.sub_blocks) == [1]
    with pytest.raises(ValueError, match="more than"):
        SlotMap(kv.group_data_refs, ChunkLayout(BPC, bytes_per_block=PAGE, world_size=1))
