"""The ``pykvcache`` command line.

Each subcommand is one function decorated with :func:`subcommand`: it receives
its argparse sub-parser, declares its options and returns the function that
runs it. Adding a subcommand (``calibrate``, ...) touches nothing else.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pykvcache.tools.bench.runner import BenchRun

Handler = Callable[[argparse.Namespace], int]
Setup = Callable[[argparse.ArgumentParser], Handler]

_SUBCOMMANDS: dict[str, tuple[str, Setup]] = {}


def subcommand(name: str, help: str) -> Callable[[Setup], Setup]:
    def register(setup: Setup) -> Setup:
        if name in _SUBCOMMANDS:
            raise ValueError(f"subcommand {name!r} defined twice")
        _SUBCOMMANDS[name] = (help, setup)
        return setup

    return register


def _size_list(text: str) -> list[int]:
    """'2,8,28' (MiB) -> bytes."""
    try:
        values = [int(float(x) * (1 << 20)) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated MiB values, got {text!r}") from None
    if not values or any(v <= 0 or v % 4096 for v in values):
        raise argparse.ArgumentTypeError(f"sizes must be positive multiples of 4 KiB, got {text!r}")
    return values


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"values must be positive, got {text!r}")
    return values


def _check_part_options(parser: argparse.ArgumentParser, part: str, options_from: Callable[[Any], Any], config: Any) -> None:
    """A part's ``--PART-set`` options parsed and checked now: a typo fails here, not after the
    other parts have run."""
    try:
        problems = options_from(config).check()
    except ValueError as exc:
        parser.error(str(exc))
    if problems:
        parser.error(f"{part} options: " + "; ".join(problems))


@subcommand("bench", "characterize the KV tier on this machine (vs fio and vLLM's fs tier)")
def _bench(parser: argparse.ArgumentParser) -> Handler:
    from .bench.config import MiB

    parser.add_argument(
        "--out", type=Path, default=None, help="directory for report.md, PNG plots and results.json (required unless --list-parts)"
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path.cwd(),
        help="directory on the storage to measure (a temporary subdirectory is created and removed); default: current directory",
    )
    preset = parser.add_mutually_exclusive_group()
    preset.add_argument(
        "--quick", action="store_true", help="smoke preset: storage and fs tier only, one chunk size, one repeat (about a minute)"
    )
    preset.add_argument(
        "--full", action="store_true", help="the whole sweep: 3 chunk sizes, 3 queue depths, 8 fio shapes (about 10 minutes)"
    )
    parser.add_argument("--parts", default=None, help="comma-separated parts to run (default: all default parts); see --list-parts")
    parser.add_argument("--list-parts", action="store_true", help="list the available parts and exit")
    parser.add_argument("--repeats", type=int, default=None, help="repeats per measurement (medians are reported)")
    parser.add_argument("--chunk-mib", type=_size_list, default=None, help="engine/fio chunk sizes in MiB, e.g. 2,8,28")
    parser.add_argument("--queue-depths", type=_int_list, default=None, help="chunk operations in flight, e.g. 1,8,32")
    parser.add_argument("--segment-mib", type=float, default=None, help="override the engine's read segment size (MiB)")
    parser.add_argument(
        "--write-segment-mib", type=float, default=None, help="engine write segment size (MiB; default: each chunk in one write)"
    )
    parser.add_argument(
        "--verify", choices=("full", "header"), default=None, help="engine read verification (default full: header + payload CRC)"
    )
    parser.add_argument(
        "--encrypt",
        action="store_true",
        help="storage part: also run every engine case with an encryption key (sealed chunks), "
        "both verify=full, side by side: the throughput ratio and CPU per GB",
    )
    parser.add_argument(
        "--serve-preset",
        default=None,
        choices=("sessions", "long-context", "quick"),
        help="serve part: what it runs (docs/performance.md, Serving): sessions (default: multi-turn "
        "users over 1.5k-token documents, every tier), long-context (TTFT vs context length "
        "1k-16k, quiet and read-capped: the crossover plot), quick (CI size)",
    )
    parser.add_argument(
        "--serve-configs",
        default=None,
        help="serve part: comma-separated configurations (recompute,pykvcache,gate_off,"
        "lookahead_off,verify_header,lmcache,native; default all)",
    )
    parser.add_argument(
        "--serve-model",
        default=None,
        help="serve part: a generated model (llama3-geometry, llama3-geometry-32k, tiny) or a model directory",
    )
    parser.add_argument("--serve-concurrency", type=_int_list, default=None, help="serve part: concurrent users per level, e.g. 2,6")
    parser.add_argument("--serve-repeats", type=int, default=None, help="serve part: repeats per configuration")
    parser.add_argument(
        "--serve-set",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="serve part: set any of its options (ServeOptions in serve_options.py), e.g. "
        "staging_bytes=48MiB or doc_tokens=1024; repeatable",
    )
    parser.add_argument(
        "--disk-hit-set",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="disk_hit part: set any of its options (DiskHitOptions in disk_hit_run.py), e.g. "
        "doc_tokens=8192,16384 or samples=9; repeatable",
    )
    parser.add_argument(
        "--cluster-set",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="cluster part: set any of its options (ClusterOptions in cluster_run.py), e.g. "
        "doc_tokens=4096 or router_path=.vllm-router; repeatable",
    )
    parser.add_argument(
        "--serve-busy-cores",
        type=int,
        default=None,
        help="serve part: busy-loop processes running while every configuration is measured (other work sharing the cores), default 0",
    )
    parser.add_argument(
        "--lmcache-mib", type=int, default=None, help="lmcache_disk part: MiB stored and loaded per system and case (default 512)"
    )
    parser.add_argument(
        "--lmcache-concurrency",
        type=_int_list,
        default=None,
        help="lmcache_disk part: operations in flight, e.g. 4,16 (LMCache disk threads = pykvcache queue depth)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (logs, CI)")
    parser.add_argument("--warm", action="store_true", help="do not drop caches before read phases")
    parser.add_argument(
        "--cold-metadata", action="store_true", help="also drop dentry/inode caches before read phases (default: page cache only)"
    )

    def run(args: argparse.Namespace) -> int:
        from .bench import BenchConfig, quick, run_bench
        from .bench.config import full
        from .bench.parts import PARTS, resolve_parts

        if args.list_parts:
            resolve_parts(None)
            for p in PARTS.values():
                print(f"{p.name:<10} {'(default) ' if p.default else ''}{p.description}")
            return 0
        if args.out is None:
            parser.error("the following arguments are required: --out")
        if not args.dir.is_dir():
            print(f"pykvcache bench: --dir {args.dir} is not a directory", file=sys.stderr)
            return 2
        parts = [p.strip() for p in args.parts.split(",") if p.strip()] if args.parts else None
        try:
            resolve_parts(parts)
        except ValueError as e:
            print(f"pykvcache bench: {e}", file=sys.stderr)
            return 2
        config = BenchConfig(out=args.out, directory=args.dir, argv=["pykvcache", *args.argv])
        if parts:
            config.parts = parts
        if args.quick:
            config = quick(config)
        elif args.full:
            config = full(config)
        if args.repeats:
            config.repeats = args.repeats
        if args.chunk_mib:
            config.chunk_sizes = args.chunk_mib
            config.fs_chunk_sizes = args.chunk_mib
            config.lmcache_chunk_sizes = args.chunk_mib
        if args.lmcache_mib is not None and args.lmcache_mib <= 0:
            parser.error(f"--lmcache-mib must be positive, got {args.lmcache_mib}")
        if args.lmcache_mib:
            config.lmcache_bytes = args.lmcache_mib * MiB
        if args.lmcache_concurrency:
            config.lmcache_concurrency = args.lmcache_concurrency
        if args.queue_depths:
            config.queue_depths = args.queue_depths
        if args.segment_mib:
            config.store_kwargs["segment_bytes"] = int(args.segment_mib * MiB)
        if args.write_segment_mib:
            config.store_kwargs["write_segment_bytes"] = int(args.write_segment_mib * MiB)
        if args.verify:
            config.store_kwargs["verify"] = args.verify
        if args.encrypt and args.verify == "header":
            parser.error("--encrypt compares verify=full stores; leave out --verify header")
        config.encrypt = args.encrypt
        if args.serve_configs:
            config.serve_configs = [c.strip() for c in args.serve_configs.split(",") if c.strip()]
        config.serve_model = args.serve_model
        config.serve_preset = args.serve_preset
        config.serve_concurrency = args.serve_concurrency
        config.serve_repeats = args.serve_repeats
        config.serve_busy_cores = args.serve_busy_cores
        config.serve_set = list(args.serve_set or [])
        if config.serve_set or args.serve_busy_cores is not None or args.serve_preset:
            from .bench.serve_options import options_from as serve_options

            _check_part_options(parser, "serve", serve_options, config)
        config.disk_hit_set = list(args.disk_hit_set or [])
        if config.disk_hit_set:
            from .bench.disk_hit_part import options_from as disk_hit_options

            _check_part_options(parser, "disk_hit", disk_hit_options, config)
        config.cluster_set = list(args.cluster_set or [])
        if config.cluster_set:
            from .bench.cluster_part import options_from as cluster_options

            _check_part_options(parser, "cluster", cluster_options, config)
        config.cold_reads = not args.warm
        config.cold_metadata = args.cold_metadata
        if args.no_progress:
            result = run_bench(config)
        else:
            from .progress import RichProgress

            with RichProgress() as progress:
                result = run_bench(config, progress)
        _print_summary(result)
        return 1 if result.failed else 0

    return run


def _print_summary(result: BenchRun) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    for out in result.outputs:
        if out.skipped:
            console.print(f"[yellow]{out.name}: skipped ({out.skipped})")
        for t in out.tables[:1]:
            table = Table(title=t.title, show_lines=False)
            for h in t.header:
                table.add_column(h)
            for r in t.rows:
                table.add_row(*r)
            console.print(table)
        for name, (met, why) in out.targets.items():
            console.print(f"{'[green]met' if met else '[red]missed'}[/] {name}: {why}")
    console.print(f"report: {result.report} ({result.elapsed_s:.0f} s)")


@subcommand("demo", "the main job on an embedded default: prefix reuse in vLLM through a local directory, then bench --quick")
def _demo(parser: argparse.ArgumentParser) -> Handler:
    from .demo import DEFAULT_OUT

    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default: ./{DEFAULT_OUT})")
    parser.add_argument("--no-bench", action="store_true", help="only the vLLM prefix-reuse part")
    parser.add_argument("--no-vllm", action="store_true", help="only the storage benchmark (bench --quick)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line at the end")

    def run(args: argparse.Namespace) -> int:
        import json

        from .demo import run_demo

        if args.out.exists() and not args.out.is_dir():
            print(f"pykvcache demo: --out {args.out} exists and is not a directory", file=sys.stderr)
            return 2
        code, record = run_demo(args.out, bench=not args.no_bench, vllm=not args.no_vllm, argv=["pykvcache", *args.argv])
        if args.json:
            print(json.dumps(record))
        return code

    return run


def _kv_options(items: list[str]) -> dict[str, object]:
    import json

    out: dict[str, object] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--kv-option {item!r}: expected KEY=VALUE")
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    return out


@subcommand("cluster", "N vLLM servers on one shared pykvcache store, vllm-router in front, until Ctrl-C")
def _cluster(parser: argparse.ArgumentParser) -> Handler:
    from .cluster.spec import POLICIES

    parser.add_argument("--model", required=True, help="the model every node serves (a path or a Hugging Face name)")
    store = parser.add_mutually_exclusive_group(required=True)
    store.add_argument("--store", type=Path, help="the store directory every node shares (on a shared filesystem across machines)")
    store.add_argument("--no-pykvcache", action="store_true", help="nodes without pykvcache (the baseline)")
    parser.add_argument("--nodes", type=int, default=2, help="vLLM servers to start (default: 2)")
    parser.add_argument(
        "--policy", choices=POLICIES, default="cache_aware", help="vllm-router's policy (default: cache_aware; docs/cluster.md says why)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address the router and the nodes listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="the router's port (default: 8000; 0: a free one)")
    parser.add_argument("--capacity", default="8GiB", help="the store's capacity, the same on every node (default: 8GiB)")
    parser.add_argument("--staging", default="256MiB", help="each node's staging memory (default: 256MiB)")
    parser.add_argument("--chunk-tokens", type=int, default=64, help="tokens per stored chunk (default: 64)")
    parser.add_argument("--block-size", type=int, default=32, help="vLLM's KV block size (default: 32)")
    parser.add_argument("--log-dir", type=Path, default=Path("cluster-logs"), help="the members' logs (default: ./cluster-logs)")
    parser.add_argument("--router-path", default=None, help="a private vllm-router install to put on PYTHONPATH (dev/setup_router.sh)")
    parser.add_argument(
        "--kv-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more pykvcache key for every node (docs/vllm.md's table; VALUE as JSON, else a string; repeat)",
    )
    parser.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for every vLLM server (repeat; e.g. --vllm-arg=--enforce-eager)",
    )
    parser.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for vllm-router (repeat; e.g. --router-arg=--balance-abs-threshold=2)",
    )

    def run(args: argparse.Namespace) -> int:
        from .cluster.run import run_cluster
        from .cluster.spec import ClusterSpec

        try:
            spec = ClusterSpec(
                model=args.model,
                store=None if args.no_pykvcache else args.store,
                nodes=args.nodes,
                policy=args.policy,
                host=args.host,
                router_port=args.port,
                capacity_bytes=args.capacity,
                staging_bytes=args.staging,
                chunk_tokens=args.chunk_tokens,
                block_size=args.block_size,
                vllm_args=args.vllm_arg,
                extra_config=_kv_options(args.kv_option),
                router_path=args.router_path,
                router_extra_args=args.router_arg,
                log_dir=args.log_dir,
            )
        except ValueError as exc:
            print(f"pykvcache cluster: {exc}", file=sys.stderr)
            return 2
        return run_cluster(spec)

    return run


@subcommand("calibrate", "measure prefill and KV load times on this model and hardware; write the gate profile")
def _calibrate(parser: argparse.ArgumentParser) -> Handler:
    from .calibrate import cli as calibrate

    calibrate.add_arguments(parser)
    return calibrate.run


@subcommand("keygen", "write a new encryption key file (32 random bytes, mode 0600) for BlockStore(encryption_key_file=...)")
def _keygen(parser: argparse.ArgumentParser) -> Handler:
    parser.add_argument("path", type=Path, help="the key file to create (never overwritten)")

    def run(args: argparse.Namespace) -> int:
        from pykvcache.keys import write_key_file

        try:
            write_key_file(args.path)
        except OSError as exc:
            print(
                f"pykvcache keygen: cannot create {args.path}: {exc.strerror}"
                + (" (refusing to overwrite a key file)" if isinstance(exc, FileExistsError) else ""),
                file=sys.stderr,
            )
            return 1
        print(f"wrote a 32-byte key to {args.path} (mode 0600); keep a copy: chunks sealed with it are unreadable without it")
        return 0

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pykvcache", description="NVMe KV-cache tier for LLM serving engines")
    subs = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, setup) in _SUBCOMMANDS.items():
        sub = subs.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(handler=setup(sub))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # recorded in every report as the exact command
    try:
        return int(args.handler(args))
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] != "rich":
            raise
        # rich is the tools' dependency, not the product's (the ``tools`` extra).
        print(
            f"pykvcache {args.command}: the `rich` package is not installed; install the tools: pip install 'pykvcache[tools]'",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
