"""Two clones on one machine each import their own tree (dev/env_cache.sh).

Third-party packages are installed once per machine and shared; the project is installed per
clone. A shared environment that held the editable install pointed every clone at the tree that
ran `make develop` (or `make demo`) last: this clone's tests would then run another tree's code.
Here a second clone of this tree runs `make develop` (what `make demo` and `make test` run
first) against the same environment cache, and each clone's .venv must still import its own
package and its own extension.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: What `make develop` needs from a clone (the docs and tests are not built).
_BUILD_INPUTS = ("Makefile", "Cargo.toml", "Cargo.lock", "pyproject.toml", "README.md", "rust", "python", "dev")


def _imported_paths(clone: Path) -> tuple[Path, Path]:
    out = subprocess.run(
        [
            str(clone / ".venv" / "bin" / "python"),
            "-c",
            "import pykvcache, pykvcache._core as c; print(pykvcache.__file__); print(c.__file__)",
        ],
        cwd="/",
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return Path(out[0]).resolve(), Path(out[1]).resolve()


def _copy_clone(dest: Path) -> None:
    """The tracked and new (not ignored) build inputs of this tree, as a fresh clone has them."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z", "--", *_BUILD_INPUTS], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    for raw in filter(None, listed):
        rel = raw.decode()
        src = ROOT / rel
        if not src.is_file():
            continue  # deleted in the work tree, not yet in git
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)


@pytest.mark.slow
def test_a_second_clone_installs_into_its_own_environment(tmp_path):
    venv = ROOT / ".venv"
    if not venv.exists():
        pytest.skip("no .venv: run `make develop` first")
    assert not venv.is_symlink(), ".venv must be the clone's own environment, not a link into the shared cache"
    assert (venv / ".pykvcache-deps").is_file(), ".venv was not set up by dev/setup_venv.sh"
    mine = _imported_paths(ROOT)
    assert all(p.is_relative_to(ROOT / "python") for p in mine), mine

    other = tmp_path / "other-clone"
    _copy_clone(other)
    env = dict(os.environ)
    # The same environment cache as this clone's (the shared deps are reused, nothing downloads),
    # and this clone's dependency builds (only the crate itself compiles).
    env["PYKVCACHE_ENV_CACHE"] = str(Path((venv / ".pykvcache-deps").read_text().strip()).parent)
    env["PYKVCACHE_MATURIN_TARGET"] = str(ROOT / "target" / "maturin")
    env.pop("VIRTUAL_ENV", None)
    done = subprocess.run(["make", "--no-print-directory", "develop"], cwd=other, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]

    theirs = _imported_paths(other)
    assert all(p.is_relative_to(other / "python") for p in theirs), theirs
    assert _imported_paths(ROOT) == mine, "the other clone's install changed what this clone imports"

    # The shared environment holds third-party packages only.
    deps = Path((venv / ".pykvcache-deps").read_text().strip())
    shared = subprocess.run([str(deps / "bin" / "python"), "-c", "import pykvcache"], cwd="/", capture_output=True, text=True)
    assert shared.returncode != 0, "the shared environment imports a pykvcache of some clone"
