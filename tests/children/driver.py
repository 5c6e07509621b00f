"""Runs one vLLM engine through a list of phases and prints the results as JSON.

Starting vLLM costs ~25 s here, so each e2e scenario is one process running
several phases against one engine. Usage::

    python driver.py scenario.json

The scenario holds ``model``, ``llm`` (extra ``vllm.LLM`` keyword arguments,
e.g. ``kv_transfer_config``) and ``phases``. The last stdout line is
``RESULT <json>`` with one entry per phase. ``replace_on_log`` ({"pattern",
"src", "dst"}) renames ``src`` over ``dst`` in the logging call of vLLM's
default loader's first message containing ``pattern`` (e.g. "Loading weights took": the
weights are replaced the moment vLLM has loaded them, before anything else runs).
A prompt given as a dict may name a LoRA adapter: ``"lora": [name, id, path]``.

Phase ops:
  generate            prompts -> token ids, num_cached_tokens, metrics after
  reset_prefix_cache  clears vLLM's device prefix cache (pykvcache keeps its data)
  corrupt_files       flips one payload byte in every chunk file under ``dir``
  scribble_staging    overwrites every slot payload of this engine's staging with noise
  settle              waits until pykvcache reports no writes in flight
  signal              sends ``signal`` (a name, e.g. SIGSTOP) to process ``pid`` (a FUSE
                      daemon: tests/helpers/stall_fs.py), ``wait_stopped`` until it is stopped
  until_breaker_closed  tiny requests until no storage directory's breaker is open (``closed``,
                      bounded by ``timeout_s``)
  shell               runs ``argv`` (a list), e.g. takes a network link down
  sleep               sleeps ``seconds``
  events_take         the KV events published since the engine started (scenario
                      ``kv_events``: a KVEventsConfig dict with a ZMQ endpoint,
                      subscribed to before the first phase)
"""

from __future__ import annotations

import glob
import json
import os
import random
import sys
import time


def _metrics(llm) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        name = metric.name
        if not (name.startswith("vllm:pykvcache_") or name.startswith("vllm:kv_offload_") or name.startswith("vllm:prefix_cache")):
            continue
        value = getattr(metric, "value", None)
        if value is None:
            value = getattr(metric, "sum", None)
        if isinstance(value, (int, float)):
            out[name] = out.get(name, 0) + value
    return out


def _prompt(spec, tokenizer):
    if isinstance(spec, str):
        return {"prompt_token_ids": tokenizer(spec).input_ids}
    ids = tokenizer(spec["text"]).input_ids
    if "keep" in spec:
        ids = ids[: spec["keep"]]
    if "append" in spec:
        ids = ids + tokenizer(spec["append"], add_special_tokens=False).input_ids
    prompt = {"prompt_token_ids": ids}
    if "salt" in spec:
        prompt["cache_salt"] = spec["salt"]  # vLLM mixes it into the block hashes
    return prompt


def _lora(spec):
    if isinstance(spec, dict) and spec.get("lora"):
        from vllm.lora.request import LoRARequest

        name, int_id, path = spec["lora"]
        return LoRARequest(name, int_id, path)
    return None


#: The logger of vLLM's default loader ("Loading weights took ...").
_LOADER_LOGGER = "vllm.model_executor.model_loader.default_loader"


def _replace_on_log(pattern: str, src: str, dst: str):
    """A filter on the default loader's logger that renames ``src`` over
    ``dst`` once, in the logging call of its first message containing
    ``pattern``. A filter on the logger that logs, not a handler: vLLM's
    logging setup may run again while an engine starts, which drops the
    handlers of "vllm" and its children but keeps filters."""
    import logging

    class Replace(logging.Filter):
        done = False

        def filter(self, record):
            if not self.done and pattern in record.getMessage():
                self.done = True
                os.replace(src, dst)
                print(f"driver: replaced {dst} on {pattern!r}", file=sys.stderr, flush=True)
            return True

    replace = Replace()
    logging.getLogger(_LOADER_LOGGER).addFilter(replace)
    # vLLM logs its load time with info_once: an earlier engine in this
    # process must not have used up the message.
    from vllm.logger import _print_info_once

    _print_info_once.cache_clear()
    return replace


def _corrupt_files(directory: str) -> int:
    count = 0
    for path in glob.glob(os.path.join(directory, "**", "*.kvc"), recursive=True):
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            # Past the header, inside the payload: any format must catch it.
            offset = size // 2 + 123
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0xFF]))
        count += 1
    return count


def staging_memfds(prefix: str) -> set[str]:
    """Names of the staging memfds whose label starts with ``prefix`` that some
    process on this host holds (the EngineCore, a child of this driver)."""
    from proc_fds import fd_links

    return {target[len("/memfd:") : -len(" (deleted)")] for _, _, target in fd_links(f"/memfd:{prefix}") if target.endswith(" (deleted)")}


def _attach_staging(llm):
    """Map this engine's staging region (a memfd held by the EngineCore)."""
    from pykvcache._core import StagingPool
    from pykvcache.vllm.layout import staging_shm_prefix

    engine_id = llm.llm_engine.vllm_config.kv_transfer_config.engine_id
    names = staging_memfds(staging_shm_prefix(engine_id))
    if len(names) != 1:
        raise RuntimeError(f"expected one staging region for engine {engine_id}, found {names}")
    return StagingPool.attach_memfd(names.pop())


def _scribble_staging(pool) -> int:
    rng = random.Random(7)
    noise = bytes(rng.getrandbits(8) for _ in range(4096))
    region = pool.region()
    for slot in range(pool.num_slots):
        start = pool.payload_offset(slot)
        for off in range(0, pool.slot_bytes, len(noise)):
            n = min(len(noise), pool.slot_bytes - off)
            region[start + off : start + off + n] = noise[:n]
    region.release()
    return pool.num_slots


def _settle(llm, tokenizer, timeout: float = 30.0) -> None:
    """Let pending disk writes finish: the engine keeps stepping while pykvcache
    has I/O in flight; a tiny request then collects the final stats."""
    from vllm import SamplingParams

    time.sleep(1.0)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        llm.generate([{"prompt_token_ids": tokenizer("settle").input_ids}], SamplingParams(max_tokens=1), use_tqdm=False)
        if _metrics(llm).get("vllm:pykvcache_staging_slots_pinned", 0) == 0:
            return
        time.sleep(0.5)


def _wait_stopped(pid: int, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                pass
        if states and all(st in "tT" for st in states):
            return
        time.sleep(0.005)


class _EventSubscriber:
    """A ZMQ SUB socket on the engine's KV event publisher (what a router runs)."""

    def __init__(self, endpoint: str):
        import zmq
        from msgspec.msgpack import Decoder
        from vllm.distributed.kv_events import KVEventBatch

        self._zmq = zmq
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.decoder = Decoder(type=KVEventBatch)
        time.sleep(0.5)  # PUB/SUB: a subscriber joining late misses what was sent

    def take(self, wait_s: float = 2.0) -> list[dict]:
        out = []
        deadline = time.monotonic() + wait_s
        while True:
            left = max(0, int((deadline - time.monotonic()) * 1000))
            if not self.sock.poll(left):
                return out
            frames = self.sock.recv_multipart()
            batch = self.decoder.decode(frames[-1])
            for ev in batch.events:
                hashes = [h.hex() if isinstance(h, bytes) else h for h in getattr(ev, "block_hashes", [])]
                out.append(
                    {
                        "type": type(ev).__name__,
                        "medium": getattr(ev, "medium", None),
                        "block_hashes": hashes,
                        "token_ids": list(getattr(ev, "token_ids", []) or []),
                        "block_size": getattr(ev, "block_size", None),
                    }
                )
            deadline = time.monotonic() + 0.5  # drain what follows closely


def run_scenario(scenario: dict, report) -> None:
    """One engine through the scenario's phases; ``report(result)`` gets the
    result before the engine shuts down (a hang in shutdown keeps the result)."""
    from vllm import LLM, SamplingParams

    extra_llm = dict(scenario.get("llm", {}))
    if scenario.get("kv_events"):
        from vllm.config import KVEventsConfig

        extra_llm["kv_events_config"] = KVEventsConfig(**scenario["kv_events"])

    swap = scenario.get("replace_on_log")
    swapper = _replace_on_log(swap["pattern"], swap["src"], swap["dst"]) if swap else None
    started = time.monotonic()
    llm = LLM(
        model=scenario["model"],
        dtype=scenario.get("dtype", "float32"),
        block_size=scenario.get("block_size", 32),
        enable_prefix_caching=True,
        enforce_eager=True,
        disable_log_stats=False,
        max_model_len=scenario.get("max_model_len", 2048),
        kv_cache_memory_bytes=scenario.get("kv_cache_memory_bytes", 8 << 20),
        seed=0,
        **extra_llm,
    )
    if swapper is not None:
        import logging

        logging.getLogger(_LOADER_LOGGER).removeFilter(swapper)
        if not swapper.done:
            raise RuntimeError(f"vLLM never logged {swap['pattern']!r}: nothing was replaced")
    subscriber = _EventSubscriber(scenario["kv_events"]["endpoint"]) if scenario.get("kv_events") else None
    tokenizer = llm.get_tokenizer()
    startup_s = time.monotonic() - started
    staging = None
    if any(p["op"] == "scribble_staging" for p in scenario["phases"]):
        staging = _attach_staging(llm)
    results = []
    for phase in scenario["phases"]:
        t0 = time.monotonic()
        entry = {"op": phase["op"], "name": phase.get("name", phase["op"])}
        print(f"driver: phase {entry['name']} starts", file=sys.stderr, flush=True)
        if phase["op"] == "generate":
            params = SamplingParams(temperature=0.0, max_tokens=phase.get("max_tokens", 24), ignore_eos=True)
            prompts = [_prompt(p, tokenizer) for p in phase["prompts"]]
            loras = [_lora(p) for p in phase["prompts"]]
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras if any(loras) else None)
            entry["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
            entry["num_cached_tokens"] = [o.num_cached_tokens or 0 for o in outs]
            entry["prompt_lens"] = [len(p["prompt_token_ids"]) for p in prompts]
            entry["generate_s"] = round(time.monotonic() - t0, 3)
            if phase.get("prompt_ids"):
                entry["prompt_ids"] = [p["prompt_token_ids"] for p in prompts]
            if phase.get("settle", True) and scenario.get("llm", {}).get("kv_transfer_config"):
                _settle(llm, tokenizer)
            entry["metrics"] = _metrics(llm)
        elif phase["op"] == "until_breaker_closed":
            # The breaker closes on the watchdog's probe after its back-off;
            # the gauge reaches vLLM's metrics with engine steps, so drive a
            # few tiny requests (unique, shorter than a chunk: no disk I/O).
            params = SamplingParams(temperature=0.0, max_tokens=1)
            end = t0 + phase.get("timeout_s", 60)
            entry["closed"] = False
            attempt = 0
            while time.monotonic() < end:
                attempt += 1
                llm.generate([f"breaker check {attempt}"], params, use_tqdm=False)
                if _metrics(llm).get("vllm:pykvcache_disk_breaker_open_dirs", 1) == 0:
                    entry["closed"] = True
                    break
                time.sleep(phase.get("interval_s", 0.5))
            entry["attempts"] = attempt
        elif phase["op"] == "reset_prefix_cache":
            entry["ok"] = bool(llm.reset_prefix_cache())
        elif phase["op"] == "corrupt_files":
            entry["files"] = _corrupt_files(phase["dir"])
        elif phase["op"] == "scribble_staging":
            entry["slots"] = _scribble_staging(staging)
        elif phase["op"] == "signal":
            import signal as signals

            os.kill(phase["pid"], getattr(signals, phase["signal"]))
            if phase["signal"] == "SIGSTOP":
                _wait_stopped(phase["pid"])
        elif phase["op"] == "sleep":
            time.sleep(phase["seconds"])
        elif phase["op"] == "settle":
            _settle(llm, tokenizer)
            entry["metrics"] = _metrics(llm)
        elif phase["op"] == "shell":
            import subprocess

            proc = subprocess.run(phase["argv"], capture_output=True, text=True, timeout=60)
            entry["rc"] = proc.returncode
            entry["output"] = (proc.stdout + proc.stderr)[-2000:]
        elif phase["op"] == "events_take":
            entry["events"] = subscriber.take()
        else:
            raise ValueError(f"unknown phase op {phase['op']}")
        entry["seconds"] = round(time.monotonic() - t0, 3)
        results.append(entry)
    kv_config = llm.llm_engine.vllm_config.kv_transfer_config
    prefix = None
    if kv_config is not None:
        from pykvcache.vllm.layout import staging_shm_prefix

        prefix = staging_shm_prefix(kv_config.engine_id)
    if staging is not None:
        staging.close()  # this driver's own mapping of the engine's staging (scribble_staging)
    report({"startup_s": round(startup_s, 2), "phases": results, "staging_prefix": prefix})
    # Shut the engine down explicitly so pykvcache's shutdown path (flush
    # pending writes) runs before exit (or before the host's next engine).
    llm.llm_engine.engine_core.shutdown()


def _host() -> int:
    """``driver.py --host``: engines one after another in this process, so a test
    module pays vLLM's import (most of an in-process engine start here) once.
    Each stdin line is a JSON request {"scenario", "log", "env"}: the engine's
    stdout and stderr go to ``log`` (fd-level, so vLLM's and the Rust engine's
    lines land there as in a child of its own), os.environ is the caller's for
    the scenario, and one ``RESULT <json>`` or ``FAILED <json>`` line answers on
    the original stdout. After a failure the host exits: a fresh one starts."""
    import gc
    import traceback

    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    saved_out, saved_err = os.dup(1), os.dup(2)
    base_env = dict(os.environ)
    for line in sys.stdin:
        request = json.loads(line)
        scenario = json.load(open(request["scenario"]))
        answered = []
        log_fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(log_fd, 1), os.dup2(log_fd, 2)
        os.close(log_fd)
        os.environ.clear()
        os.environ.update(request.get("env") or base_env)
        failed = None
        try:
            run_scenario(scenario, answered.append)
        except BaseException:  # noqa: BLE001 - every failure goes back to the test
            failed = traceback.format_exc()
            print(failed, file=sys.stderr)
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved_out, 1), os.dup2(saved_err, 2)
            os.environ.clear()
            os.environ.update(base_env)
        if failed is None:
            # The next engine starts on a clean slate: vLLM's process-wide state
            # (process groups, the device cache) and the finished engine's objects.
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
            gc.collect()
        if answered and failed is None:
            protocol.write("RESULT " + json.dumps(answered[-1]) + "\n")
        else:
            protocol.write("FAILED " + json.dumps(failed or "no result") + "\n")
            return 1
    return 0


def main() -> int:
    if sys.argv[1] == "--host":
        return _host()
    scenario = json.load(open(sys.argv[1]))
    run_scenario(scenario, lambda result: print("RESULT " + json.dumps(result), flush=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
