"""The calibration profile: what ``pykvcache calibrate`` measured, as JSON.

A profile is only valid for the model, dtype, KV size and accelerator it was
measured on. :func:`load_cost_model` checks that before trusting it; when the
file is missing, unreadable or made for something else it logs why and
returns a conservative default instead (serving goes on). The default gate
loads prefixes of :data:`DEFAULT_BREAK_EVEN_TOKENS` tokens or more, the
static threshold other KV tiers use, and still refines itself online.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import stat
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pykvcache._sysinfo import cpu_model
from pykvcache.gate.cost_model import INF, CostModel, LoadCost, PrefillCurve

logger = logging.getLogger(__name__)

PROFILE_FORMAT = "pykvcache-gate-profile"
PROFILE_VERSION = 1

#: Break-even of the default model used without a valid profile (tokens).
DEFAULT_BREAK_EVEN_TOKENS = 256
_DEFAULT_FIXED_S = 1e-3
_DEFAULT_DISK_BYTES_PER_S = 1e9


class ProfileError(ValueError):
    """A profile file is malformed or cannot be read."""


def _accelerator_name() -> str:
    """Name of the first NVIDIA GPU from the driver's /proc entry (no CUDA
    initialisation: the scheduler process must not create a CUDA context),
    else ``cpu``."""
    root = Path("/proc/driver/nvidia/gpus")
    try:
        for info in sorted(root.iterdir()):
            for line in (info / "information").read_text().splitlines():
                if line.startswith("Model:"):
                    return "gpu:" + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


_cpu_model = cpu_model


def hardware_id() -> dict[str, Any]:
    """What the prefill curve depends on: the accelerator (or the CPU model and
    core count on a CPU-only host)."""
    return {"accelerator": _accelerator_name(), "cpu": _cpu_model(), "cpus": os.cpu_count() or 0}


def storage_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The block device and filesystem holding ``path`` (Linux /sys and /proc)."""
    path = os.path.abspath(os.fspath(path))
    info: dict[str, Any] = {"dir": path, "device": None, "fstype": None}
    try:
        st = os.stat(path)
    except OSError:
        return info
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    info["device"] = f"{major}:{minor}"
    sys_dev = Path(f"/sys/dev/block/{major}:{minor}")
    if sys_dev.exists():
        info["device"] = sys_dev.resolve().name
    best = ""
    try:
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            left, _, right = line.partition(" - ")
            mount_point = left.split()[4].replace("\\040", " ")
            within = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
            if within and len(mount_point) >= len(best):
                best = mount_point
                info["fstype"] = right.split()[0]
    except (OSError, IndexError):
        pass
    return info


def _norm_dtype(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _norm_model(model: str) -> str:
    return str(model).rstrip("/").rsplit("/", 1)[-1]


#: Far above any profile (a few KiB): a larger file is not one, and is not read into memory.
MAX_PROFILE_BYTES = 16 << 20


def _read_regular_file(path: str | os.PathLike[str], limit: int) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes. Opened
    non-blocking and checked before reading: a FIFO or device at the path
    would otherwise block start-up or be read without end."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        if st.st_size > limit:
            raise OSError(errno.EFBIG, f"{st.st_size} bytes, more than a profile ({limit} at most)")
        with os.fdopen(fd, "rb") as f:
            fd = -1
            return f.read(limit + 1)
    finally:
        if fd >= 0:
            os.close(fd)


@dataclass
class GateProfile:
    model: str
    dtype: str
    block_size: int  # tokens per KV block in the engine
    chunk_tokens: int  # tokens per stored chunk
    kv_bytes_per_token: float  # as stored: all layers, all ranks, row padding included
    world_size: int
    hardware: dict[str, Any]
    storage: dict[str, Any]  # dir, device, fstype, direct_io, backend
    prefill: dict[str, Any]  # a, b, c (+ measured points)
    load: dict[str, Any]  # fixed_s, disk_bytes_per_s, h2d_bytes_per_s, step_s, disk_step_s (+ points)
    break_even_tokens: float | None  # None: loading never pays
    created: str
    pykvcache_version: str
    version: int = PROFILE_VERSION
    format: str = PROFILE_FORMAT
    notes: list[str] = field(default_factory=list)

    def cost_model(self) -> CostModel:
        p, ld = self.prefill, self.load
        h2d = ld.get("h2d_bytes_per_s")
        return CostModel(
            PrefillCurve(float(p["a"]), float(p["b"]), float(p["c"])),
            LoadCost(
                float(ld["fixed_s"]),
                float(ld["disk_bytes_per_s"]),
                INF if h2d is None else float(h2d),
                float(ld.get("step_s", 0.0)),
                float(ld.get("disk_step_s", 0.0)),
            ),
            float(self.kv_bytes_per_token),
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=False) + "\n"

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write atomically (a reader never sees half a profile)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(self.to_json())
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def from_dict(cls, data: Any) -> GateProfile:
        if not isinstance(data, dict):
            raise ProfileError("profile must be a JSON object")
        if data.get("format") != PROFILE_FORMAT:
            raise ProfileError(f"not a pykvcache gate profile (format={data.get('format')!r})")
        if data.get("version") != PROFILE_VERSION:
            raise ProfileError(
                f"profile version {data.get('version')!r} is not supported (this pykvcache reads "
                f"version {PROFILE_VERSION}); run `pykvcache calibrate` again"
            )
        names = set(cls.__dataclass_fields__)
        missing = sorted(n for n in names - set(data) if n != "notes")
        if missing:
            raise ProfileError(f"profile lacks {', '.join(missing)}")
        profile = cls(**{k: v for k, v in data.items() if k in names})
        for key in ("prefill", "load", "hardware", "storage"):
            if not isinstance(getattr(profile, key), dict):
                raise ProfileError(f"profile field {key} must be an object")
        bpt = profile.kv_bytes_per_token
        if not (isinstance(bpt, (int, float)) and not isinstance(bpt, bool) and math.isfinite(bpt) and bpt > 0):
            raise ProfileError(f"profile field kv_bytes_per_token must be a number > 0 (got {bpt!r})")
        for key, lo in (("block_size", 1), ("chunk_tokens", 1), ("world_size", 1)):
            v = getattr(profile, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ProfileError(f"profile field {key} must be an integer >= {lo} (got {v!r})")
        try:
            profile.cost_model()  # validates every coefficient
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileError(f"profile coefficients are invalid: {exc}") from None
        be = profile.break_even_tokens
        if be is not None and not (isinstance(be, (int, float)) and math.isfinite(be) and be >= 0):
            raise ProfileError(f"break_even_tokens must be a number >= 0 or null (got {be!r})")
        return profile

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> GateProfile:
        try:
            raw = _read_regular_file(path, MAX_PROFILE_BYTES)
        except OSError as exc:
            raise ProfileError(f"cannot read gate profile {path}: {exc.strerror or exc}") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            # A binary file (or the wrong file) must not stop start-up either.
            raise ProfileError(
                f"gate profile {path} is not UTF-8 text, so not a JSON profile (byte {exc.start}: {raw[exc.start : exc.start + 1]!r})"
            ) from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProfileError(f"gate profile {path} is not valid JSON: {exc}") from None
        except RecursionError:
            raise ProfileError(f"gate profile {path} is not valid JSON: nested too deeply") from None
        try:
            return cls.from_dict(data)
        except ProfileError as exc:
            raise ProfileError(f"gate profile {path}: {exc}") from None


@dataclass(frozen=True)
class ProfileExpectation:
    """What the running engine is; a profile must match it to be used."""

    model: str
    dtype: str
    kv_bytes_per_token: float
    chunk_tokens: int
    hardware: dict[str, Any] | None = None  # None: this host's hardware_id()
    storage_device: str | None = None


def mismatches(profile: GateProfile, expected: ProfileExpectation) -> tuple[list[str], list[str]]:
    """``(fatal, minor)`` differences. Fatal ones invalidate the prefill curve
    or the byte counts; minor ones only make the load estimate rougher (online
    refinement corrects it)."""
    fatal, minor = [], []
    if _norm_model(profile.model) != _norm_model(expected.model):
        fatal.append(f"model {profile.model!r} != {expected.model!r}")
    if _norm_dtype(profile.dtype) != _norm_dtype(expected.dtype):
        fatal.append(
            f"dtype {profile.dtype} != {_norm_dtype(expected.dtype)} (run `pykvcache calibrate "
            f"--dtype {_norm_dtype(expected.dtype)}`, or serve with --dtype {profile.dtype})"
        )
    if not math.isclose(profile.kv_bytes_per_token, expected.kv_bytes_per_token, rel_tol=0.02):
        fatal.append(f"KV bytes per token {profile.kv_bytes_per_token:g} != {expected.kv_bytes_per_token:g}")
    hw = expected.hardware if expected.hardware is not None else hardware_id()
    if profile.hardware.get("accelerator") != hw.get("accelerator"):
        fatal.append(f"accelerator {profile.hardware.get('accelerator')!r} != {hw.get('accelerator')!r}")
    elif hw.get("accelerator") == "cpu" and (
        profile.hardware.get("cpu") != hw.get("cpu") or profile.hardware.get("cpus") != hw.get("cpus")
    ):
        fatal.append(f"CPU {profile.hardware.get('cpu')!r} x{profile.hardware.get('cpus')} != {hw.get('cpu')!r} x{hw.get('cpus')}")
    if profile.chunk_tokens != expected.chunk_tokens:
        minor.append(f"chunk of {profile.chunk_tokens} tokens != {expected.chunk_tokens}")
    dev = profile.storage.get("device")
    if expected.storage_device is not None and dev is not None and dev != expected.storage_device:
        minor.append(f"storage device {dev} != {expected.storage_device}")
    return fatal, minor


def default_cost_model(bytes_per_token: float) -> CostModel:
    """Conservative model without a profile: a 1 GB/s, 1 ms device and a linear
    prefill curve chosen so that the break-even is DEFAULT_BREAK_EVEN_TOKENS."""
    load = LoadCost(_DEFAULT_FIXED_S, _DEFAULT_DISK_BYTES_PER_S)
    per_token = _DEFAULT_FIXED_S / DEFAULT_BREAK_EVEN_TOKENS + bytes_per_token / _DEFAULT_DISK_BYTES_PER_S
    return CostModel(PrefillCurve(0.0, per_token, 0.0), load, bytes_per_token)


def load_cost_model(path: str | os.PathLike[str] | None, expected: ProfileExpectation, *, gating: bool = True) -> tuple[CostModel, str]:
    """The cost model to gate with and where it came from (``"profile"`` or
    ``"default: <why>"``). Never raises for a bad profile: it warns once and
    falls back to :func:`default_cost_model`. ``gating=False`` (``gate: false``:
    everything is loaded, the model only prices the counters) logs the
    fallback at info: there is no decision for a missing profile to change."""
    why: str
    if path is None:
        why = "no gate profile configured (run `pykvcache calibrate` and set gate_profile)"
    else:
        try:
            profile = GateProfile.read(path)
        except ProfileError as exc:
            why = str(exc)
        else:
            fatal, minor = mismatches(profile, expected)
            if not fatal:
                for m in minor:
                    logger.warning("pykvcache gate: profile %s measured with %s; using it anyway", path, m)
                return profile.cost_model(), "profile"
            why = f"gate profile {path} was measured for something else: " + "; ".join(fatal)
    logger.log(
        logging.WARNING if gating else logging.INFO,
        "pykvcache gate: %s.%s Using a conservative default: load prefixes of %d tokens or more.",
        why,
        "" if path is None else " The gate_profile setting is ignored.",
        DEFAULT_BREAK_EVEN_TOKENS,
    )
    return default_cost_model(expected.kv_bytes_per_token), f"default: {why}"
