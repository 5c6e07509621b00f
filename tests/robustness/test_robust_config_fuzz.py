"""Fuzzing the vLLM config parser: any JSON-like kv_connector_extra_config
either parses into a valid config or raises one ConfigError (a ValueError)
naming the problem — never another exception, never a half-valid config."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pykvcache.vllm.config import ConfigError, validate_extra_config

KEYS = [
    "storage_dirs",
    "capacity_bytes",
    "staging_bytes",
    "block_size",
    "blocks_per_chunk",
    "queue_depth",
    "backend",
    "direct_io",
    "register_buffers",
    "max_inflight_writes",
    "offload_prompt_only",
    "model_id",
    "namespace_salt",
    "wipe_on_reset",
    "gate",
    "gate_profile",
    "gate_margin",
    "gate_online",
    "store_min_tokens",
    "store_second_sighting",
    "lookahead_bytes",
    "lookahead_requests",
    "lookup_hold_bytes",
    "min_free_bytes",
    "min_free_fraction",
    "allow_insecure_root",
    "not_a_key",
]

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.just("a\x00b"),
    st.sampled_from(
        [
            "1GiB",
            "500GiB",
            "2TB",
            "-1",
            "0",
            "1e3",
            "auto",
            "io_uring",
            "threads",
            "required",
            "optional",
            "disabled",
            "break_even",
            "NaN",
            "10 GiB",
            "GiB",
            "infGiB",
            "nanGiB",
            "-infTiB",
            "1e400GiB",
            "5%",
            "0B",
        ]
    ),
)
json_values = st.recursive(
    json_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=2), max_leaves=6
)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(extra=st.dictionaries(st.sampled_from(KEYS), json_values, max_size=10), base=st.booleans())
def test_config_parser_never_crashes(tmp_path_factory, extra, base):
    if base:
        extra = {"storage_dirs": [str(tmp_path_factory.getbasetemp() / "kv")], "capacity_bytes": "1GiB", **extra}
    try:
        cfg = validate_extra_config(extra)  # parsing and the storage checks
    except ConfigError as e:
        assert str(e)
        return
    assert cfg.capacity_bytes > 0 and cfg.staging_bytes > 0 and cfg.queue_depth > 0
    assert cfg.storage_dirs and all(isinstance(d, str) and d for d in cfg.storage_dirs)
