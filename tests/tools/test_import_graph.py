"""The package's import graph has no cycles, function-level imports included.

A cycle hidden behind an import inside a function still ties two modules into one: neither
can be read, tested or changed without the other. Every import in python/pykvcache counts
here (module level, inside functions, under ``TYPE_CHECKING``), resolved to the module file it
names; the graph must be acyclic.

The vLLM integration is grouped by the process its code runs in, and the groups keep to it:
``pykvcache.vllm.worker`` (each worker process) and ``pykvcache.vllm.scheduler`` (the scheduler
process) never import each other, the weights' identity imports neither, and the pieces both
processes share (``pykvcache.vllm``'s own modules) import no group: only the entry points that
vLLM loads by name (the spec, the connector, the tiering tier) bring the groups together.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python" / "pykvcache"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _python_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                # `from pkg import mod` names a module; `from mod import name` the module itself.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                # A package's __init__ is imported by every submodule import: not an edge of its own.
                if target and target != module and not module.startswith(target + "."):
                    graph[module].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_python_package_has_no_import_cycle():
    graph = _python_graph()
    assert sum(len(v) for v in graph.values()) > 100, "the graph was not read"
    assert _cycles(graph) == []


VLLM = "pykvcache.vllm"
#: The modules vLLM loads by name (``spec_module_path``, ``kv_connector_module_path``, a
#: secondary tier's ``module_path``): they build the scheduler side and the worker side.
ENTRY_POINTS = {f"{VLLM}.spec", f"{VLLM}.connector", f"{VLLM}.tier"}
#: What each group may not import.
FORBIDDEN = {
    f"{VLLM}.worker": (f"{VLLM}.scheduler", *ENTRY_POINTS),
    f"{VLLM}.scheduler": (f"{VLLM}.worker", *ENTRY_POINTS),
    f"{VLLM}.identity": (f"{VLLM}.worker", f"{VLLM}.scheduler", *ENTRY_POINTS),
}


def _group(module: str) -> str:
    """The group a module of pykvcache.vllm belongs to: a subpackage, or ``shared``."""
    rest = module[len(VLLM) + 1 :].split(".")
    return f"{VLLM}.{rest[0]}" if len(rest) > 1 or f"{VLLM}.{rest[0]}" in FORBIDDEN else "shared"


def _layering_breaches(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in graph.items():
        if not module.startswith(VLLM + ".") or module in ENTRY_POINTS:
            continue
        group = _group(module)
        forbidden = FORBIDDEN.get(group, (*FORBIDDEN, *ENTRY_POINTS))
        for target in sorted(targets):
            if any(target == f or target.startswith(f + ".") for f in forbidden):
                bad.append(f"{module} ({group}) imports {target}")
    return bad


def test_the_layering_check_finds_a_breach():
    assert _layering_breaches(
        {
            f"{VLLM}.worker.copy": {f"{VLLM}.scheduler.manager"},
            f"{VLLM}.scheduler.manager": {f"{VLLM}.worker"},
            f"{VLLM}.layout": {f"{VLLM}.identity.namespace"},
            f"{VLLM}.spec": {f"{VLLM}.worker.copy", f"{VLLM}.scheduler.manager"},
        }
    ) == [
        f"{VLLM}.worker.copy ({VLLM}.worker) imports {VLLM}.scheduler.manager",
        f"{VLLM}.scheduler.manager ({VLLM}.scheduler) imports {VLLM}.worker",
        f"{VLLM}.layout (shared) imports {VLLM}.identity.namespace",
    ]


def test_the_vllm_groups_keep_to_their_process():
    graph = _python_graph()
    groups = {_group(m) for m in graph if m.startswith(VLLM + ".")}
    assert groups == {*FORBIDDEN, "shared"}, groups
    assert ENTRY_POINTS <= set(graph)
    assert _layering_breaches(graph) == []
