"""The SQLite store's recaps: the figures of a period, recorded once with their email."""

from __future__ import annotations

import sqlite3

from service.models import NewJob
from service.store.sqlite.queue import insert_jobs
from service.store.sqlite.transport import SqliteTransport


class SqliteRecaps(SqliteTransport):
    async def database_time(self) -> float | None:
        # One toko-api per file, stamping products with this host's clock.
        return None

    async def product_counts(self, start: float, end: float) -> tuple[int, int]:
        """(products created before ``end``, products created in [start, end))."""

        def read(conn: sqlite3.Connection) -> tuple[int, int]:
            (total,) = conn.execute(
                "SELECT count(*) FROM products WHERE created_at < ?", (end,)
            ).fetchone()
            (new,) = conn.execute(
                "SELECT count(*) FROM products WHERE created_at >= ? AND created_at < ?",
                (start, end),
            ).fetchone()
            return int(total), int(new)

        return await self._read(read)

    # recaps ------------------------------------------------------------------------
    async def record_recap(
        self, period: str, products_total: int, products_new: int, job: NewJob
    ) -> int | None:
        """Record a period's recap and enqueue its email, once: None if already recorded."""
        return await self._write(
            _record_recap, (period, products_total, products_new, job, self._clock())
        )

    async def last_recap_before(self, period: str) -> str | None:
        """The latest recorded period earlier than ``period`` (ISO dates sort as text)."""

        def read(conn: sqlite3.Connection) -> str | None:
            (last,) = conn.execute(
                "SELECT max(period) FROM recaps WHERE period < ?", (period,)
            ).fetchone()
            return str(last) if last is not None else None

        return await self._read(read)


RecapArg = tuple[str, int, int, NewJob, float]


def _record_recap(conn: sqlite3.Connection, items: list[RecapArg]) -> list[int | None]:
    results: list[int | None] = []
    for period, total, new, job, now in items:
        if conn.execute("SELECT 1 FROM recaps WHERE period = ?", (period,)).fetchone():
            results.append(None)
            continue
        (job_id,) = insert_jobs(conn, [(job, now)])
        conn.execute(
            "INSERT INTO recaps (period, products_total, products_new, job_id, created_at) "
            "VALUES (?, ?, ?, ?, ?)",
            (period, total, new, job_id, now),
        )
        results.append(job_id)
    return results
