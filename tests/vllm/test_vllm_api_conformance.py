"""pykvcache's classes against the vLLM that is installed (0.32 CPU build in
.venv, 0.33 CUDA build in .venv-vllm033): every abstract method of vLLM's base
classes is implemented, and every method pykvcache overrides accepts exactly
the parameters vLLM's base declares (same names, kinds and order; extras only
with defaults or as ``**kwargs``). A vLLM release that adds or renames a
parameter of a hook pykvcache implements fails here, not in a serving engine.
"""

from __future__ import annotations

import importlib.util
import inspect

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


def _pairs():
    from pykvcache.vllm.connector import PyKvCacheConnector
    from pykvcache.vllm.scheduler.manager import NvmeOffloadingManager
    from pykvcache.vllm.spec import NvmeOffloadingSpec
    from pykvcache.vllm.tier import PykvcacheTier
    from pykvcache.vllm.worker.staging_worker import StagingWorker
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    from vllm.v1.kv_offload.base import OffloadingManager, OffloadingSpec, OffloadingWorker
    from vllm.v1.kv_offload.tiering.base import SecondaryTierManager

    return [
        (NvmeOffloadingSpec, OffloadingSpec),
        (NvmeOffloadingManager, OffloadingManager),
        (StagingWorker, OffloadingWorker),
        (PyKvCacheConnector, OffloadingConnector),
        (PykvcacheTier, SecondaryTierManager),
    ]


def signature_mismatch(ours, base) -> str | None:
    """Why ``ours`` cannot stand in for ``base`` (None when it can)."""
    try:
        mine, theirs = inspect.signature(ours), inspect.signature(base)
    except (TypeError, ValueError):
        return None  # builtins without signatures: nothing to compare
    ours_params = list(mine.parameters.values())
    base_params = list(theirs.parameters.values())
    by_name = {p.name: p for p in ours_params}
    for i, bp in enumerate(base_params):
        if bp.kind in (bp.VAR_POSITIONAL, bp.VAR_KEYWORD):
            if not any(p.kind is bp.kind for p in ours_params):
                return f"vLLM's {bp} is not accepted"
            continue
        op = by_name.get(bp.name)
        if op is None:
            return f"parameter {bp.name!r} ({bp.kind.description}) of vLLM's signature {theirs} is missing from {mine}"
        if bp.kind in (bp.POSITIONAL_ONLY, bp.POSITIONAL_OR_KEYWORD):
            if i >= len(ours_params) or ours_params[i].name != bp.name:
                return f"parameter {bp.name!r} is not at position {i}: vLLM {theirs}, pykvcache {mine}"
            if op.kind not in (bp.POSITIONAL_ONLY, bp.POSITIONAL_OR_KEYWORD):
                return f"parameter {bp.name!r} is {op.kind.description}, vLLM passes it positionally"
        elif bp.kind is bp.KEYWORD_ONLY and op.kind is op.POSITIONAL_ONLY:
            return f"parameter {bp.name!r} is positional-only, vLLM passes it by keyword"
        if bp.default is not bp.empty and op.default is op.empty:
            return f"parameter {bp.name!r} has a default in vLLM ({bp.default!r}) but not in pykvcache"
    base_names = {p.name for p in base_params}
    for op in ours_params:
        if op.name in base_names or op.kind in (op.VAR_POSITIONAL, op.VAR_KEYWORD):
            continue
        if op.default is op.empty:
            return f"pykvcache requires {op.name!r}, which vLLM's signature {theirs} never passes"
    return None


def _overrides(ours, base):
    """(name, our attribute, vLLM's attribute) for each method pykvcache
    defines over one of vLLM's base class."""
    for name, base_attr in inspect.getmembers(base):
        if name.startswith("__") and name != "__init__":
            continue
        owner = next((k for k in ours.__mro__ if name in k.__dict__), None)
        if owner is None or owner in base.__mro__:
            continue  # vLLM's own
        if isinstance(owner.__dict__[name], property) or not callable(base_attr):
            continue
        if name == "__init__" and base_attr is object.__init__:
            continue  # vLLM never constructs it (pykvcache's spec does)
        yield name, getattr(ours, name), base_attr


@pytest.mark.parametrize("index", range(5))
def test_every_abstract_method_of_vllms_base_is_implemented(index):
    ours, base = _pairs()[index]
    missing = sorted(getattr(ours, "__abstractmethods__", ()) or ())
    assert not missing, f"{ours.__name__} leaves vLLM's {base.__name__} methods abstract: {missing}"
    for name in sorted(getattr(base, "__abstractmethods__", ())):
        owner = next(k for k in ours.__mro__ if name in k.__dict__)
        assert owner not in base.__mro__, f"{ours.__name__}.{name} is vLLM's abstract stub"


@pytest.mark.parametrize("index", range(5))
def test_every_override_takes_vllms_parameters(index):
    ours, base = _pairs()[index]
    problems = [
        f"{ours.__name__}.{name}: {why}"
        for name, mine, theirs in _overrides(ours, base)
        if (why := signature_mismatch(mine, theirs)) is not None
    ]
    assert not problems, "\n".join(problems)
    assert list(_overrides(ours, base)), f"nothing of {base.__name__} compared"


def test_the_comparison_catches_an_added_or_renamed_parameter():
    """The check itself: a base that gained a parameter, renamed one, or made
    one keyword-passed is reported; an override with an extra defaulted
    parameter or **kwargs is accepted."""

    def base(self, key, req_context): ...
    def base_new(self, key, req_context, *, expedited=False): ...
    def same(self, key, req_context): ...
    def renamed(self, key, ctx): ...
    def extra_ok(self, key, req_context, background=False, **kw): ...
    def extra_required(self, key, req_context, owner): ...

    assert signature_mismatch(same, base) is None
    assert signature_mismatch(extra_ok, base) is None
    assert "expedited" in signature_mismatch(same, base_new)
    assert signature_mismatch(extra_ok, base_new) is not None  # named, so must be declared
    assert "req_context" in signature_mismatch(renamed, base)
    assert "owner" in signature_mismatch(extra_required, base)
