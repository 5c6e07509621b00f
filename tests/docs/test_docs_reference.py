"""The reference docs state what the code does: one owner per fact, checked.

* docs/vllm.md's key table lists exactly the keys of
  ``pykvcache.vllm.config.PykvcacheConfig`` (plus vLLM's own keys it chooses
  to document), each with the default the dataclass has;
* docs/python-api.md's ``BlockStore`` keyword table lists exactly the keyword
  arguments of the engine's ``#[pyo3(signature = ...)]`` (rust/src/python.rs),
  with its defaults, and ``_core.pyi`` declares the same;
* docs/vllm.md's metric list is the table in ``pykvcache/vllm/metrics.py``;
* the README's results table is the one in docs/performance.md;
* every relative link of README.md and docs/**/*.md points to a file (and
  heading) that exists, and every repository path the hand-written docs name
  exists.

A key, keyword or metric the code gains without a row in the docs fails here.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
VLLM_DOC = DOCS / "vllm.md"
API_DOC = DOCS / "python-api.md"
PERF_DOC = DOCS / "performance.md"
PYTHON_RS = ROOT / "rust" / "src" / "python.rs"
CORE_PYI = ROOT / "python" / "pykvcache" / "_core.pyi"

REQUIRED = object()


# ---------------------------------------------------------------- markdown


def _strip_fences(text: str) -> str:
    """The text outside fenced code blocks (their lines become blank)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append("")
            continue
        out.append("" if fenced else line)
    return "\n".join(out)


def _cells(row: str) -> list[str]:
    """Cells of a table row; a ``|`` inside inline code does not split."""
    cells, cell, in_code = [], "", False
    for ch in row.strip().strip("|"):
        if ch == "`":
            in_code = not in_code
        if ch == "|" and not in_code:
            cells.append(cell.strip())
            cell = ""
        else:
            cell += ch
    cells.append(cell.strip())
    return cells


def tables(path: Path, header: list[str]) -> list[dict[str, str]]:
    """Rows (header -> cell) of every table of ``path`` with this header."""
    rows: list[dict[str, str]] = []
    lines = _strip_fences(path.read_text()).splitlines()
    for i, line in enumerate(lines):
        if (
            line.startswith("|")
            and _cells(line) == header
            and i + 1 < len(lines)
            and set(lines[i + 1].replace("|", "").strip()) <= set("-: ")
        ):
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                cells = _cells(row)
                assert len(cells) == len(header), f"{path.name}: malformed row {row!r}"
                rows.append(dict(zip(header, cells)))
    assert rows, f"{path.name} has no table with the header {header}"
    return rows


def section(path: Path, title: str) -> str:
    """The text of the ``## title`` section (up to the next heading of level <= 2)."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^#{{1,2}} |\Z)", path.read_text(), flags=re.S | re.M)
    assert match, f"{path.name} has no section '## {title}'"
    return match.group(1)


def _code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


# ---------------------------------------------------------------- literals


def _safe_eval(text: str):
    """A Python literal, also ``4 << 20`` (constants and shifts only)."""

    def ev(node):
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.LShift):
            return ev(node.left) << ev(node.right)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError(f"not a literal: {text!r}")

    return ev(ast.parse(text.strip(), mode="eval").body)


def _rust_default(text: str):
    """A default in a ``#[pyo3(signature)]``: Rust literals as Python values."""
    text = text.strip()
    match = re.fullmatch(r"Some\((.*)\)", text)
    if match:
        text = match.group(1)
    text = {"true": "True", "false": "False"}.get(text, text)
    if text.startswith("defaults::"):
        # The engine's one owner of defaults (rust/src/store/config.rs), exported
        # to Python as _core.ENGINE_DEFAULTS.
        from pykvcache._core import ENGINE_DEFAULTS

        key = text[len("defaults::") :].lower()
        if key not in ENGINE_DEFAULTS and key.endswith("_s"):
            key = key[:-2]
        assert key in ENGINE_DEFAULTS, f"{text} is not in _core.ENGINE_DEFAULTS"
        return ENGINE_DEFAULTS[key]
    return _safe_eval(text)


def _same(documented, default) -> bool:
    if isinstance(default, bool) or isinstance(documented, bool):
        return type(documented) is type(default) and documented == default
    return documented == default


# ---------------------------------------------------------------- vLLM keys


def _config():
    if importlib.util.find_spec("pykvcache._core") is None:
        pytest.skip("the engine extension is not built")
    from pykvcache.vllm import config

    return config


def _vllm_key_rows() -> dict[str, str]:
    documented: dict[str, str] = {}
    for row in tables(VLLM_DOC, ["Key", "Default", "Meaning"]):
        for key in _code_spans(row["Key"]):
            assert key not in documented, f"docs/vllm.md documents {key} twice"
            documented[key] = row["Default"]
    return documented


def _vllm_doc_default(key: str, cell: str):
    """The documented default: REQUIRED, a literal (JSON as in the config
    dict, or a size such as ``1GiB``), or a description (a str wrapped in a
    tuple) of a default the code computes."""
    if cell.startswith("required"):
        return REQUIRED
    match = re.fullmatch(r"`([^`]*)`", cell)
    if not match:
        return (cell,)
    literal = match.group(1)
    try:
        return json.loads(literal)
    except ValueError:
        pass
    try:
        return _config().parse_size(literal)
    except ValueError:
        raise AssertionError(f"docs/vllm.md: the default of {key}, {literal!r}, is not a value the config accepts") from None


def test_the_vllm_key_table_lists_every_key_of_the_config():
    config = _config()
    documented = set(_vllm_key_rows())
    code = config.PykvcacheConfig.keys()
    missing = sorted(code - documented)
    unknown = sorted(documented - code - config.VLLM_KEYS)
    assert not missing, f"keys of PykvcacheConfig that docs/vllm.md's key table lacks: {missing}"
    assert not unknown, f"docs/vllm.md documents keys the config does not accept: {unknown}"
    text = VLLM_DOC.read_text()
    for key in sorted(config.VLLM_KEYS - documented):
        assert f"`{key}`" in text, f"vLLM's key {key} (accepted by the config) is not mentioned in docs/vllm.md"


def test_the_vllm_key_table_gives_the_defaults_of_the_code():
    config = _config()
    rows = _vllm_key_rows()
    # Defaults the code computes (None in the dataclass) are described; where
    # the share is a constant, the description must state it.
    computed = {
        "lookahead_bytes": f"{config.LOOKAHEAD_SHARE:.0%} of `staging_bytes`",
        "lookup_hold_bytes": f"{config.LOOKUP_HOLD_SHARE:.0%} of `staging_bytes`",
    }
    wrong = []
    for field in dataclasses.fields(config.PykvcacheConfig):
        if field.name not in rows:
            continue  # reported by the test above
        doc = _vllm_doc_default(field.name, rows[field.name])
        if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            if doc is not REQUIRED:
                wrong.append(f"{field.name}: required in the code, documented default {rows[field.name]!r}")
            continue
        default = field.default
        if doc is REQUIRED:
            wrong.append(f"{field.name}: documented as required, the code defaults to {default!r}")
        elif isinstance(doc, tuple):
            if default is not None:
                wrong.append(f"{field.name}: documented as {doc[0]!r}, the code's default is {default!r}")
            elif field.name in computed and computed[field.name] not in doc[0]:
                wrong.append(f"{field.name}: documented as {doc[0]!r}, expected {computed[field.name]!r}")
        elif not _same(doc, default):
            wrong.append(f"{field.name}: documented default {doc!r}, the code's default is {default!r}")
    for key in config.VLLM_KEYS & set(rows) - config.PykvcacheConfig.keys():
        if _vllm_doc_default(key, rows[key]) is not REQUIRED:
            wrong.append(f"{key}: a vLLM key with no pykvcache default; document it as required")
    assert not wrong, "docs/vllm.md's key table disagrees with PykvcacheConfig:\n  " + "\n  ".join(wrong)


def test_the_vllm_key_table_names_every_accepted_choice():
    config = _config()
    rows = {key: row for row in tables(VLLM_DOC, ["Key", "Default", "Meaning"]) for key in _code_spans(row["Key"])}
    for key, choices in (("backend", config.BACKENDS), ("direct_io", config.DIRECT_IO_POLICIES)):
        named = set(_code_spans(rows[key]["Meaning"]))
        assert set(choices) <= named, f"docs/vllm.md: {key} accepts {choices}, the table names {sorted(named)}"


# ---------------------------------------------------------------- BlockStore keywords


def engine_keywords() -> dict[str, object]:
    """Keyword-only arguments of ``BlockStore`` in the PyO3 signature, with
    their defaults (REQUIRED when none); private ``_fault`` hooks left out."""
    source = PYTHON_RS.read_text()
    start = source.index('#[pyclass(name = "BlockStore"')
    match = re.compile(r"#\[pyo3\(signature = \((.*?)\)\)\]\s*(?:#\[[^\]]*\]\s*)*fn new\(", re.S).search(source, start)
    assert match, "no #[pyo3(signature)] on BlockStore::new in rust/src/python.rs"
    args, depth, current = [], 0, ""
    for ch in match.group(1):
        depth += ch in "(["
        depth -= ch in ")]"
        if ch == "," and depth == 0:
            args.append(current.strip())
            current = ""
        else:
            current += ch
    args.append(current.strip())
    keywords: dict[str, object] = {}
    star = args.index("*")
    for arg in args[star + 1 :]:
        name, _, default = arg.partition("=")
        if name.strip().startswith("_"):
            continue
        keywords[name.strip()] = _rust_default(default) if default else REQUIRED
    return keywords


def _pyi_init() -> ast.FunctionDef:
    tree = ast.parse(CORE_PYI.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "BlockStore")
    # PyO3 builds objects in __new__ (mypy.stubtest checks the stub says so).
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__new__")


def _documented_keywords() -> dict[str, dict[str, str]]:
    rows = tables(API_DOC, ["Keyword", "Default", "Meaning"])
    out: dict[str, dict[str, str]] = {}
    for row in rows:
        (name,) = _code_spans(row["Keyword"])
        assert name not in out, f"docs/python-api.md documents {name} twice"
        out[name] = row
    return out


def test_the_engine_signature_parses():
    # Guards the parser above: a signature it misreads must not pass vacuously.
    keywords = engine_keywords()
    assert keywords["namespace"] is REQUIRED and keywords["segment_bytes"] == 4 << 20
    assert keywords["submit_timeout"] == 30.0 and keywords["register_buffers"] is True
    assert not any(name.startswith("_") for name in keywords)


def test_the_blockstore_keyword_table_is_the_engine_signature():
    engine = engine_keywords()
    documented = _documented_keywords()
    assert list(documented) == list(engine), (
        "docs/python-api.md's BlockStore keywords differ from rust/src/python.rs's signature:\n"
        f"  missing in the docs: {sorted(set(engine) - set(documented))}\n"
        f"  not in the engine: {sorted(set(documented) - set(engine))}\n"
        "  (same order as the signature)"
    )
    wrong = []
    for name, default in engine.items():
        cell = documented[name]["Default"]
        if default is REQUIRED:
            if cell != "required":
                wrong.append(f"{name}: required in the engine, documented {cell!r}")
            continue
        spans = _code_spans(cell)
        value = _safe_eval(spans[0]) if spans else REQUIRED
        if value is REQUIRED or not _same(value, default):
            wrong.append(f"{name}: documented default {cell!r}, the engine's is {default!r}")
    assert not wrong, "docs/python-api.md's BlockStore defaults are not the engine's:\n  " + "\n  ".join(wrong)


def test_the_pyi_declares_the_engine_signature():
    init = _pyi_init()
    pyi = {}
    for arg, default in zip(init.args.kwonlyargs, init.args.kw_defaults):
        pyi[arg.arg] = REQUIRED if default is None else _safe_eval(ast.unparse(default))
    engine = engine_keywords()
    assert list(pyi) == list(engine), f"_core.pyi keywords {list(pyi)} != engine {list(engine)}"
    for name, default in engine.items():
        assert pyi[name] is default if default is REQUIRED else _same(pyi[name], default), (
            f"_core.pyi: {name} defaults to {pyi[name]!r}, the engine to {default!r}"
        )


def test_the_keyword_tables_give_the_engines_limits():
    """A count the engine bounds (``_core.ENGINE_LIMITS``) states its bounds,
    ``low–high``, in docs/python-api.md's keyword table and, for the keys of
    the vLLM table that become such a keyword (``Key.store``), in docs/vllm.md's."""
    from pykvcache._core import ENGINE_LIMITS

    documented = _documented_keywords()
    vllm_rows = _vllm_key_meanings()
    wrong = []
    for name, (low, high) in ENGINE_LIMITS.items():
        bounds = f"{low}–{high}"
        if name in documented and bounds not in documented[name]["Meaning"]:
            wrong.append(f"docs/python-api.md: {name} does not say {bounds}")
    for key, spec in _config().PykvcacheConfig.table().items():
        if spec.store in ENGINE_LIMITS:
            low, high = ENGINE_LIMITS[spec.store]
            if f"{low}–{high}" not in vllm_rows.get(key, ""):
                wrong.append(f"docs/vllm.md: {key} does not say {low}–{high}")
    assert not wrong, "\n  ".join(["the docs' bounds are not the engine's:", *wrong])


def _vllm_key_meanings() -> dict[str, str]:
    return {key: row["Meaning"] for row in tables(VLLM_DOC, ["Key", "Default", "Meaning"]) for key in _code_spans(row["Key"])}


def test_the_blockstore_keyword_table_names_every_accepted_choice():
    documented = _documented_keywords()
    for arg in _pyi_init().args.kwonlyargs:
        annotation = arg.annotation
        if isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value) == "Literal":
            choices = ast.literal_eval(annotation.slice)
            named = {_safe_eval(span) for span in _code_spans(documented[arg.arg]["Meaning"]) if span.startswith('"')} | {
                _safe_eval(span) for span in _code_spans(documented[arg.arg]["Default"])
            }
            assert set(choices) <= named, f"docs/python-api.md: {arg.arg} accepts {choices}, the table names {named}"


# ---------------------------------------------------------------- metrics


def test_the_metric_list_is_the_metrics_table():
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (metrics.py declares vLLM metric types)")
    _config()
    from pykvcache.vllm import metrics

    kinds = {"counters": metrics.COUNTERS, "gauges": metrics.GAUGES, "histograms": metrics.HISTOGRAMS}
    documented: set[str] = set()
    for row in tables(VLLM_DOC, ["Kind", "Metrics"]):
        kind = row["Kind"].split(":")[0].strip()
        names = {name for name in _code_spans(row["Metrics"])}
        assert kind in kinds, f"docs/vllm.md: unknown metric kind {row['Kind']!r}"
        assert names <= set(kinds[kind]), f"docs/vllm.md lists as {kind}: {sorted(names - set(kinds[kind]))}"
        documented |= names
    declared = set(metrics.COUNTERS) | set(metrics.GAUGES) | set(metrics.HISTOGRAMS)
    assert documented == declared, (
        f"metrics declared but not in docs/vllm.md: {sorted(declared - documented)}; "
        f"documented but not declared: {sorted(documented - declared)}"
    )


# ---------------------------------------------------------------- results


def test_the_readme_results_are_stated_in_the_performance_doc():
    """The README's headline table is an excerpt of docs/performance.md's, and
    every ratio the README's results section gives is stated there."""
    perf = PERF_DOC.read_text()
    results = section(README, "Performance")
    rows = [line for line in results.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) > 2, "the README has no results table"
    perf_lines = set(perf.splitlines())
    for row in rows:
        assert row in perf_lines, f"README results row not in docs/performance.md: {row}"
    for ratio in re.findall(r"\d+(?:\.\d+)?(?:–\d+(?:\.\d+)?)?×", results):
        assert ratio in perf, f"README states {ratio}, docs/performance.md does not"


# ---------------------------------------------------------------- links and paths


def _docs() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = _strip_fences(path.read_text())
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        slug, n = _slug(heading), 1
        while slug in found:  # GitHub numbers repeated headings
            slug = f"{_slug(heading)}-{n}"
            n += 1
        found.add(slug)
    found |= set(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", text))
    return found


def relative_links(path: Path) -> list[str]:
    text = re.sub(r"`[^`]*`", "", _strip_fences(path.read_text()))
    targets = re.findall(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_the_checker_finds_links_and_anchors():
    # Guards the parsers: a doc the checker reads nothing from would pass vacuously.
    assert "docs/vllm.md" in relative_links(README)
    assert "using-pykvcache-with-vllm" in anchors(README)
    assert "file-per-chunk-vs-slab" in anchors(DOCS / "design.md")


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    broken = []
    for target in relative_links(doc):
        file, _, fragment = target.partition("#")
        resolved = (doc.parent / file).resolve() if file else doc
        if not resolved.exists():
            broken.append(f"{target} (no {resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved})")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            broken.append(f"{target} (no heading #{fragment} in {resolved.relative_to(ROOT)})")
    assert not broken, f"{doc.relative_to(ROOT)} has broken links:\n  " + "\n  ".join(broken)


REPO_PATH = re.compile(r"(?:docs|tests|scripts|rust|python|examples|dev|benches)/[\w./-]*")


@pytest.mark.parametrize(
    "doc", [README, *sorted(DOCS.glob("*.md")), *sorted((DOCS / "decisions").glob("*.md"))], ids=lambda p: str(p.relative_to(ROOT))
)
def test_every_repository_path_named_exists(doc):
    """Paths in inline code (``tests/e2e/...``, ``rust/src/...``): a file that
    moved must not leave the docs pointing at nothing. Generated reports
    (docs/perf/) are records of their run and are not checked."""
    missing = sorted(
        {span for span in _code_spans(_strip_fences(doc.read_text())) if REPO_PATH.fullmatch(span) and not (ROOT / span).exists()}
    )
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_the_readme_sends_users_to_the_one_key_table_and_stays_a_front_page():
    """Keys live in one table, docs/vllm.md's (checked against the code above); the README
    (a front page of at most 150 lines) links to it instead of keeping a copy
    that could drift, and names the two required keys."""
    assert tables(VLLM_DOC, ["Key", "Default", "Meaning"]), "docs/vllm.md lost its key table"
    assert not re.search(r"^\| *Key *\| *Default *\|", README.read_text(), flags=re.M), "a second key table in the README"
    assert "docs/vllm.md#configuration-keys" in relative_links(README)
    assert "configuration-keys" in anchors(VLLM_DOC)
    results = section(README, "Performance")
    assert len([line for line in results.splitlines() if line.startswith("| ")]) - 1 <= 5, "headline table > 5 rows"
    assert len(README.read_text().splitlines()) <= 150


def test_every_decision_record_is_in_the_index():
    """docs/decisions/README.md lists every record (a record nobody can find
    from the index is a decision made again)."""
    index = (DOCS / "decisions" / "README.md").read_text()
    records = sorted(p.name for p in (DOCS / "decisions").glob("[0-9][0-9][0-9][0-9]-*.md"))
    missing = [name for name in records if f"]({name})" not in index]
    assert records and not missing, f"decision records missing from docs/decisions/README.md: {missing}"


# ---------------------------------------------------------------- resetting the tier on a server


def _user_docs() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def test_docs_that_tell_users_to_reset_give_the_servers_endpoint_and_its_dev_mode():
    """``POST /reset_prefix_cache`` answers only when
    the server runs with ``VLLM_SERVER_DEV_MODE=1``; the docs told users to
    reset without saying so."""
    telling = [p for p in _user_docs() if "reset_prefix_cache" in p.read_text()]
    assert telling, "no user document explains how to reset the tier"
    for path in telling:
        text = path.read_text()
        assert "POST /reset_prefix_cache?reset_external=true" in text, path.name
        assert "VLLM_SERVER_DEV_MODE=1" in text, path.name


def test_the_documented_reset_endpoint_is_vllms():
    """What the docs say about the endpoint is what the installed vLLM does:
    its dev routes (``/reset_prefix_cache`` among them) are mounted only under
    ``VLLM_SERVER_DEV_MODE``, and ``reset_external`` resets the connector."""
    import inspect

    pytest.importorskip("vllm", reason="vLLM is not installed")
    routers = pytest.importorskip("vllm.entrypoints.launchers.api_server.routers")
    cache_router = pytest.importorskip("vllm.entrypoints.serve.dev.cache.api_router")
    assert "VLLM_SERVER_DEV_MODE" in inspect.getsource(routers)
    assert "reset_external" in inspect.signature(cache_router.reset_prefix_cache).parameters
