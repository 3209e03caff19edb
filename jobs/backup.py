"""``toko-backup``: consistent online backups of the SQLite store, and restore.

Started nightly by toko-backup.timer while toko-api keeps writing: SQLite's
backup API copies a consistent snapshot (WAL lets the writer carry on), the
copy is checked with ``PRAGMA integrity_check``, then published atomically
(temporary file, fsync, rename, fsync of the folder) with mode 0600. Only
the newest TOKO_BACKUP_KEEP backups are kept. One run at a time writes to a
folder; a run stopped by SIGTERM deletes its temporary file, and each run
first deletes those that killed runs left.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
import os
import re
import shutil
import sqlite3
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from jobs.common import JobFailed, require_database, run_job, stop_on_sigterm
from service.settings import Settings
from service.store.disk import fsync_dir, fsync_file
from service.store.lock import InstanceLock, InstanceLocked
from service.store.sqlite import connect
from service.store.sqlite.migrations import LATEST_VERSION

log = logging.getLogger("toko.backup")
PREFIX = "toko-"
SUFFIX = ".db"
# Held while a backup is written; hidden, and never named like a backup.
LOCK_NAME = ".toko-backup.lock"
# Every toko database has had these since its first schema version.
TOKO_TABLES = ("products", "jobs")
# The socket too: with it listening, the next connection starts toko-api
# again, and the restore an admin retries is refused once more.
STOP_API = "systemctl stop toko-api.socket toko-api"


def backup_name(now: float, suffix: str = SUFFIX) -> str:
    return PREFIX + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now)) + suffix


def _backup_pattern(suffix: str) -> str:
    """A regular expression for exactly the names backup_name() gives."""
    return re.escape(PREFIX) + r"\d{8}T\d{6}Z" + re.escape(suffix)


def list_backups(folder: Path, suffix: str = SUFFIX) -> list[Path]:
    """Finished backups, oldest first (the timestamped names sort by time).

    Only the names backup_name() gives: an admin's copy beside them
    (toko-before-upgrade.db, "toko-20261101T023000Z (copy).db") is neither
    counted among the TOKO_BACKUP_KEEP nor pruned. Counted, it took a place,
    pushing a real backup out, and went itself once enough runs had come.
    """
    if not folder.exists():
        return []  # none written yet
    if not folder.is_dir():  # --list showed nothing, as if there were no backups
        raise _unusable_folder(folder, FileExistsError())
    name = re.compile(_backup_pattern(suffix))
    return sorted(p for p in folder.iterdir() if name.fullmatch(p.name) and p.is_file())


def print_backups(folder: Path, suffix: str) -> None:
    """``--list``: each backup with its size; where none are, the folder looked in."""
    backups = list_backups(folder, suffix)
    for path in backups:
        print(f"{path}  {path.stat().st_size} bytes")
    if not backups:
        # On stderr, so that a script reading the list gets none: but the admin
        # sees where it looked (run without the service's settings, ./var).
        print(f"toko-backup: no backups in {folder.absolute()} (TOKO_BACKUP_DIR)", file=sys.stderr)


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


def refuse_newer(source: Path, version: int, latest: int) -> None:
    """A newer toko's backup would leave a database this toko-api refuses to start on."""
    if version > latest:
        raise JobFailed(
            f"{source} was made by a newer toko (schema version {version}; "
            f"this toko knows up to {latest}): upgrade toko first"
        )


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


def _unusable_folder(folder: Path, exc: OSError) -> JobFailed:
    """One line naming the setting: "[Errno 17] File exists: PATH" said neither what nor why."""
    # mkdir(exist_ok=True) says "exists" only when it is no directory.
    reason = "it is not a directory" if isinstance(exc, FileExistsError) else exc.strerror
    return JobFailed(f"cannot use {folder} for backups (TOKO_BACKUP_DIR): {reason or exc}")


@contextlib.contextmanager
def _folder_lock(folder: Path) -> Iterator[None]:
    """One backup at a time per folder (a manual run during the timer's waits).

    Only so can a run delete the partial copies it finds: none is being written.
    """
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise _unusable_folder(folder, exc) from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another toko-backup is writing to this folder; waiting for it to finish")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _journal(tmp: Path) -> Path:
    return tmp.with_name(tmp.name + "-journal")  # SQLite's, while it writes the copy


def remove_partials(folder: Path, suffix: str) -> list[Path]:
    """Delete the temporary copies of runs that were killed (SIGKILL, power cut).

    They are full-size, hidden from --list and pruning, and each run picks a
    new name: left alone, they fill the disk the database is on. Only toko's
    own temporary names; the caller holds the folder lock, so no live run's.
    """
    pattern = re.compile(rf"\.{_backup_pattern(suffix)}\.partial(-journal)?")
    removed = [path for path in folder.iterdir() if pattern.fullmatch(path.name)]
    for path in removed:
        log.warning(
            "removed the partial copy of a backup that did not finish",
            extra={"PATH": str(path), "BYTES": path.stat().st_size},
        )
        path.unlink()
    return removed


def publish_backup(
    folder: Path,
    keep: int,
    suffix: str,
    write: Callable[[Path], None],
    clock: Callable[[], float] = time.time,
) -> Path:
    """Write a backup atomically and prune old ones; both backends use it.

    ``write(tmp)`` fills and verifies a temporary file in ``folder``; it is then
    fsynced, renamed into place and the folder fsynced, so a crash leaves
    either the whole backup or none.
    """
    with _folder_lock(folder):
        remove_partials(folder, suffix)
        stamp = clock()
        final = folder / backup_name(stamp, suffix)
        while final.exists():  # a second backup within the same second must not replace it
            stamp += 1
            final = folder / backup_name(stamp, suffix)
        tmp = folder / f".{final.name}.partial"
        try:
            write(tmp)
            fsync_file(tmp)
            tmp.rename(final)
            fsync_dir(folder)
        except BaseException:  # Stopped (SIGTERM) included: see jobs.common.stop_on_sigterm
            for path in (tmp, _journal(tmp)):
                path.unlink(missing_ok=True)
            raise
        pruned = prune(folder, keep, suffix, newest=final)
    log.info(
        "backup written",
        extra={"PATH": str(final), "BYTES": final.stat().st_size, "PRUNED": len(pruned)},
    )
    return final


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
                " the last good ones are kept (README: A damaged database)"
            ) from None
        # An emptied database file (or another program's) copies without an
        # error: published, it pushed the last good backups out. PostgreSQL's
        # backups check for the toko tables too. A newer schema is no reason
        # to refuse: back up whatever toko-api last wrote.
        toko_schema_version(tmp, shown_as=database)

    return publish_backup(folder, keep, SUFFIX, write, clock)


def prune(folder: Path, keep: int, suffix: str = SUFFIX, newest: Path | None = None) -> list[Path]:
    """Delete all but the last ``keep`` backups in name (time) order.

    ``newest``, the backup just written, is kept and counts as one of them
    whatever its name: a clock behind (a board without a battery-backed clock
    before NTP) names it older than the rest, and it holds the latest data.
    """
    others = [path for path in list_backups(folder, suffix) if path != newest]
    room = keep - (newest is not None)
    old = others[: max(len(others) - room, 0)]
    for path in old:
        path.unlink()
    return old


def _keep_path(db: Path, now: float) -> Path:
    """A new, empty file for the replaced database: never one an earlier restore kept.

    Named by the second alone, a restore within the same second as the last
    one copied over the file that held the database before both.
    """
    while True:
        stamp = backup_name(now)[len(PREFIX) : -len(SUFFIX)]
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


def _main(args: argparse.Namespace, settings: Settings) -> int:
    stop_on_sigterm()
    if settings.is_postgres:
        from jobs import pg_backup  # imports this module: import it only when needed

        return pg_backup.run(args.list, args.restore, settings)
    folder = Path(settings.backup_dir)
    try:
        if args.list:
            print_backups(folder, SUFFIX)
        elif args.restore:
            kept = restore(settings.database, Path(args.restore))
            print(f"restored {args.restore} into {settings.database}")
            if kept:
                print(f"the previous database is kept as {kept}")
        else:
            print(make_backup(settings.database, folder, settings.backup_keep))
    except (OSError, sqlite3.Error) as exc:
        raise JobFailed(str(exc)) from exc
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="toko-backup",
        description=(
            "Write a verified, consistent backup of the toko database while toko-api runs, "
            "keeping the newest TOKO_BACKUP_KEEP (default 7) in TOKO_BACKUP_DIR "
            "(default: backups/ beside the database)."
        ),
    )
    action = parser.add_mutually_exclusive_group()
    action.add_argument(
        "--restore",
        metavar="FILE",
        help="replace the database with FILE (toko-api must be stopped)",
    )
    action.add_argument("--list", action="store_true", help="list the backups, oldest first")
    return run_job("toko-backup", parser, _main)
