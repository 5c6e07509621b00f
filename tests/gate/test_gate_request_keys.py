"""The request's key list recovered from vLLM's own ReqContext (no engine)."""

from __future__ import annotations

import importlib.util

import pytest
from pykvcache.gate.request_keys import request_keys_from

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


def _ctx(num_chunks: int, chunk_tokens: int, groups=(0,)):
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key

    ctx = ReqContext(req_id="r")
    keys = {}
    for g in groups:
        for i in range(num_chunks):
            key = make_offload_key(f"hash-{i}".encode(), g)
            ctx.set_offload_key_position(key, (i + 1) * chunk_tokens)
            keys.setdefault(g, []).append(key)
    return ctx, keys


def test_full_list_from_the_first_looked_up_key():
    ctx, keys = _ctx(10, 32, groups=(0, 1))
    got, start = request_keys_from(ctx, keys[0][3], 32)
    assert got == keys[0][3:] and start == 96
    got, start = request_keys_from(ctx, keys[1][0], 32)
    assert got == keys[1] and start == 0


def test_boundary_keys_are_skipped():
    from vllm.v1.kv_offload.base import make_offload_key

    ctx, keys = _ctx(4, 64)
    ctx.set_offload_key_position(make_offload_key(b"tail", 0), 64 * 4 + 16)  # partial tail
    ctx.set_offload_key_position(make_offload_key(b"dup", 0), 128)  # a later key at a chunk end
    got, _ = request_keys_from(ctx, keys[0][0], 64)
    assert got == keys[0]


def test_without_positions_only_the_key_itself():
    from vllm.v1.kv_offload.base import ReqContext

    got, start = request_keys_from(ReqContext(req_id="r"), b"k" * 8, 32)
    assert got == [b"k" * 8] and start == 0
