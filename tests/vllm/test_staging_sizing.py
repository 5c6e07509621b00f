"""The start-up check of staging against the longest prompt the engine
accepts (pykvcache.vllm.staging_sizing): the serving benchmark found that
staging under two full-length prefixes serializes every long load and that a
lookahead budget under one prefix preloads nothing useful."""

from __future__ import annotations

import pytest
from pykvcache.vllm.staging_sizing import RECOMMENDED_PREFIXES, staging_sizing

SLOT = (2 << 20) + 4096  # a 2 MiB chunk file (64 tokens x 32 KiB) with its header


def sizing(staging_mib: int, *, lookahead_share: float = 0.5, max_model_len: int = 2048, groups: int = 1):
    slots = (staging_mib << 20) // SLOT
    return staging_sizing(
        slots=slots,
        slot_bytes=SLOT,
        lookahead_slots=int(slots * lookahead_share),
        max_model_len=max_model_len,
        chunk_tokens=64,
        groups=groups,
    )


def test_a_full_length_prompt_loads_all_but_its_last_token():
    # 2047 loadable tokens / 64 = 31 whole chunks (vLLM recomputes the last token).
    assert sizing(160).prefix_chunks == 31
    assert sizing(160, max_model_len=2049).prefix_chunks == 32
    assert sizing(160, groups=2).prefix_chunks == 62


def test_staging_under_one_prefix_says_how_much_of_it_can_load_and_what_to_give():
    advice = sizing(48).advice()
    assert len(advice) == 2, advice
    assert "fewer than the 31 of one full-length prompt" in advice[0]
    assert "at most 74%" in advice[0]
    want = RECOMMENDED_PREFIXES * 31 * SLOT
    assert f"staging_bytes >= {want}" in advice[0]
    assert "lookahead's budget (11 chunks)" in advice[1]


def test_staging_under_two_prefixes_warns_that_loads_serialize():
    advice = sizing(96).advice()
    assert any("1.5 full-length prefixes" in a and "serialize" in a for a in advice), advice


@pytest.mark.parametrize("mib", [160, 256])
def test_staging_sized_as_recommended_gives_no_advice(mib):
    assert sizing(mib).advice() == []


def test_lookahead_off_is_not_advised_about():
    advice = sizing(96, lookahead_share=0).advice()
    assert advice and not any("lookahead" in a for a in advice)


def test_unknown_model_length_gives_no_advice():
    assert sizing(8, max_model_len=0).advice() == []
