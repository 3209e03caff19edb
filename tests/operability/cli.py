"""Run toko's console scripts as real processes from async tests."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from service.store.sqlite import SqliteStore
from tests.support.service import clean_environment

BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Completed:
    args: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)

    def log_records(self) -> list[dict[str, Any]]:
        """The JSON log lines on stdout (timer jobs log there outside systemd)."""
        records = []
        for line in self.stdout.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                records.append(record)
        return records


def environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """A clean environment plus ``env``, as the commands get it."""
    return clean_environment(**(env or {}))


async def run(
    command: str,
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = 30.0,  # noqa: ASYNC109
) -> Completed:
    """``command args...`` with a clean environment plus ``env``; waits for the exit."""
    proc = await asyncio.create_subprocess_exec(
        str(BIN / command),
        *args,
        env=environment(env),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(timeout):
        out, err = await proc.communicate()
    assert proc.returncode is not None
    return Completed((command, *args), proc.returncode, out.decode(), err.decode())


def partials(folder: Path) -> list[str]:
    """toko-backup's partial copies in ``folder`` (hidden while they are written)."""
    return sorted(path.name for path in folder.glob(".toko-*.partial*"))


def freeze_mid_copy(proc: subprocess.Popen[str], folder: Path) -> list[str]:
    """SIGSTOP ``proc`` while its partial copy exists; the names of its partial files."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None:
        if partials(folder):
            proc.send_signal(signal.SIGSTOP)
            # Frozen now: a partial copy still there means the run is before its rename.
            if found := partials(folder):
                return found
            proc.send_signal(signal.SIGCONT)
            pytest.fail("the copy was published before the run could be frozen")
        time.sleep(0.002)
    pytest.fail(f"no partial copy appeared (exit code {proc.poll()})")


def mount_tmpfs(where: Path, options: str) -> Iterator[Path]:
    """A real tmpfs at the new folder ``where`` (a small or read-only disk), for a fixture."""
    if os.geteuid() != 0:
        pytest.fail("mounting a tmpfs needs root (deselect with -m 'not root')", pytrace=False)
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "toko-test", where], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "--lazy", where], check=False)


async def padded_toko_database(path: Path, pages: int) -> Path:
    """A toko database at ``path`` with ``pages`` extra 4 KB blobs in a table of
    its own: as large as a test of copying it needs, checkpointed into one file."""
    store = SqliteStore(str(path))
    await store.open()
    await store.close()
    with closing(sqlite3.connect(path)) as conn:
        conn.execute("CREATE TABLE pad (b BLOB)")
        conn.execute(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?)"
            " INSERT INTO pad SELECT zeroblob(4000) FROM n",
            (pages,),
        )
        conn.commit()
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return path


async def utc_today() -> date:
    """Today (UTC, the zone the runs get), far enough from midnight for a test's runs."""
    now = datetime.now(UTC)
    to_midnight = datetime.combine(now.date() + timedelta(days=1), datetime.min.time(), UTC) - now
    if to_midnight < timedelta(seconds=20):
        await asyncio.sleep(to_midnight.total_seconds() + 0.5)
    return datetime.now(UTC).date()
