"""``pykvcache cluster``: start a cluster, report on it until asked to stop, stop it cleanly.

It prints one line per member as it comes up (``router URL``, ``node-N URL pid PID log
PATH``, the router's with its pid too), then ``ready``; a member that dies is reported at once (the router's own health checks
take it out of rotation); SIGINT or SIGTERM stops everything and prints ``stopped``, or what
could not be stopped. The exit status is 0 after a clean stop, 1 when a process or port was
left behind, 2 when the cluster could not start.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType

from ..vllm_server import ServerFailed
from .cluster import Cluster
from .router import RouterMissing
from .spec import ClusterSpec

WATCH_INTERVAL_S = 0.5


def _say(line: str) -> None:
    print(line, flush=True)


def run_cluster(spec: ClusterSpec) -> int:
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    cluster = Cluster(spec, report=_say)
    try:
        try:
            cluster.start()
        except (RouterMissing, ServerFailed) as exc:
            print(f"pykvcache cluster: {exc}", file=sys.stderr)
            return 2
        assert cluster.router is not None
        assert cluster.router.proc is not None
        _say(f"router {cluster.router.url} pid {cluster.router.proc.pid} policy {spec.policy} log {cluster.router.log_path}")
        for node in cluster.nodes:
            _say(f"{node.name} {node.url} pid {node.pgid} log {node.server.log_path}")
        _say(f"ready: {len(cluster.nodes)} nodes on store {spec.store}; send requests to {cluster.router.url}")
        while not stop.wait(WATCH_INTERVAL_S):
            cluster.watch()
            if not cluster.live_nodes():
                _say("no node is left; stopping")
                break
    finally:
        left = cluster.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    _say("stopped" if not left else f"stopped, {len(left)} left behind")
    return 1 if left else 0
