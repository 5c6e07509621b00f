"""What runs in vLLM's scheduler process (the EngineCore).

The spec's manager (:mod:`.manager`, and :mod:`.adapter_keys` for LoRA), the
lookahead preloader and the waiting queue it reads, the staging cache of chunks
read ahead, the break-even gate's per-request plan and the engine steps it
times, and the disk tier that both ways into vLLM share (:mod:`.disk_tier`:
the standalone manager here and :mod:`pykvcache.vllm.tier` for vLLM's tiering
framework). Nothing here is imported by :mod:`pykvcache.vllm.worker`.
"""
