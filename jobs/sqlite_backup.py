"""``toko-backup`` on SQLite: consistent online backups of the store, and restore.

Started nightly by toko-backup.timer while toko-api keeps writing: SQLite's
backup API copies a consistent snapshot (WAL lets the writer carry on), the
copy is checked with ``PRAGMA integrity_check``, then published atomically
(temporary file, fsync, rename, fsync of the folder) with mode 0600. Only
the newest TOKO_BACKUP_KEEP backups are kept. One run at a time writes to a
folder; a run stopped by SIGTERM deletes its temporary file, and each run
first deletes those that killed runs left (:mod:`jobs.backup_files`, shared
with :mod:`jobs.pg_backup`).
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

from jobs import backup_files
from jobs.backup_files import PREFIX, STOP_API, backup_name, publish_backup, refuse_newer
from jobs.common import JobFailed, require_database
from service.store.disk import fsync_dir, fsync_file
from service.store.lock import InstanceLock, InstanceLocked
from service.store.sqlite import connect
from service.store.sqlite.migrations import LATEST_VERSION

log = logging.getLogger("toko.backup")
SUFFIX = ".db"
# Every toko database has had these since its first schema version.
TOKO_TABLES = ("products", "jobs")


def list_backups(folder: Path) -> list[Path]:
    """The finished SQLite backups in ``folder``, oldest first."""
    return backup_files.list_backups(folder, SUFFIX)


def prune(folder: Path, keep: int, newest: Path | None = None) -> list[Path]:
    """Delete all but the last ``keep`` SQLite backups (see backup_files.prune)."""
    return backup_files.prune(folder, keep, SUFFIX, newest)


def check_integrity(path: Path) -> None:
    problem = integrity_problem(sqlite3.connect(f"file:{path}?mode=ro", uri=True))
    if problem is not None:
        raise JobFailed(f"{path} {problem}")


def integrity_problem(conn: sqlite3.Connection) -> str | None:
    """What ``PRAGMA integrity_check`` finds wrong with the database of ``conn``
    (which it closes), as the end of a sentence; None if nothing."""
    try:
        rows = conn.execute("PRAGMA integrity_check").fetchall()
    except sqlite3.DatabaseError as exc:
        return f"is not a usable SQLite database: {exc}"
    finally:
        conn.close()
    if rows == [("ok",)]:
        return None
    # One row per problem, the first under a "*** in database main ***" line.
    problems = [ln for (row,) in rows for ln in str(row).splitlines() if not ln.startswith("***")]
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return f"failed the integrity check: {'; '.join(problems[:3])}{more}"


def toko_schema_version(path: Path, shown_as: Path | str | None = None) -> int:
    """The schema version of the toko database at ``path``; JobFailed if it is none.

    Any SQLite file passes the integrity check, an empty one included.
    ``shown_as`` names the file in the message (a copy's source, say).
    """
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        (version,) = conn.execute("PRAGMA user_version").fetchone()
        rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
    finally:
        conn.close()
    name = path if shown_as is None else shown_as
    tables = {table for (table,) in rows}
    missing = [table for table in TOKO_TABLES if table not in tables]
    if missing:
        raise JobFailed(f"{name} is not a toko database (no {' or '.join(missing)} table)")
    if version < 1:  # every toko sets it in the transaction that creates the tables
        raise JobFailed(f"{name} is not a toko database (no toko schema version)")
    return int(version)


def check_toko_database(path: Path) -> None:
    """Raise JobFailed unless toko-api can run on ``path`` (checked before restoring it).

    Another program's database would be restored, and toko-api would then
    start on an empty shop beside its tables.
    """
    refuse_newer(path, toko_schema_version(path), LATEST_VERSION)


def make_backup(
    database: str, folder: Path, keep: int, clock: Callable[[], float] = time.time
) -> Path:
    require_database(database)

    def write(tmp: Path) -> None:
        # Create it 0600 before SQLite writes a byte: backups hold all the shop's data.
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        source = connect(database, read_only=True)
        target = sqlite3.connect(tmp)
        try:
            source.backup(target)
            # A self-contained single file: no -wal beside it to lose.
            target.execute("PRAGMA journal_mode = DELETE")
        except sqlite3.Error as exc:
            # SQLite's own words ("database or disk is full", "disk I/O error")
            # do not say which disk: the likely one is the backups'.
            raise JobFailed(f"copying {database} into {folder} failed: {exc}") from exc
        finally:
            target.close()
            source.close()
        try:
            check_integrity(tmp)
        except JobFailed:
            # The online backup copies pages as they are: a damaged database
            # gives a damaged copy. Say which of the two is, for that is what
            # the admin must act on.
            damage = integrity_problem(connect(database, read_only=True))
            if damage is None:
                raise
            raise JobFailed(
                f"the database {database} is damaged: it {damage}. No backup was written;"
                " the last good ones are kept"
                " (see /usr/share/doc/toko/docs/how-to/damaged-database.md)"
            ) from None
        # An emptied database file (or another program's) copies without an
        # error: published, it pushed the last good backups out. PostgreSQL's
        # backups check for the toko tables too. A newer schema is no reason
        # to refuse: back up whatever toko-api last wrote.
        toko_schema_version(tmp, shown_as=database)

    return publish_backup(folder, keep, SUFFIX, write, clock)


def _keep_path(db: Path, now: float) -> Path:
    """A new, empty file for the replaced database: never one an earlier restore kept.

    Named by the second alone, a restore within the same second as the last
    one copied over the file that held the database before both.
    """
    while True:
        stamp = backup_name(now, SUFFIX)[len(PREFIX) : -len(SUFFIX)]
        kept = db.with_name(f"{db.name}.before-restore-{stamp}")
        try:
            os.close(os.open(kept, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:
            now += 1
            continue
        return kept


def _replace_database(db: Path, source: Path, clock: Callable[[], float]) -> Path | None:
    """Put ``source`` in place of ``db``, a copy of which is kept; return that copy.

    Stopped or failed before the swap (a full disk, SIGTERM), it leaves the
    database as it was and neither copy behind: a partial one, named as the
    kept database, looked like a whole one.
    """
    kept: Path | None = None
    tmp = db.with_name(f".{db.name}.restoring")
    replaced = False
    try:
        if db.exists():
            # Fold any WAL content into the old file so the kept copy is complete.
            conn = connect(str(db))
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            conn.close()
            kept = _keep_path(db, clock())
            shutil.copy2(db, kept)
            # On disk before the database is replaced: it may be the only
            # copy of the newest data (its name is synced with the rename's).
            fsync_file(kept)
        shutil.copyfile(source, tmp)
        os.chmod(tmp, 0o600)
        fsync_file(tmp)
        for stale in (db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
            stale.unlink(missing_ok=True)
        tmp.rename(db)
        replaced = True
        fsync_dir(db.parent)
    except BaseException:  # Stopped (SIGTERM) included
        tmp.unlink(missing_ok=True)
        if kept is not None and not replaced:
            kept.unlink(missing_ok=True)
        raise
    return kept


def restore(database: str, source: Path, clock: Callable[[], float] = time.time) -> Path | None:
    """Replace the database with ``source``; the current file is kept beside it."""
    if not source.is_file():
        raise JobFailed(f"no backup file at {source}")
    check_integrity(source)
    check_toko_database(source)
    lock = InstanceLock(database)
    try:
        lock.acquire()  # also keeps toko-api from starting mid-restore
    except InstanceLocked:
        raise JobFailed(f"toko-api is running; stop it first ({STOP_API}), then restore") from None
    try:
        # The file itself: through a symbolic link (the database on a disk of
        # its own), the link would be replaced and the file left as it was.
        kept = _replace_database(Path(os.path.realpath(database)), source, clock)
    finally:
        lock.release()
    kept_as = {} if kept is None else {"PREVIOUS": str(kept)}  # nothing there before: no field
    log.info("backup restored", extra={"PATH": str(source), **kept_as})
    return kept
