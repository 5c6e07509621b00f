"""driver.py plus what the lookahead/gate scenario needs: per-prompt
``kv_transfer_params`` and per-request engine timestamps.

Extra phase keys for ``generate``: ``kv_transfer_params`` (applied to every
prompt of the phase), or per prompt ``kv_transfer_params_each`` (a list, None
= no params) and ``max_tokens_each``; each result also carries ``ttft_s`` per
request: the engine's queued -> first token interval (arrival to first token,
measured in the engine process, so the client's scheduling noise is not in
it), and ``ts`` per request: the engine's queued / scheduled / first token /
last token timestamps (monotonic, seconds).

``reset_prefix_cache`` takes ``reset_connector`` (with ``wipe_on_reset:
false`` this empties pykvcache's staging and keeps the chunk files).
"""

from __future__ import annotations

import json
import sys
import time

import driver


def _ttft(out) -> float | None:
    m = getattr(out, "metrics", None)
    first = getattr(m, "first_token_ts", 0) if m is not None else 0
    queued = getattr(m, "queued_ts", 0) if m is not None else 0
    return round(first - queued, 5) if first and queued else None


def _timestamps(out) -> dict[str, float]:
    m = getattr(out, "metrics", None)
    return {
        k: float(getattr(m, k + "_ts", 0.0) or 0.0) if m is not None else 0.0 for k in ("queued", "scheduled", "first_token", "last_token")
    }


def main() -> int:
    scenario = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams

    started = time.monotonic()
    llm = LLM(
        model=scenario["model"],
        dtype="float32",
        block_size=32,
        enable_prefix_caching=True,
        enforce_eager=True,
        disable_log_stats=False,
        max_model_len=2048,
        kv_cache_memory_bytes=scenario.get("kv_cache_memory_bytes", 8 << 20),
        seed=0,
        **scenario.get("llm", {}),
    )
    tokenizer = llm.get_tokenizer()
    startup_s = time.monotonic() - started
    results = []
    for phase in scenario["phases"]:
        t0 = time.monotonic()
        entry = {"op": phase["op"], "name": phase.get("name", phase["op"])}
        if phase["op"] == "generate":
            n = len(phase["prompts"])
            kv_each = phase.get("kv_transfer_params_each") or [phase.get("kv_transfer_params")] * n
            max_each = phase.get("max_tokens_each") or [phase.get("max_tokens", 4)] * n
            params = [
                SamplingParams(
                    temperature=0.0, max_tokens=mt, ignore_eos=True, **({"extra_args": {"kv_transfer_params": kv}} if kv else {})
                )
                for kv, mt in zip(kv_each, max_each)
            ]
            prompts = [driver._prompt(p, tokenizer) for p in phase["prompts"]]
            outs = llm.generate(prompts, params, use_tqdm=False)
            entry["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
            entry["num_cached_tokens"] = [o.num_cached_tokens or 0 for o in outs]
            entry["prompt_lens"] = [len(p["prompt_token_ids"]) for p in prompts]
            entry["ttft_s"] = [_ttft(o) for o in outs]
            entry["ts"] = [_timestamps(o) for o in outs]
            if phase.get("settle", True):
                driver._settle(llm, tokenizer)
            entry["metrics"] = driver._metrics(llm)
        elif phase["op"] == "reset_prefix_cache":
            entry["ok"] = bool(llm.reset_prefix_cache(reset_connector=bool(phase.get("reset_connector", False))))
        else:
            raise ValueError(f"unknown phase op {phase['op']}")
        entry["seconds"] = round(time.monotonic() - t0, 3)
        results.append(entry)
    print("RESULT " + json.dumps({"startup_s": round(startup_s, 2), "phases": results}), flush=True)
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
