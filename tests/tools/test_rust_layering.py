"""The engine's module graph, read from rust/src: no cycles, and no arrow against its layers.

Every path in a Rust file that names a module of the crate counts: ``use`` declarations
(trees expanded), and paths in code (``crate::store::config::limits::QUEUE_DEPTH``,
``super::jobs::Job``, ``completion::submit`` in the module that declares ``completion``),
tests included, resolved to the file of the deepest module they name (an inline
``mod limits { }`` belongs to its file). A module using its own parent (or any ancestor)
is no edge: in Rust the parent is where its children's shared items live, as a package's
``__init__`` is in Python (``tests/tools/test_import_graph.py`` counts the same way).

(a) The file graph has no cycle: two files that use each other are one module in two
pieces, which cannot be read, tested or changed apart.

(b) Every top-level module uses only modules of its own layer or below, in the order the
crate root (``rust/src/lib.rs``) states. A lower layer reaching up (the I/O backend
reading the store's configuration, say) ties the lower layer to everything above it.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "rust" / "src"

#: The layers of ``rust/src/lib.rs``'s top comment, bottom up: a module may use modules of
#: its own layer or of the layers before it.
LAYERS: list[set[str]] = [
    {"error", "checksum", "wait", "stats", "notice", "faults"},  # shared pieces
    {"digest"},  # the weights' content digest (the vLLM integration's)
    {"disk"},  # chunk format, directory layout, file operations, index, scan
    {"staging", "ready"},  # the shared staging pool the bytes move through, its ready words
    {"backend"},  # moves segments between staging and files
    {"ops"},  # the table of operations in flight
    {"store"},  # put/get over all of these
    {"python"},  # the PyO3 glue
]

Module = tuple[str, ...]
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def _strip(text: str) -> str:
    """The code with comments, strings and char literals blanked (lines kept)."""
    out: list[str] = []
    i, n = 0, len(text)
    blank = lambda s: re.sub(r"[^\n]", " ", s)  # noqa: E731
    while i < n:
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, j = 0, i
            while j < n:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                    if depth == 0:
                        break
                else:
                    j += 1
        elif (m := re.match(r'b?r(#*)"', text[i : i + 12])) and (i == 0 or not re.match(r"\w", text[i - 1])):
            end = '"' + m.group(1)
            j = text.find(end, i + m.end())
            j = n if j < 0 else j + len(end)
        elif text[i] == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            j += 1
        elif text[i] == "'" and (m := re.match(r"'(\\.|\\u\{[0-9a-fA-F]+\}|[^\\'\n])'", text[i : i + 12])):
            j = i + m.end()
        else:
            out.append(text[i])
            i += 1
            continue
        out.append(blank(text[i:j]))
        i = j
    return "".join(out)


def _module_of(path: Path) -> Module:
    parts = path.relative_to(SRC).with_suffix("").parts
    if parts == ("lib",):
        return ()
    return tuple(parts[:-1]) if parts[-1] == "mod" else tuple(parts)


def _inline_modules(code: str) -> list[tuple[int, int, str]]:
    """(start, end, name) of every ``mod name { ... }`` in the stripped code."""
    spans = []
    for m in re.finditer(rf"\bmod\s+({_IDENT})\s*\{{", code):
        depth, j = 0, m.end() - 1
        while j < len(code):
            depth += {"{": 1, "}": -1}.get(code[j], 0)
            if depth == 0:
                break
            j += 1
        spans.append((m.start(), j, m.group(1)))
    return spans


def _use_paths(tree: str) -> list[list[str]]:
    """The paths of a ``use`` tree: ``a::{b, c::{d as e, self}}`` -> a::b, a::c::d, a::c."""
    tokens = re.findall(rf"{_IDENT}|::|\{{|\}}|,|\*", tree)
    pos = 0

    def parse(prefix: list[str]) -> list[list[str]]:
        nonlocal pos
        path = list(prefix)
        while pos < len(tokens):
            tok = tokens[pos]
            if tok == "{":
                pos += 1
                out: list[list[str]] = []
                while pos < len(tokens) and tokens[pos] != "}":
                    if tokens[pos] == ",":
                        pos += 1
                        continue
                    out += parse(path)
                pos += 1
                return out
            if tok in (",", "}"):
                break
            if tok == "as":
                pos += 2  # the alias names nothing new
                continue
            if tok == "self":
                pos += 1
                continue  # the module the group is in
            if tok not in ("::", "*"):
                path.append(tok)
            pos += 1
        return [path]

    return parse([])


def rust_graph(src: Path = SRC) -> dict[Module, dict[Module, str]]:
    """File-level module graph: module -> {module it uses: where (file:line), first seen}."""
    files = {_module_of(p): p for p in sorted(src.rglob("*.rs"))}
    graph: dict[Module, dict[Module, str]] = {m: {} for m in files}
    for module, path in files.items():
        code = _strip(path.read_text())
        spans = _inline_modules(code)
        inline = {module + tuple(name for s, e, name in spans if s < start <= e) + (own,) for start, _, own in spans}

        def scope(at: int) -> Module:
            return module + tuple(name for s, e, name in spans if s < at <= e)

        found: list[tuple[int, list[str]]] = []
        for m in re.finditer(r"\buse\s+([^;]*);", code):
            found += [(m.start(), p) for p in _use_paths(m.group(1))]
        path_re = rf"(?<![\w:])({_IDENT}(?:\s*::\s*{_IDENT})+)"
        found += [(m.start(), re.split(r"\s*::\s*", m.group(1))) for m in re.finditer(path_re, code)]
        for at, segments in found:
            here = scope(at)
            if not segments:
                continue
            if segments[0] == "crate":
                target = segments[1:]
            elif segments[0] in ("super", "self"):
                base = list(here)
                while segments and segments[0] in ("super", "self"):
                    if segments.pop(0) == "super":
                        base.pop()
                target = base + segments
            elif here + (segments[0],) in files or here + (segments[0],) in inline:
                target = list(here) + segments
            else:
                continue  # another crate (std, libc, pyo3, ...) or a local name
            while tuple(target) not in files:
                target.pop()
            used = tuple(target)
            if used == module or module[: len(used)] == used:
                continue  # itself, or an ancestor (see the module docs)
            line = code.count("\n", 0, at) + 1
            graph[module].setdefault(used, f"{path.relative_to(ROOT)}:{line}")
    return graph


def _cycles(graph: dict[Module, dict[Module, str]]) -> list[list[Module]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[Module, int] = {}
    low: dict[Module, int] = {}
    stack: list[Module] = []
    on_stack: set[Module] = set()
    out: list[list[Module]] = []

    def visit(v: Module) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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


def _name(m: Module) -> str:
    return "::".join(("crate",) + m)


def _layer(top: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if top in layer)


def test_the_parser_sees_the_crate():
    graph = rust_graph()
    assert {("store", "read"), ("backend", "uring"), ("staging",), ("disk", "format")} <= set(graph)
    # A use tree, a path in code, a child module named bare, and a parent that is no edge.
    assert ("disk", "format") in graph[("store", "read")]
    assert ("staging",) in graph[("store", "config")]  # `crate::staging::MAX_SLOTS` in a const
    assert ("store", "jobs") in graph[("store",)]  # `use jobs::{...}` where `mod jobs;` is declared
    assert ("store",) not in graph[("store", "read")]
    assert _use_paths("crate::a::{self, b::{c as d, e}, f}") == [
        ["crate", "a"],
        ["crate", "a", "b", "c"],
        ["crate", "a", "b", "e"],
        ["crate", "a", "f"],
    ]
    assert "crate::x" not in _strip('let s = "crate::x"; // crate::y\n/* crate::z */ let c = \'"\';')


def test_every_top_level_module_has_a_layer():
    tops = {m[0] for m in rust_graph() if m}
    missing = tops - set().union(*LAYERS)
    assert not missing, f"give these a layer here and in lib.rs's top comment: {sorted(missing)}"
    lib = (SRC / "lib.rs").read_text()
    for layer in LAYERS:
        for top in layer:
            assert f"`{top}`" in lib, f"lib.rs's layer list does not name `{top}`"


def test_no_module_cycles():
    cycles = _cycles(rust_graph())
    assert not cycles, "modules that use each other:\n" + "\n".join(" <-> ".join(map(_name, c)) for c in cycles)


def test_no_arrow_against_the_layers():
    bad = []
    for module, uses in rust_graph().items():
        if not module:
            continue  # the crate root declares and re-exports every layer
        for used, where in sorted(uses.items()):
            if used and _layer(used[0]) > _layer(module[0]):
                bad.append(f"{where}: {_name(module)} (layer {_layer(module[0])}) uses {_name(used)} (layer {_layer(used[0])})")
    assert not bad, "a lower layer reaches up:\n" + "\n".join(bad)
