"""The file guard when the write-ahead log and the database go at nearly once.

``rm toko.db*`` unlinks several files, one after another. The guard looks at
the database, then at its log. When it finds the log gone but the database
still there, it folds the log into the database; if the rm takes the
database a moment later, that fold went into a deleted file. These tests
put the second unlink exactly in that moment, on a real SQLite file.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from service.store.sqlite.file_guard import DatabaseFileGone, FileGuard


class UnlinksDuringCheckpoint(sqlite3.Connection):
    """A connection that, at its next checkpoint, first unlinks ``victim``."""

    victim: Path | None = None

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        if self.victim is not None and "wal_checkpoint" in sql:
            self.victim.unlink()
            self.victim = None
        return super().execute(sql, *args)


@pytest.fixture
def database(tmp_path: Path) -> Path:
    return tmp_path / "toko.db"


@pytest.fixture
def conn(database: Path) -> Iterator[UnlinksDuringCheckpoint]:
    connection = sqlite3.connect(database, factory=UnlinksDuringCheckpoint, isolation_level=None)
    with closing(connection):
        connection.execute("PRAGMA journal_mode = WAL")
        connection.execute("PRAGMA synchronous = FULL")
        connection.execute("CREATE TABLE products (nama TEXT)")
        yield connection


def insert(conn: sqlite3.Connection, guard: FileGuard, nama: str) -> None:
    """One commit, then the guard's look, as the writer thread does."""
    conn.execute("INSERT INTO products VALUES (?)", (nama,))
    guard.check(conn)


def guard_after_log_deleted(database: Path, conn: sqlite3.Connection) -> FileGuard:
    """A guard that has seen one commit, and then ``rm toko.db-wal``."""
    guard = FileGuard(str(database))
    guard.opened(conn)
    insert(conn, guard, "Kopi")
    Path(f"{database}-wal").unlink()
    return guard


def names(path: Path) -> list[str]:
    with closing(sqlite3.connect(path)) as other:
        return [row[0] for row in other.execute("SELECT nama FROM products ORDER BY rowid")]


def test_a_deleted_log_alone_is_folded_into_the_database(
    database: Path, conn: UnlinksDuringCheckpoint
) -> None:
    guard = guard_after_log_deleted(database, conn)

    with pytest.raises(DatabaseFileGone, match="write-ahead log"):
        insert(conn, guard, "Teh")
    assert guard.restart_heals
    assert names(database) == ["Kopi", "Teh"]
    assert not list(database.parent.glob("*.rescued-*"))


def test_the_database_deleted_right_after_its_log_is_saved_beside_it(
    database: Path, conn: UnlinksDuringCheckpoint
) -> None:
    guard = guard_after_log_deleted(database, conn)
    conn.victim = database  # the rm's next unlink lands while the log is folded in

    with pytest.raises(DatabaseFileGone, match="database file"):
        insert(conn, guard, "Teh")
    assert not guard.restart_heals, "a restart would open an empty database"
    [rescued] = database.parent.glob("toko.db.rescued-*")
    assert names(rescued) == ["Kopi", "Teh"]
