import os
import subprocess

import pytest


@pytest.fixture
def store_dir(tmp_path):
    d = tmp_path / "store"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture
def mounted(tmp_path):
    """Mounts a real filesystem of a given type for the test (needs root)."""
    mounts = []

    def mount(fstype: str, options: str = "mode=0700"):
        target = tmp_path / f"mnt-{fstype}-{len(mounts)}"
        target.mkdir()
        rc = subprocess.run(["mount", "-t", fstype, "-o", options, fstype, str(target)], capture_output=True)
        if rc.returncode != 0:
            pytest.skip(f"cannot mount {fstype} here: {rc.stderr.decode().strip()}")
        mounts.append(target)
        return target

    yield mount
    for m in mounts:
        subprocess.run(["umount", str(m)], check=False)


def pytest_report_header(config):
    return f"pykvcache tests, uid={os.getuid()}"
