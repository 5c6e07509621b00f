"""Profiles: round trip, validation with clear errors, and the conservative
fallback when a profile is missing or made for something else."""

from __future__ import annotations

import json
import logging

import pytest
from pykvcache.gate import (
    DEFAULT_BREAK_EVEN_TOKENS,
    ChunkState,
    GateProfile,
    ProfileError,
    ProfileExpectation,
    build_gate,
    hardware_id,
    load_cost_model,
)
from pykvcache.gate.profile import storage_info

BPT = 4096.0


def _profile(**over) -> GateProfile:
    fields = dict(
        model="/models/tiny-llama",
        dtype="float32",
        block_size=32,
        chunk_tokens=64,
        kv_bytes_per_token=BPT,
        world_size=1,
        hardware=hardware_id(),
        storage={"dir": "/data", "device": "nvme0n1", "fstype": "ext4"},
        prefill={"a": 0.004, "b": 2e-5, "c": 1e-9, "points": []},
        load={"fixed_s": 0.0005, "disk_bytes_per_s": 2e9, "h2d_bytes_per_s": 2e10, "points": []},
        break_even_tokens=30.0,
        created="2025-01-01T00:00:00+00:00",
        pykvcache_version="0.1.0",
    )
    fields.update(over)
    return GateProfile(**fields)


def _expect(**over) -> ProfileExpectation:
    fields = dict(model="tiny-llama", dtype="torch.float32", kv_bytes_per_token=BPT, chunk_tokens=64)
    fields.update(over)
    return ProfileExpectation(**fields)


def test_round_trip(tmp_path):
    path = _profile().save(tmp_path / "sub" / "p.json")
    back = GateProfile.read(path)
    assert back == _profile()
    model = back.cost_model()
    assert model.bytes_per_token == BPT and model.load.disk_bytes_per_s == 2e9
    assert not list(path.parent.glob(".p.json.*"))  # no temporary left behind
    assert model.load.step_s == 0.0  # profiles without a measured load path (older ones)
    stepped = _profile(load={"fixed_s": 0.0005, "disk_bytes_per_s": 2e9, "h2d_bytes_per_s": 2e10, "step_s": 0.002})
    back = GateProfile.read(stepped.save(tmp_path / "s.json")).cost_model()
    assert back.load.step_s == 0.002 and back.break_even_tokens() > model.break_even_tokens()


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda d: d.update(format="something"), "not a pykvcache gate profile"),
        (lambda d: d.update(version=99), "version 99 is not supported"),
        (lambda d: d.pop("prefill"), "lacks prefill"),
        (lambda d: d["prefill"].update(b=-1), "coefficients are invalid"),
        (lambda d: d["load"].update(disk_bytes_per_s=0), "coefficients are invalid"),
        (lambda d: d["load"].pop("fixed_s"), "coefficients are invalid"),
        (lambda d: d["load"].update(step_s=-0.001), "coefficients are invalid"),
        (lambda d: d.update(block_size="32"), "block_size must be an integer"),
        (lambda d: d.update(break_even_tokens=-5), "break_even_tokens"),
    ],
)
def test_invalid_profiles_are_rejected_with_a_reason(tmp_path, mutate, message):
    data = json.loads(_profile().to_json())
    mutate(data)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=message):
        GateProfile.read(path)


def test_unreadable_profiles(tmp_path):
    with pytest.raises(ProfileError, match="cannot read"):
        GateProfile.read(tmp_path / "absent.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        GateProfile.read(tmp_path / "bad.json")


def test_matching_profile_is_used(tmp_path):
    path = _profile().save(tmp_path / "p.json")
    model, source = load_cost_model(path, _expect())
    assert source == "profile"
    assert model.prefill.b == 2e-5


def test_missing_profile_falls_back_with_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="pykvcache.gate.profile"):
        model, source = load_cost_model(tmp_path / "absent.json", _expect())
    assert source.startswith("default: cannot read gate profile")
    assert "conservative default" in caplog.text and "absent.json" in caplog.text
    assert model.break_even_tokens() == pytest.approx(DEFAULT_BREAK_EVEN_TOKENS)


def test_a_gate_switched_off_does_not_warn_about_a_missing_profile(caplog):
    """``gate: false`` loads everything: no profile can change a decision, so
    the fallback is an info line, not a warning (the storage benchmark's tiers
    printed it seven times into `make demo`)."""
    from pykvcache.gate import build_gate

    with caplog.at_level(logging.INFO, logger="pykvcache.gate.profile"):
        gate, source = build_gate(None, _expect(), enabled=False)
    assert source.startswith("default: no gate profile configured")
    assert [r.levelno for r in caplog.records] == [logging.INFO], caplog.records
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pykvcache.gate.profile"):
        build_gate(None, _expect(), enabled=True)
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    model, source = load_cost_model(None, _expect())
    assert "pykvcache calibrate" in source


@pytest.mark.parametrize(
    "expect,what",
    [
        (dict(model="other-model"), "model"),
        (dict(dtype="bfloat16"), "dtype"),
        (dict(kv_bytes_per_token=8192.0), "KV bytes per token"),
        (dict(hardware={"accelerator": "gpu:NVIDIA H100", "cpu": "x", "cpus": 8}), "accelerator"),
    ],
)
def test_profile_for_something_else_falls_back(tmp_path, caplog, expect, what):
    path = _profile().save(tmp_path / "p.json")
    with caplog.at_level(logging.WARNING, logger="pykvcache.gate.profile"):
        model, source = load_cost_model(path, _expect(**expect))
    assert source.startswith("default:") and what in source
    assert what in caplog.text
    assert model.break_even_tokens() == pytest.approx(DEFAULT_BREAK_EVEN_TOKENS)


def test_minor_differences_only_warn(tmp_path, caplog):
    path = _profile().save(tmp_path / "p.json")
    with caplog.at_level(logging.WARNING, logger="pykvcache.gate.profile"):
        _, source = load_cost_model(path, _expect(chunk_tokens=256, storage_device="sdb"))
    assert source == "profile"
    assert "chunk of 64 tokens != 256" in caplog.text and "storage device nvme0n1 != sdb" in caplog.text


def test_default_gate_loads_long_prefixes_only(tmp_path):
    gate, source = build_gate(None, _expect())
    assert source.startswith("default:")
    n = DEFAULT_BREAK_EVEN_TOKENS // 64
    assert gate.decide([ChunkState.DISK] * (n - 1)).recompute
    assert gate.decide([ChunkState.DISK] * (n + 1)).load_chunks == n + 1


def test_storage_info_names_the_filesystem(tmp_path):
    info = storage_info(tmp_path)
    assert info["dir"] == str(tmp_path)
    assert info["device"] and info["fstype"]


@pytest.mark.parametrize(
    "content,why",
    [
        (b"\xff\xfe\x00binary\x80\x81", "not UTF-8 text"),  # UnicodeDecodeError
        (b"[" * 200_000, "not valid JSON"),  # nested past the parser's recursion limit
        (b"\x00" * 64, "not valid JSON"),
    ],
)
def test_a_profile_that_is_not_text_is_one_warning_and_the_default(tmp_path, caplog, content, why):
    # A binary gate_profile crashed start-up with a
    # UnicodeDecodeError that named neither the file nor gate_profile.
    path = tmp_path / "p.json"
    path.write_bytes(content)
    with pytest.raises(ProfileError, match=why):
        GateProfile.read(path)
    with caplog.at_level(logging.WARNING, logger="pykvcache.gate.profile"):
        model, source = load_cost_model(path, _expect())
    assert source.startswith("default:") and why in source and str(path) in source
    assert len(caplog.records) == 1 and "conservative default" in caplog.text and "gate_profile" in caplog.text
    assert model.break_even_tokens() == pytest.approx(DEFAULT_BREAK_EVEN_TOKENS)


def test_a_fifo_or_a_huge_file_as_profile_is_refused_without_reading_it(tmp_path, caplog):
    import os

    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # reading it would block start-up until a writer came
    import threading

    got = []
    # In a daemon thread: a regression blocks in open() and fails here, not hangs.
    reader = threading.Thread(target=lambda: got.append(load_cost_model(fifo, _expect())), daemon=True)
    reader.start()
    reader.join(10)
    assert got, "reading the FIFO blocked"
    source = got[0][1]
    assert source.startswith("default:") and "not a regular file" in source
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as f:
        f.truncate(64 << 20)  # sparse: nothing written, and nothing read
    with pytest.raises(ProfileError, match="more than a profile"):
        GateProfile.read(huge)


def test_a_profile_with_a_numeric_field_as_text_is_rejected(tmp_path, caplog):
    data = json.loads(_profile().to_json())
    data["kv_bytes_per_token"] = "4096"  # float() accepts it; the comparison with the engine did not
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="pykvcache.gate.profile"):
        _, source = load_cost_model(path, _expect())
    assert source.startswith("default:") and "kv_bytes_per_token" in source
