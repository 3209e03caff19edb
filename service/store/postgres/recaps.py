"""The PostgreSQL store's recaps: one row a period, however many hosts race for it."""

from __future__ import annotations

import json

import asyncpg  # type: ignore[import-untyped]  # no stubs shipped

from service.models import NewJob
from service.store.postgres.checks import SERVER_TIME_SQL
from service.store.postgres.migrations import RECAP_LOCK_CLASS
from service.store.postgres.transport import PostgresTransport


class PostgresRecaps(PostgresTransport):
    async def product_counts(self, start: float, end: float) -> tuple[int, int]:
        """(products created before ``end``, products created in [start, end))."""
        row = await self._fetchrow(
            "SELECT count(*) FILTER (WHERE created_at < $2),"
            "       count(*) FILTER (WHERE created_at >= $1 AND created_at < $2)"
            "  FROM products",
            start,
            end,
            retry=True,
        )
        assert row is not None
        return int(row[0]), int(row[1])

    # recaps ------------------------------------------------------------------------
    async def record_recap(
        self, period: str, products_total: int, products_new: int, job: NewJob
    ) -> int | None:
        """Record a period's recap and enqueue its email, once: None if already recorded."""
        now = self._clock()

        async def run(conn: asyncpg.Connection) -> int | None:
            async with conn.transaction():
                # Racing runs (timers on every host) queue here; the winner's
                # row is visible to the rest once they get the lock.
                await conn.execute(
                    "SELECT pg_advisory_xact_lock($1, hashtext($2))", RECAP_LOCK_CLASS, period
                )
                if await conn.fetchval("SELECT 1 FROM recaps WHERE period = $1", period):
                    return None
                job_id: int = await conn.fetchval(
                    "INSERT INTO jobs (kind, payload, max_attempts, run_at, created_at,"
                    " updated_at) VALUES ($1, $2::jsonb, $3, $4, $4, $4) RETURNING id",
                    job.kind,
                    json.dumps(job.payload),
                    job.max_attempts,
                    now,
                )
                await conn.execute(
                    "INSERT INTO recaps (period, products_total, products_new, job_id,"
                    " created_at) VALUES ($1, $2, $3, $4, $5)",
                    period,
                    products_total,
                    products_new,
                    job_id,
                    now,
                )
                return job_id

        return await self._db(run, write=True)

    async def database_time(self) -> float | None:
        """The database server's clock: a recap's day is over when it says so there."""
        row = await self._fetchrow(SERVER_TIME_SQL, retry=True)
        assert row is not None
        return float(row[0])

    async def last_recap_before(self, period: str) -> str | None:
        """The latest recorded period earlier than ``period`` (ISO dates sort as text)."""
        row = await self._fetchrow(
            "SELECT max(period) FROM recaps WHERE period < $1", period, retry=True
        )
        assert row is not None
        return None if row[0] is None else str(row[0])
