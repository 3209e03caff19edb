"""Read-only looks into the service's SQLite file (the contract's tables)."""

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
