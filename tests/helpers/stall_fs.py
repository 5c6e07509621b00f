"""A real FUSE filesystem whose requests can be made to hang or fail on command.

A passthrough of a backing directory (libfuse 3 through `mfusepy`), run as its own
process. `StallFs` starts it and controls it:

- ``stall()`` SIGSTOPs the daemon: every request on the mount (open, stat, read, write,
  close's flush, rename, unlink, statfs) then waits in the kernel, as on a network
  filesystem whose link is down, until ``resume()`` (SIGCONT);
- ``fail(errno)`` makes every request return that errno (``ENOTCONN`` as a killed
  Gluster client does, ``EIO``...) until ``heal()``;
- ``refuse=("fallocate", "o_direct")`` at mount: fallocate answers EOPNOTSUPP (Lustre),
  an open with O_DIRECT answers EINVAL. O_TMPFILE is refused by every high-level libfuse
  filesystem (EOPNOTSUPP), as on Gluster. Unaligned O_DIRECT is accepted, as on NFS.

Everything it mounts is unmounted and its process ended on exit, also when the test
fails. ``skip_reason()`` says why FUSE cannot be used here (no /dev/fuse, no root, no
mfusepy or libfuse 3), for ``pytest.skip``.

Run as a script: ``python stall_fs.py BACKING MOUNTPOINT CONTROL_FILE [REFUSALS]``.
"""

from __future__ import annotations

import errno
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def skip_reason() -> str | None:
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse (FUSE not in this kernel)"
    if os.geteuid() != 0:
        return "mounting FUSE without fusermount needs root"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as e:
        return f"mfusepy (FUSE bindings, test dependency) unavailable: {e}"
    return None


class StallFs:
    """Context manager: ``with StallFs(tmp_path) as fs: fs.mount_point ...``."""

    def __init__(self, base: Path, refuse: tuple[str, ...] = ()):
        self.base = Path(base)
        self.backing = self.base / "backing"
        self.mount_point = self.base / "mnt"
        self.control = self.base / "control"
        self.refuse = refuse
        self.proc: subprocess.Popen | None = None
        self.stalled = False

    def __enter__(self) -> "StallFs":
        self.backing.mkdir(parents=True, exist_ok=True)
        self.mount_point.mkdir(parents=True, exist_ok=True)
        self.control.write_text("ok")
        env = dict(os.environ)
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE), str(self.backing), str(self.mount_point), str(self.control), ",".join(self.refuse)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 20
        while not os.path.ismount(self.mount_point):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                err = self.proc.stderr.read().decode() if self.proc.poll() is not None else "timed out"
                self.__exit__(None, None, None)
                raise RuntimeError(f"stall_fs did not mount: {err}")
            time.sleep(0.02)
        return self

    def stall(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.stalled = True
        # Stopped once every thread of the daemon is (a request being served
        # as the signal came may still complete).
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            states = []
            for tid in os.listdir(f"/proc/{self.proc.pid}/task"):
                try:
                    states.append(Path(f"/proc/{self.proc.pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[0])
                except OSError:
                    pass
            if states and all(st in "tT" for st in states):
                break
            time.sleep(0.005)

    def resume(self) -> None:
        if self.proc is not None and self.stalled:
            os.kill(self.proc.pid, signal.SIGCONT)
        self.stalled = False

    def fail(self, err: int) -> None:
        self._set_mode(errno.errorcode[err])

    def heal(self) -> None:
        self._set_mode("ok")

    def _set_mode(self, mode: str) -> None:
        tmp = self.control.with_suffix(".new")
        tmp.write_text(mode)
        os.replace(tmp, self.control)
        time.sleep(0.05)  # the daemon polls the control file every 10 ms

    def __exit__(self, *exc) -> None:
        self.resume()
        if self.proc is not None:
            # Lazy unmount first: nothing waits on a daemon that is going away.
            subprocess.run(["umount", "-l", str(self.mount_point)], capture_output=True)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
            if self.proc.stderr:
                self.proc.stderr.close()
            self.proc = None
        if os.path.ismount(self.mount_point):
            subprocess.run(["umount", "-l", str(self.mount_point)], capture_output=True)


# ---- the daemon (runs in its own process)


def _serve(backing: str, mount_point: str, control: str, refusals: set[str]) -> None:
    import mfusepy
    from mfusepy import FUSE, FuseOSError, Operations

    mode = {"errno": 0}

    def watch() -> None:
        while True:
            try:
                m = Path(control).read_text().strip()
            except OSError:
                m = "ok"
            mode["errno"] = 0 if m == "ok" else getattr(errno, m, errno.EIO)
            time.sleep(0.01)

    threading.Thread(target=watch, daemon=True).start()

    def real(path: str) -> str:
        return os.path.join(backing, path.lstrip("/"))

    def guarded(fn):
        # functools.wraps: mfusepy reads the signature (create with or without flags).
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            if mode["errno"]:
                raise FuseOSError(mode["errno"])
            try:
                return fn(self, *args, **kwargs)
            except OSError as e:
                raise FuseOSError(e.errno or errno.EIO) from None

        return wrapper

    class Passthrough(Operations):
        use_ns = True

        @guarded
        def getattr(self, path, fh=None):
            st = os.fstat(fh) if fh is not None else os.lstat(real(path))
            keys = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_blocks")
            d = {k: getattr(st, k) for k in keys}
            d.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns, st_ino=st.st_ino)
            return d

        @guarded
        def access(self, path, amode):
            if not os.access(real(path), amode):
                raise FuseOSError(errno.EACCES)
            return 0

        @guarded
        def readdir(self, path, fh):
            return [".", ".."] + os.listdir(real(path))

        @guarded
        def mkdir(self, path, mode):
            return os.mkdir(real(path), mode)

        @guarded
        def rmdir(self, path):
            return os.rmdir(real(path))

        @guarded
        def chmod(self, path, mode):
            return os.chmod(real(path), mode)

        @guarded
        def chown(self, path, uid, gid):
            return os.chown(real(path), uid, gid)

        @guarded
        def unlink(self, path):
            return os.unlink(real(path))

        @guarded
        def rename(self, old, new):
            return os.rename(real(old), real(new))

        @guarded
        def link(self, target, source):
            return os.link(real(source), real(target))

        @guarded
        def symlink(self, target, source):
            return os.symlink(source, real(target))

        @guarded
        def readlink(self, path):
            return os.readlink(real(path))

        @guarded
        def utimens(self, path, times=None):
            os.utime(real(path), ns=times, follow_symlinks=False)
            return 0

        @guarded
        def truncate(self, path, length, fh=None):
            if fh is not None:
                return os.ftruncate(fh, length)
            return os.truncate(real(path), length)

        @guarded
        def open(self, path, flags):
            if flags & os.O_DIRECT and "o_direct" in refusals:
                raise FuseOSError(errno.EINVAL)
            return os.open(real(path), flags & ~(os.O_DIRECT | os.O_NONBLOCK))

        @guarded
        def create(self, path, mode, flags=0):
            if flags & os.O_DIRECT and "o_direct" in refusals:
                raise FuseOSError(errno.EINVAL)
            return os.open(real(path), os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)

        @guarded
        def read(self, path, size, offset, fh):
            return os.pread(fh, size, offset)

        @guarded
        def write(self, path, data, offset, fh):
            return os.pwrite(fh, data, offset)

        @guarded
        def fallocate(self, path, mode, offset, size, fh):
            if "fallocate" in refusals:
                raise FuseOSError(errno.EOPNOTSUPP)
            os.posix_fallocate(fh, offset, size)
            return 0

        @guarded
        def statfs(self, path):
            st = os.statvfs(real(path))
            keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files", "f_flag", "f_frsize", "f_namemax")
            return {k: getattr(st, k) for k in keys}

        @guarded
        def flush(self, path, fh):
            return 0

        @guarded
        def fsync(self, path, datasync, fh):
            os.fsync(fh)
            return 0

        def release(self, path, fh):
            os.close(fh)
            return 0

    del mfusepy
    FUSE(Passthrough(), mount_point, foreground=True, nothreads=False, allow_other=True, default_permissions=True)


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2], sys.argv[3], set(filter(None, (sys.argv[4] if len(sys.argv) > 4 else "").split(","))))
