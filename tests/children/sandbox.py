"""Process-level restrictions used to force fallbacks for real (no mocks):
a seccomp filter that refuses io_uring_setup the way container runtimes do,
and dropping CAP_IPC_LOCK so that RLIMIT_MEMLOCK applies to io_uring buffer
registration as it does for unprivileged users."""

import ctypes
import resource
import struct

_libc = ctypes.CDLL(None, use_errno=True)

PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
NR_IO_URING_SETUP = 425  # same number on x86_64 and the generic table (aarch64)
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _insn(code, jt, jf, k):
    return struct.pack("HBBI", code, jt, jf, k)


def refuse_io_uring(errno: int = 1) -> None:
    """Installs a seccomp filter: io_uring_setup fails with `errno` (EPERM)."""
    import platform

    arch = AUDIT_ARCH[platform.machine()]
    prog = b"".join(
        [
            _insn(0x20, 0, 0, 4),  # ld arch
            _insn(0x15, 1, 0, arch),  # jeq arch -> check nr
            _insn(0x06, 0, 0, 0x7FFF0000),  # other arch: allow
            _insn(0x20, 0, 0, 0),  # ld nr
            _insn(0x15, 0, 1, NR_IO_URING_SETUP),
            _insn(0x06, 0, 0, 0x00050000 | errno),  # SECCOMP_RET_ERRNO
            _insn(0x06, 0, 0, 0x7FFF0000),  # allow
        ]
    )
    buf = ctypes.create_string_buffer(prog)
    fprog = _SockFprog(len(prog) // 8, ctypes.addressof(buf))
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
    if _libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_SECCOMP")


CAP_IPC_LOCK = 14


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def limit_locked_memory(limit_bytes: int) -> None:
    """Drops CAP_IPC_LOCK and lowers RLIMIT_MEMLOCK to `limit_bytes`."""
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (limit_bytes, limit_bytes))
    hdr = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (_CapData * 2)()
    if _libc.capget(ctypes.byref(hdr), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    mask = ~(1 << CAP_IPC_LOCK) & 0xFFFFFFFF
    data[0].effective &= mask
    data[0].permitted &= mask
    data[0].inheritable &= mask
    if _libc.capset(ctypes.byref(hdr), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")
