"""Validation of kv_connector_extra_config (no vLLM process)."""

from __future__ import annotations

import os

import pytest
from pykvcache.vllm.config import GIB, ConfigError, parse_extra_config


def _base(tmp_path, **extra):
    return {
        "spec_name": "NvmeOffloadingSpec",
        "spec_module_path": "pykvcache.vllm",
        "storage_dirs": [str(tmp_path / "kv")],
        "capacity_bytes": 10 * GIB,
        **extra,
    }


def test_minimal_config_gets_documented_defaults(tmp_path):
    cfg = parse_extra_config(_base(tmp_path))
    assert cfg.storage_dirs == (str(tmp_path / "kv"),)
    assert cfg.capacity_bytes == 10 * GIB
    assert cfg.staging_bytes == 1 * GIB
    assert (cfg.queue_depth, cfg.backend, cfg.direct_io) == (32, "auto", "optional")
    assert cfg.offload_prompt_only is False
    assert cfg.register_buffers is True and cfg.wipe_on_reset is True
    assert cfg.model_id is None and cfg.namespace_salt == ""


def test_all_problems_reported_in_one_error(tmp_path):
    bad = {
        "spec_name": "NvmeOffloadingSpec",
        "queue_depth": 0,
        "backend": "spdk",
        "direct_io": "yes",
        "offload_prompt_only": "true",
        "capcity_bytes": 5,
        "staging_bytes": -1,
    }
    with pytest.raises(ConfigError) as info:
        parse_extra_config(bad)
    message = str(info.value)
    for fragment in (
        "storage_dirs is required",
        "capacity_bytes is required",
        "queue_depth must be a positive integer",
        "backend must be one of",
        "direct_io must be one of",
        "offload_prompt_only must be true or false",
        "unknown key(s) 'capcity_bytes'",
        "staging_bytes must be",
    ):
        assert fragment in message, fragment
    assert isinstance(info.value, ValueError)


def test_sizes_accept_binary_and_decimal_suffixes(tmp_path):
    cfg = parse_extra_config(_base(tmp_path, capacity_bytes="2TiB", staging_bytes="512MiB"))
    assert cfg.capacity_bytes == 2 << 40
    assert cfg.staging_bytes == 512 << 20
    assert parse_extra_config(_base(tmp_path, capacity_bytes="3GB")).capacity_bytes == 3 * 10**9
    for bad in ("lots", "0GiB", True, 0, "-5MiB", 1.5):
        with pytest.raises(ConfigError, match="capacity_bytes"):
            parse_extra_config(_base(tmp_path, capacity_bytes=bad))


def test_chunk_size_keys(tmp_path):
    assert parse_extra_config(_base(tmp_path, block_size=256)).block_size == 256
    assert parse_extra_config(_base(tmp_path, blocks_per_chunk=4)).blocks_per_chunk == 4
    with pytest.raises(ConfigError, match="only one of block_size"):
        parse_extra_config(_base(tmp_path, block_size=256, blocks_per_chunk=4))
    with pytest.raises(ConfigError, match="block_size must be a positive integer"):
        parse_extra_config(_base(tmp_path, block_size="256"))


def test_storage_dirs_forms_and_errors(tmp_path):
    cfg = parse_extra_config(_base(tmp_path, storage_dirs=str(tmp_path / "a")))
    assert cfg.storage_dirs == (str(tmp_path / "a"),)
    rel = parse_extra_config(_base(tmp_path, storage_dirs=["rel/dir"]))
    assert rel.storage_dirs == (os.path.abspath("rel/dir"),)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for bad, fragment in (
        ([], "non-empty list"),
        ([str(a_file)], "not a directory"),
        ([str(tmp_path), str(tmp_path)], "twice"),
        ([""], "non-empty paths"),
        (5, "non-empty list"),
    ):
        with pytest.raises(ConfigError, match=fragment):
            parse_extra_config(_base(tmp_path, storage_dirs=bad))


def test_identity_keys(tmp_path):
    cfg = parse_extra_config(_base(tmp_path, model_id="llama-3b@rev7", namespace_salt="tenantA"))
    assert (cfg.model_id, cfg.namespace_salt) == ("llama-3b@rev7", "tenantA")
    with pytest.raises(ConfigError, match="model_id"):
        parse_extra_config(_base(tmp_path, model_id=""))


def test_kv_transfer_config_helper_builds_a_valid_config(tmp_path):
    from pykvcache.vllm.config import kv_transfer_config

    kv = kv_transfer_config([str(tmp_path / "kv")], "2GiB", block_size=64)
    assert kv["kv_connector"] == "OffloadingConnector" and kv["kv_role"] == "kv_both"
    cfg = parse_extra_config(kv["kv_connector_extra_config"])
    assert cfg.capacity_bytes == 2 * GIB and cfg.storage_dirs == (str(tmp_path / "kv"),)


def test_preformat_keys(tmp_path):
    cfg = parse_extra_config(_base(tmp_path))
    assert cfg.preformat is False and cfg.preformat_max_s == 300.0
    cfg = parse_extra_config(_base(tmp_path, preformat=True, preformat_max_s=30))
    assert cfg.preformat is True and cfg.preformat_max_s == 30.0
    for bad in (0, -1, float("nan"), float("inf"), "60", True):
        with pytest.raises(ConfigError, match="preformat_max_s must be"):
            parse_extra_config(_base(tmp_path, preformat=True, preformat_max_s=bad))
    assert parse_extra_config(_base(tmp_path, preformat="background")).preformat == "background"
    for bad in ("yes", 1, 0, None):
        with pytest.raises(ConfigError, match="preformat must be true, false or"):
            parse_extra_config(_base(tmp_path, preformat=bad))


def test_sizes_that_are_not_finite_or_too_large_are_config_errors(tmp_path):
    # "infGiB" used to escape as a bare OverflowError, "nanGiB" as ValueError
    # from int(); 2**64 would overflow the engine's 64-bit counter.
    for name in ("capacity_bytes", "staging_bytes", "lookahead_bytes", "lookup_hold_bytes", "min_free_bytes"):
        for bad in ("infGiB", "nanGiB", "-infGiB", "1e400GiB", 2**64, "99999999999TiB"):
            with pytest.raises(ConfigError, match=name):
                parse_extra_config(_base(tmp_path, **{name: bad}))
    for name in ("queue_depth", "block_size", "max_inflight_writes", "lookahead_requests"):
        with pytest.raises(ConfigError, match=name):
            parse_extra_config(_base(tmp_path, **{name: 2**64}))


def test_free_space_and_insecure_root_keys(tmp_path):
    cfg = parse_extra_config(_base(tmp_path))
    assert (cfg.min_free_bytes, cfg.min_free_fraction, cfg.allow_insecure_root) == (None, None, False)
    cfg = parse_extra_config(_base(tmp_path, min_free_bytes="2GiB", min_free_fraction=0.1, allow_insecure_root=True))
    assert (cfg.min_free_bytes, cfg.min_free_fraction, cfg.allow_insecure_root) == (2 * GIB, 0.1, True)
    assert parse_extra_config(_base(tmp_path, min_free_bytes=0)).min_free_bytes == 0
    for bad in (1.0, -0.1, float("nan"), "5%", True):
        with pytest.raises(ConfigError, match="min_free_fraction"):
            parse_extra_config(_base(tmp_path, min_free_fraction=bad))
    with pytest.raises(ConfigError, match="allow_insecure_root must be true or false"):
        parse_extra_config(_base(tmp_path, allow_insecure_root="yes"))


def test_storage_checks_before_anything_starts(tmp_path):
    from pykvcache.vllm.config import validate_extra_config

    real = tmp_path / "nvme0"
    real.mkdir(mode=0o700)
    link = tmp_path / "kv-link"
    os.symlink(real, link)
    validate_extra_config(_base(tmp_path, storage_dirs=[str(link)]))  # a symlinked root is fine
    validate_extra_config(_base(tmp_path, storage_dirs=[str(tmp_path / "new" / "deeper")]))
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    dangling = tmp_path / "dangling"
    os.symlink(tmp_path / "missing", dangling)
    cases = [
        ([str(open_dir)], {}, "world-writable"),
        ([str(a_file / "sub")], {}, "cannot be created"),
        ([str(dangling)], {}, "does not exist"),
        ([str(real), str(link)], {}, "are the same directory"),
        ([str(real)], {"min_free_bytes": 2**62}, "min_free_bytes"),
    ]
    for dirs, extra, fragment in cases:
        with pytest.raises(ConfigError, match=fragment):
            validate_extra_config(_base(tmp_path, storage_dirs=dirs, **extra))
    validate_extra_config(_base(tmp_path, storage_dirs=[str(open_dir)], allow_insecure_root=True))
    # parse and storage problems together, in one error
    with pytest.raises(ConfigError) as info:
        validate_extra_config(_base(tmp_path, storage_dirs=[str(open_dir)], capacity_bytes="infGiB"))
    assert "capacity_bytes" in str(info.value)


def test_the_helper_rejects_bad_settings_when_called(tmp_path):
    from pykvcache.vllm.config import kv_transfer_config

    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(ConfigError, match="world-writable"):
        kv_transfer_config([str(open_dir)], "1GiB")
    with pytest.raises(ConfigError, match="capacity_bytes"):
        kv_transfer_config([str(tmp_path / "kv")], "infGiB")


# ---- one table

#: Keys whose ``null`` means "not given" (the default); every other key refuses it.
NULL_IS_DEFAULT = {
    "encryption_key_file",
    "encryption_previous_key_file",
    "block_size",
    "blocks_per_chunk",
    "queue_depth",
    "max_inflight_writes",
    "min_free_bytes",
    "min_free_fraction",
    "io_deadline_s",
    "model_id",
    "namespace_salt",
    "gate_profile",
    "gate_trace",
    "lookahead_bytes",
    "lookup_hold_bytes",
}


def _blockstore_keywords() -> list[str]:
    import ast
    from pathlib import Path

    from pykvcache import _core

    tree = ast.parse(Path(_core.__file__).with_name("_core.pyi").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "BlockStore")
    new = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__new__")
    return [a.arg for a in new.args.kwonlyargs]


def test_every_key_is_one_row_of_the_table():
    import dataclasses

    from pykvcache.vllm.config import Key, PykvcacheConfig

    table = PykvcacheConfig.table()
    assert list(table) == [f.name for f in dataclasses.fields(PykvcacheConfig)]
    for field in dataclasses.fields(PykvcacheConfig):
        spec = table[field.name]
        assert isinstance(spec, Key), field.name
        required = field.default is dataclasses.MISSING
        assert bool(spec.required) == required, f"{field.name}: a required key says why, no other"
        if not required and field.default is not None:
            assert spec.check(field.name, field.default) == field.default, (
                f"{field.name}: the default {field.default!r} is not a value the key accepts"
            )
    assert {n for n, s in table.items() if s.null_is_default} == NULL_IS_DEFAULT


def test_null_means_the_default_only_where_the_table_says_so(tmp_path):
    from pykvcache.vllm.config import PykvcacheConfig

    default = parse_extra_config(_base(tmp_path))
    for name in sorted(PykvcacheConfig.keys() - {"storage_dirs", "capacity_bytes"}):
        if name in NULL_IS_DEFAULT:
            assert getattr(parse_extra_config(_base(tmp_path, **{name: None})), name) == getattr(default, name)
        else:
            with pytest.raises(ConfigError, match=f"{name} must be"):
                parse_extra_config(_base(tmp_path, **{name: None}))


def test_the_store_keywords_come_from_the_table(tmp_path):
    from pykvcache.vllm.config import store_keywords

    cfg = parse_extra_config(
        _base(tmp_path, queue_depth=64, verify="header", min_free_bytes=0, io_deadline_s=7, refresh_interval_s=0, backend="threads")
    )
    kw = store_keywords(cfg)
    assert set(kw) <= set(_blockstore_keywords()), "every keyword is one BlockStore takes"
    assert kw == {
        "capacity_bytes": 10 * GIB,
        "queue_depth": 64,
        "backend": "threads",
        "direct_io": "optional",
        "verify": "header",
        "register_buffers": True,
        "segment_files": "auto",
        "min_free_bytes": 0,
        "min_free_fraction": None,
        "io_deadline": 7.0,
        "allow_insecure_root": False,
        "encryption_key_file": None,
        "encryption_previous_key_file": None,
        "refresh_interval_s": None,
    }
    assert store_keywords(parse_extra_config(_base(tmp_path, refresh_interval_s=2)))["refresh_interval_s"] == 2.0


def test_the_vllm_layer_reads_the_limits_from_the_engine(tmp_path):
    import re
    from pathlib import Path

    from pykvcache import _core
    from pykvcache.vllm import config

    assert config.MAX_QUEUE_DEPTH == _core.ENGINE_LIMITS["queue_depth"][1]
    assert config.MAX_STAGING_SLOTS == _core.ENGINE_LIMITS["num_slots"][1]
    most = config.MAX_QUEUE_DEPTH
    assert parse_extra_config(_base(tmp_path, queue_depth=most)).queue_depth == most
    with pytest.raises(ConfigError, match=f"queue_depth must be a positive integer, at most {most}"):
        parse_extra_config(_base(tmp_path, queue_depth=most + 1))
    # No copy of an engine limit where the store and its staging are sized: the entry points,
    # the shared modules and the scheduler side.
    vllm_dir = Path(config.__file__).parent
    sources = sorted([*vllm_dir.glob("*.py"), *(vllm_dir / "scheduler").glob("*.py")])
    assert {"config.py", "spec.py", "tier.py", "disk_tier.py"} <= {p.name for p in sources}
    for path in sources:
        source = path.read_text()
        for number in ("4096", "65535", "65536", "1 << 16"):
            assert not re.search(rf"(?<![\w.]){re.escape(number)}(?![\w.])", source), f"{path.name} repeats the engine limit {number}"


# ---- first contact: every problem in one error, the host's included


def _problems(extra) -> list[str]:
    from pykvcache.vllm.config import validate_extra_config

    with pytest.raises(ConfigError) as info:
        validate_extra_config(extra)
    assert str(info.value).count("invalid pykvcache settings") == 1, str(info.value)
    return info.value.problems


def test_a_misspelt_key_does_not_hide_the_other_problems(tmp_path):
    """A misspelt key used to be reported alone (the storage, the host and the values against
    each other were checked only once the keys parsed): one start per problem."""
    from pykvcache.vllm.config_checks import host_memory_bytes

    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    too_much = 2 * host_memory_bytes()
    problems = _problems(
        {
            "storage_dirs": [str(a_file / "kv")],
            "capacity_bytes": 1,
            "capacty": "1GiB",
            "staging_bytes": too_much,
            "lookahead_bytes": too_much + 1,
            "model_id": "../../etc",
            "gate_trace": "/proc/pykvcache-trace",
        }
    )
    text = "\n".join(problems)
    for fragment in (
        "unknown key(s) 'capacty'",
        "capacity_bytes (1 bytes) is smaller than the smallest chunk file",
        f"staging_bytes ({too_much} bytes",
        "more than this host's memory",
        "lookahead_bytes",
        "more than staging_bytes",
        "model_id must be a label",
        "gate_trace /proc/pykvcache-trace is on a proc filesystem",
        f"{a_file} is not a writable directory",
    ):
        assert fragment in text, (fragment, text)
    assert len(problems) == 7, problems


def test_shares_of_staging_larger_than_staging_are_refused(tmp_path):
    from pykvcache.vllm.config import validate_extra_config

    for name in ("lookahead_bytes", "lookup_hold_bytes"):
        [problem] = _problems(_base(tmp_path, staging_bytes="64MiB", **{name: "65MiB"}))
        assert problem.startswith(f"{name} ({65 << 20} bytes) is more than staging_bytes ({64 << 20} bytes)")
        # Against the default staging (1 GiB) when staging_bytes is not given.
        assert _problems(_base(tmp_path, **{name: "2GiB"}))[0].startswith(name)
        assert getattr(validate_extra_config(_base(tmp_path, staging_bytes="64MiB", **{name: "64MiB"})), name) == 64 << 20
    # A staging_bytes refused on its own is not compared with (its own problem says it).
    [problem] = _problems(_base(tmp_path, staging_bytes="lots", lookahead_bytes="1GiB"))
    assert problem.startswith("staging_bytes must be")


def test_model_id_is_a_label_not_a_path(tmp_path):
    for good in ("llama-3b@rev7", "meta-llama/Llama-3-8B", "qwen2.5:7b"):
        assert parse_extra_config(_base(tmp_path, model_id=good)).model_id == good
    for bad in ("../../etc", "..", "/etc/passwd", "a//b", "org/", "./x", "a\\b", "a\nb", "a\x00b", "  "):
        with pytest.raises(ConfigError, match="model_id must be a"):
            parse_extra_config(_base(tmp_path, model_id=bad))


def test_gate_trace_must_be_a_file_this_process_can_append_to(tmp_path):
    import subprocess

    from pykvcache.vllm.config import validate_extra_config

    good = tmp_path / "trace.jsonl"
    assert validate_extra_config(_base(tmp_path, gate_trace=str(good))).gate_trace == str(good)
    good.write_text("")  # appended to when it exists
    assert validate_extra_config(_base(tmp_path, gate_trace=str(good))).gate_trace == str(good)
    read_only = tmp_path / "ro"
    read_only.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(read_only)], check=False)
    try:
        cases = {
            "/proc/sys/vm/drop_caches": "on a proc filesystem",  # exists: a kernel setting
            "/sys/kernel/pykvcache-trace": "on a sysfs filesystem",
            str(tmp_path): "exists and is not a regular file",
            str(tmp_path / "missing" / "trace.jsonl"): "is not an existing directory",
        }
        if os.path.ismount(read_only):
            cases[str(read_only / "trace.jsonl")] = "is not writable by this process"
        for path, fragment in cases.items():
            [problem] = _problems(_base(tmp_path, gate_trace=path))
            assert problem.startswith(f"gate_trace {path}") and fragment in problem, (path, problem)
    finally:
        subprocess.run(["umount", str(read_only)], check=False, capture_output=True)
    assert not os.path.exists(tmp_path / "missing"), "nothing is created by the check"


def test_staging_more_than_the_host_has_is_refused_before_anything_starts(tmp_path):
    from pykvcache.vllm.config import kv_transfer_config
    from pykvcache.vllm.config_checks import host_memory_bytes

    memory = host_memory_bytes()
    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) * 1024
    assert 0 < memory <= total
    with pytest.raises(ConfigError, match=r"staging_bytes \(\d+ bytes, [\d.]+ GiB\) is more than this host's memory"):
        kv_transfer_config([str(tmp_path / "kv")], "1GiB", staging_bytes=memory + 1)
    kv_transfer_config([str(tmp_path / "kv")], "1GiB", staging_bytes=64 << 20)
