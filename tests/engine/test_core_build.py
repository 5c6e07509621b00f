"""Which build of the engine is installed, and that users get the one without test hooks.

The engine's fault injection (``BlockStore``'s ``_fault_*`` keywords: short transfers,
injected errnos) is compiled into the build ``make develop`` makes for the tests, and left
out of the release wheel (``make wheel``) that users install. ``make test-vllm033`` runs this
file against that wheel with ``PYKVCACHE_RELEASE_WHEEL=1``; everywhere else the installed
engine is the tests' build.
"""

from __future__ import annotations

import errno
import os
import re
import tomllib
from pathlib import Path

import pykvcache as kv
import pytest
from pykvcache import _core

ROOT = Path(__file__).resolve().parents[2]
RELEASE_WHEEL = os.environ.get("PYKVCACHE_RELEASE_WHEEL") == "1"
HOOKS = [("_fault_max_transfer", 4096), ("_fault_fail_nth", (1, errno.EIO))]


def test_the_build_says_whether_it_has_the_test_hooks():
    assert isinstance(_core.FAULT_INJECTION, bool)
    if RELEASE_WHEEL:
        assert _core.FAULT_INJECTION is False, "the release wheel was built with fault injection"
    else:
        assert _core.FAULT_INJECTION is True, "the tests' engine lacks fault injection: run `make develop`"


@pytest.mark.parametrize(("keyword", "value"), HOOKS)
def test_a_fault_keyword_works_only_in_a_build_with_fault_injection(tmp_path, keyword, value):
    pool = kv.StagingPool(64 << 10, 2)
    make = lambda: kv.BlockStore(
        [str(tmp_path)],
        pool,
        namespace="build",
        capacity_bytes=1 << 30,  # noqa: E731
        **{keyword: value},
    )
    if _core.FAULT_INJECTION:
        with make() as store:
            assert store.stats()["writes"] == 0
        return
    with pytest.raises(TypeError, match=rf"{keyword}: test hooks this build of pykvcache does not have"):
        make()
    with kv.BlockStore([str(tmp_path)], pool, namespace="build", capacity_bytes=1 << 30) as store:
        assert store.stats()["writes"] == 0, "without the keyword the same store opens"


def test_the_wheel_is_configured_without_fault_injection():
    """The wheel gets the features pyproject.toml names for maturin; ``python`` must not
    imply the test hooks, and the tests' build asks for them itself."""
    features = tomllib.loads((ROOT / "Cargo.toml").read_text())["features"]
    assert "fault-injection" not in features["python"]
    maturin = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["maturin"]
    assert "fault-injection" not in maturin["features"]
    makefile = (ROOT / "Makefile").read_text()
    develop = re.search(r"^develop:.*\n\tbash (\S+)$", makefile, re.M)
    assert develop, "make develop runs a script"
    assert "--features python,fault-injection" in (ROOT / develop.group(1)).read_text()
    assert "PYKVCACHE_RELEASE_WHEEL=1" in makefile and "tests/engine/test_core_build.py" in makefile
