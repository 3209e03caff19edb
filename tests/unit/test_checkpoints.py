"""The write-ahead log's checkpoints (service.store.sqlite.checkpoints), on a real SQLite file."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path

from service.store.sqlite import SqliteStore
from service.store.sqlite.checkpoints import LIMIT_BYTES

BLOB = os.urandom(64 * 1024)  # 16 pages of log a row


def insert_blobs(conn: sqlite3.Connection, blobs: list[bytes]) -> Sequence[None]:
    conn.executemany("INSERT INTO ballast (b) VALUES (?)", [(b,) for b in blobs])
    return [None] * len(blobs)


def wal_size(path: str) -> int:
    return os.stat(f"{path}-wal").st_size


async def write_blobs(store: SqliteStore, count: int) -> None:
    await asyncio.gather(*(store._write(insert_blobs, BLOB) for _ in range(count)))


async def test_a_long_read_holds_the_log_and_once_it_ends_the_log_starts_over_cut_back(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "toko.db")
    store = SqliteStore(path)
    await store.open()
    try:
        setup = sqlite3.connect(path)
        setup.execute("CREATE TABLE ballast (b BLOB)")
        setup.close()
        # A read that lasts (a backup, a sqlite3 shell): no checkpoint can copy
        # the pages committed after it began, so the log must grow meanwhile.
        reader = sqlite3.connect(path, isolation_level=None)
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM ballast").fetchall()
        rows = 0
        while wal_size(path) <= LIMIT_BYTES:
            await write_blobs(store, 64)
            rows += 64
        reader.execute("COMMIT")
        reader.close()

        # Now the thread's rounds copy it all, the writer finishes one, and the
        # next commit starts the log over: the file is cut back to the limit.
        deadline = time.monotonic() + 20
        while wal_size(path) > LIMIT_BYTES and time.monotonic() < deadline:
            await write_blobs(store, 8)
            rows += 8
        assert wal_size(path) <= LIMIT_BYTES
        checkpointer = store._checkpointer
        assert checkpointer.rounds > 0 and checkpointer.finishes > 0
    finally:
        await store.close()
    check = sqlite3.connect(path)
    try:
        assert check.execute("SELECT count(*) FROM ballast").fetchone() == (rows,)
        assert check.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    finally:
        check.close()
