"""``pykvcache bench --parts cluster`` at CI size: one real cluster (two vLLM OpenAI servers on
one store directory of the suite's GlusterFS volume, each through its own client of it,
vllm-router 0.1.17 in front with ``cache_aware``) through every phase: prime, steady state, the
node holding the documents SIGKILLed under load, a new node joining.

What holds whatever the host's speed: no request fails but those in flight on the killed
node; the killed node is reported; the survivors and the joining node answer; the joining
node's first requests for known documents read their prefixes from the shared store; nothing
is left behind. The analysis of the full run (the issue's ratios, identical outputs) is run
on this cluster's own records under the four configurations' names.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
from pykvcache.tools.bench.cluster_part import analyse, options_from, quick_options, run_with
from pykvcache.tools.bench.cluster_run import CONFIGS, ClusterOptions, victim
from pykvcache.tools.bench.cold_cache import DiskCounter
from pykvcache.tools.bench.config import BenchConfig
from pykvcache.tools.bench.machine import describe_machine
from pykvcache.tools.bench.parts import BenchContext, NoProgress
from pykvcache.tools.bench.report import write_report
from pykvcache.tools.cluster.spec import ClusterSpec
from vllm_marks import VLLM_ENGINE

pytestmark = VLLM_ENGINE

ROOT = Path(__file__).resolve().parents[2]


def test_options_are_checked_before_anything_starts(tmp_path):
    config = BenchConfig(out=tmp_path, directory=tmp_path, quick=True, cluster_set=["doc_tokens=4096", "configs=round_robin,cache_aware"])
    opts = options_from(config)
    assert opts.doc_tokens == 4096 and opts.configs == ["round_robin", "cache_aware"]
    with pytest.raises(ValueError, match="KEY one of"):
        options_from(replace(config, cluster_set=["doc_tokns=1"]))
    bad = ClusterOptions(configs=["round_robin", "nope"], nodes=1, chunk_tokens=48, kill_after=0, max_model_len=512, kv_options="[1]")
    problems = " | ".join(bad.check())
    for said in ("nope: unknown", "nodes=1", "chunk_tokens=48", "kill_after=0", "max_model_len=512", "kv_options: a JSON object"):
        assert said in problems, problems
    assert ClusterOptions().check() == [] and quick_options().check() == []
    assert "store_mounts " + str(tmp_path / "absent") in " | ".join(ClusterOptions(store_mounts=[str(tmp_path / "absent")]).check())
    with pytest.raises(ValueError, match="store_views without a store"):
        ClusterSpec(model="m", store=None, store_views=[tmp_path])
    with pytest.raises(ValueError, match="store view .*absent: not a directory"):
        ClusterSpec(model="m", store=tmp_path, store_views=[tmp_path, tmp_path / "absent"])
    views = [tmp_path / "a", tmp_path / "b"]
    for view in views:
        view.mkdir()
    spec = ClusterSpec(model="m", store=tmp_path, store_views=views)
    assert [spec.store_for(i) for i in range(3)] == [views[0], views[1], views[0]]  # a joining node: the first view
    assert spec.kv_transfer(1)["kv_connector_extra_config"]["storage_dirs"] == [str(views[1])]


def test_the_victim_is_the_node_holding_the_most_documents():
    class _Node:
        def __init__(self, name: str) -> None:
            self.name = name

    class _Cluster:
        def live_nodes(self):
            return [_Node("node-0"), _Node("node-1")]

    assert victim({0: "node-0", 1: "node-0", 2: "node-1"}, _Cluster()) == "node-0"  # type: ignore[arg-type]  # duck-typed: live_nodes() only
    assert victim({0: None}, _Cluster()) == "node-1"  # type: ignore[arg-type]  # duck-typed: live_nodes() only


def test_one_cluster_through_prime_steady_loss_and_join(tmp_path, tiny_model_cache, shared_dirs):
    on_a, on_b = shared_dirs  # one directory of the volume, through node A's and node B's mounts
    config = BenchConfig(out=tmp_path / "out", directory=on_a, quick=True)
    machine = describe_machine(tmp_path, ["pytest"])
    ctx = BenchContext(config, machine, DiskCounter(None), NoProgress())
    # One configuration, the one with the store: the other three differ by the router's
    # policy and by no store, each a flag of the same Cluster. The gate loads at any gain
    # (gate_margin): on a loaded CI host it may judge the tiny model's recompute cheaper.
    opts = replace(
        quick_options(),
        configs=["cache_aware+store"],
        router_path=str(ROOT / ".vllm-router"),
        kv_options='{"gate_margin": 0.02}',
        store_mounts=[str(on_b)],
    )

    out = run_with(ctx, opts, model_cache=tiny_model_cache)

    assert out.skipped is None, out.skipped
    (entry,) = out.raw["runs"]
    assert "error" not in entry, entry["error"]
    assert entry["left_behind"] == []
    phases = entry["phases"]
    for name, count in (("prime", opts.documents), ("steady", opts.sessions * opts.turns), ("loss", opts.sessions * opts.turns)):
        assert len(phases[name]["records"]) == count, name
    assert all(r["error"] is None and r["output_tokens"] == opts.output_tokens for p in ("prime", "steady") for r in phases[p]["records"])
    # The router routed by prefix (its own counters) to nodes that served the prompts.
    steady = phases["steady"]
    routed = steady["router"]
    assert routed.get("vllm_router_processed_requests_total", 0) == opts.sessions * opts.turns, routed
    assert routed.get('vllm_router_prefix_routing_decisions_total{policy="cache_aware",stage="regular",outcome="prefix_hit"}', 0) > 0, (
        routed
    )
    assert sum(m.get("vllm:prompt_tokens_total", 0) for m in steady["nodes"].values()) > 0

    loss = phases["loss"]
    assert loss["victim"] in ("node-0", "node-1") and loss["killed_at"] is not None
    report = [e for e in entry["events"] if e.startswith(f"{loss['victim']} ")]
    assert report and "exited with status -9; removed from the router" in report[0], entry["events"]
    # Requests the router sent before it took the node out may have gone to it (a clean-clone
    # run: one sent 0.57 s after the SIGKILL, cut off mid-answer); none sent after may fail.
    assert loss["killed_at"] <= loss["removed_at"], loss
    failed_after = [r for r in loss["records"] if r["error"] is not None and r["t_start"] >= loss["removed_at"]]
    assert failed_after == [], failed_after
    assert loss["victim"] not in loss["nodes"]  # the survivors' counters only

    # Each node wrote through its own client of the volume: node-1 through B's mount.
    (node_1_log,) = (tmp_path / "out").rglob("node-1.log")
    assert str(on_b) in node_1_log.read_text(errors="replace"), "node-1 did not use B's mount"
    join = phases["join"]
    assert len(join["records"]) == opts.documents and all(r["error"] is None for r in join["records"])
    assert join["nodes"][join["node"]].get("vllm:pykvcache_disk_read_bytes_total", 0) > 0, join["nodes"][join["node"]]

    # The full run's analysis on this run's records under every configuration's name: each
    # target is judged (the same records: ratios of 1, outputs identical).
    runs = [{**copy.deepcopy(entry), "config": name} for name in CONFIGS]
    full = analyse(runs, opts, 64, quick=False)
    assert set(full.targets) >= {"cluster_p50_vs_round_robin", "cluster_p50_vs_cache_aware", "cluster_join_ttft", "cluster_loss_failures"}
    assert full.targets["cluster_identical_outputs"][0] and full.targets["cluster_nothing_left"][0]
    assert not full.targets["cluster_p50_vs_round_robin"][0] and "1.00x" in full.targets["cluster_p50_vs_round_robin"][1]

    text = write_report(config.out, machine, config, [out], 1.0).read_text()
    assert "Node loss" in text and "Node join" in text and "cache_aware+store" in text
