"""The serve part's presets and its long-context sweep, on synthetic results:
sizing per point, the crossover rows (ratios against recompute of the same
round, deferred lookups, greedy outputs compared), the table, the targets and
the plot. No server starts here (the serve smoke test runs real ones)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from pykvcache.tools.bench.config import BenchConfig
from pykvcache.tools.bench.parts import Figure
from pykvcache.tools.bench.serve_options import (
    PRESETS,
    VARIANT,
    ServeOptions,
    advised_staging_bytes,
    check_sweep,
    long_context_options,
    options_from,
    set_option,
    sized_for,
    sweep_points,
    sweep_steps,
)
from pykvcache.tools.bench.serve_stats import paired_ratios
from pykvcache.tools.bench.serve_sweep import BREAK_EVEN_GAUGE, CROSSOVER_MD, DEFERRED, analyse_sweep, crossover, write_crossover

BPT = 32 * 1024  # llama3-geometry: 32 KiB of KV per token


def test_presets_and_options(tmp_path):
    cfg = BenchConfig(out=tmp_path, directory=tmp_path)
    assert options_from(cfg).preset == "sessions" and not options_from(cfg).contexts
    cfg.quick = True
    assert options_from(cfg).preset == "quick"
    cfg.serve_preset = "long-context"
    opts = options_from(cfg)
    assert opts.preset == "long-context" and opts.contexts == [1024, 4096, 8192, 16384]
    assert opts.model == "llama3-geometry-32k" and "recompute" in opts.configs
    assert set(PRESETS) == {"sessions", "long-context", "quick"}
    cfg.serve_preset = "nope"
    with pytest.raises(ValueError, match="serve-preset"):
        options_from(cfg)
    # Typed lists, also where the default list is empty.
    o = ServeOptions()
    set_option(o, "contexts=4096, 8192")
    set_option(o, "read_caps=0,25")
    set_option(o, "phases=steady")
    assert o.contexts == [4096, 8192] and o.read_caps == [0.0, 25.0] and o.phases == ["steady"]


def test_sizing_follows_the_start_up_check():
    opts = long_context_options()
    s = sized_for(opts, 8192, 25.0, BPT)
    # The longest prompt fits, the device cache holds one such request, staging is the advice.
    assert s.max_model_len >= 8192 + opts.turns * (opts.question_tokens + opts.answer_tokens) + opts.output_tokens
    assert s.max_model_len % 32 == 0 and s.kv_cache_tokens == s.max_model_len
    assert s.staging_bytes == advised_staging_bytes(s.max_model_len, 64, BPT)
    # 3 full-length prefixes: fewer than the 4 documents, so prefixes come back from disk.
    assert 2.9 < s.staging_bytes / (s.max_model_len * BPT) < 3.1
    assert opts.documents * 8192 > s.staging_bytes / BPT
    assert s.read_mbps == 25.0 and s.doc_tokens == 8192
    assert sweep_points(opts) == [(c, cap) for c in (1024, 4096, 8192, 16384) for cap in (0.0, 25.0)]
    assert sweep_steps(opts) == 2 * 8 * 3 * (2 + 2)
    explicit = sized_for(ServeOptions(contexts=[512], max_model_len=2048, kv_cache_tokens=4096, staging_bytes=1 << 20), 512, 0.0, BPT)
    assert (explicit.max_model_len, explicit.kv_cache_tokens, explicit.staging_bytes) == (2048, 4096, 1 << 20)


def test_check_sweep():
    opts = long_context_options()
    opts.read_caps = [0.0]
    assert check_sweep(opts) == []
    opts.configs = ["pykvcache"]
    opts.phases = ["warm"]
    opts.max_model_len = 1000
    problems = " ".join(check_sweep(opts))
    assert "needs the recompute configuration" in problems and "phases" in problems
    assert "below the longest prompt" in problems


def test_read_caps_the_host_cannot_apply_are_dropped_not_fatal(monkeypatch):
    from pykvcache.tools.bench import read_throttle
    from pykvcache.tools.bench.serve_options import without_unavailable_caps

    opts = long_context_options()
    monkeypatch.setattr(read_throttle, "unavailable", lambda: "needs root (a blkio cgroup)")
    assert check_sweep(opts) == []
    kept, why = without_unavailable_caps(opts)
    assert kept.read_caps == [0.0] and why == "read caps 25 MB/s not run: needs root (a blkio cgroup)"
    monkeypatch.setattr(read_throttle, "unavailable", lambda: None)
    assert without_unavailable_caps(opts) == (opts, None)


def _level(phase, ttfts, texts, deferred=0.0, wall=10.0):
    recs = [
        {"session": i, "turn": 1, "ttft_s": t, "itl_s": [0.01], "output_tokens": 8, "error": None, "text": x, "reused_tokens": 0}
        for i, (t, x) in enumerate(zip(ttfts, texts))
    ]
    return {
        "phase": phase,
        "concurrency": 4,
        "wall_s": wall,
        "cpu_s": 1.0,
        "records": recs,
        "metrics": {
            DEFERRED: deferred,
            "vllm:request_prefill_time_seconds_sum": sum(ttfts),
            "vllm:request_prefill_time_seconds_count": len(ttfts),
        },
    }


def _run(config, context, cap, rep, scale, texts=("a", "b", "c"), deferred=0.0, be=300.0):
    levels = [_level(p, [scale * x for x in (1.0, 2.0, 4.0)], texts, deferred, wall=scale * 10) for p in ("cold", "steady")]
    return {
        "config": config,
        "repeat": rep,
        "context_tokens": context,
        "read_mbps": cap,
        "levels": levels,
        "log": "/nonexistent",
        "metrics": {BREAK_EVEN_GAUGE: be},
        "sizing": {"max_model_len": context + 256, "kv_cache_tokens": context + 256, "staging_bytes": 3 * (context + 256) * BPT},
        "staging_advice": [],
    }


def _synthetic(opts):
    runs = []
    for rep in range(2):
        for context, cap in sweep_points(opts):
            gain = context / 1024 * (0.5 if cap else 1.0)  # grows with the context, halved when capped
            runs += [
                _run("recompute", context, cap, rep, 1.0),
                _run("pykvcache", context, cap, rep, 1.0 / gain, deferred=rep),
                _run(
                    "lookahead_off",
                    context,
                    cap,
                    rep,
                    1.2 / gain,
                    texts=("a", "b", "x") if context == 8192 and rep == 1 else ("a", "b", "c"),
                ),
            ]
    return runs


def test_crossover_rows_tables_targets_and_plot(tmp_path):
    opts = long_context_options()
    opts.contexts = [1024, 8192]
    runs = _synthetic(opts)
    # One request of recompute's 1k cold phase failed (a client or server error): counted, never compared.
    failed = next(r for r in runs if (r["config"], r["context_tokens"], r["read_mbps"], r["repeat"]) == ("recompute", 1024, 0.0, 0))
    failed["levels"][0]["records"][0]["error"] = "ServerDisconnectedError: Server disconnected"
    rows = crossover(runs, opts)
    row = next(r for r in rows if (r["context"], r["read_mbps"], r["phase"], r["config"]) == (8192, 0.0, "steady", "pykvcache"))
    assert row["p50"] == pytest.approx([8.0, 8.0]) and row["p99"] == pytest.approx([8.0, 8.0])
    assert row["throughput"] == pytest.approx([8.0, 8.0])
    assert row["deferred"] == [0.0, 1.0] and row["identical"] == row["compared"] == 6
    off = next(r for r in rows if (r["context"], r["read_mbps"], r["phase"], r["config"]) == (8192, 0.0, "steady", "lookahead_off"))
    assert off["identical"] == 5 and off["compared"] == 6  # one request's greedy text differs

    model_info = {
        "name": "llama3-geometry-32k",
        "bytes_per_token": BPT,
        "config": {"num_hidden_layers": 4, "hidden_size": 512, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 32768},
    }
    out = analyse_sweep(runs, opts, model_info)
    steady = next(t for t in out.tables if "steady state" in t.title)
    cells = {(r[0], r[1], r[2]): r for r in steady.rows}
    assert cells[("8192", "quiet", "pykvcache")][3] == "8.00 (8.00–8.00)×"
    assert cells[("8192", "reads capped 25 MB/s", "pykvcache")][3] == "4.00 (4.00–4.00)×"
    assert cells[("8192", "quiet", "pykvcache")][8] == "0 / 1"
    la = next(t for t in out.tables if t.title.startswith("Lookahead on vs off"))
    assert la.rows[0][3] == "1.20 (1.20–1.20)"
    regimes = next(t for t in out.tables if t.title.startswith("A load against its prefill"))
    capped_8k = next(r for r in regimes.rows if r[0] == "8192" and r[1] != "quiet")
    assert capped_8k[2] == f"{8192 * BPT / 1e6:.0f}" and capped_8k[3] == f"{8192 * BPT / 1e6 / 25:.1f}"
    t = out.targets
    assert not t["greedy outputs identical to recompute's for every request"][0]
    assert t["every request answered (no client or server error)"] == (False, "1 request(s) failed, every configuration counted")
    cold = next(t for t in out.tables if "cold start" in t.title)
    assert cold.rows[0][9] == "5/5 (1 request(s) failed)"  # 1k quiet pykvcache: 6 compared less the failed one
    assert not t["deferred lookups per run: 0 (pykvcache, steady state, staging as advised)"][0]
    assert t["steady state at 8k, quiet: p50 >= 8x, p99 >= 5x, throughput >= 5x recompute's"][0]
    assert t["reads capped 25 MB/s, 8192 tokens: p50 >= 3x recompute's"][0]
    assert not t["reads capped 25 MB/s, 1024 tokens: p50 >= 3x recompute's"][0]
    assert out.raw["break_even"] == {"configured": 256.0, "source": "the gate's default (no profile)", "learnt": {0.0: 300.0, 25.0: 300.0}}
    # The markdown file and the plot (drawn for real, with the break-even marked).
    md = write_crossover(out, tmp_path).read_text()
    assert (tmp_path / CROSSOVER_MD).exists() and "serve_crossover.png" in md and "| 8192 | quiet | pykvcache |" in md
    [fig] = [f for f in out.figures if isinstance(f, Figure)]
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure as MplFigure

    canvas = MplFigure(figsize=fig.size)
    fig.draw(canvas)
    ax = canvas.axes[0]
    assert any(line.get_xdata()[0] == 256.0 for line in ax.get_lines() if len(line.get_xdata()) == 2)
    assert any("break-even" in t.get_text() for t in ax.texts)


# ---------------------------------------------------------------- the variant configuration (A/B of two code versions)


def _variant_tree(root):
    """A real second copy of this pykvcache package, its built _core included."""
    import shutil

    import pykvcache

    src = Path(pykvcache.__file__).parent
    shutil.copytree(src, root / "pykvcache", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def test_the_variant_needs_a_tree_with_a_built_package(tmp_path):
    opts = long_context_options()
    opts.read_caps = [0.0]
    opts.configs = ["recompute", "pykvcache", VARIANT]
    assert "set variant_path=DIR" in " ".join(check_sweep(opts))
    opts.variant_path = str(tmp_path)
    assert "holds no pykvcache package" in " ".join(check_sweep(opts))
    (tmp_path / "pykvcache").mkdir()
    (tmp_path / "pykvcache" / "__init__.py").write_text("")
    assert "no built _core extension" in " ".join(check_sweep(opts))
    variant = _variant_tree(tmp_path / "tree")
    opts.variant_path = str(variant)
    assert check_sweep(opts) == []
    sessions = ServeOptions(configs=["recompute", VARIANT])
    assert any("set variant_path" in p for p in sessions.check())
    assert VARIANT not in ServeOptions().configs, "the default run must not need a second tree"


def test_the_variants_server_imports_the_other_tree(tmp_path):
    """Same kv_transfer_config as pykvcache's, served from the variant's tree:
    PYTHONPATH comes before this install's editable .pth entry (checked with
    a real interpreter, as the server would start)."""
    import subprocess

    from pykvcache.tools.bench.serve_run import server_config
    from pykvcache.tools.vllm_server import Server

    variant = _variant_tree(tmp_path / "tree")
    opts = ServeOptions(configs=["recompute", "pykvcache", VARIANT], variant_path=str(variant))
    ours = server_config("pykvcache", "m", opts, BPT, tmp_path / "kv")
    theirs = server_config(VARIANT, "m", opts, BPT, tmp_path / "kv")
    assert theirs.kv_transfer_config == ours.kv_transfer_config and theirs.args == ours.args
    assert theirs.python_path == [str(variant.resolve())] and ours.python_path == []
    env = Server(theirs, tmp_path / "log").environment()
    probe = "import pykvcache, pykvcache._core as c; print(pykvcache.__file__); print(c.__file__)"
    lines = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout.split()
    assert all(Path(x).resolve().is_relative_to(variant.resolve()) for x in lines), lines


def test_the_variant_is_reported_against_pykvcache_per_repeat():
    opts = long_context_options()
    opts.contexts = [8192]
    opts.read_caps = [0.0]
    opts.configs = ["recompute", "pykvcache", VARIANT]
    opts.variant_path = "tree"
    runs = [r for r in _synthetic(opts) if r["config"] != "lookahead_off"]
    runs += [_run(VARIANT, 8192, 0.0, rep, 0.1) for rep in range(2)]  # pykvcache's scale there: 1 / 8
    model_info = {
        "name": "m",
        "bytes_per_token": BPT,
        "config": {"num_hidden_layers": 4, "hidden_size": 512, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 32768},
    }
    out = analyse_sweep(runs, opts, model_info)
    table = next(t for t in out.tables if t.title.startswith("Variant (tree) vs pykvcache"))
    assert [r[2] for r in table.rows] == ["cold", "steady"]
    assert all(r[3] == "1.25 (1.25–1.25)" for r in table.rows)
    steady = next(t for t in out.tables if "steady state" in t.title)
    assert any(r[2] == VARIANT for r in steady.rows), "the variant is also measured against recompute"
    assert not any(t.title.startswith("Lookahead on vs off") for t in out.tables)


def test_paired_ratios_pair_repeats_both_ran():
    per_rep = {
        "pykvcache": {0: {"p50": 2.0}, 1: {"p50": 4.0}, 2: {"p50": 1.0}},
        VARIANT: {0: {"p50": 1.0}, 1: {"p50": 0.0}, 3: {"p50": 1.0}},
    }
    assert paired_ratios(per_rep, VARIANT, "pykvcache", "p50") == [2.0]
    assert paired_ratios(per_rep, "lookahead_off", "pykvcache", "p50") == []
