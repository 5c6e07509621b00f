"""The shared-filesystem measurement (scripts/shared_fs_bench.py) runs end to
end on the suite's GlusterFS mounts, small."""

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


OPS_SCRIPT = SCRIPT.with_name("shared_fs_ops.py")


@pytest.mark.skipif(shutil.which("fio") is None or shutil.which("setfattr") is None, reason="fio or setfattr is not installed")
def test_the_ops_count_says_what_a_chunk_costs_beside_fio(gluster, tmp_path):
    """scripts/shared_fs_ops.py on the suite's mounts, one small case: the
    clients' counters give the engine's operations per chunk, READ and WRITE
    apart, and fio's on the same mounts; one file per chunk against the
    default there, segment files (decision 0086)."""
    import glusterfs

    sys.path.insert(0, str(SCRIPT.parent))
    import shared_fs_ops

    for key in shared_fs_ops.COUNTING:
        gluster.cli("volume", "set", glusterfs.VOLUME, key, "on")
    out = tmp_path / "ops.json"
    try:
        engines = ["--engine", "files=;segment_files=false", "--engine", "default="]
        args = ["--chunks", "1", "--qd", "2", "--mib", "2", "--repeats", "1", "--layouts", *engines, "--json", str(out)]
        mounts = ["--mount-a", str(gluster.mounts["a"]), "--mount-b", str(gluster.mounts["b"])]
        proc = subprocess.run([sys.executable, str(OPS_SCRIPT), *args, *mounts], capture_output=True, text=True, timeout=300)
    finally:
        for key in shared_fs_ops.COUNTING:
            gluster.cli("volume", "set", glusterfs.VOLUME, key, "off")
    assert proc.returncode == 0, proc.stderr[-3000:]
    row, segments, *bounds = json.loads(out.read_text())
    assert row["chunks"] == 16 and "| files | 1 MiB | 2 |" in proc.stdout
    for tool in ("pykvcache", "fio"):
        for phase in ("put", "get"):
            ops = row[tool][phase]["ops"]
            assert row[tool][phase]["gbps"] > 0, (tool, phase)
            assert ops.get("WRITE" if phase == "put" else "READ", 0) >= 16, (tool, phase, ops)
    # The default on a network filesystem: no name per chunk. One segment
    # created for the 16 chunks; a get opens nothing (its segment is held).
    seg_put, seg_get = segments["pykvcache"]["put"]["ops"], segments["pykvcache"]["get"]["ops"]
    assert segments["engine"] == "default" and seg_put.get("CREATE", 0) <= 1 and "RENAME" not in seg_put, seg_put
    assert seg_get.get("OPEN", 0) <= 1 and seg_put["WRITE"] >= 16, (seg_put, seg_get)
    assert shared_fs_ops.per_chunk(seg_put, 16)[0] < shared_fs_ops.per_chunk(row["pykvcache"]["put"]["ops"], 16)[0] / 3
    # A put creates and renames a file: metadata a fio block does not pay.
    put = row["pykvcache"]["put"]["ops"]
    assert put.get("CREATE") == 16 and put.get("RENAME") == 16, put
    # Held shard directories: a put looks up its temp file's name, the chunk's
    # and both at the rename, not every component of their paths (5 + 1 for a
    # shard not held yet, against 28 walking the paths).
    assert put["LOOKUP"] <= 6 * 16, put
    # The capacity ledger's credit: a transaction (lock and unlock) covers
    # several puts, so a put's locks are mostly its temp file's (2).
    assert put["LK"] < 3 * 16, put
    assert shared_fs_ops.per_chunk(put, 16)[0] > shared_fs_ops.per_chunk(row["fio"]["put"]["ops"], 16)[0]
    # --layouts: the bounds beside the engine, each row against the same fio run.
    by_name = {b["engine"]: b for b in bounds}
    assert sorted(by_name) == ["fio again", "logged", "named", "unnamed"] and all(b["fio"] == row["fio"] for b in bounds)
    named, unnamed = by_name["named"]["pykvcache"], by_name["unnamed"]["pykvcache"]
    # One link per chunk and no file of its own; read back by reading the link.
    assert named["put"]["ops"].get("SYMLINK") == 16 and "CREATE" not in named["put"]["ops"], named["put"]["ops"]
    assert named["get"]["ops"].get("READLINK") == 16, named["get"]["ops"]
    assert shared_fs_ops.per_chunk(unnamed["put"]["ops"], 16)[0] < 1 and shared_fs_ops.per_chunk(unnamed["get"]["ops"], 16)[0] < 1
    # Logged: the index block rewritten after each chunk, a write with no other operation.
    logged = by_name["logged"]["pykvcache"]
    assert logged["put"]["ops"]["WRITE"] >= unnamed["put"]["ops"]["WRITE"] + 16, (logged["put"]["ops"], unnamed["put"]["ops"])
    assert shared_fs_ops.per_chunk(logged["put"]["ops"], 16)[0] < 1
    assert by_name["fio again"]["pykvcache"]["get"]["gbps"] > 0


def test_the_holes_probe_answers_what_segment_files_rely_on(gluster):
    """``shared_fs_ops.py --holes`` on the suite's mounts: a hole punched
    through node A reads as zeros through node B, and node B still reads a
    file node A unlinked through a descriptor it opened before (decision 0086)."""
    mounts = ["--mount-a", str(gluster.mounts["a"]), "--mount-b", str(gluster.mounts["b"])]
    proc = subprocess.run([sys.executable, str(OPS_SCRIPT), "--holes", *mounts], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "hole all zeros: True; the rest unchanged: True" in proc.stdout, proc.stdout
    assert f"{8 << 20} of {8 << 20} bytes, right: True" in proc.stdout, proc.stdout
    assert not [p for p in gluster.mounts["a"].iterdir() if p.name.startswith("holes-")], "the probe left its file"
