"""A real shared filesystem for tests: one GlusterFS volume on one brick,
mounted twice by two FUSE clients ("node A", "node B"), each client in its
own network namespace, talking to the server over veth pairs through a bridge.

Layout (every name carries a per-run tag, so two runs never collide)::

    netns <tag>s : glusterd + brick process, bridge kvbr (10.214.0.1)
    netns <tag>a : FUSE client of node A, veth kvc (10.214.0.11)
    netns <tag>b : FUSE client of node B, veth kvc (10.214.0.12)

The mounts live in the ordinary mount namespace (every process sees them);
only the clients' network traffic goes through the namespaces, so
``link("b", up=False)`` partitions node B from the server like a pulled cable.

glusterd runs in a private *mount* namespace too, with /var/lib/glusterd,
/run/gluster and /var/log/glusterfs bind-mounted from this run's directory: it
never touches (or meets) a system glusterd, and everything it spawns (the brick
process) is found again by that namespace. Teardown kills exactly those
processes and the two clients this module started, lazily unmounts, deletes
the namespaces (and with them the veths) and removes the brick. A run that
died without tearing down (SIGKILL of pytest) is cleaned by the next setup.

See docs/decisions/0035-shared-filesystems.md (the measurements behind the
settings) and 0036 (capacity on a shared directory).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(os.environ.get("PYKVCACHE_GLUSTER_ROOT", "/tmp/pykvcache-glusterfs"))
GLUSTERD = "/usr/sbin/glusterd"
GLUSTERFS = "/usr/sbin/glusterfs"
GLUSTER_CLI = "/usr/sbin/gluster"
VOLUME = "kvtest"
SERVER_IP = "10.214.0.1"
NODE_IPS = {"a": "10.214.0.11", "b": "10.214.0.12"}
CLIENT_DEV = "kvc"  # the veth end inside a client's namespace

# With these, new, replaced and deleted files are visible on the other mount
# within ~25 ms and close-to-open holds (the note's measurements); Gluster's
# defaults leave ~1 s of staleness.
STRICT_VOLUME_OPTIONS = {
    "performance.stat-prefetch": "off",
    "performance.quick-read": "off",
    "performance.open-behind": "off",
    "performance.flush-behind": "off",
}
STRICT_CLIENT_OPTIONS = ["--attribute-timeout=0", "--entry-timeout=0", "--negative-timeout=0", "--fopen-keep-cache=false"]
# O_DIRECT reaches the brick (unaligned O_DIRECT fails as on ext4) instead of
# being acknowledged early by write-behind.
ODIRECT_VOLUME_OPTIONS = {"performance.strict-o-direct": "on", "network.remote-dio": "disable"}


class GlusterUnavailable(Exception):
    """This machine cannot run the fixture; the message says why (a skip reason)."""


def missing_requirement() -> str | None:
    """Why the fixture cannot run here, or None."""
    if os.geteuid() != 0:
        return "GlusterFS fixture needs root (mounts, network namespaces)"
    for binary, package in ((GLUSTERD, "glusterfs-server"), (GLUSTER_CLI, "glusterfs-server"), (GLUSTERFS, "glusterfs-client")):
        if not os.access(binary, os.X_OK):
            return f"{binary} missing: apt-get install -y glusterfs-server glusterfs-client ({package})"
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse missing: the kernel or container has no FUSE"
    try:
        with open("/proc/filesystems") as f:
            if not any(line.split()[-1] == "fuse" for line in f if line.strip()):
                return "the kernel has no FUSE filesystem (/proc/filesystems)"
    except OSError as exc:
        return f"cannot read /proc/filesystems: {exc}"
    for tool in ("ip", "nsenter", "unshare", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"{tool} missing (iproute2 / util-linux)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"ip netns unusable: {probe.stderr.strip()}"
    return None


def _run(cmd: list[str], check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _mnt_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def _fuse_mounts_under(path: Path) -> list[str]:
    prefix = str(path).rstrip("/") + "/"
    out = []
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            mp = parts[1].replace("\\040", " ")
            if parts[2].startswith("fuse") and mp.startswith(prefix):
                out.append(mp)
    return out


def _netns_names() -> set[str]:
    proc = _run(["ip", "netns", "list"], check=False)
    return {line.split()[0] for line in proc.stdout.splitlines() if line.strip()}


@dataclass
class GlusterFixture:
    """One running fixture. ``mounts["a"]``/``mounts["b"]`` are the two nodes'
    views of the same volume; ``brick`` is the server's directory behind it."""

    run_dir: Path
    tag: str
    consistency: str = "strict"
    ping_timeout: int | None = 5
    mounts: dict[str, Path] = field(default_factory=dict)
    brick: Path | None = None
    netns: dict[str, str] = field(default_factory=dict)
    client_pids: dict[str, int] = field(default_factory=dict)
    glusterd_pid: int | None = None
    glusterd_mnt_ns: str | None = None
    setup_s: float = 0.0

    # ------------------------------------------------------------ state
    @property
    def state_file(self) -> Path:
        return self.run_dir / "state.json"

    def _save(self) -> None:
        state = {
            "owner_pid": os.getpid(),
            "tag": self.tag,
            "mounts": {k: str(v) for k, v in self.mounts.items()},
            "netns": self.netns,
            "client_pids": self.client_pids,
            "glusterd_pid": self.glusterd_pid,
            "glusterd_mnt_ns": self.glusterd_mnt_ns,
        }
        self.state_file.write_text(json.dumps(state))

    # ------------------------------------------------------------ helpers
    def srv(self, *cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        """Runs ``cmd`` where glusterd runs (its network and mount namespaces)."""
        assert self.glusterd_pid is not None
        return _run(
            ["nsenter", f"--net=/run/netns/{self.netns['s']}", f"--mount=/proc/{self.glusterd_pid}/ns/mnt", *cmd],
            check=check,
            timeout=timeout,
        )

    def cli(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        return self.srv(GLUSTER_CLI, "--mode=script", *args, check=check, timeout=timeout)

    def link(self, node: str, up: bool) -> None:
        """Takes node ``node``'s network link to the server down (a partition) or up."""
        _run(["ip", "-n", self.netns[node], "link", "set", CLIENT_DEV, "up" if up else "down"])

    def brick_bytes(self, suffix: str = ".kvc") -> int:
        """Bytes of the chunk files (``suffix``) on the brick: what the shared directory holds."""
        total = 0
        assert self.brick is not None
        for dirpath, dirnames, filenames in os.walk(self.brick):
            dirnames[:] = [d for d in dirnames if d != ".glusterfs"]
            for name in filenames:
                if name.endswith(suffix):
                    try:
                        total += os.lstat(os.path.join(dirpath, name)).st_size
                    except FileNotFoundError:
                        pass
        return total

    def server_pids(self) -> list[int]:
        """glusterd and the brick process (everything in glusterd's mount namespace)."""
        return [
            int(e) for e in os.listdir("/proc") if e.isdigit() and _mnt_ns(int(e)) == self.glusterd_mnt_ns and "gluster" in _cmdline(int(e))
        ]

    def kill_client(self, node: str) -> None:
        """SIGKILLs node ``node``'s FUSE client: its mount answers ENOTCONN until remounted."""
        pid = self.client_pids.get(node)
        if pid and _alive(pid):
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)

    def remount(self, node: str) -> None:
        """A fresh FUSE client for ``node`` (after ``kill_client`` or a stale mount)."""
        mp = self.mounts[node]
        if os.path.ismount(mp) or str(mp) in _fuse_mounts_under(mp.parent):
            _run(["umount", "-l", str(mp)], check=False)
        self.kill_client(node)
        self._mount(node)

    # ------------------------------------------------------------ setup
    def setup(self) -> "GlusterFixture":
        started = time.monotonic()
        self.run_dir.mkdir(parents=True)
        self._save()
        for sub in ("lib", "run", "log", "brick", "mnt/a", "mnt/b"):
            (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
        self.brick = self.run_dir / "brick"
        self.mounts = {"a": self.run_dir / "mnt" / "a", "b": self.run_dir / "mnt" / "b"}
        self._network()
        self._save()
        self._glusterd()
        self._save()
        self._volume()
        for node in ("a", "b"):
            self._mount(node)
            self._save()
        self._check_shared()
        self.setup_s = time.monotonic() - started
        return self

    def _network(self) -> None:
        t = self.tag
        self.netns = {"s": f"{t}s", "a": f"{t}a", "b": f"{t}b"}
        for ns in self.netns.values():
            _run(["ip", "netns", "add", ns])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        s = self.netns["s"]
        _run(["ip", "-n", s, "link", "add", "kvbr", "type", "bridge"])
        _run(["ip", "-n", s, "addr", "add", f"{SERVER_IP}/24", "dev", "kvbr"])
        _run(["ip", "-n", s, "link", "set", "kvbr", "up"])
        for node in ("a", "b"):
            ns = self.netns[node]
            # Created in the host namespace under unique temporary names, then
            # moved: a fixed name could collide with another run's half-made pair.
            host_c, host_s = f"{t}{node}c", f"{t}{node}s"
            _run(["ip", "link", "add", host_c, "netns", ns, "type", "veth", "peer", "name", host_s, "netns", s])
            _run(["ip", "-n", ns, "link", "set", host_c, "name", CLIENT_DEV])
            _run(["ip", "-n", s, "link", "set", host_s, "master", "kvbr"])
            _run(["ip", "-n", s, "link", "set", host_s, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{NODE_IPS[node]}/24", "dev", CLIENT_DEV])
            _run(["ip", "-n", ns, "link", "set", CLIENT_DEV, "up"])

    def _glusterd(self) -> None:
        pidfile = self.run_dir / "run" / "glusterd.pid"
        d = self.run_dir
        # Private mount namespace: glusterd's state, sockets, pid files and
        # logs are this run's directories, whatever else runs on the machine.
        script = (
            "set -e; mount --make-rprivate /; "
            f"mkdir -p {d}/run/gluster /var/lib/glusterd /var/log/glusterfs; "
            # All of /run: glusterd's CLI socket is /run/glusterd.socket, beside /run/gluster.
            f"mount --bind {d}/lib /var/lib/glusterd; mount --bind {d}/run /run; "
            f"mount --bind {d}/log /var/log/glusterfs; "
            f"exec {GLUSTERD} -p {pidfile} --log-level WARNING"
        )
        _run(["ip", "netns", "exec", self.netns["s"], "unshare", "--mount", "--propagation", "private", "sh", "-c", script])
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not pidfile.exists():
            time.sleep(0.05)
        self.glusterd_pid = int(pidfile.read_text().split()[0])
        self.glusterd_mnt_ns = _mnt_ns(self.glusterd_pid)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.cli("pool", "list", check=False, timeout=10).returncode == 0:
                return
            time.sleep(0.1)
        raise RuntimeError("glusterd did not answer within 30 s")

    def _volume(self) -> None:
        self.cli("volume", "create", VOLUME, f"{SERVER_IP}:{self.brick}", "force")
        options = dict(ODIRECT_VOLUME_OPTIONS)
        if self.consistency == "strict":
            options.update(STRICT_VOLUME_OPTIONS)
        if self.ping_timeout is not None:
            # How long I/O on a partitioned node blocks before ENOTCONN
            # (Gluster's default 42 s makes it ~78 s).
            options["network.ping-timeout"] = str(self.ping_timeout)
        for key, value in options.items():
            self.cli("volume", "set", VOLUME, key, value)
        self.cli("volume", "start", VOLUME)
        deadline = time.monotonic() + 60  # slow on a loaded 2-core machine
        while time.monotonic() < deadline:
            status = self.cli("volume", "status", VOLUME, "--xml", check=False, timeout=20)
            if "<status>1</status>" in status.stdout:
                return
            time.sleep(0.2)
        raise RuntimeError("the brick did not come online within 60 s")

    def _mount(self, node: str) -> None:
        mp = self.mounts[node]
        pidfile = self.run_dir / "run" / f"client-{node}.pid"
        pidfile.unlink(missing_ok=True)
        opts = STRICT_CLIENT_OPTIONS if self.consistency == "strict" else []
        # The client binary directly: mount.glusterfs mangles
        # "-o fopen-keep-cache=false" into an invalid option.
        _run(
            [
                "nsenter",
                f"--net=/run/netns/{self.netns[node]}",
                GLUSTERFS,
                "--process-name",
                "fuse",
                f"--volfile-server={SERVER_IP}",
                f"--volfile-id=/{VOLUME}",
                f"--pid-file={pidfile}",
                f"--log-file={self.run_dir / 'log' / f'client-{node}.log'}",
                "--log-level=WARNING",
                *opts,
                str(mp),
            ]
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if pidfile.exists() and os.path.ismount(mp):
                try:
                    if os.stat(mp).st_ino == 1:
                        self.client_pids[node] = int(pidfile.read_text().split()[0])
                        return
                except OSError:
                    pass
            time.sleep(0.05)
        raise RuntimeError(f"mount of node {node} at {mp} did not come up")

    def _check_shared(self) -> None:
        probe = f".probe-{os.getpid()}"
        (self.mounts["a"] / probe).write_text("ok")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                if (self.mounts["b"] / probe).read_text() == "ok":
                    break
            except OSError:
                pass
            time.sleep(0.05)
        else:
            raise RuntimeError("a file written on node A is not visible on node B")
        assert self.brick is not None and (self.brick / probe).exists(), "the probe did not reach the brick"
        (self.mounts["a"] / probe).unlink()

    # ------------------------------------------------------------ teardown
    def teardown(self) -> None:
        teardown_state(self.run_dir)


def teardown_state(run_dir: Path) -> None:
    """Undoes one run from its state file; never raises, safe to repeat."""
    try:
        state = json.loads((run_dir / "state.json").read_text())
    except (OSError, ValueError):
        state = {}
    netns = state.get("netns", {})
    # Partitioned links first: a client blocked on a dead link would hold its
    # unmount (and any test process in D state) for the ping timeout.
    for node in ("a", "b"):
        ns = netns.get(node)
        if ns in _netns_names():
            _run(["ip", "-n", ns, "link", "set", CLIENT_DEV, "up"], check=False)
    for mp in _fuse_mounts_under(run_dir):
        _run(["umount", "-l", mp], check=False)
    for pid in state.get("client_pids", {}).values():
        if pid and _alive(pid) and "glusterfs" in _cmdline(pid) and str(run_dir) in _cmdline(pid):
            os.kill(pid, signal.SIGKILL)
    gd = state.get("glusterd_pid")
    ns_id = state.get("glusterd_mnt_ns")
    if ns_id:
        # glusterd and everything it spawned (brick processes) live in the
        # private mount namespace it was started in: exactly those.
        ours = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and _mnt_ns(int(entry)) == ns_id and "gluster" in _cmdline(int(entry)):
                ours.append(int(entry))
        for pid in ours:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_alive(p) for p in ours):
            time.sleep(0.05)
    elif gd and _alive(gd) and "glusterd" in _cmdline(gd):
        os.kill(gd, signal.SIGKILL)
    for ns in netns.values():
        if ns in _netns_names():
            _run(["ip", "netns", "del", ns], check=False)
    # The brick's .glusterfs tree holds hard links and xattrs: plain rmtree works.
    shutil.rmtree(run_dir, ignore_errors=True)


def clean_leftovers(root: Path = ROOT) -> list[str]:
    """Tears down runs whose pytest process is gone (killed before its teardown)."""
    cleaned = []
    if not root.is_dir():
        return cleaned
    for run_dir in sorted(root.glob("run-*")):
        try:
            owner = json.loads((run_dir / "state.json").read_text()).get("owner_pid")
        except (OSError, ValueError):
            owner = None
        if owner is not None and _alive(owner):
            continue  # a live session's fixture (this process's too: a second fixture beside the first)
        teardown_state(run_dir)
        cleaned.append(run_dir.name)
    return cleaned


def start(consistency: str = "strict", ping_timeout: int | None = 5) -> GlusterFixture:
    """Cleans leftovers of dead runs, then sets a fixture up (torn down again
    if the setup fails half-way). Raises GlusterUnavailable with the reason
    where this machine cannot run it."""
    why = missing_requirement()
    if why:
        raise GlusterUnavailable(why)
    clean_leftovers()
    ROOT.mkdir(parents=True, exist_ok=True)
    tag = f"kv{os.getpid() % 100000:05d}{'d' if consistency == 'default' else ''}"
    fx = GlusterFixture(run_dir=ROOT / f"run-{tag}", tag=tag, consistency=consistency, ping_timeout=ping_timeout)
    if fx.run_dir.exists():
        teardown_state(fx.run_dir)
    try:
        return fx.setup()
    except BaseException:
        fx.teardown()
        raise
