"""The product and the tools built on it, read from the source.

The product (the engine binding, the direct API, ``pykvcache.vllm``,
``pykvcache.gate``) never imports ``pykvcache.tools`` (the ``pykvcache``
command: bench, calibrate, demo); the tools use the product's public names,
and reach private vLLM / manager attributes only through
``pykvcache.tools.vllm_adapter``. What the product imports is declared as a
dependency; rich (the tools' progress bars and tables) is an extra, and the
product imports without it.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python" / "pykvcache"
TOOLS = PACKAGE / "tools"
ADAPTER = TOOLS / "vllm_adapter.py"
#: Module paths the product must not import: the tools, under their new and old names.
TOOL_MODULES = ("pykvcache.tools", "pykvcache.cli", "pykvcache.bench", "pykvcache.calibrate", "pykvcache.demo")
#: Private product modules the tools may import, and why.
PRIVATE_ALLOWED = {
    # One reader of /proc/cpuinfo for the gate's hardware id and the bench's machine description.
    "pykvcache._sysinfo",
}
#: vLLM's (and pykvcache's manager's) attributes without a public API; only the adapter touches them.
INTERNAL_ATTRIBUTES = {"llm_engine", "engine_core", "vllm_config", "gating", "preloader"}
#: Installed with vLLM, which is what loads ``pykvcache.vllm``: not pykvcache's to declare.
SERVING_ENGINE = {"vllm", "torch", "huggingface_hub"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """Every import in the file (function-level ones too): (line, absolute module, names)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [a.name for a in node.names]
            out.append((node.lineno, target, names))
            # ``from pykvcache import tools`` imports the submodule.
            out += [(node.lineno, f"{target}.{n}", []) for n in names]
    return out


def _product_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if TOOLS not in p.parents)


def _tool_files() -> list[Path]:
    return sorted(TOOLS.rglob("*.py"))


def test_the_layout_has_both_sides():
    product = {_module_name(p) for p in _product_files()}
    assert {"pykvcache", "pykvcache.aio", "pykvcache.preformat", "pykvcache.vllm.spec", "pykvcache.gate"} <= product
    tools = {_module_name(p) for p in _tool_files()}
    assert {
        "pykvcache.tools.cli",
        "pykvcache.tools.demo",
        "pykvcache.tools.bench.runner",
        "pykvcache.tools.calibrate.measure",
        "pykvcache.tools.calibrate.fit",
        "pykvcache.tools.calibrate.cli",
    } <= tools
    # The old homes are gone, so nothing can import them by mistake; the command has one
    # module (``pykvcache``, ``python -m pykvcache.tools.cli``), no alias beside the product.
    assert not (PACKAGE / "bench").exists() and not (PACKAGE / "calibrate.py").exists()
    assert not (PACKAGE / "demo.py").exists() and not (PACKAGE / "cli.py").exists()
    assert not (PACKAGE / "__main__.py").exists()


def test_the_product_never_imports_the_tools():
    bad = []
    for path in _product_files():
        for line, module, _ in _imports(path):
            if any(module == t or module.startswith(t + ".") for t in TOOL_MODULES):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not bad, "the product imports the tools:\n" + "\n".join(bad)


def test_tools_import_only_public_product_names():
    bad = []
    for path in _tool_files():
        for line, module, names in _imports(path):
            if not module.startswith("pykvcache.") or module.startswith("pykvcache.tools"):
                continue
            private = [p for p in module.split(".") if p.startswith("_") and not p.startswith("__")]
            if private and not any(module == m or module.startswith(m + ".") for m in PRIVATE_ALLOWED):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports private module {module}")
            for name in names:
                if name.startswith("_") and not name.startswith("__"):
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports private name {module}.{name}")
    assert not bad, "\n".join(bad)


def test_demo_does_not_import_harness_internals_or_the_command():
    allowed = {"pykvcache.tools.bench", "pykvcache.tools.vllm_run", "pykvcache.tools.progress"}
    got = {m for _, m, _ in _imports(TOOLS / "demo.py") if m.startswith("pykvcache.tools")}
    # ``from .bench import BenchConfig, ...`` is the harness's public entry point.
    got -= {f"pykvcache.tools.bench.{n}" for n in ("BenchConfig", "quick", "run_bench", "smoke")}
    got -= {f"pykvcache.tools.vllm_run.{n}" for n in ("start_child", "wait_child")}
    got -= {"pykvcache.tools.progress.RichProgress"}
    assert got <= allowed, got - allowed


def test_private_vllm_attributes_are_reached_only_in_the_adapter():
    bad = []
    for path in _tool_files():
        if path == ADAPTER:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Attribute):
                continue
            owner_is_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            private = node.attr.startswith("_") and not node.attr.startswith("__") and not owner_is_self
            if private or node.attr in INTERNAL_ATTRIBUTES:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert not bad, "reach these through pykvcache.tools.vllm_adapter:\n" + "\n".join(bad)


def test_the_cost_model_is_fitted_in_one_place():
    """``pykvcache calibrate`` and the TTFT bench fit with one function; the
    pieces of the fit are called nowhere else."""
    pieces = {"fit_recompute", "fit_load_path", "fit_disk_step", "fit_disk", "fit"}
    fit_module = TOOLS / "calibrate" / "fit.py"
    users = set()
    for path in _tool_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
                if name in pieces and path != fit_module:
                    pytest.fail(f"{path.relative_to(ROOT)}:{node.lineno} fits {name} itself; use fit_cost_model")
                if name == "fit_cost_model":
                    users.add(path.relative_to(TOOLS).as_posix())
    assert users == {"calibrate/cli.py", "bench/ttft_driver.py"}


def test_what_the_product_imports_is_declared_and_rich_is_an_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def dist(requirement: str) -> str:
        return requirement.split(";")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip()

    declared = {dist(r) for r in project["dependencies"]}
    imported: dict[str, str] = {}
    for path in _product_files():
        if "testing" in path.relative_to(PACKAGE).parts:
            continue  # test fixtures (tiny model): the test environment provides them
        for line, module, _ in _imports(path):
            top = module.split(".")[0]
            if top and top != "pykvcache" and top not in sys.stdlib_module_names:
                imported.setdefault(top, f"{path.relative_to(ROOT)}:{line}")
    missing = {m: where for m, where in imported.items() if m not in declared | SERVING_ENGINE}
    assert not missing, f"imported by the product, not declared in [project].dependencies: {missing}"
    assert "numpy" in imported  # the vLLM integration's slot maps
    assert "rich" not in imported and "rich" not in declared
    assert "rich" in {dist(r) for r in project["optional-dependencies"]["tools"]}
    assert project["scripts"]["pykvcache"] == "pykvcache.tools.cli:main"


#: Run first in a child: rich is absent, as where it is not installed (``import rich``
#: and ``rich.*`` fail, ``importlib.util.find_spec("rich")`` is None, which is what
#: libraries probing for it see; a finder that raises would break their probes).
BLOCK_RICH = textwrap.dedent(
    """
    import sys

    sys.modules["rich"] = None
    """
)


def _python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    return subprocess.run(
        [sys.executable, "-c", BLOCK_RICH + textwrap.dedent(code), *args], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT
    )


def test_rich_is_really_blocked_in_the_child():
    proc = _python("import rich")
    assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr


def test_the_product_imports_without_rich():
    modules = ["pykvcache", "pykvcache.aio", "pykvcache.preformat", "pykvcache.gate"]
    if importlib.util.find_spec("vllm") is not None:
        modules += ["pykvcache.vllm.spec", "pykvcache.vllm.connector"]
    proc = _python(
        """
        import importlib, sys
        for name in sys.argv[1:]:
            importlib.import_module(name)
        assert sys.modules["rich"] is None and not [m for m in sys.modules if m.startswith("rich.")]
        leaked = sorted(m for m in sys.modules if m.startswith("pykvcache.tools"))
        assert not leaked, leaked
        print("imported", len(sys.argv) - 1)
        """,
        *modules,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"imported {len(modules)}" in proc.stdout


def test_the_command_without_rich_says_how_to_install_it(tmp_path):
    proc = _python(
        """
        import runpy, sys
        sys.argv = ["pykvcache", *sys.argv[1:]]
        runpy.run_module("pykvcache.tools.cli", run_name="__main__")
        """,
        "demo",
        "--no-vllm",
        "--no-bench",
        "--out",
        str(tmp_path / "demo"),
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "pip install 'pykvcache[tools]'" in proc.stderr
    assert "Traceback" not in proc.stderr
