"""One owner per fact: the engine defines defaults, choices, alignment and the
chunk-file length; the stubs and the Python modules read or repeat them, and
these tests keep the copies equal."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from pykvcache import _core
from pykvcache.vllm import config as vllm_config

PYI = Path(_core.__file__).with_name("_core.pyi")


def _pyi_tree() -> ast.Module:
    return ast.parse(PYI.read_text())


def test_store_stats_typeddict_lists_every_stats_key(store_dir):
    pool = _core.StagingPool(1 << 20, 2)
    with _core.BlockStore([store_dir], pool, namespace="constants", capacity_bytes=1 << 30) as store:
        keys = set(store.stats())
        assert store.backend_error is None
        assert store.stats()["backend_error"] == ""
    pool.close()
    stub = next(n for n in _pyi_tree().body if isinstance(n, ast.ClassDef) and n.name == "StoreStats")
    declared = {n.target.id for n in stub.body if isinstance(n, ast.AnnAssign)}
    assert declared == keys, f"missing in the stub: {keys - declared}, not returned: {declared - keys}"


def test_stub_defaults_repeat_the_engine_defaults():
    cls = next(n for n in _pyi_tree().body if isinstance(n, ast.ClassDef) and n.name == "BlockStore")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__new__")  # PyO3: #[new]
    # Constant expressions such as ``4 << 20``: evaluated without builtins.
    value = lambda d: eval(compile(ast.Expression(d), str(PYI), "eval"), {"__builtins__": {}})  # noqa: E731,S307
    stub = {a.arg: value(d) for a, d in zip(init.args.kwonlyargs, init.args.kw_defaults) if d is not None}
    assert _core.ENGINE_DEFAULTS, "exported"
    for key, value in _core.ENGINE_DEFAULTS.items():
        assert stub[key] == value, f"_core.pyi says {key}={stub[key]!r}, the engine {value!r}"


def test_choices_come_from_the_engine():
    assert vllm_config.BACKENDS == _core.BACKENDS == ("auto", "io_uring", "threads")
    assert vllm_config.DIRECT_IO_POLICIES == _core.DIRECT_IO_POLICIES == ("required", "optional", "disabled")
    assert _core.VERIFY_MODES == ("full", "header")
    assert _core.ENGINE_DEFAULTS["backend"] in _core.BACKENDS
    assert _core.ENGINE_DEFAULTS["direct_io"] in _core.DIRECT_IO_POLICIES
    assert _core.ENGINE_DEFAULTS["verify"] in _core.VERIFY_MODES
    assert vllm_config.PykvcacheConfig.__dataclass_fields__["queue_depth"].default == _core.ENGINE_DEFAULTS["queue_depth"]


def test_chunk_file_bytes_is_the_header_plus_the_aligned_payload():
    align, header = _core.IO_ALIGN, _core.HEADER_BYTES
    assert align == 4096 and header % align == 0
    for payload in (0, 1, align - 1, align, align + 1, 28 << 20):
        assert _core.chunk_file_bytes(payload) == header + -(-payload // align) * align
    pool = _core.StagingPool(5000, 1)
    assert pool.slot_stride == _core.chunk_file_bytes(5000), "a slot holds one chunk file"
    pool.close()
    with pytest.raises(OverflowError):
        _core.chunk_file_bytes(2**64 - 1)
    with pytest.raises((ValueError, OverflowError)):
        _core.chunk_file_bytes(-1)
