"""``toko-backup``: the command line of the backups, and restore.

A verified, consistent backup of the store while toko-api runs, ``--list``
and ``--restore FILE``, on the backend TOKO_DATABASE names: SQLite
(:mod:`jobs.sqlite_backup`) or PostgreSQL (:mod:`jobs.pg_backup`); the
backup files' names, folder and pruning are theirs in common
(:mod:`jobs.backup_files`). This module only parses, dispatches and prints.
"""

from __future__ import annotations

import argparse
import sqlite3
import subprocess
from pathlib import Path

from jobs import sqlite_backup
from jobs.backup_files import print_backups
from jobs.common import JobFailed, add_version, run_job, stop_on_sigterm
from jobs.textfile import reported
from service.settings import ToolSettings
from service.settings_spec import VARIABLES


def _sqlite(args: argparse.Namespace, settings: ToolSettings, figures: dict[str, float]) -> int:
    folder = Path(settings.backup.dir)
    try:
        if args.list:
            print_backups(folder, sqlite_backup.SUFFIX)
        elif args.restore:
            kept = sqlite_backup.restore(settings.store.database, Path(args.restore))
            print(f"restored {args.restore} into {settings.store.database}")
            if kept:
                print(f"the previous database is kept as {kept}")
        else:
            written = sqlite_backup.make_backup(
                settings.store.database, folder, settings.backup.keep
            )
            print(written)
            figures["size_bytes"] = written.stat().st_size
    except (OSError, sqlite3.Error) as exc:
        raise JobFailed(str(exc)) from exc
    return 0


def _postgres_folder(settings: ToolSettings) -> Path:
    # The default beside the SQLite file means nothing for a URL.
    if settings.backup.dir.startswith(("postgresql:", "postgres:")):
        raise JobFailed(
            "set TOKO_BACKUP_DIR (where backups go) when TOKO_DATABASE is a PostgreSQL URL"
        )
    return Path(settings.backup.dir)


def _postgres(args: argparse.Namespace, settings: ToolSettings, figures: dict[str, float]) -> int:
    # Imported here, not above: only a PostgreSQL run pays for loading asyncpg.
    # (No cycle either way: neither backend imports this module.)
    from jobs import pg_backup
    from service.redaction import redact

    folder = _postgres_folder(settings)
    try:
        if args.list:
            print_backups(folder, pg_backup.SUFFIX)
        elif args.restore:
            kept = pg_backup.restore(settings, Path(args.restore), folder)
            print(f"restored {args.restore} into {redact(settings.store.database)}")
            if kept:
                print(f"the previous contents are kept as {kept}")
        else:
            written = pg_backup.make_backup(settings, folder, settings.backup.keep)
            print(written)
            figures["size_bytes"] = written.stat().st_size
    except (OSError, subprocess.SubprocessError) as exc:
        raise JobFailed(str(exc)) from exc
    return 0


# The run's own figures in its report to node_exporter (jobs.textfile).
REPORT_FIGURES = {"size_bytes": "Size of the backup the last successful run wrote."}


def _main(args: argparse.Namespace, settings: ToolSettings, figures: dict[str, float]) -> int:
    stop_on_sigterm()
    backend = _postgres if settings.store.is_postgres else _sqlite
    return backend(args, settings, figures)


def _is_backup(args: argparse.Namespace) -> bool:
    """Whether the run makes a backup (the timer's), not an admin's --list or --restore."""
    return not (args.list or args.restore)


def build_parser() -> argparse.ArgumentParser:
    """toko-backup's options, the one source of its --help and its man page."""
    keep = next(v.default for v in VARIABLES if v.name == "TOKO_BACKUP_KEEP")
    parser = argparse.ArgumentParser(
        prog="toko-backup",
        description=(
            "Write a verified, consistent backup of the toko database while toko-api runs, "
            f"keeping the newest TOKO_BACKUP_KEEP (default {keep}) in TOKO_BACKUP_DIR "
            "(default: backups/ beside the database). toko-backup.timer starts it every "
            "night, and after a boot when the host was off at that time (systemctl "
            "list-timers). --list and --restore are for an admin, run with the service's user "
            "and settings (systemd-run: see /usr/share/doc/toko/docs/how-to/run-commands.md)."
        ),
    )
    add_version(parser)
    action = parser.add_mutually_exclusive_group()
    action.add_argument(
        "--restore",
        metavar="FILE",
        help="replace the database with FILE (toko-api must be stopped)",
    )
    action.add_argument("--list", action="store_true", help="list the backups, oldest first")
    return parser


def main() -> int:
    body = reported("toko-backup", REPORT_FIGURES, _main, when=_is_backup)
    return run_job("toko-backup", build_parser(), body)
