"""Encryption key files for ``BlockStore(encryption_key_file=...)`` (decision 0083)."""

from __future__ import annotations

import os
from pathlib import Path


def write_key_file(path: str | os.PathLike[str]) -> Path:
    """Creates ``path`` holding 32 random bytes, mode 0600 whatever the umask, synced.
    Never replaces anything: an existing file (a key in use, or a link planted there)
    raises ``FileExistsError``; other failures raise ``OSError``."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        key = os.urandom(32)
        while key:
            key = key[os.write(fd, key) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    return path
