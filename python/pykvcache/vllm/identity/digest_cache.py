"""This node's cache of weights digests, keyed on each file's identity.

Digesting every byte of a 16 GB checkpoint costs seconds; a restart on the
same files should cost a ``stat``. A digest is stored against the file's real
path, size, mtime_ns, ctime_ns, inode and device: an in-place edit changes
mtime and ctime, and although ``touch -r`` (``os.utime``) can put the mtime
back, only the kernel sets ctime (to "now", on every write, chmod or utime),
so an edited file never matches its old entry. The digest itself is of
content, so two nodes (or two copies on one node) with the same bytes agree;
the cache only spares the reading.

Racy window (as git's index has): on a filesystem with coarse timestamps, an
edit right after a digest can leave mtime and ctime unchanged. A digest is
recorded only when the file's last change is older than
:data:`RACY_WINDOW_NS` at the time the digest started, so a later edit
always lands in a later timestamp.

The cache lives under the user's cache directory (``$XDG_CACHE_HOME`` or
``~/.cache``), not in the model directory (often read-only, or shared by
nodes whose inodes mean nothing to each other), and not in the store (shared
by nodes too). It is trusted only when it is a regular file owned by this
user and writable by nobody else: whoever can write it chooses namespaces.
An unusable location (read-only home, a file in the way) costs a full digest
at every start, with one warning per process and location.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from pykvcache.vllm.identity.weights_digest import SCHEME

logger = logging.getLogger("vllm.pykvcache." + __name__.rsplit(".", 1)[-1])

#: A file changed this recently when its digest started is not cached (2 s:
#: above the coarsest timestamps of the filesystems weights live on, 1 s).
RACY_WINDOW_NS = 2_000_000_000

#: Entries kept; the oldest go first (a node seldom holds more weight files).
MAX_ENTRIES = 4096

_warned: set[str] = set()


def _warn_once(kind: str, path: Path, detail: str) -> None:
    if str(path) in _warned:
        return
    _warned.add(str(path))
    logger.warning(
        "pykvcache: weights digest cache %s %s (%s): weights are digested in full at every start until it is usable", path, kind, detail
    )


def _file_key(st: os.stat_result) -> dict[str, int]:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "ino": st.st_ino, "dev": st.st_dev}


def same_file_state(a: os.stat_result, b: os.stat_result) -> bool:
    """Whether nothing about the file changed between two stats of it."""
    return _file_key(a) == _file_key(b)


class DigestCache:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._entries: dict[str, dict[str, Any]] | None = None
        self._new: dict[str, dict[str, Any]] = {}

    @classmethod
    def default(cls) -> DigestCache | None:
        """``$XDG_CACHE_HOME/pykvcache/weights-digests.json`` (``~/.cache`` by
        default); None when neither is an absolute path (a container without
        a home directory): a cache relative to the working directory would
        land wherever the server happens to start."""
        xdg = os.environ.get("XDG_CACHE_HOME", "")
        base = xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
        if not os.path.isabs(base):
            _warn_once("has no location", Path(base), "neither XDG_CACHE_HOME nor the home directory is an absolute path")
            return None
        return cls(Path(base) / "pykvcache" / "weights-digests.json")

    def _read(self) -> dict[str, dict[str, Any]]:
        """The entries on disk; {} when there are none or they are not to be trusted."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            _warn_once("is unreadable", self.path, str(exc))
            return {}
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
                _warn_once("is not trusted", self.path, "not a regular file of this user, or writable by others")
                return {}
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = json.loads(f.read())
        except (OSError, ValueError) as exc:
            _warn_once("is unreadable", self.path, str(exc))
            return {}
        finally:
            os.close(fd)
        if not isinstance(data, dict) or data.get("scheme") != SCHEME or not isinstance(data.get("entries"), dict):
            return {}
        entries: dict[str, dict[str, Any]] = data["entries"]
        return entries

    def lookup(self, real_path: str, st: os.stat_result) -> str | None:
        """The cached digest of ``real_path`` if the file is as it was then."""
        if self._entries is None:
            self._entries = self._read()
        entry = self._new.get(real_path) or self._entries.get(real_path)
        if not isinstance(entry, dict) or entry.get("file") != _file_key(st):
            return None
        digest = entry.get("digest")
        return digest if isinstance(digest, str) else None

    def record(self, real_path: str, st: os.stat_result, digest: str, started_ns: int) -> bool:
        """Remembers ``digest`` for the file as ``st`` saw it (the stat taken
        before its bytes were read, and unchanged after); not when the file
        changed within the racy window before ``started_ns``."""
        if started_ns - max(st.st_mtime_ns, st.st_ctime_ns) < RACY_WINDOW_NS:
            return False
        self._new[real_path] = {"file": _file_key(st), "digest": digest}
        return True

    def save(self) -> None:
        """Writes the new entries, merged into what is on disk now (another
        engine on this node may have added its own since): write a private
        temporary file, then rename it over the cache. Concurrent saves lose
        one side's new entries, which costs that side's next start a digest."""
        if not self._new:
            return
        entries = self._read()
        for path, entry in self._new.items():
            entries.pop(path, None)
            entries[path] = entry  # most recent last
        entries = dict(list(entries.items())[-MAX_ENTRIES:])
        tmp = None
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".weights-digests.", dir=self.path.parent)
            with os.fdopen(fd, "w") as f:
                json.dump({"scheme": SCHEME, "entries": entries}, f)
            os.replace(tmp, self.path)
            tmp = None
        except OSError as exc:
            _warn_once("cannot be written", self.path, str(exc))
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        self._entries, self._new = entries, {}
