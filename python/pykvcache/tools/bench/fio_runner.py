"""fio as the physical limit of the storage under the benchmark directory.

Every run uses io_uring, O_DIRECT, registered (fixed) buffers and registered
files -- the same mechanisms the engine uses -- on files that were completely
written first (reads of never-written extents return zeros without touching the
device). One fio job at one depth is not the device limit on every machine
(virtio disks, for one, read faster with several files in flight), so the limit
is the best configuration of a sweep over depth and numjobs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .cold_cache import DiskCounter
from .cpu_meter import CpuPerGb

FILE_PREFIX = "pykvcache-fio"


class FioError(RuntimeError):
    pass


@dataclass(frozen=True)
class FioJob:
    rw: str  # "read" | "write"
    block_bytes: int
    iodepth: int
    numjobs: int
    runtime_s: float
    fixedbufs: bool = True
    # 0: a few large preconditioned files (the device limit). N > 0: the
    # engine's own layout -- N fresh files of one chunk each, written once
    # (allocating, like the engine's puts) and read back once.
    chunk_files: int = 0
    # Chunk files only: write over the files a previous write of the same
    # shape left (allocated blocks), as the engine does when it recycles.
    overwrite: bool = False

    @property
    def label(self) -> str:
        layout = f" files={self.chunk_files}" if self.chunk_files else ""
        layout += " overwrite" if self.overwrite else ""
        return f"fio {self.rw} bs={self.block_bytes >> 20}MiB qd={self.iodepth} jobs={self.numjobs}{layout}"

    @property
    def inflight_bytes(self) -> int:
        return self.block_bytes * self.iodepth * self.numjobs


@dataclass
class FioResult(CpuPerGb):
    job: FioJob
    bytes: int
    seconds: float
    bw_bytes_s: float
    cpu_user_s: float
    cpu_sys_s: float
    mean_latency_s: float | None
    command: list[str]
    disk: dict[str, int] | None = None

    @property
    def gbps(self) -> float:
        return self.bw_bytes_s / 1e9

    def to_dict(self) -> dict:
        d = asdict(self)
        d["gbps"] = self.gbps
        d["cpu_s_per_gb"] = self.cpu_s_per_gb
        return d


def parse_fio_json(text: str, job: FioJob, command: list[str]) -> FioResult:
    """Aggregate fio's per-job JSON (no group_reporting) into one result.

    Bandwidth is total bytes over the longest job's runtime; CPU is the sum over
    jobs of usr/sys percentages times that job's own runtime (fio reports CPU as
    a percentage of one core over the job's life).
    """
    # fio may print notices before the JSON document.
    start = text.find("{")
    if start < 0:
        raise FioError(f"no JSON in fio output: {text[:200]!r}")
    try:
        doc = json.loads(text[start:])
    except json.JSONDecodeError as e:
        raise FioError(f"unparseable fio JSON: {e}") from e
    jobs = doc.get("jobs") or []
    if not jobs:
        raise FioError("fio reported no jobs")
    total_bytes = 0
    longest_ms = 0
    user = sys_ = 0.0
    lat_weighted = 0.0
    ios = 0
    for j in jobs:
        if j.get("error"):
            raise FioError(f"fio job {j.get('jobname')} failed with error {j['error']}")
        d = j[job.rw]
        total_bytes += int(d["io_bytes"])
        longest_ms = max(longest_ms, int(d["runtime"]))
        run_s = int(j.get("job_runtime", d["runtime"])) / 1000.0
        user += float(j["usr_cpu"]) / 100.0 * run_s
        sys_ += float(j["sys_cpu"]) / 100.0 * run_s
        n = int(d.get("total_ios", 0))
        lat = d.get("lat_ns", {}).get("mean")
        if n and lat is not None:
            lat_weighted += float(lat) * n
            ios += n
    seconds = longest_ms / 1000.0
    if seconds <= 0 or total_bytes <= 0:
        raise FioError(f"fio moved no data ({job.label})")
    return FioResult(
        job=job,
        bytes=total_bytes,
        seconds=seconds,
        bw_bytes_s=total_bytes / seconds,
        cpu_user_s=user,
        cpu_sys_s=sys_,
        mean_latency_s=(lat_weighted / ios / 1e9) if ios else None,
        command=command,
    )


@dataclass
class FioRunner:
    """Runs fio jobs against preconditioned files in ``directory``."""

    directory: Path
    file_bytes: int
    max_numjobs: int
    fio: str = field(default_factory=lambda: shutil.which("fio") or "fio")
    before_run: Callable[[FioJob], None] | None = None
    disk: DiskCounter | None = None

    def __post_init__(self) -> None:
        self.directory = Path(self.directory)
        self._prepared = 0

    @staticmethod
    def available() -> bool:
        return shutil.which("fio") is not None

    def _base_args(self, name: str, numjobs: int) -> list[str]:
        return [
            self.fio,
            f"--name={name}",
            f"--directory={self.directory}",
            f"--filename_format={FILE_PREFIX}.$jobnum",
            f"--size={self.file_bytes}",
            "--ioengine=io_uring",
            "--direct=1",
            f"--numjobs={numjobs}",
        ]

    def precondition(self, numjobs: int | None = None) -> list[str]:
        """Write every file the sweep will read, once, completely."""
        n = numjobs or self.max_numjobs
        if self._prepared >= n:
            return []
        self.directory.mkdir(parents=True, exist_ok=True)
        cmd = [
            *self._base_args("precondition", n),
            "--rw=write",
            "--bs=4m",
            "--iodepth=8",
            "--output-format=json",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise FioError(f"fio precondition failed: {proc.stderr.strip()[-500:]}")
        for i in range(n):
            p = self.directory / f"{FILE_PREFIX}.{i}"
            if not p.exists() or p.stat().st_size < self.file_bytes:
                raise FioError(f"precondition did not write {p}")
        os.sync()
        self._prepared = n
        return cmd

    @property
    def chunk_dir(self) -> Path:
        return self.directory / "chunk-files"

    def _chunk_files_command(self, job: FioJob, output: Path) -> list[str]:
        return [
            self.fio,
            "--name=chunkfiles",
            f"--directory={self.chunk_dir}",
            f"--nrfiles={job.chunk_files}",
            f"--filesize={job.block_bytes}",
            f"--bs={job.block_bytes}",
            # One I/O per file, qd files open: the engine's access pattern.
            f"--openfiles={job.iodepth}",
            "--file_service_type=roundrobin",
            # The engine does not preallocate: blocks are allocated by the writes.
            "--fallocate=none",
            "--ioengine=io_uring",
            "--direct=1",
            *(["--fixedbufs"] if job.fixedbufs else []),
            f"--rw={job.rw}",
            f"--iodepth={job.iodepth}",
            f"--numjobs={job.numjobs}",
            "--output-format=json",
            f"--output={output}",
        ]

    def command(self, job: FioJob, output: Path) -> list[str]:
        if job.chunk_files:
            return self._chunk_files_command(job, output)
        cmd = [
            *self._base_args("bench", job.numjobs),
            f"--rw={job.rw}",
            f"--bs={job.block_bytes}",
            f"--iodepth={job.iodepth}",
            "--time_based",
            f"--runtime={max(1, round(job.runtime_s * 1000))}ms",
            "--output-format=json",
            f"--output={output}",
        ]
        if job.fixedbufs:
            # Without fixed buffers fio takes page faults on its read buffers
            # inside the timed window and under-reports reads badly.
            cmd[-2:-2] = ["--fixedbufs", "--registerfiles"]
        return cmd

    def run(self, job: FioJob) -> FioResult:
        if job.chunk_files:
            if job.rw == "write" and not job.overwrite:
                # Fresh files every time, as the engine's puts create them.
                shutil.rmtree(self.chunk_dir, ignore_errors=True)
            elif not self.chunk_dir.exists():
                raise FioError("a chunk-files read or overwrite needs the chunk-files write of the same shape first")
            self.chunk_dir.mkdir(parents=True, exist_ok=True)
        else:
            self.precondition(max(job.numjobs, self._prepared))
        if self.before_run is not None:
            self.before_run(job)
        with tempfile.TemporaryDirectory(prefix="pykvcache-fio-") as tmp:
            out = Path(tmp) / "fio.json"
            cmd = self.command(job, out)
            d0 = self.disk.sample() if self.disk else None
            proc = subprocess.run(cmd, capture_output=True, text=True)
            d1 = self.disk.sample() if self.disk else None
            if proc.returncode != 0:
                raise FioError(f"{job.label} failed (rc {proc.returncode}): {proc.stderr.strip()[-500:]}")
            text = out.read_text() if out.exists() else proc.stdout
        result = parse_fio_json(text, job, _portable(cmd))
        delta = DiskCounter.delta(d0, d1)
        result.disk = delta.to_dict() if delta else None
        return result

    def cleanup(self) -> None:
        for p in self.directory.glob(f"{FILE_PREFIX}.*"):
            p.unlink(missing_ok=True)
        shutil.rmtree(self.chunk_dir, ignore_errors=True)
        self._prepared = 0


def _portable(cmd: list[str]) -> list[str]:
    """The command as a reader can rerun it: no temp output path."""
    return [c for c in cmd if not c.startswith("--output=")]


def sweep_jobs(
    rw: str,
    block_bytes: int,
    configs: Iterable[tuple[int, int]],
    runtime_s: float,
    max_inflight_bytes: int,
) -> list[FioJob]:
    """(numjobs, iodepth) pairs -> jobs, leaving out those whose registered
    buffers (numjobs x depth x bs) would exceed the memory cap."""
    jobs = []
    for numjobs, depth in configs:
        job = FioJob(rw=rw, block_bytes=block_bytes, iodepth=depth, numjobs=numjobs, runtime_s=runtime_s)
        if job.inflight_bytes <= max_inflight_bytes:
            jobs.append(job)
    return jobs


def best(results: Iterable[FioResult], rw: str, block_bytes: int | None = None) -> FioResult | None:
    pool = [r for r in results if r.job.rw == rw and (block_bytes is None or r.job.block_bytes == block_bytes)]
    return max(pool, key=lambda r: r.bw_bytes_s, default=None)
