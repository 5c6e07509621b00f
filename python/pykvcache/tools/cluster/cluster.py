"""A cluster: N vLLM OpenAI servers on one shared pykvcache store, ``vllm-router`` in front.

``with Cluster(spec) as c:`` starts the nodes (all at once: each loads the model and profiles
its memory on its own), then the router once every node answers ``/health``. ``watch()``
reports a member that has exited (once, with its status and log tail) and takes it out of
the router at once; the router's own health checks (every second) would too, a moment later. ``join()`` starts one more
node and adds it to the router. Leaving the ``with`` block stops the router and every node
(each server in its own process group: SIGINT, vLLM's clean shutdown that flushes pykvcache's
writes, then SIGKILL for whatever is left) and checks that no process of theirs is left.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..vllm_server import Server, ServerConfig, free_port, log_tail
from .router import Router, check_router
from .spec import ClusterSpec

Report = Callable[[str], None]


@dataclass
class Node:
    """One member: its server, its KV event endpoint, and whether it is meant to be running."""

    name: str
    server: Server
    events_endpoint: str | None
    expected_up: bool = True
    reported: bool = False
    pgid: int | None = field(default=None)

    @property
    def url(self) -> str:
        return self.server.url


class Cluster:
    def __init__(self, spec: ClusterSpec, report: Report = print, start_timeout_s: float = 600.0) -> None:
        self.spec = spec
        self.report = report
        self.start_timeout_s = start_timeout_s
        self.nodes: list[Node] = []
        self.router: Router | None = None
        self.crashed: list[str] = []

    # -- start -------------------------------------------------------------------------------

    def _new_node(self) -> Node:
        spec = self.spec
        index = len(self.nodes)
        name = f"node-{index}"
        endpoint = f"tcp://{spec.host}:{free_port()}" if spec.uses_events else None
        cfg = ServerConfig(
            name=name, model=spec.model, args=spec.node_args(endpoint), env=spec.node_env(), kv_transfer_config=spec.kv_transfer(index)
        )
        server = Server(cfg, spec.log_dir / f"{name}.log", start_timeout_s=self.start_timeout_s, host=spec.host)
        node = Node(name, server, endpoint)
        self.nodes.append(node)
        return node

    def start(self) -> Cluster:
        spec = self.spec
        check_router(spec.router_path)
        spec.log_dir.mkdir(parents=True, exist_ok=True)
        fresh = [self._new_node() for _ in range(spec.nodes)]
        try:
            self._start_servers(fresh)
            workers = {n.url: n.events_endpoint for n in fresh}
            self.router = Router(
                spec.router_args(workers), spec.log_dir / "router.log", host=spec.host, port=spec.router_port, router_path=spec.router_path
            )
            self.router.start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_servers(self, nodes: list[Node]) -> None:
        errors: list[BaseException] = []

        def start(node: Node) -> None:
            try:
                node.server.start()
                assert node.server.proc is not None
                node.pgid = node.server.proc.pid
            except BaseException as exc:  # reported below, with every node's reason
                errors.append(exc)

        threads = [threading.Thread(target=start, args=(n,), name=f"start-{n.name}") for n in nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def join(self) -> Node:
        """Start one more node on the same store and add it to the router."""
        assert self.router is not None, "start() the cluster first"
        node = self._new_node()
        self._start_servers([node])
        self.router.add_worker(node.url)
        self.report(f"{node.name} joined at {node.url}")
        return node

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- run ---------------------------------------------------------------------------------

    def kill(self, name: str) -> None:
        """SIGKILL a node's whole process group (what a lost machine looks like to the rest)."""
        node = self.node(name)
        node.expected_up = False
        node.server.kill_group()

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def watch(self) -> list[str]:
        """Members that died since the last call, each reported once (a node killed with
        :meth:`kill` too: it is gone all the same)."""
        died = []
        for node in self.nodes:
            if node.reported or node.server.alive():
                continue
            node.reported = True
            status = node.server.proc.returncode if node.server.proc is not None else None
            died.append(node.name)
            self.crashed.append(node.name)
            # The router would find it dead by its health checks within two seconds, and send
            # it requests until then (vllm-router 0.1.17 answers them 500, not retried
            # elsewhere): taking it out now leaves only the requests it had.
            removed = self._remove_from_router(node)
            self.report(
                f"{node.name} ({node.url}) exited with status {status}; {removed}; "
                f"log {node.server.log_path}:\n{log_tail(node.server.log_path, 12)}"
            )
        if self.router is not None and not self.router.alive() and "router" not in self.crashed:
            self.crashed.append("router")
            died.append("router")
            status = self.router.proc.returncode if self.router.proc is not None else None
            self.report(f"the router exited with status {status}; log {self.router.log_path}")
        return died

    def _remove_from_router(self, node: Node) -> str:
        if self.router is None or not self.router.alive():
            return "no router to remove it from"
        try:
            self.router.remove_worker(node.url)
        except OSError as exc:
            return f"the router did not take it out ({exc}); its health checks will"
        return "removed from the router"

    def live_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.server.alive()]

    # -- stop --------------------------------------------------------------------------------

    def stop(self) -> list[str]:
        """Stop the router and every node; returns what is left behind (processes, ports),
        which is empty unless something would not die."""
        if self.router is not None:
            self.router.stop()
        threads = [threading.Thread(target=n.server.stop, name=f"stop-{n.name}") for n in self.nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        left = [f"{n.name}: process group {n.pgid}" for n in self.nodes if n.pgid is not None and _group_alive(n.pgid)]
        if self.router is not None and self.router.proc is not None and _group_alive(self.router.proc.pid):
            left.append(f"router: process group {self.router.proc.pid}")
        ports = [(n.name, n.server.port) for n in self.nodes] + ([("router", self.router.port)] if self.router else [])
        left += [f"{name}: port {port} still listening" for name, port in ports if _listening(self.spec.host, port)]
        for line in left:
            self.report(f"left behind: {line}")
        return left


def _group_alive(pgid: int, grace_s: float = 10.0) -> bool:
    """Whether a process of the group is still there ``grace_s`` after its SIGKILL: the
    group's other processes were re-parented when its leader was reaped, and init reaps
    them a moment later."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.1)


def _listening(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0
