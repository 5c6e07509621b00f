"""The `text_signature`s written by hand in the glue (where PyO3 would show `...` for a
default) repeat the engine's defaults: mypy.stubtest (make lint) checks the stub against
them, this checks them against the engine."""

import inspect

from pykvcache import _core


def test_hand_written_text_signatures_repeat_the_engine_defaults():
    assert inspect.signature(_core.probe_storage_dir).parameters["file_mode"].default == _core.ENGINE_DEFAULTS["file_mode"]
    pool = _core.StagingPool(4096, 1)
    try:
        assert inspect.signature(pool.acquire).parameters["timeout"].default == 0.0
        assert pool.acquire() == 0 and pool.try_acquire() is None  # the default really is 0 s: no wait
    finally:
        pool.close()
