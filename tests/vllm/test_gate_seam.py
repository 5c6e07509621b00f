"""The vLLM side sees the gate through one narrow seam (docs/gate.md, "Inside
the vLLM manager"): the manager, its preloader and disk I/O, the disk tier,
the tiering tier and the connector call only the members of the ``Gating``
protocol, and there are at most six of them.

Counted statically: every attribute read, called or set on the object the
gate is held in (any name or attribute called ``gating``) in
python/pykvcache/vllm/, outside the modules that define the gate.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pykvcache.vllm
from pykvcache.vllm.scheduler import gating

VLLM = Path(pykvcache.vllm.__file__).parent
#: The gate's own modules: the strategy and the seam.
GATE_MODULES = {"scheduler/gate_plan.py", "scheduler/gating.py"}
HOLDERS = {"gating", "_gating"}


def _holds_gate(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id in HOLDERS) or (isinstance(node, ast.Attribute) and node.attr in HOLDERS)


def seam_uses() -> dict[str, set[str]]:
    """Member name -> the vllm/ modules that use it on the gate."""
    uses: dict[str, set[str]] = {}
    for path in sorted(VLLM.rglob("*.py")):
        module = path.relative_to(VLLM).as_posix()
        if module in GATE_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Attribute) and _holds_gate(node.value):
                uses.setdefault(node.attr, set()).add(module)
    return uses


def protocol_members() -> set[str]:
    return {name for name, value in vars(gating.Gating).items() if not name.startswith("_") and callable(value)}


def test_the_protocol_has_at_most_six_members():
    members = protocol_members()
    assert members == {"allows", "plan_preload", "admit_store", "observe", "snapshot", "close"}
    assert len(members) <= 6


def test_the_vllm_side_uses_only_the_protocol():
    uses = seam_uses()
    outside = {name: sorted(modules) for name, modules in uses.items() if name not in protocol_members()}
    assert not outside, f"reached past the Gating protocol: {outside}"
    assert {"allows", "plan_preload", "admit_store", "observe", "snapshot", "close"} <= set(uses), (
        "the count looks at the wrong names (a member nobody calls, or the gate held under another name)"
    )


def test_the_null_gate_and_the_break_even_gate_implement_the_whole_protocol():
    from pykvcache.vllm.scheduler.gate_plan import GateWiring

    for cls in (gating.NoGating, GateWiring):
        missing = {name for name in protocol_members() if not callable(getattr(cls, name, None))}
        assert not missing, f"{cls.__name__} lacks {missing}"
