"""`make lint` runs the six lint gates, and `make test` runs it as a stage.

Cheap: reads the Makefile, dev/test_stages.sh, the pins, the mypy configuration, the stubtest
allowlist and the package's ignore comments; the gates themselves run in the lint stage, which
is what fails on a finding.
"""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: mypy's --strict, as pyproject.toml spells it out per module (an override's `strict = true`
#: would turn it on for every module).
STRICT_FLAGS = (
    "disallow_any_generics",
    "disallow_subclassing_any",
    "disallow_untyped_calls",
    "disallow_untyped_defs",
    "disallow_incomplete_defs",
    "disallow_untyped_decorators",
    "warn_return_any",
    "strict_equality",
    "extra_checks",
)


def _recipe(target: str) -> list[str]:
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = lines.index(f"{target}:")
    recipe = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip())
    return recipe


def test_make_lint_runs_clippy_rustfmt_ruff_ruff_format_mypy_and_stubtest():
    lint = next(line for line in (ROOT / "Makefile").read_text().splitlines() if line.startswith("lint:"))
    assert lint.split() == ["lint:", "lint-code", "typecheck"], lint
    recipe = _recipe("lint-code") + _recipe("typecheck")
    expected = [
        r"(CARGO_TARGET_DIR=target/maturin )?cargo clippy( --release)? --all-targets --features python( --quiet)? -- -D warnings",
        r"cargo fmt --check",
        r"\$\(PY\) -m ruff check( --quiet)? \.",
        r"\$\(PY\) -m ruff format --check( --quiet)? \.",
        r"\$\(PY\) -m mypy",
        r"\$\(PY\) -m mypy\.stubtest pykvcache\._core --allowlist dev/stubtest-allowlist\.txt",
    ]
    assert len(recipe) == len(expected), recipe
    for line, pattern in zip(recipe, expected):
        assert re.fullmatch(pattern, line), f"{line!r} is not {pattern!r}"


def test_make_test_runs_the_lint_stage_right_after_the_build():
    stages = [line for line in (ROOT / "dev" / "test_stages.sh").read_text().splitlines() if line.startswith("stage ")]
    names = [line.split()[1] for line in stages]
    assert names[names.index("build") + 1] == "lint", names
    assert "make --no-print-directory lint" in stages[names.index("lint")]


def test_the_lint_tools_are_pinned_and_configured():
    pins = dict(
        line.split("==")
        for line in (ROOT / "dev" / "requirements-dev.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    assert "ruff" in pins and "mypy" in pins, pins
    pyproject = (ROOT / "pyproject.toml").read_text()
    select = re.search(r"^\[tool\.ruff\.lint\]\n(?:#.*\n)*select = \[(.*?)\]", pyproject, re.M)
    assert select and {'"F"', '"E9"'} <= {s.strip() for s in select.group(1).split(",")}, "pyflakes and syntax errors"
    assert (ROOT / "rustfmt.toml").is_file()


def test_mypy_is_strict_for_the_product_and_checks_the_package():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert config["files"] == ["python/pykvcache"], config["files"]
    strict = [o for o in config["overrides"] if "pykvcache.vllm.*" in o["module"]]
    assert len(strict) == 1 and {"pykvcache", "pykvcache.gate.*"} <= set(strict[0]["module"]), strict
    assert all(strict[0].get(flag) is True for flag in STRICT_FLAGS), strict[0]
    # Untyped third-party modules are named one by one, never all at once.
    assert "ignore_missing_imports" not in config
    for override in config["overrides"]:
        if override.get("ignore_missing_imports"):
            assert not any(m.startswith("pykvcache") for m in override["module"]), override


def test_every_type_ignore_in_the_package_names_its_error_code_and_reason():
    bare = []
    for path in sorted((ROOT / "python" / "pykvcache").rglob("*.py*")):
        if path.suffix not in (".py", ".pyi"):
            continue
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if "# type: ignore" not in line:
                continue
            coded = re.search(r"# type: ignore\[[a-z-]+(, *[a-z-]+)*\]", line)
            # The reason: after the code on the same line, or a comment line just above.
            reason = coded and (line[coded.end() :].strip(" #") or (i and lines[i - 1].strip().startswith("#")))
            if not reason:
                bare.append(f"{path.relative_to(ROOT)}:{i + 1}: {line.strip()}")
    assert not bare, "\n".join(bare)


def test_every_stubtest_allowlist_entry_gives_its_reason():
    lines = (ROOT / "dev" / "stubtest-allowlist.txt").read_text().splitlines()
    entries = [i for i, line in enumerate(lines) if line.strip() and not line.startswith("#")]
    assert entries
    for i in entries:
        # The entry follows a comment (its reason) or another entry under the same reason.
        j = i - 1
        while j >= 0 and lines[j].strip() and not lines[j].startswith("#"):
            j -= 1
        assert j >= 0 and lines[j].startswith("#"), f"{lines[i]} has no reason above it"
