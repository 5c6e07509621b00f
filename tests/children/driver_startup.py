"""Starts (or fails to start) one vLLM engine with pykvcache and prints what
start-up looked like. Usage: ``python driver_startup.py scenario.json``.

``mode`` "bad": builds ``kv_transfer_config`` with pykvcache's helper from
``helper_args`` and hands it to ``vllm.LLM``; prints the error and how long
after the call it came. With ``json_kv``, then hands that dict to ``vllm.LLM``
as it is (what ``--kv-transfer-config`` JSON gives vLLM: no helper), and
prints how long the refused engine start took. ``mode`` "start": ``vllm.LLM`` with ``kv`` as
``kv_transfer_config``; prints the start-up time and the pykvcache metrics
vLLM lists before any request, then runs one request.
The last stdout line is ``RESULT <json>``.
"""

from __future__ import annotations

import json
import sys
import time

#: Printed before the refused engine start of ``json_kv``.
JSON_START = "-- the same kind of settings as JSON, no helper --"


def _llm(model: str, kv: dict):
    from vllm import LLM

    return LLM(
        model=model,
        dtype="float32",
        block_size=32,
        enable_prefix_caching=True,
        enforce_eager=True,
        disable_log_stats=False,
        max_model_len=2048,
        kv_cache_memory_bytes=8 << 20,
        seed=0,
        kv_transfer_config=kv,
    )


def _metrics(llm) -> dict[str, float]:
    from driver import _metrics as all_metrics  # pykvcache's, vLLM's offload and prefix-cache series

    return {name: value for name, value in all_metrics(llm).items() if name.startswith("vllm:pykvcache_")}


def main() -> int:
    scenario = json.load(open(sys.argv[1]))
    import vllm  # noqa: F401 - imported before the clock starts: its import time is no start-up
    from pykvcache.vllm import ConfigError
    from pykvcache.vllm.config import kv_transfer_config

    started = time.monotonic()
    if scenario["mode"] == "bad":
        try:
            _llm(scenario["model"], kv_transfer_config(**scenario["helper_args"]))
        except ConfigError as exc:
            result = {"error": str(exc), "seconds": round(time.monotonic() - started, 3)}
        else:
            result = {"error": None}
        if scenario.get("json_kv"):
            print(JSON_START, flush=True)  # the helper's part of the output ends here
            started = time.monotonic()
            try:
                _llm(scenario["model"], scenario["json_kv"])
            except Exception as exc:  # noqa: BLE001 - vLLM's engine start failure; its cause is in the log
                result.update(json_error=f"{type(exc).__name__}: {exc}", json_seconds=round(time.monotonic() - started, 1))
            else:
                result.update(json_error=None)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    llm = _llm(scenario["model"], scenario["kv"])
    startup_s = time.monotonic() - started
    before = _metrics(llm)
    from vllm import SamplingParams

    llm.generate([{"prompt_token_ids": list(range(1, 200))}], SamplingParams(max_tokens=4), use_tqdm=False)
    print("RESULT " + json.dumps({"startup_s": round(startup_s, 2), "metrics_before": before, "metrics_after": _metrics(llm)}), flush=True)
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
