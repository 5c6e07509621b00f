"""What the scheduler tells a worker about the staging side of a transfer."""

from __future__ import annotations

import numpy as np
from vllm.v1.kv_offload.base import BlockIDsLoadStoreSpec


class StagingSlotsSpec(BlockIDsLoadStoreSpec):
    """Staging slots, one per chunk key, in the order of the keys the connector
    passed to ``prepare_load``/``prepare_store`` (group-major, prefix order).
    ``block_ids`` holds the slot numbers.

    A load of chunks whose reads were still in flight at ``prepare_load``
    (decision 0055) also carries ``ready_generations``, one per slot: 0 = the
    bytes were verified already, > 0 = wait for that generation of the slot's
    ready word to be settled ready, -1 = the read failed already. ``wait_s``
    bounds the time without a read ending (the store's ``io_verdict_bound_s``:
    by then the scheduler's engine has settled every read it started, so the
    bound only fires if that process stopped answering). Without them (None)
    every slot was verified when the load was prepared.
    """

    def __init__(self, block_ids: list[int], ready_generations: list[int] | None = None, wait_s: float | None = None) -> None:
        super().__init__(block_ids)
        self.ready_generations = ready_generations
        self.wait_s = wait_s

    @property
    def slots(self) -> np.ndarray:
        return self.block_ids
