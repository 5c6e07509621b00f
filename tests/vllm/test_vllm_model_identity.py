"""The model identity in the namespace: what changes KV values changes it, and
nothing else does (a path, an mtime, a scheduler setting). The weights are
identified by a digest of every byte (decision 0052), cached per node against
the file's identity so a second start reads nothing."""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
import shutil
import stat
import struct
import time
from pathlib import Path

import pytest
from pykvcache.vllm.identity.model_identity import (
    config_identity,
    model_identity,
    resolve_weights,
    weights_identity,
)
from pykvcache.vllm.identity.namespace import identity_digest

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

TENSOR_BYTES = 100_000


@pytest.fixture(autouse=True)
def private_cache_home(tmp_path, monkeypatch):
    """The default digest cache lives under the user's cache directory: a test's own."""
    home = tmp_path / "xdg-cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    return home


def _safetensors(path: Path, tensors: dict[str, bytes]) -> None:
    header, offset = {}, 0
    for name, data in tensors.items():
        header[name] = {"dtype": "U8", "shape": [len(data)], "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + b"".join(tensors.values()))


def _build_checkpoint(d: Path) -> Path:
    d.mkdir()
    tensors = {f"layer{i}.weight": bytes([i]) * (TENSOR_BYTES + i) for i in range(4)}
    _safetensors(d / "model.safetensors", tensors)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    (d / "tokenizer.json").write_text("{}")
    return d


@pytest.fixture
def checkpoint(tmp_path):
    return _build_checkpoint(tmp_path / "ckpt")


@pytest.fixture(scope="module")
def aged_checkpoint(tmp_path_factory):
    """A checkpoint older than the racy window, for tests that do not change it
    (one wait for all of them)."""
    d = _build_checkpoint(tmp_path_factory.mktemp("aged") / "ckpt")
    _age(d / "model.safetensors", d / "config.json")
    return d


def _digest(path: Path) -> str:
    return weights_identity(path).digest


def _tensor_start(path: Path, index: int) -> int:
    header_len = struct.unpack("<Q", path.read_bytes()[:8])[0]
    return 8 + header_len + sum(TENSOR_BYTES + i for i in range(index))


def _edit_in_place(path: Path, offset: int, data: bytes, *, keep_times: bool) -> None:
    """Overwrites bytes of ``path`` in place (same inode and size); with
    ``keep_times`` puts atime and mtime back the way ``touch -r`` would."""
    before = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
    if keep_times:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size)


def _age(*paths: Path) -> None:
    """Waits until the files' last change is older than the cache's racy
    window: only then is a digest recorded against the file's identity."""
    from pykvcache.vllm.identity.digest_cache import RACY_WINDOW_NS

    newest = max(max(p.stat().st_mtime_ns, p.stat().st_ctime_ns) for p in paths)
    time.sleep(max(0.0, (newest + RACY_WINDOW_NS - time.time_ns()) / 1e9) + 0.2)


def _rchar() -> int:
    """Bytes this process has read through read-type system calls (the kernel's count)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def test_identical_weights_elsewhere_or_touched_have_the_same_identity(checkpoint, tmp_path):
    copy_dir = tmp_path / "node-b" / "ckpt"
    shutil.copytree(checkpoint, copy_dir)
    os.utime(copy_dir / "model.safetensors", (1, 1))
    (copy_dir / "tokenizer.json").write_text('{"changed": true}')  # maps text to ids only
    assert (copy_dir / "model.safetensors").stat().st_ino != (checkpoint / "model.safetensors").stat().st_ino
    assert _digest(checkpoint) == _digest(copy_dir) != ""


# Offsets into one tensor: its first, middle and last bytes (where the old
# identity sampled 4 KiB) and bytes between them, which only a digest of every
# byte sees.
@pytest.mark.parametrize("offset", [0, TENSOR_BYTES // 2, TENSOR_BYTES + 1, 5_000, 30_000, 77_777])
def test_a_changed_byte_anywhere_in_a_tensor_changes_the_identity(checkpoint, offset):
    before = _digest(checkpoint)
    path = checkpoint / "model.safetensors"
    _edit_in_place(path, _tensor_start(path, 2) + offset, b"\xff", keep_times=True)
    assert _digest(checkpoint) != before


def test_rows_edited_in_place_with_restored_mtime_miss_a_cached_digest(checkpoint):
    path = checkpoint / "model.safetensors"
    _age(path, checkpoint / "config.json")
    first = weights_identity(checkpoint)
    assert weights_identity(checkpoint).files_cached == first.files  # cached now
    # "200 rows" of layer1 between the old sample positions; times put back.
    _edit_in_place(path, _tensor_start(path, 1) + 20_000, b"\x7f" * 200, keep_times=True)
    edited = weights_identity(checkpoint)
    assert edited.digest != first.digest
    assert edited.bytes_hashed >= path.stat().st_size  # the file was read again, not looked up


def test_a_second_computation_reads_nothing(tmp_path):
    # Three digest pieces and a remainder: the split into pieces is exercised too.
    from pykvcache.vllm.identity.weights_digest import PIECE_BYTES

    d = tmp_path / "big"
    d.mkdir()
    size = 3 * PIECE_BYTES + 12_345
    with open(d / "model.safetensors", "wb") as f:
        for _ in range(size // (1 << 20)):
            f.write(os.urandom(1 << 20))
        f.write(os.urandom(size % (1 << 20)))
    (d / "config.json").write_text("{}")
    _age(d / "model.safetensors", d / "config.json")
    before = _rchar()
    first = weights_identity(d)
    first_read = _rchar() - before
    assert first.bytes_hashed == size + 2 and first.files_cached == 0
    assert first_read >= size
    before = _rchar()
    second = weights_identity(d)
    second_read = _rchar() - before
    assert second.digest == first.digest
    assert second.bytes_hashed == 0 and second.files_cached == 2
    assert second_read < first_read / 100, (first_read, second_read)
    # A change in the last piece is seen (every piece is in the digest).
    _edit_in_place(d / "model.safetensors", size - 7, b"\x00\x01", keep_times=True)
    assert weights_identity(d).digest != first.digest


def test_ctime_is_part_of_the_cache_key(checkpoint):
    """Only root can set a ctime: a touch -r after an edit leaves it changed."""
    path = checkpoint / "model.safetensors"
    _age(path, checkpoint / "config.json")
    first = weights_identity(checkpoint)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # same bytes, size, mtime; new ctime
    again = weights_identity(checkpoint)
    assert again.digest == first.digest
    assert again.bytes_hashed == st.st_size  # only the touched file was read again
    assert again.files_cached == 1


def test_a_file_changed_within_the_racy_window_is_not_cached(checkpoint):
    """A filesystem with coarse timestamps can give an edit made right after a
    digest the same mtime and ctime: such recent files are digested every time."""
    weights_identity(checkpoint)
    again = weights_identity(checkpoint)
    assert again.files_cached == 0 and again.bytes_hashed > 0


def test_identical_copies_on_one_node_share_the_identity_and_each_is_cached(checkpoint, tmp_path):
    other = tmp_path / "copy"
    shutil.copytree(checkpoint, other)
    _age(*(p for d in (checkpoint, other) for p in d.iterdir()))
    assert weights_identity(checkpoint).digest == weights_identity(other).digest
    assert weights_identity(checkpoint).files_cached == weights_identity(other).files_cached == 2


def _assert_cacheable(checkpoint: Path, cache_path: Path) -> None:
    """With a usable cache these files would have been cached (so a test that
    sees none cached saw the cache location refused, not a racy file)."""
    from pykvcache.vllm.identity.digest_cache import DigestCache

    weights_identity(checkpoint, cache=DigestCache(cache_path))
    assert weights_identity(checkpoint, cache=DigestCache(cache_path)).files_cached == 2


def test_an_unusable_cache_location_recomputes_and_warns_once(aged_checkpoint, private_cache_home, caplog):
    private_cache_home.parent.mkdir(parents=True, exist_ok=True)
    private_cache_home.write_text("a file where the cache directory should be")
    caplog.set_level(logging.WARNING)
    first = weights_identity(aged_checkpoint)
    second = weights_identity(aged_checkpoint)
    assert first.digest == second.digest != ""
    assert second.files_cached == 0
    warnings = [r for r in caplog.records if "digest cache" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    _assert_cacheable(aged_checkpoint, private_cache_home.parent / "usable.json")


def test_without_a_home_or_cache_directory_nothing_is_cached_in_the_working_directory(aged_checkpoint, tmp_path, monkeypatch, caplog):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # ignored, as the XDG spec says
    monkeypatch.setenv("HOME", "relative-home")  # as ~ stays when no home is known
    caplog.set_level(logging.WARNING)
    first = weights_identity(aged_checkpoint)
    assert weights_identity(aged_checkpoint).files_cached == 0
    assert first.digest != "" and list(cwd.iterdir()) == []
    assert "digest cache" in caplog.text
    _assert_cacheable(aged_checkpoint, tmp_path / "usable.json")


def test_a_cache_file_others_can_write_is_not_trusted(aged_checkpoint, private_cache_home, caplog):
    weights_identity(aged_checkpoint)
    cache_files = list(private_cache_home.rglob("*.json"))
    assert len(cache_files) == 1
    assert stat.S_IMODE(cache_files[0].stat().st_mode) & 0o077 == 0
    os.chmod(cache_files[0], 0o666)
    caplog.set_level(logging.WARNING)
    again = weights_identity(aged_checkpoint)
    assert again.files_cached == 0
    assert "digest cache" in caplog.text


def test_config_and_index_files_are_part_of_the_identity(checkpoint):
    before = _digest(checkpoint)
    (checkpoint / "quantize_config.json").write_text('{"bits": 4}')
    assert _digest(checkpoint) != before


def test_other_weight_formats_are_digested_whole(tmp_path):
    blob = tmp_path / "ckpt"
    blob.mkdir()
    data = bytearray(os.urandom(3 << 20))
    (blob / "pytorch_model.bin").write_bytes(data)
    identity = weights_identity(blob)
    assert identity.bytes_hashed == len(data)
    data[(1 << 20) + 12_345] ^= 1  # far from any former sample position
    (blob / "pytorch_model.bin").write_bytes(data)
    assert weights_identity(blob).digest != identity.digest


def test_weights_not_found_locally_fall_back_to_name_and_revision(caplog):
    assert resolve_weights("no-such-org/no-such-model-xyz", None) is None
    ident = model_identity(None, "no-such-org/no-such-model-xyz")
    assert ident["weights"] == {"model": "no-such-org/no-such-model-xyz", "revision": "None"}
    assert "namespace_salt" in caplog.text


def test_every_byte_of_the_kv_relevant_files_is_read_once(checkpoint):
    identity = weights_identity(checkpoint)
    assert identity.files == 2  # model.safetensors and config.json; the tokenizer is not KV
    assert identity.bytes_hashed == sum((checkpoint / n).stat().st_size for n in ("model.safetensors", "config.json"))


@pytest.fixture(scope="module")
def engine_configs(tiny_model):
    """Real VllmConfig objects of the tiny model, as vLLM builds them from its flags."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    from vllm_marks import skip_without_device_type

    skip_without_device_type()
    from vllm.engine.arg_utils import EngineArgs

    model = tiny_model

    def build(**kw):
        kw.setdefault("dtype", "float32")
        return EngineArgs(model=model, enforce_eager=True, max_model_len=2048, **kw).create_engine_config()

    return build


@needs_vllm
def test_every_kv_relevant_engine_flag_changes_the_identity(engine_configs):
    base = identity_digest(config_identity(engine_configs()))
    assert identity_digest(config_identity(engine_configs())) == base
    # Scheduler and memory settings do not change KV values.
    assert identity_digest(config_identity(engine_configs(max_num_seqs=3, gpu_memory_utilization=0.5))) == base
    changes = {
        "hf_overrides rope_theta": {"hf_overrides": {"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}},
        "rope scaling": {"hf_overrides": {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0}}},
        "revision": {"revision": "v2"},
        "code_revision": {"code_revision": "abc"},
        "kv cache dtype fp8": {"kv_cache_dtype": "fp8"},
        "kv cache dtype fp8_e5m2": {"kv_cache_dtype": "fp8_e5m2"},
        "compute dtype": {"dtype": "bfloat16"},
        "lora": {"enable_lora": True, "max_lora_rank": 8},
    }
    digests = {name: identity_digest(config_identity(engine_configs(**kw))) for name, kw in changes.items()}
    assert base not in digests.values()
    assert len(set(digests.values())) == len(digests), digests


@needs_vllm
def test_quantization_is_part_of_the_identity(engine_configs):
    # The CPU build refuses --quantization fp8 for this model at config time,
    # so the resolved config is changed the way that flag sets it.
    config = engine_configs()
    quantized = copy.copy(config)
    quantized.model_config = copy.copy(config.model_config)
    object.__setattr__(quantized.model_config, "quantization", "fp8")
    assert identity_digest(config_identity(quantized)) != identity_digest(config_identity(config))


def test_the_cost_script_measures_a_first_and_a_cached_start(tmp_path):
    import importlib.util as iu

    script = Path(__file__).resolve().parents[2] / "scripts" / "weights_identity_cost.py"
    spec = iu.spec_from_file_location("weights_identity_cost", script)
    mod = iu.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    size = mod.build_checkpoint(ckpt, 3 << 20, shards=2)
    results = mod.measure(ckpt, tmp_path / "digests.json")
    assert results["cold"].bytes_hashed == results["warm"].bytes_hashed == size + 2
    assert results["cached"].bytes_hashed == 0 and results["cached"].files_cached == 3
    assert len({r.digest for r in results.values()}) == 1
    assert "16 GB in" in mod.describe("warm", results["warm"])


@needs_vllm
def test_loaders_that_read_the_files_share_a_namespace_and_others_get_their_own(engine_configs, tiny_model):
    from pykvcache.vllm.identity.model_identity import model_identity

    def ident(**kw):
        return identity_digest(model_identity(engine_configs(**kw), tiny_model))

    real = ident()
    assert ident(load_format="safetensors") == real  # the same files, the same weights
    dummy = ident(load_format="dummy")
    assert dummy != real
    assert ident(load_format="dummy") != dummy  # random weights: never shared, even between dummies


@needs_vllm
def test_sliding_window_and_the_prefix_hash_are_part_of_the_identity(engine_configs):
    base = identity_digest(config_identity(engine_configs()))
    config = engine_configs()
    hashed = copy.copy(config)
    hashed.cache_config = copy.copy(config.cache_config)
    object.__setattr__(hashed.cache_config, "prefix_caching_hash_algo", "xxhash")
    windowed = copy.copy(config)
    windowed.model_config = copy.copy(config.model_config)
    object.__setattr__(windowed.model_config, "disable_sliding_window", True)
    assert len({base, identity_digest(config_identity(hashed)), identity_digest(config_identity(windowed))}) == 3
