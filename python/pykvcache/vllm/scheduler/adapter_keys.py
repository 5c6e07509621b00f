"""LoRA adapters keyed by their content, not their name.

vLLM keys the blocks of a request with a LoRA adapter by the adapter's name
and path (extra keys of the block hashes): an adapter retrained and saved
under the same name and path gets the same keys, and after a restart the
disk would serve the old adapter's KV. So the chunk keys of such a request
carry a digest of the adapter's files (every byte, as the weights'
identity: :func:`pykvcache.vllm.identity.model_identity.weights_identity`, cached by
file state in the node's digest cache): ``sha256(block hash, digest)`` in
place of the block hash, the group index kept.

The digest is taken when the scheduler first sees a request with the
adapter, before any worker of this engine has loaded it (vLLM loads an
adapter when a request using it is first scheduled). Each later request,
and each store, checks that the adapter's files are still as digested; once
they are not, this engine cannot know which version its workers hold, and
requests with that adapter neither load nor store chunks until a restart
(one warning). An adapter that cannot be read here (not local) is refused
the same way. An adapter loaded by ``add_lora`` before its first request and
changed in between is not detected (docs/robustness.md).

KV events keep vLLM's keys: stored chunks are announced under the block
hashes vLLM knows (the mapping is kept while events are on).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import secrets
import sys
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from vllm.v1.kv_offload.base import LookupResult, OffloadKey

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import (
        CacheHitSource,
        OffloadingEvent,
        PrepareStoreOutput,
        ReqContext,
        RequestOffloadingContext,
    )

    from pykvcache.vllm.transfer_spec import StagingSlotsSpec

from pykvcache.vllm.identity.digest_cache import same_file_state
from pykvcache.vllm.identity.loaded_weights import DigestedFile
from pykvcache.vllm.scheduler.manager import NvmeOffloadingManager

logger = logging.getLogger("vllm.pykvcache." + __name__.rsplit(".", 1)[-1])

_DOMAIN = b"pykvcache adapter key\0"
#: How far up the stack the scheduler's ``request`` can be from the manager's
#: ``on_new_request`` (vLLM's connector scheduler calls it directly).
_MAX_FRAMES = 6


@dataclass
class _Adapter:
    tag: bytes | None  # the digest; None: refused
    files: tuple[DigestedFile, ...] = ()
    why: str = ""


def _adapter_path(lora: Any) -> str:
    return str(getattr(lora, "lora_path", None) or getattr(lora, "path", "") or "")


def _still_as_digested(files: tuple[DigestedFile, ...]) -> str | None:
    for f in files:
        try:
            now = os.stat(f.path)
        except OSError as exc:
            return f"{f.path.name} cannot be read any more ({exc.strerror})"
        if not same_file_state(now, f.st):
            return f"{f.path.name} changed"
    return None


@dataclass
class AdapterDigests:
    """Each adapter's content digest in this engine, by (id, name, path)."""

    _known: dict[tuple[int, str, str], _Adapter] = field(default_factory=dict)

    def tag(self, lora: Any) -> bytes | None:
        """The adapter's digest; None when it is refused (see the module docstring)."""
        from pykvcache.vllm.identity.model_identity import resolve_weights, weights_identity

        path = _adapter_path(lora)
        key = (int(getattr(lora, "lora_int_id", 0) or 0), str(getattr(lora, "lora_name", "")), path)
        known = self._known.get(key)
        if known is None:
            source = resolve_weights(path, None) if path else None
            digest = weights_identity(source) if source is not None else None
            if digest is None or not digest.digest:
                known = _Adapter(None, why=f"its files at {path!r} were not found here")
            else:
                known = _Adapter(bytes.fromhex(digest.digest), digest.digested)
            self._known[key] = known
            if known.tag is None:
                self._refused(key, known)
        return known.tag

    def confirm(self, lora: Any) -> bool:
        """Whether the adapter's files are still as digested (False refuses it from now on)."""
        path = _adapter_path(lora)
        key = (int(getattr(lora, "lora_int_id", 0) or 0), str(getattr(lora, "lora_name", "")), path)
        known = self._known.get(key)
        if known is None or known.tag is None:
            return False
        why = _still_as_digested(known.files)
        if why is None:
            return True
        known.tag, known.why = None, why + " after this engine first used it"
        self._refused(key, known)
        return False

    @staticmethod
    def _refused(key: tuple[int, str, str], known: _Adapter) -> None:
        logger.warning(
            "pykvcache: LoRA adapter %s (id %d, %s): %s; requests with it load and store no chunks until the engine restarts",
            key[1],
            key[0],
            key[2],
            known.why,
        )


def derived_key(key: bytes, tag: bytes) -> OffloadKey:
    """The chunk key of ``key`` (block hash + 4-byte group index) for an adapter with digest ``tag``."""
    block_hash, group = key[:-4], key[-4:]
    return OffloadKey(hashlib.sha256(_DOMAIN + block_hash + tag).digest()[: len(block_hash)] + group)


def _find_request(req_id: str) -> Any | None:
    """vLLM's ``Request`` being registered (a local of the caller's frames)."""
    frame: Any = sys._getframe(2)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        for name in ("request", "req"):
            candidate = frame.f_locals.get(name)
            if getattr(candidate, "request_id", None) == req_id:
                return candidate
        frame = frame.f_back
    return None


_NO_ADAPTER = object()


@dataclass
class _RequestAdapter:
    """Kept in the request's ReqContext (vLLM keeps one per request until its
    last store completes, after the request itself finished)."""

    lora: Any
    tag: bytes | None  # None: refused
    #: Its files changed since the digest: no further stores (the keys stay,
    #: so stores prepared before still complete under them).
    stores_refused: bool = False
    _positions: dict[bytes, int] = field(default_factory=dict)
    _seen: int = 0  # how many of vLLM's positions _positions covers

    def positions(self, raw: dict[bytes, int], tag: bytes) -> dict[bytes, int]:
        """vLLM's key positions (the request's chunks, in prompt order) under
        derived keys; vLLM only ever appends to them."""
        if len(raw) != self._seen:
            items = list(raw.items())
            self._positions.update((derived_key(k, tag), p) for k, p in items[self._seen :])
            self._seen = len(items)
        return self._positions


class _DerivedContext:
    """A request's ReqContext as the manager sees it: the gate and the store
    admission read the request's keys from its positions, which must be the
    keys the manager is asked about."""

    def __init__(self, context: Any, adapter: _RequestAdapter, tag: bytes) -> None:
        self._context, self._adapter, self._tag = context, adapter, tag

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    @property
    def _offload_key_positions(self) -> dict[bytes, int]:
        return self._adapter.positions(getattr(self._context, "_offload_key_positions", None) or {}, self._tag)


class AdapterKeyedManager(NvmeOffloadingManager):
    """The manager of an engine with LoRA enabled: requests with an adapter
    use :func:`derived_key`; requests without one, vLLM's keys unchanged."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        events = bool(kwargs.get("enable_events", False))
        self.adapters = AdapterDigests()
        self._raw_of: dict[OffloadKey, OffloadKey] | None = {} if events else None  # derived -> vLLM's
        self._nonce = secrets.token_bytes(16)  # keys of refused requests: match nothing

    # -- requests --------------------------------------------------------------
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        req_id = req_context.req_id
        request = _find_request(req_id)
        lora = getattr(request, "lora_request", None) if request is not None else _NO_ADAPTER
        if lora is _NO_ADAPTER:
            # Not found: its adapter, if any, is unknown; refused (never raw keys).
            logger.warning("pykvcache: request %s not found on registration; it neither loads nor stores chunks", req_id)
            req_context.set_state(_RequestAdapter(None, None))
        elif lora is not None:
            # Known adapters are checked again: changed files refuse them.
            tag = self.adapters.tag(lora)
            if tag is not None and not self.adapters.confirm(lora):
                tag = None
            req_context.set_state(_RequestAdapter(lora, tag))
        return super().on_new_request(req_context)

    @staticmethod
    def _adapter(req_context: ReqContext) -> _RequestAdapter | None:
        return req_context.get_state(_RequestAdapter)

    def _tag(self, adapter: _RequestAdapter) -> bytes:
        return adapter.tag if adapter.tag is not None else self._nonce

    def _keys(self, keys: Collection[OffloadKey], req_context: ReqContext) -> list[OffloadKey]:
        adapter = self._adapter(req_context)
        if adapter is None:
            return list(keys)
        return [derived_key(k, self._tag(adapter)) for k in keys]

    def _context(self, req_context: ReqContext) -> ReqContext:
        """``req_context`` as the manager must see it (see _DerivedContext, which stands in for it)."""
        adapter = self._adapter(req_context)
        if adapter is None:
            return req_context
        return cast("ReqContext", _DerivedContext(req_context, adapter, self._tag(adapter)))

    def _refused(self, req_context: ReqContext) -> bool:
        adapter = self._adapter(req_context)
        return adapter is not None and adapter.tag is None

    # -- keys ------------------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self._refused(req_context):
            return LookupResult.MISS
        return super().lookup(self._keys([key], req_context)[0], self._context(req_context))

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return super().get_load_source(self._keys([key], req_context)[0], self._context(req_context))

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> StagingSlotsSpec:
        return super().prepare_load(self._keys(keys, req_context), self._context(req_context))

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        return super().touch(self._keys(keys, req_context), self._context(req_context))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        return super().complete_load(self._keys(keys, req_context), self._context(req_context))

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        keys = list(keys)
        adapter = self._adapter(req_context)
        if adapter is not None and adapter.tag is not None and not adapter.stores_refused and not self.adapters.confirm(adapter.lora):
            adapter.stores_refused = True  # changed since its digest: its KV may be the new one's
        if self._refused(req_context) or (adapter is not None and adapter.stores_refused):
            return super().prepare_store([], req_context)
        derived = self._keys(keys, req_context)
        out = super().prepare_store(derived, self._context(req_context))
        if out is None or derived == keys:
            return out
        raw = dict(zip(derived, keys))
        if self._raw_of is not None:
            self._raw_of.update((d, raw[d]) for d in out.keys_to_store)
        return dataclasses.replace(
            out, keys_to_store=[raw[k] for k in out.keys_to_store], evicted_keys=[raw.get(k, k) for k in out.evicted_keys]
        )

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        return super().complete_store(self._keys(keys, req_context), self._context(req_context), success)

    def take_events(self) -> list[OffloadingEvent]:
        events = list(super().take_events())
        if self._raw_of is None:
            return events
        out: list[OffloadingEvent] = []
        for event in events:
            raw = [self._raw_of.get(k, k) for k in event.keys]
            if event.removed:
                for k in event.keys:
                    self._raw_of.pop(k, None)
            out.append(dataclasses.replace(event, keys=raw) if raw != list(event.keys) else event)
        return out


def manager_class(vllm_config: Any) -> type[NvmeOffloadingManager]:
    """The manager for an engine: adapter-keyed where LoRA is enabled."""
    return AdapterKeyedManager if getattr(vllm_config, "lora_config", None) is not None else NvmeOffloadingManager
