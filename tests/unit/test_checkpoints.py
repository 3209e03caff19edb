"""The write-ahead log's checkpoints (service.store.sqlite.checkpoints), on a real SQLite file."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path

from service.store.sqlite import SqliteStore
from service.store.sqlite.checkpoints import FINISH_AT_PAGES, LIMIT_BYTES, Checkpointer
from service.store.sqlite.transport import connect

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


def log_pages(conn: sqlite3.Connection) -> int:
    """Frames in the log; a PASSIVE checkpoint with nothing to copy changes nothing."""
    return int(conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()[1])


def test_a_round_after_the_writers_finish_and_before_its_next_commit_leaves_it_nothing(
    tmp_path: Path,
) -> None:
    # A round runs when a commit woke it and its pacing ended, so it can land
    # between the writer's finish and the next commit. The log is copied then,
    # and the next commit starts it over: another finish would be one more
    # sync of the database file on the commit path, for nothing.
    path = str(tmp_path / "toko.db")
    writer = connect(path)
    writer.execute("PRAGMA wal_autocheckpoint = 0")
    writer.execute("CREATE TABLE ballast (b BLOB)")
    thread_side = connect(path)
    checkpointer = Checkpointer(lambda: thread_side)

    def commit_pages(pages: int) -> None:
        insert_blobs(writer, [BLOB] * (pages // 16 + 1))
        writer.commit()
        checkpointer.committed()

    try:
        commit_pages(FINISH_AT_PAGES)
        checkpointer._round(thread_side)
        checkpointer.between_batches(writer)
        assert checkpointer.finishes == 1

        checkpointer._round(thread_side)  # no commit since the finish
        checkpointer.between_batches(writer)
        assert checkpointer.finishes == 1
        assert log_pages(thread_side) > FINISH_AT_PAGES  # not started over yet

        # The next commit starts the log over; once it is long again, the
        # writer finishes a round as before.
        commit_pages(16)
        assert log_pages(thread_side) < FINISH_AT_PAGES
        commit_pages(FINISH_AT_PAGES)
        checkpointer._round(thread_side)
        checkpointer.between_batches(writer)
        assert checkpointer.finishes == 2
    finally:
        writer.close()
        thread_side.close()
