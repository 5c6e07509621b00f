"""driver.py plus what the lookahead/gate scenario needs: per-prompt
``kv_transfer_params`` and per-request engine timestamps.

Extra phase keys for ``generate``: ``kv_transfer_params`` (applied to every
prompt of the phase); each result also carries ``ttft_s`` per request: the
engine's queued -> first token interval (arrival to first token, measured in
the engine process, so the client's scheduling noise is not in it).
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
            extra = {}
            if "kv_transfer_params" in phase:
                extra["extra_args"] = {"kv_transfer_params": phase["kv_transfer_params"]}
            params = SamplingParams(temperature=0.0, max_tokens=phase.get("max_tokens", 4),
                                    ignore_eos=True, **extra)
            prompts = [driver._prompt(p, tokenizer) for p in phase["prompts"]]
            outs = llm.generate(prompts, params, use_tqdm=False)
            entry["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
            entry["num_cached_tokens"] = [o.num_cached_tokens or 0 for o in outs]
            entry["prompt_lens"] = [len(p["prompt_token_ids"]) for p in prompts]
            entry["ttft_s"] = [_ttft(o) for o in outs]
            if phase.get("settle", True):
                driver._settle(llm, tokenizer)
            entry["metrics"] = driver._metrics(llm)
        elif phase["op"] == "reset_prefix_cache":
            entry["ok"] = bool(llm.reset_prefix_cache())
        else:
            raise ValueError(f"unknown phase op {phase['op']}")
        entry["seconds"] = round(time.monotonic() - t0, 3)
        results.append(entry)
    print("RESULT " + json.dumps({"startup_s": round(startup_s, 2), "phases": results}),
          flush=True)
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
