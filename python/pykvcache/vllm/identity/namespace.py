"""Namespace fingerprint: chunks written under one configuration are never read
under another.

The fingerprint covers everything that changes the bytes of a chunk or their
meaning: the model's identity (its resolved configuration and a content digest
of its weights, :mod:`pykvcache.vllm.identity.model_identity`), the KV dtype and layout, the token span of a
block, a hash block and a chunk, how KV is split over workers (one chunk file
holds one row per worker rank, so the world/TP/PP sizes are part of it but a
single rank is not), the bytes per block, pykvcache's row layout and the
on-disk format version. The Rust core puts the namespace in the directory path
and in every chunk header, and refuses a chunk whose header disagrees.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

#: Version of the slot layout this package writes (rows per rank, refs in a
#: row, sub-blocks per ref). Bump on any change to :mod:`pykvcache.vllm.layout`.
ROW_LAYOUT_VERSION = 1

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")

#: Row layout of the parallelism-agnostic (canonical, shared-row) chunks.
CANONICAL_ROW_LAYOUT = "canonical-shared-row-v1"


@dataclass(frozen=True)
class NamespaceInputs:
    """What the fingerprint is computed from (built from vLLM's OffloadingConfig)."""

    model: str
    dtype: str
    kv_cache_layout: str | None
    canonical_layout: bool
    replicated_layout: bool
    groups: tuple[tuple[int, int, tuple[str, ...]], ...]  # (group_id, tokens_per_block, layers)
    tokens_per_hash: int
    blocks_per_chunk: int
    bytes_per_block: int
    world_size: int
    tp_size: int
    pp_size: int
    pcp_size: int
    dcp_size: int
    format_version: int
    #: An int for the spec's rows; a name for other layouts (the tiering tier's chunks).
    row_layout_version: int | str = ROW_LAYOUT_VERSION
    salt: str = ""
    #: sha256 of :func:`pykvcache.vllm.identity.model_identity.model_identity` ("" = not computed).
    model_identity: str = ""

    def parallelism_agnostic(self, canonical_bytes_per_block: int) -> NamespaceInputs:
        """The same inputs with the parallel sizes left out (chunks in the
        canonical layout are identical at any TP size) and the canonical block
        size in: engines at TP=1 and TP=2 share this namespace."""
        return _parallelism_agnostic(self, canonical_bytes_per_block)

    @classmethod
    def from_offloading_config(
        cls,
        config: Any,
        *,
        format_version: int,
        model_id: str | None = None,
        salt: str = "",
        model_identity: str = "",
    ) -> NamespaceInputs:
        par = config.parallel
        return cls(
            # The directory name, not the path: nodes that share a store keep
            # their own copies of the weights in different places, and the
            # weights' content is in model_identity.
            model=model_id or model_label(config.model.name),
            dtype=str(config.model.dtype),
            kv_cache_layout=getattr(config, "kv_cache_layout", None),
            canonical_layout=bool(getattr(config, "canonical_layout", False)),
            replicated_layout=bool(getattr(config, "replicated_layout", False)),
            groups=tuple((g.group_id, g.tokens_per_block, tuple(g.layer_names)) for g in config.groups),
            tokens_per_hash=config.cache.tokens_per_hash,
            blocks_per_chunk=config.cache.blocks_per_chunk,
            bytes_per_block=config.worker_kv_bytes_per_block,
            world_size=par.world_size,
            tp_size=par.tp_size,
            pp_size=par.pp_size,
            pcp_size=par.pcp_size,
            dcp_size=par.dcp_size,
            format_version=format_version,
            salt=salt,
            model_identity=model_identity,
        )


def _parallelism_agnostic(inputs: NamespaceInputs, canonical_bytes_per_block: int) -> NamespaceInputs:
    return dataclasses.replace(
        inputs,
        world_size=0,
        tp_size=0,
        pp_size=0,
        pcp_size=0,
        dcp_size=0,
        bytes_per_block=canonical_bytes_per_block,
        row_layout_version=CANONICAL_ROW_LAYOUT,
    )


def model_label(model: str) -> str:
    """The last path component of a model path or hub id."""
    return model.rstrip("/").rsplit("/", 1)[-1] or model


def identity_digest(identity: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


def namespace_for(inputs: NamespaceInputs) -> str:
    """A short, path-safe, human-readable namespace: ``<model>-<dtype>-<digest>``."""
    blob = json.dumps(inputs.__dict__, sort_keys=True, default=list)
    digest = hashlib.sha256(blob.encode()).hexdigest()[:24]
    model = inputs.model.rstrip("/").rsplit("/", 1)[-1] or "model"
    label = _SAFE.sub("_", f"{model}-{inputs.dtype}")[:40].strip("._-") or "ns"
    return f"{label}-{digest}"
