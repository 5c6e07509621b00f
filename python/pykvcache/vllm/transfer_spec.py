"""What the scheduler tells a worker about the staging side of a transfer."""

from __future__ import annotations

from vllm.v1.kv_offload.base import BlockIDsLoadStoreSpec


class StagingSlotsSpec(BlockIDsLoadStoreSpec):
    """Staging slots, one per chunk key, in the order of the keys the connector
    passed to ``prepare_load``/``prepare_store`` (group-major, prefix order).
    ``block_ids`` holds the slot numbers."""

    @property
    def slots(self):
        return self.block_ids
