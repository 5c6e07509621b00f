"""The shared-filesystem measurement (scripts/shared_fs_bench.py) runs end to
end on the session's GlusterFS mounts, small."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "shared_fs_bench.py"


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_the_shared_fs_bench_measures_pykvcache_and_fio_on_both_setups(gluster, tmp_path):
    out = tmp_path / "bench.json"
    local = tmp_path / "local"
    local.mkdir()
    pids = [str(p) for p in list(gluster.client_pids.values()) + gluster.server_pids()]
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--mib",
            "16",
            "--chunk-mib",
            "4",
            "--qd",
            "4",
            "--mount-a",
            str(gluster.mounts["a"]),
            "--mount-b",
            str(gluster.mounts["b"]),
            "--local",
            str(local),
            "--json",
            str(out),
            "--cpu-pids",
            *pids,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "shared filesystem (GlusterFS over veth, 2-core VM)" in proc.stdout
    results = json.loads(out.read_text())["results"]
    for where in ("local disk", "shared"):
        for tool in ("pykvcache", "fio"):
            for rw in ("write", "read"):
                r = results[where][tool][rw]
                assert r["gbps"] > 0 and r["cpu_s_per_gb"] >= 0, (where, tool, rw, r)
    # The FUSE clients and the brick work for every byte on the shared setup.
    assert results["shared"]["pykvcache"]["write"]["cpu_s_per_gb_all"] > results["shared"]["pykvcache"]["write"]["cpu_s_per_gb"]
    assert not list(local.iterdir()), "the bench left files behind"
