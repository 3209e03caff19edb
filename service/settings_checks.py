"""Checks of the settings against the filesystem, run at start by the programs
that open the SQLite database (toko-api and the timer jobs).

They would sit beside the SQLite store, the one that needs them; they are
kept apart from service/store/ while that package is reworked elsewhere.
"""

from __future__ import annotations

import os
import pwd
from pathlib import Path
from typing import TYPE_CHECKING

from service.settings_parsers import ConfigError

if TYPE_CHECKING:
    from service.settings import ToolSettings


def check_database_folder(settings: ToolSettings) -> None:
    """Fail, naming TOKO_DATABASE, where the SQLite file is a folder, or it or its
    folder is read-only or not the user's to write.

    The units let toko write in /var/lib/toko only (ProtectSystem=strict). A
    database moved elsewhere without a ReadWritePaths= drop-in failed with
    "[Errno 30] Read-only file system" on its lock file, exit 1, which
    Restart=on-failure retried until systemd gave up; this is exit 2 instead,
    with what to do. SQLite writes its -wal, -shm and lock file beside the
    database, so the folder must be writable, not only the file.
    """
    if settings.store.is_postgres:
        return
    if Path(settings.store.database).is_dir():
        # TOKO_DATABASE=/srv/toko, meant as the folder: "cannot open database
        # /srv/toko: unable to open database file", exit 1, retried by systemd.
        file = Path(settings.store.database) / "toko.db"
        raise ConfigError(
            f"TOKO_DATABASE names {settings.store.database}, which is a folder; "
            f"name the database file in it, like {file}"
        )
    # SQLite writes beside the file a symbolic link points to, as toko its lock
    # file: that folder must be writable, not the link's.
    folder = Path(os.path.realpath(settings.store.database)).parent
    existing = folder
    try:
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent  # toko-api creates the rest
        read_only = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
    except OSError:
        return  # not ours to judge here: opening the database says what is wrong
    if read_only:
        raise ConfigError(
            f"TOKO_DATABASE names a file in {folder}, which is read-only here: toko's units "
            f"may write only in /var/lib/toko unless a drop-in adds ReadWritePaths={folder} "
            "(see /usr/share/doc/toko/docs/how-to/database-elsewhere.md)"
        )
    # A folder made, or a database copied in, by root (mkdir, cp): "unable to
    # open database file", exit 1, retried until systemd gave up.
    for path, needed in (
        (existing, os.W_OK | os.X_OK),
        (Path(settings.store.database), os.R_OK | os.W_OK),
    ):
        try:
            owner = path.stat().st_uid
        except OSError:
            continue  # not there yet, or not ours to see: opening it says so
        if owner == 0 and not os.access(path, needed):
            me = user_name(os.geteuid())
            raise ConfigError(
                f"TOKO_DATABASE: {path} belongs to root, and {me} cannot write to it: "
                f"chown {me}: {path}"
            )


def user_name(uid: int) -> str:
    """The name of user ``uid``, or ``#uid`` where it has none."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"#{uid}"
