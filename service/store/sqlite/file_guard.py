"""Notice when the SQLite file is deleted or replaced under a running toko-api.

An open connection keeps writing to the file it opened, even after ``rm`` or
a ``mv`` over it: SQLite in WAL mode does not check. Every 201 after that
would be a product the next start can no longer see. So after each commit the
writer checks that the path still names the file it writes; once it does not,
every write is refused (503, and /healthz says why) until toko-api restarts.

What the process still has open may be the only copy of that data, so it
is saved beside the path first, or, when it cannot be written there (the
whole folder deleted, a full disk), the message says which ``/proc`` file to
copy before the process ends.

The same goes for the write-ahead log beside it (``rm toko.db-*``): every
commit since the last checkpoint is only in that file, and SQLite goes on
appending to the unlinked one. A ``kill -9`` then loses them all, and other
processes (toko-queue, toko-backup) open a new, empty log and see an old
database. So the writer folds the log it still has open into the database
file, which is still linked, and refuses writes, because from then on its
log and its locks are not the ones other processes use; then toko-api stops
for systemd to restart it with a new log. The sooner the better: the
stopping process deletes the new log, with whatever a toko-queue command
wrote there meanwhile, as its own. The log's inode does not change while
toko-api runs: checkpoints rewind or truncate it in place, and only the last
connection to close deletes it.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from pathlib import Path

from service.store.disk import fsync_dir, fsync_file

log = logging.getLogger("toko.store")


class DatabaseFileGone(sqlite3.OperationalError):
    """The path no longer names the file this process writes: writes would be lost."""


def file_identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of the file at ``path``; None when nothing is there."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st.st_dev, st.st_ino


class FileGuard:
    """The writer thread calls ``opened`` once, then ``check`` after each commit."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.wal_path = f"{path}-wal"  # until opened() knows where SQLite put it
        self._identity: tuple[int, int] | None = None
        self._wal_identity: tuple[int, int] | None = None
        self._gone: DatabaseFileGone | None = None
        # Whether a restart alone puts things right: the log was folded into the
        # database file, and no file needs the admin's choice.
        self.restart_heals = False

    @property
    def gone(self) -> bool:
        """Whether ``check`` has found the file gone (for good: only a restart reopens)."""
        return self._gone is not None

    def opened(self, conn: sqlite3.Connection) -> None:
        """Remember which files the writer's connection ``conn`` has just opened."""
        self._identity = file_identity(self.path)
        # Beside the file a symbolic link at the path points to: SQLite names
        # the log after the real file.
        self.wal_path = f"{_main_file(conn) or self.path}-wal"
        # The connection has read the database in WAL mode, which opens the log.
        self._wal_identity = file_identity(self.wal_path)

    def check(self, conn: sqlite3.Connection) -> None:
        """Raise DatabaseFileGone if the path no longer names the file ``conn`` writes,
        or its write-ahead log path no longer names the log ``conn`` writes.

        The first time it finds either gone, it saves what ``conn`` still sees.
        """
        if self._gone is None:
            try:
                now = file_identity(self.path)
                wal = file_identity(self.wal_path) if now == self._identity else None
            except OSError:
                return  # cannot tell (a permission changed?): SQLite will say if it matters
            if now != self._identity:
                self._gone = self._file_gone(conn, now)
            elif wal == self._wal_identity:
                return
            elif self._wal_identity is None:  # none at open: the log this commit wrote
                self._wal_identity = wal
                return
            else:
                self._gone = self._wal_gone(conn, wal)
        raise self._gone

    def _file_gone(self, conn: sqlite3.Connection, now: tuple[int, int] | None) -> DatabaseFileGone:
        what = "deleted or moved away" if now is None else "replaced"
        self._save(conn, f"database file {what}")
        return DatabaseFileGone(
            f"the database file {self.path} was deleted or replaced while toko-api ran;"
            " restart toko-api to use the file now at that path"
        )

    def _wal_gone(self, conn: sqlite3.Connection, now: tuple[int, int] | None) -> DatabaseFileGone:
        what = "deleted" if now is None else "replaced"
        checkpointed = _checkpointed(conn)
        # `rm toko.db*` unlinks the database too, perhaps between check()'s two
        # looks or during the checkpoint: then what was folded in is gone with
        # it, and only a copy keeps it. So look at the database once more.
        try:
            database = file_identity(self.path)
        except OSError:
            database = self._identity  # cannot tell: as check() does, assume it is there
        if database != self._identity:
            return self._file_gone(conn, database)
        if checkpointed:
            self.restart_heals = True
            log.critical(
                "database write-ahead log %s while running: everything stored until now is"
                " in %s. toko-api stops, for a restart (systemd's) to open a new log: its"
                " writes would go to a log no other process sees",
                what,
                self.path,
                extra={"DATABASE": self.path, "WAL": self.wal_path},
            )
        else:
            self._save(conn, f"database write-ahead log {what}")
        return DatabaseFileGone(
            f"the database's write-ahead log {self.wal_path} was {what} while toko-api ran;"
            " restart toko-api to use the database again"
        )

    def _save(self, conn: sqlite3.Connection, what: str) -> None:
        # Fold the WAL into the open file first, so that file alone is whole.
        try:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error as exc:
            log.warning("checkpoint of the vanished database failed: %s", exc)
        rescued = Path(self.path).with_name(
            f"{Path(self.path).name}.rescued-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
        )
        try:
            _copy(conn, rescued)
        except (OSError, sqlite3.Error) as exc:
            log.critical(
                "%s while running: refusing writes, which would be lost."
                " Could not save its contents beside it (%s); they are in %s until toko-api"
                " stops: copy that file, then restart toko-api",
                what,
                exc,
                _open_copy_hint(self._identity),
                extra={"DATABASE": self.path},
            )
            return
        log.critical(
            "%s while running: refusing writes, which would be lost."
            " Its contents up to now are saved in %s; put that back at %s (or keep the"
            " file now there), then restart toko-api",
            what,
            rescued,
            self.path,
            extra={"DATABASE": self.path, "RESCUED": str(rescued)},
        )


def _main_file(conn: sqlite3.Connection) -> str | None:
    """The path SQLite opened for ``conn``'s database, symbolic links resolved."""
    for _, name, file in conn.execute("PRAGMA database_list"):
        if name == "main":
            return str(file) or None
    return None


def _checkpointed(conn: sqlite3.Connection) -> bool:
    """Whether ``conn``'s whole write-ahead log is now durably in the database file."""
    # Into the file the connection has open, which is still the one at the path:
    # synchronous=FULL makes the checkpoint sync it before it empties the log.
    try:
        busy, _, _ = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    except sqlite3.Error as exc:
        log.warning("checkpoint of the vanished write-ahead log failed: %s", exc)
        return False
    return bool(busy == 0)


def _copy(conn: sqlite3.Connection, target: Path) -> None:
    """A durable copy of what ``conn`` sees at ``target``, a new file; none if it fails."""
    # 0600 before SQLite writes a byte, as for backups: it holds all the shop's data.
    os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    try:
        dest = sqlite3.connect(target)
        try:
            conn.backup(dest)
            dest.execute("PRAGMA journal_mode = DELETE")  # one self-contained file
        finally:
            dest.close()
        fsync_file(target)
        fsync_dir(target.parent)
    except BaseException:
        target.unlink(missing_ok=True)
        raise


def _open_copy_hint(identity: tuple[int, int] | None) -> str:
    """The /proc path of this process's descriptor for the vanished file."""
    fd_dir = Path("/proc/self/fd")
    try:
        for entry in fd_dir.iterdir():
            try:
                st = entry.stat()
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == identity:
                return f"/proc/{os.getpid()}/fd/{entry.name}"
    except OSError:
        pass
    return f"the files open in /proc/{os.getpid()}/fd"
