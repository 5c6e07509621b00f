"""`make lint` runs the four lint gates, and `make test` runs it as a stage.

Cheap: reads the Makefile, dev/test_stages.sh, the pins and the stubtest allowlist; the
gates themselves run in the lint stage, which is what fails on a finding.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _recipe(target: str) -> list[str]:
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = lines.index(f"{target}:")
    recipe = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip())
    return recipe


def test_make_lint_runs_clippy_rustfmt_ruff_and_stubtest():
    recipe = _recipe("lint")
    expected = [
        r"(CARGO_TARGET_DIR=target/maturin )?cargo clippy( --release)? --all-targets --features python( --quiet)? -- -D warnings",
        r"cargo fmt --check",
        r"\$\(PY\) -m ruff check( --quiet)? \.",
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
    pins = dict(line.split("==") for line in (ROOT / "dev" / "requirements-dev.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert "ruff" in pins and "mypy" in pins, pins
    pyproject = (ROOT / "pyproject.toml").read_text()
    select = re.search(r"^\[tool\.ruff\.lint\]\n(?:#.*\n)*select = \[(.*?)\]", pyproject, re.M)
    assert select and {'"F"', '"E9"'} <= {s.strip() for s in select.group(1).split(",")}, "pyflakes and syntax errors"
    assert (ROOT / "rustfmt.toml").is_file()


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
