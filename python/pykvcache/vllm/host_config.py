"""Finds the ``VllmConfig`` of the engine that is constructing pykvcache's spec.

vLLM hands an ``OffloadingSpec`` only its normalised ``OffloadingConfig`` (model
name and KV dtype, no HF config, overrides, revision or quantization), but what
determines KV values lives in the full ``VllmConfig``. This module is the one
place that reaches past the public spec API to get it, in this order:

1. the config :class:`pykvcache.vllm.connector.PyKvCacheConnector` publishes
   while its base class builds the spec (:func:`publishing`);
2. the ``vllm_config`` argument of the ``OffloadingConnector.__init__`` frame
   that is constructing the spec (the stock connector; found by walking the
   caller frames, as that argument is all vLLM passes);
3. vLLM's ``get_current_vllm_config_or_none()`` (set while workers build).

``None`` when none applies (a spec built outside vLLM); callers then fingerprint
what they can and say so.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from types import FrameType
from typing import TYPE_CHECKING, Any, Iterator, TypeGuard

if TYPE_CHECKING:
    from vllm.config import VllmConfig

_published: contextvars.ContextVar[VllmConfig | None] = contextvars.ContextVar("pykvcache_vllm_config", default=None)
_reports_steps: contextvars.ContextVar[bool] = contextvars.ContextVar("pykvcache_reports_steps", default=False)

#: How far up the stack a constructing connector can be (spec factory, tiering
#: spec wrappers...); a bound so a deep unrelated stack costs nothing.
_MAX_FRAMES = 32


@contextlib.contextmanager
def publishing(vllm_config: VllmConfig, *, reports_steps: bool = False) -> Iterator[None]:
    """Makes ``vllm_config`` visible to specs constructed inside the block,
    and whether the connector constructing them reports the engine's steps
    (:func:`steps_reported`)."""
    token = _published.set(vllm_config)
    steps = _reports_steps.set(reports_steps)
    try:
        yield
    finally:
        _reports_steps.reset(steps)
        _published.reset(token)


def steps_reported() -> bool:
    """Whether the connector building the caller reports each engine step
    (PyKvCacheConnector does: the gate learns the prefill side from them;
    vLLM's stock connector does not)."""
    return _reports_steps.get()


def _is_vllm_config(obj: Any) -> TypeGuard[VllmConfig]:
    try:
        from vllm.config import VllmConfig
    except ImportError:  # pragma: no cover - vLLM is what calls us
        return False
    return isinstance(obj, VllmConfig)


def find_vllm_config() -> VllmConfig | None:
    """The ``VllmConfig`` of the engine constructing the caller, or None."""
    cfg = _published.get()
    if cfg is not None:
        return cfg
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            break
        candidate = frame.f_locals.get("vllm_config")
        if candidate is not None and _is_vllm_config(candidate):
            return candidate
        frame = frame.f_back
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:  # pragma: no cover - older vLLM
        return None
    return get_current_vllm_config_or_none()
