"""One toko-api per SQLite file: an advisory lock held for the process lifetime.

The queue's crash recovery ("running" jobs belong to a dead process) is only
true when no other toko-api uses the same file; the lock makes it so. The
restore command checks the same lock to refuse while toko-api runs.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class InstanceLocked(RuntimeError):
    pass


def lock_path(database: str) -> Path:
    # Beside the file itself: a second toko-api given another path to it (a
    # symbolic link to the file or to its folder) must meet the same lock.
    return Path(os.path.realpath(database) + ".lock")


class InstanceLock:
    def __init__(self, database: str) -> None:
        self.path = lock_path(database)
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise InstanceLocked(f"{self.path} is held by pid {holder}") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def is_locked(database: str) -> bool:
    """True while some process (a running toko-api) holds the instance lock."""
    path = lock_path(database)
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
