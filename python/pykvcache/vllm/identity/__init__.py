"""What the chunks of an engine are keyed by.

A full digest of the model's weight files (:mod:`.model_identity`,
:mod:`.weights_digest`), cached per node by file state (:mod:`.digest_cache`),
checked to be the files vLLM loaded (:mod:`.loaded_weights`), and the namespace
fingerprint built from it and the KV layout (:mod:`.namespace`). Computed in
the scheduler process, at start; imports nothing else of :mod:`pykvcache.vllm`.
"""
