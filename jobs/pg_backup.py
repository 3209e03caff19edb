"""``toko-backup`` on PostgreSQL: pg_dump custom-format backups, and restore.

The same promises as the SQLite path (:mod:`jobs.sqlite_backup`): a consistent copy
taken while toko-api keeps writing (pg_dump reads one snapshot), verified
before it is published (``pg_restore`` must read the whole archive, and its
``--list`` find the toko tables), published atomically with mode 0600, and
only the newest TOKO_BACKUP_KEEP kept. The timer may run on every host; each host
keeps its own copies in its own TOKO_BACKUP_DIR.

Restore refuses while any toko-api is connected to the database (every
instance connects with ``application_name=toko-api``), dumps the current
contents beside the backups first, and holds the migration lock meanwhile so
a toko-api starting mid-restore waits instead of seeing half a schema.
"""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import asyncpg  # type: ignore[import-untyped]  # no stubs shipped

from jobs.backup_files import PREFIX, STOP_API, backup_name, publish_backup, refuse_newer
from jobs.common import JobFailed
from service.redaction import redact, without_password
from service.settings import ToolSettings
from service.store.disk import fsync_dir, fsync_file
from service.store.postgres.migrations import LATEST_VERSION, MIGRATION_LOCK

log = logging.getLogger("toko.backup")
SUFFIX = ".dump"
# Tables whose data a toko backup must hold.
REQUIRED_TABLES = ("products", "jobs", "recaps", "toko_schema")
TOOL_TIMEOUT = 3600.0


def pg_tool(name: str) -> str:
    """The newest installed ``name`` (pg_dump must not be older than the server)."""
    versions = sorted(
        glob.glob(f"/usr/lib/postgresql/*/bin/{name}"),
        key=lambda p: [int(x) for x in Path(p).parent.parent.name.split(".") if x.isdigit()],
    )
    found = versions[-1] if versions else shutil.which(name)
    if not found:
        raise JobFailed(f"{name} not found; install the Debian package postgresql-client")
    return found


def _tool_env(settings: ToolSettings) -> dict[str, str]:
    # The password goes to the tools through their environment, never argv (ps shows argv).
    env = dict(os.environ)
    env["PGAPPNAME"] = "toko-backup"
    password = without_password(settings.store.database)[1] or settings.store.database_password
    if password is not None:
        env["PGPASSWORD"] = password
    return env


def _dbname(settings: ToolSettings) -> str:
    """``--dbname=`` for the tools: the URL without a password in it.

    A password written into TOKO_DATABASE (user:password@, or ?password=)
    went on pg_dump's and pg_restore's command line, which every local user
    reads in ps and /proc/PID/cmdline; it reaches them in PGPASSWORD instead
    (and wins there, as it did in the URL).
    """
    return without_password(settings.store.database)[0]


def _one_line(output: str) -> str:
    """A tool's message on one line: the failure is one journal entry and one stderr line.

    pg_dump spreads one error over several (libpq's "server closed the
    connection unexpectedly", then "pg_dump: detail: ..." lines).
    """
    return "; ".join(line.strip() for line in output.splitlines() if line.strip())


def _run(
    settings: ToolSettings, *args: str, stdout: IO[bytes] | None = None
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        args,
        env=_tool_env(settings),
        stdin=subprocess.DEVNULL,
        stdout=stdout or subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        timeout=TOOL_TIMEOUT,
        check=False,
    )
    if result.returncode != 0:
        tool = Path(args[0]).name
        detail = _one_line(result.stderr or result.stdout).replace(settings.store.database, "…")
        raise JobFailed(f"{tool} failed ({result.returncode}): {detail[-2000:]}")
    return result


def check_archive(settings: ToolSettings, path: Path) -> None:
    """Raise JobFailed unless ``path`` is a complete custom-format toko dump."""
    tool = pg_tool("pg_restore")
    try:
        listing = _run(settings, tool, "--list", str(path)).stdout
        # --list reads the table of contents only, at the start of the file: a
        # dump missing its end passes it (one of 60 kB cut at 30% did). Reading
        # every data block as a restore does (into nothing) finds it out.
        _run(settings, tool, f"--file={os.devnull}", str(path))
    except JobFailed as exc:
        raise JobFailed(f"{path} is not a usable pg_dump archive: {exc}") from exc
    data = {
        line.split()[-2]
        for line in listing.splitlines()
        if " TABLE DATA " in line and not line.startswith(";")
    }
    missing = [table for table in REQUIRED_TABLES if table not in data]
    if missing:
        raise JobFailed(f"{path} holds no data for the toko tables {', '.join(missing)}")


def archived_schema_version(settings: ToolSettings, path: Path) -> int | None:
    """The version in the archive's toko_schema row, read without a database."""
    script = _run(
        settings, pg_tool("pg_restore"), "--data-only", "--table=toko_schema", "--file=-", str(path)
    ).stdout
    lines = iter(script.splitlines())
    for line in lines:
        # toko-backup's archives hold COPY data; `pg_dump --inserts` or
        # `--column-inserts` by hand, an INSERT (columns as the table has them).
        copy = re.fullmatch(r"COPY \S*toko_schema \((.*)\) FROM stdin;", line)
        insert = re.fullmatch(r"INSERT INTO \S*toko_schema (?:\((.*)\) )?VALUES \((.*)\);", line)
        if copy:
            columns, row = copy[1], next(lines, "\\.")
            if row == "\\.":
                return None
            values = row.split("\t")
        elif insert:
            columns, values = insert[1] or "one, version", insert[2].split(",")
        else:
            continue
        names = [name.strip() for name in columns.split(",")]
        return int(values[names.index("version")]) if "version" in names else None
    return None


def check_schema_version(settings: ToolSettings, path: Path) -> None:
    """Refuse an archive whose schema this toko-api could not start on."""
    version = archived_schema_version(settings, path)
    if version is None:
        raise JobFailed(f"{path} is not a toko backup (no schema version in it)")
    refuse_newer(path, version, LATEST_VERSION)


def _dump(settings: ToolSettings, target: Path) -> None:
    """pg_dump the database into a new file ``target`` (created 0600 first)."""
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    # 0600 before pg_dump writes a byte. It writes to our descriptor, not by
    # name (--file): a pg_dump outliving a stopped run (one signalled while
    # it was being started) cannot create the file again once it is removed.
    with open(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as out:
        _run(
            settings,
            pg_tool("pg_dump"),
            "--format=custom",
            "--no-password",
            f"--dbname={_dbname(settings)}",
            stdout=out,
        )


def make_backup(
    settings: ToolSettings, folder: Path, keep: int, clock: Callable[[], float] = time.time
) -> Path:
    def write(tmp: Path) -> None:
        _dump(settings, tmp)
        check_archive(settings, tmp)

    return publish_backup(folder, keep, SUFFIX, write, clock)


async def _connected_apis(conn: asyncpg.Connection) -> list[str]:
    rows = await conn.fetch(
        "SELECT coalesce(host(client_addr), 'local') AS client, count(*) AS n"
        "  FROM pg_stat_activity"
        " WHERE datname = current_database() AND application_name = 'toko-api'"
        "   AND pid <> pg_backend_pid()"
        " GROUP BY 1 ORDER BY 1"
    )
    return [f"{row['client']} ({row['n']} connections)" for row in rows]


def _safety_dump_path(folder: Path, now: float) -> Path:
    """Where the current contents go before a restore: a name no earlier restore took.

    Not named toko-*: pruning never removes it.
    """
    while True:
        kept = folder / f"before-restore-{backup_name(now, SUFFIX)[len(PREFIX) :]}"
        if not kept.exists():  # _dump() refuses one that does (O_EXCL)
            return kept
        now += 1  # a second restore within the same second


def _keep_current_contents(settings: ToolSettings, kept: Path) -> None:
    """Dump the database to ``kept``, on disk, name included, before it is replaced.

    A dump that fails (the server gone; pg_dump stopped by the SIGTERM that
    systemd sends the whole unit) is deleted: left, it looked like the kept
    contents.
    """
    try:
        _dump(settings, kept)
        fsync_file(kept)
        fsync_dir(kept.parent)
    except BaseException:
        kept.unlink(missing_ok=True)
        raise


async def _restore(
    settings: ToolSettings, source: Path, folder: Path, clock: Callable[[], float]
) -> Path | None:
    try:
        conn = await asyncpg.connect(
            settings.store.database,
            password=settings.store.database_password,
            server_settings={"application_name": "toko-backup"},
        )
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise JobFailed(f"cannot connect to {redact(settings.store.database)}: {exc}") from exc
    try:
        # The lock below lasts as long as this session, idle while pg_dump and
        # pg_restore run: an idle_session_timeout set for the role or database
        # (PostgreSQL 14+) closed it mid-restore, and let toko-api in.
        await conn.execute(
            "SELECT set_config('idle_session_timeout', '0', false)"
            " WHERE current_setting('idle_session_timeout', true) IS NOT NULL"
        )
        # Held for the whole restore: a toko-api starting now waits in its migration.
        await conn.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK)
        apis = await _connected_apis(conn)
        if apis:
            raise JobFailed(
                "toko-api is connected to this database from "
                + ", ".join(apis)
                + f"; stop it on every host first ({STOP_API}), then restore"
            )
        kept: Path | None = None
        if await conn.fetchval("SELECT to_regclass('products') IS NOT NULL"):
            kept = _safety_dump_path(folder, clock())
            await asyncio.to_thread(_keep_current_contents, settings, kept)
        await asyncio.to_thread(
            _run,
            settings,
            pg_tool("pg_restore"),
            "--clean",
            "--if-exists",
            "--no-owner",
            "--no-privileges",
            "--single-transaction",
            "--exit-on-error",
            "--no-password",
            f"--dbname={_dbname(settings)}",
            str(source),
        )
        return kept
    finally:
        await conn.close()


def restore(
    settings: ToolSettings, source: Path, folder: Path, clock: Callable[[], float] = time.time
) -> Path | None:
    """Replace the database's contents with ``source``; return the safety dump, if any."""
    if not source.is_file():
        raise JobFailed(f"no backup file at {source}")
    check_archive(settings, source)
    # Not in check_archive: during an upgrade the hosts still on this toko
    # back up a database a newer one has migrated, and rightly so.
    check_schema_version(settings, source)
    kept = asyncio.run(_restore(settings, source, folder, clock))
    kept_as = {} if kept is None else {"PREVIOUS": str(kept)}  # nothing there before: no field
    log.info("backup restored", extra={"PATH": str(source), **kept_as})
    return kept
