"""Break-even admission gate: load a prefix from the KV tier only when that is
faster than recomputing it.

* :mod:`~pykvcache.gate.cost_model`  T_load vs T_prefill, break-even
* :mod:`~pykvcache.gate.profile`     the profile ``pykvcache calibrate`` writes
* :mod:`~pykvcache.gate.decision`    per-request decision (a prefix, in chunks)
* :mod:`~pykvcache.gate.online`      refinement from observed load and prefill times
* :mod:`~pykvcache.gate.device_memory`  the learnt device model kept for the next start
* :mod:`~pykvcache.gate.exploration` sampling a load now and then while recomputing
* :mod:`~pykvcache.gate.outages`     what not to learn around a storage outage (circuit breakers)
* :mod:`~pykvcache.gate.store_admission`  skipping stores that cannot pay off
* :mod:`~pykvcache.gate.request_keys`  a request's key list from vLLM's ReqContext

Pure Python without third-party imports, so the scheduler can import it cheaply.
"""

from __future__ import annotations

import os

from pykvcache.gate import device_memory
from pykvcache.gate.cost_model import CostModel, LoadCost, PrefillCurve
from pykvcache.gate.decision import GATE_COUNTERS, GATE_GAUGES, AdmissionGate, ChunkState, GateDecision
from pykvcache.gate.exploration import Exploration
from pykvcache.gate.online import MIN_LESSON_S, OnlineLoadModel, OnlinePrefillModel
from pykvcache.gate.outages import OutageFilter
from pykvcache.gate.profile import (
    DEFAULT_BREAK_EVEN_TOKENS,
    GateProfile,
    ProfileError,
    ProfileExpectation,
    default_cost_model,
    hardware_id,
    load_cost_model,
)
from pykvcache.gate.request_keys import request_keys_from
from pykvcache.gate.store_admission import STORE_COUNTERS, StoreAdmission

__all__ = [
    "DEFAULT_BREAK_EVEN_TOKENS",
    "GATE_COUNTERS",
    "GATE_GAUGES",
    "STORE_COUNTERS",
    "AdmissionGate",
    "ChunkState",
    "CostModel",
    "Exploration",
    "GateDecision",
    "GateProfile",
    "LoadCost",
    "MIN_LESSON_S",
    "OnlineLoadModel",
    "OnlinePrefillModel",
    "OutageFilter",
    "PrefillCurve",
    "ProfileError",
    "ProfileExpectation",
    "StoreAdmission",
    "build_gate",
    "default_cost_model",
    "device_memory",
    "hardware_id",
    "load_cost_model",
    "request_keys_from",
]


def build_gate(
    profile_path: str | os.PathLike[str] | None,
    expected: ProfileExpectation,
    *,
    online: bool = True,
    margin: float = 1.0,
    enabled: bool = True,
    steps: bool = False,
) -> tuple[AdmissionGate, str]:
    """The gate for a running engine and the source of its model (``"profile"``
    or ``"default: <why>"``; a bad or foreign profile is logged, not raised).
    ``steps``: the connector reports the engine's steps, which teach the
    prefill side (PyKvCacheConnector's, through the gate plan's step timer)."""
    model, source = load_cost_model(profile_path, expected, gating=enabled)
    # The load side of a profile is a prior, as the default's is: the first
    # lesson replaces it and nothing bounds the estimate to it; every lesson
    # covers a throttle's slice of the device's time (online.py, decision 0079).
    refine = OnlineLoadModel(model.load, prior_weight=0, min_lesson_s=MIN_LESSON_S) if online else None
    # The prefill side is learnt only over the default prior: a profile timed
    # prefill on this host through vLLM and stays authoritative (its load side
    # is refined as before). Without online refinement nothing could ever be
    # learnt, so gate_online off keeps the static default as before.
    prefill = OnlinePrefillModel(model.prefill, calibrated=False) if online and source != "profile" else None
    if prefill is not None:
        prefill.fed = steps
    # Online learning alone never unlearns a slow disk once the gate stops
    # loading: it samples a load now and then (decision 0054).
    gate = AdmissionGate(
        model,
        chunk_tokens=expected.chunk_tokens,
        online=refine,
        margin=margin,
        enabled=enabled,
        prefill_online=prefill,
        exploration=Exploration() if online else None,
    )
    gate.first_contact = source == "profile"
    return gate, source
