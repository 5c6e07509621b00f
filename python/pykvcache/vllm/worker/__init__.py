"""What runs in each of vLLM's worker processes (one per rank).

:class:`~.staging_worker.StagingWorker` copies KV pages between the device
cache and the staging slots (:mod:`.cuda_copy` on a GPU, :mod:`.cpu_copy` on
the CPU platform, both laid out by :mod:`.slot_map`), and polls the loads whose
disk reads the scheduler still has in flight (:mod:`.pending_loads`). No disk
I/O happens here. Nothing here is imported by :mod:`pykvcache.vllm.scheduler`.
"""
