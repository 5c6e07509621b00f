"""The shared-filesystem fixture: one GlusterFS volume mounted by two FUSE
clients in their own network namespaces (tests/helpers/glusterfs.py). Set up
once per session (~4 s), torn down at the end whatever happened (also on
KeyboardInterrupt: pytest's finalizer, and an atexit hook as a second line);
a run killed before that is cleaned by the next setup."""

from __future__ import annotations

import atexit

import glusterfs
import pytest


def _start(consistency: str, ping_timeout: int | None):
    try:
        fx = glusterfs.start(consistency=consistency, ping_timeout=ping_timeout)
    except glusterfs.GlusterUnavailable as exc:
        pytest.skip(str(exc))
    atexit.register(fx.teardown)
    return fx


@pytest.fixture(scope="session")
def gluster():
    """Strict consistency (no client caches: another mount sees a change within
    ~25 ms), O_DIRECT to the brick, ``network.ping-timeout`` 5 s."""
    fx = _start("strict", 5)
    try:
        yield fx
    finally:
        fx.teardown()


@pytest.fixture(scope="session")
def gluster_default():
    """The same with Gluster's default caching (about 1 s of staleness between
    mounts for replaced files, sizes and deletions)."""
    fx = _start("default", 5)
    try:
        yield fx
    finally:
        fx.teardown()


@pytest.fixture
def shared_dirs(gluster, request):
    """A fresh directory on the volume for one test: (node A's path, node B's path)."""
    name = request.node.name.replace("[", "-").replace("]", "").replace("/", "-")[:80]
    a, b = gluster.mounts["a"] / name, gluster.mounts["b"] / name
    if a.exists():
        import shutil

        shutil.rmtree(a, ignore_errors=True)
    a.mkdir(mode=0o700)
    yield a, b
    import shutil

    shutil.rmtree(a, ignore_errors=True)
