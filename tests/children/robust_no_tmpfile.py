"""Makes this process's filesystems look like ones without O_TMPFILE support
(NFS, FUSE, older network and cluster filesystems): a seccomp filter fails
open/openat carrying O_TMPFILE with EOPNOTSUPP, as those filesystems do.
The engine then takes its real temp-file + rename path on real files."""

import ctypes
import errno
import platform
import struct

_libc = ctypes.CDLL(None, use_errno=True)

PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
O_TMPFILE_BIT = 0o20000000  # __O_TMPFILE (O_TMPFILE = __O_TMPFILE | O_DIRECTORY)
# (audit arch, openat nr, open nr or None)
ARCH = {"x86_64": (0xC000003E, 257, 2), "aarch64": (0xC00000B7, 56, None)}


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _insn(code, jt, jf, k):
    return struct.pack("HBBI", code, jt, jf, k)


LD_W_ABS, JA, JEQ_K, JSET_K, RET_K = 0x20, 0x05, 0x15, 0x45, 0x06
ALLOW, RET_ERRNO = 0x7FFF0000, 0x00050000


def refuse_o_tmpfile() -> None:
    arch, nr_openat, nr_open = ARCH[platform.machine()]
    nr_open = nr_open if nr_open is not None else nr_openat
    deny = RET_ERRNO | errno.EOPNOTSUPP
    prog = b"".join(
        [
            _insn(LD_W_ABS, 0, 0, 4),  # 0: arch
            _insn(JEQ_K, 0, 8, arch),  # 1: other arch -> allow (10)
            _insn(LD_W_ABS, 0, 0, 0),  # 2: syscall nr
            _insn(JEQ_K, 3, 0, nr_openat),  # 3: openat -> flags in args[2] (7)
            _insn(JEQ_K, 0, 5, nr_open),  # 4: open -> flags in args[1] (5); else allow (10)
            _insn(LD_W_ABS, 0, 0, 24),  # 5: low word of args[1]
            _insn(JA, 0, 0, 1),  # 6: -> 8
            _insn(LD_W_ABS, 0, 0, 32),  # 7: low word of args[2]
            _insn(JSET_K, 0, 1, O_TMPFILE_BIT),  # 8: O_TMPFILE set? deny (9) : allow (10)
            _insn(RET_K, 0, 0, deny),  # 9
            _insn(RET_K, 0, 0, ALLOW),  # 10
        ]
    )
    buf = ctypes.create_string_buffer(prog)
    fprog = _SockFprog(len(prog) // 8, ctypes.addressof(buf))
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
    if _libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_SECCOMP")
