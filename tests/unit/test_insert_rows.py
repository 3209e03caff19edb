"""service.store.sqlite.queue.insert_rows: the ids it derives from lastrowid are
the rows' own, on a real SQLite file, also where rows were deleted before."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from service.store.sqlite.queue import insert_rows


def stored(conn: sqlite3.Connection) -> dict[int, str]:
    return dict(conn.execute("SELECT id, name FROM t ORDER BY id").fetchall())


def test_each_id_is_its_rows_in_order_across_gaps_and_deleted_top_rows(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "t.db", isolation_level=None)
    conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, name TEXT NOT NULL)")
    expected: dict[int, str] = {}
    for round_, size in enumerate([1, 7, 3, 64, 2]):
        names = [f"r{round_}-{i}" for i in range(size)]
        ids = insert_rows(conn, "t", ("name",), [(n,) for n in names])
        expected.update(zip(ids, names, strict=True))
        assert stored(conn) == expected
        # Gaps in the middle, and the top row gone: the next ids reuse it.
        top = max(expected)
        conn.execute("DELETE FROM t WHERE id IN (?, ?)", (min(expected), top))
        del expected[min(expected)]
        expected.pop(top, None)
    assert stored(conn) == expected
