"""The backup files of ``toko-backup``, whichever the backend writes them.

Both backends (:mod:`jobs.sqlite_backup`, :mod:`jobs.pg_backup`) name their
backups here (``toko-<UTC time><suffix>``), publish them atomically into
TOKO_BACKUP_DIR (temporary file, fsync, rename, fsync of the folder) under a
folder lock, keep only the newest TOKO_BACKUP_KEEP, and list them. Also
shared: what both restores refuse (a newer toko's backup) and ask for
(toko-api stopped). This module imports neither backend.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from jobs.common import JobFailed
from service.store.disk import fsync_dir, fsync_file

log = logging.getLogger("toko.backup")
PREFIX = "toko-"
# Held while a backup is written; hidden, and never named like a backup.
LOCK_NAME = ".toko-backup.lock"
# The socket too: with it listening, the next connection starts toko-api
# again, and the restore an admin retries is refused once more.
STOP_API = "systemctl stop toko-api.socket toko-api"


def backup_name(now: float, suffix: str) -> str:
    return PREFIX + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now)) + suffix


def _backup_pattern(suffix: str) -> str:
    """A regular expression for exactly the names backup_name() gives."""
    return re.escape(PREFIX) + r"\d{8}T\d{6}Z" + re.escape(suffix)


def list_backups(folder: Path, suffix: str) -> list[Path]:
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


def refuse_newer(source: Path, version: int, latest: int) -> None:
    """A newer toko's backup would leave a database this toko-api refuses to start on."""
    if version > latest:
        raise JobFailed(
            f"{source} was made by a newer toko (schema version {version}; "
            f"this toko knows up to {latest}): upgrade toko first"
        )


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


def prune(folder: Path, keep: int, suffix: str, newest: Path | None = None) -> list[Path]:
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
