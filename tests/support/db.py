"""Looks into the service's SQLite file (the contract's tables), read-only; and bit rot."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any


def query(database: Path | str, sql: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
    """Rows of ``sql`` as dicts; a short-lived connection that never writes."""
    with closing(sqlite3.connect(database, timeout=10)) as conn:
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA query_only = ON")
        return [dict(row) for row in conn.execute(sql, params)]


def product_count(database: Path | str) -> int:
    return int(query(database, "SELECT count(*) AS n FROM products")[0]["n"])


def jobs(database: Path | str) -> list[dict[str, Any]]:
    return query(database, "SELECT * FROM jobs ORDER BY id")


def job_states(database: Path | str) -> dict[str, int]:
    rows = query(database, "SELECT state, count(*) AS n FROM jobs GROUP BY state")
    return {row["state"]: int(row["n"]) for row in rows}


def damage_products_table(path: Path | str) -> None:
    """Bit rot in the products table's first page, as a failing disk leaves it
    (the file is written here, so this one does not only look)."""
    with closing(sqlite3.connect(path)) as conn:
        sql = "SELECT rootpage FROM sqlite_master WHERE name = 'products'"
        (page,) = conn.execute(sql).fetchone()
        (size,) = conn.execute("PRAGMA page_size").fetchone()
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    with open(path, "r+b") as f:
        f.seek((page - 1) * size)  # its header and cell pointers
        f.write(b"\xff" * 48)
