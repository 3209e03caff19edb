"""The PostgreSQL store's queue administration (``toko-queue``, retention)."""

from __future__ import annotations

from collections.abc import Sequence

from service.models import JOB_STATES, JobState, QueueCounts
from service.store.admin import (
    RETRYABLE_WHERE,
    STATE_WHERE,
    JobDetails,
    QueueStats,
    Retryable,
    details_from_row,
)
from service.store.postgres.migrations import JOBS_CHANNEL
from service.store.postgres.queue import DETAIL_COLUMNS
from service.store.postgres.transport import PostgresTransport

# Jobs one `toko-queue retry` changes per statement (see retry_now).
RETRY_CHUNK = 1000


def list_jobs_sql(state: JobState) -> str:
    """The query of ``list_jobs`` (parameter: the limit): done and failed jobs
    come in order from their own indexes (migrations 2 and 5), not the table."""
    return (
        f"SELECT {DETAIL_COLUMNS} FROM jobs WHERE {STATE_WHERE[state]} "
        "ORDER BY updated_at DESC, id DESC LIMIT $1"
    )


# One chunk of purge_done (parameters: older_than, chunk), through jobs_done_updated_at.
PURGE_DONE_SQL = """
    WITH doomed AS (
        SELECT id FROM jobs WHERE state = 'done' AND updated_at < $1
         LIMIT $2 FOR UPDATE SKIP LOCKED
    ), unlinked AS (
        UPDATE recaps SET job_id = NULL WHERE job_id IN (SELECT id FROM doomed)
    ), deleted AS (
        DELETE FROM jobs WHERE id IN (SELECT id FROM doomed) RETURNING 1
    )
    SELECT count(*) FROM deleted
"""


class PostgresAdmin(PostgresTransport):
    # queue administration (QueueAdmin: toko-queue, retention) -----------------------
    async def queue_stats(self) -> QueueStats:
        figures = dict.fromkeys(JOB_STATES, 0)
        by_kind: dict[str, dict[str, int]] = {}
        rows = await self._fetch(
            "SELECT kind, state, count(*) FROM jobs GROUP BY kind, state ORDER BY kind", retry=True
        )
        for kind, state, count in rows:
            figures[state] += int(count)
            by_kind.setdefault(kind, dict.fromkeys(JOB_STATES, 0))[state] = int(count)
        oldest = await self._fetchrow(
            "SELECT min(run_at) FROM jobs WHERE state = 'pending'", retry=True
        )
        oldest_run_at = oldest[0] if oldest else None
        return QueueStats(
            QueueCounts.of(figures, oldest_run_at, self._clock()), by_kind, oldest_run_at
        )

    async def list_jobs(self, state: JobState, limit: int) -> list[JobDetails]:
        rows = await self._fetch(list_jobs_sql(state), limit, retry=True)
        return [details_from_row(row) for row in rows]

    async def job_details(self, job_id: int) -> JobDetails | None:
        row = await self._fetchrow(
            f"SELECT {DETAIL_COLUMNS} FROM jobs WHERE id = $1", job_id, retry=True
        )
        return details_from_row(row) if row else None

    async def retry_now(
        self, job_ids: Sequence[int] | None, which: Retryable, chunk: int = RETRY_CHUNK
    ) -> list[int]:
        where = RETRYABLE_WHERE[which]
        if job_ids is None:
            rows = await self._fetch(f"SELECT id FROM jobs WHERE {where} ORDER BY id", retry=True)
            job_ids = [int(row[0]) for row in rows]
        # Chunks, each its own statement: one update of a whole backlog
        # (300,000 failed jobs) outlasted a statement_timeout of 500 ms set for
        # the role or database, and `retry --all-failed` could never succeed.
        ids = list(job_ids)
        retried: list[int] = []
        for start in range(0, len(ids), chunk):
            retried += await self._retry_chunk(ids[start : start + chunk], where)
        return sorted(retried)

    async def _retry_chunk(self, job_ids: list[int], where: str) -> list[int]:
        # attempts = 0: an admin's retry gets the full attempt budget again;
        # last_error stays as the history of why it had failed. ``where`` is
        # checked again, so a job that changed since it was listed is left
        # alone. The jobs are due now, so every instance hears of them
        # (NOTIFY, same transaction).
        rows = await self._fetch(
            f"""
            WITH retried AS (
                UPDATE jobs SET state = 'pending', attempts = 0, run_at = $2,
                       lease_until = NULL, updated_at = $2
                 WHERE {where} AND id = ANY($1::bigint[])
                RETURNING id
            ), told AS (
                SELECT pg_notify('{JOBS_CHANNEL}', '') WHERE EXISTS (SELECT 1 FROM retried)
            )
            SELECT id FROM retried, (SELECT count(*) FROM told) AS t
            """,
            job_ids,
            self._clock(),
            write=True,
        )
        return [int(row[0]) for row in rows]

    async def purge_done(self, older_than: float, chunk: int = 1000) -> int:
        # Chunks, each its own transaction: no long lock on a big table while
        # every instance keeps acking. A recap keeps its row (that is what makes
        # a period run once) but lets go of its pruned email job.
        total = 0
        while True:
            row = await self._fetchrow(PURGE_DONE_SQL, older_than, chunk, write=True)
            deleted = int(row[0]) if row else 0
            total += deleted
            if deleted < chunk:
                return total
