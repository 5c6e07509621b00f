"""The mark of every test that passes the engine's ``_fault_*`` keywords (its test hooks)."""

import pytest
from pykvcache import _core

#: On a test that passes ``BlockStore(_fault_...=)``: the release wheel is built without
#: fault injection and refuses those keywords (``tests/engine/test_core_build.py``).
NEEDS_FAULT_INJECTION = pytest.mark.skipif(
    not _core.FAULT_INJECTION,
    reason="this build of pykvcache._core has no fault injection (the release wheel); "
    "the _fault_* keywords need the build `make develop` makes",
)
