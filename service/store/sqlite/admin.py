"""The SQLite store's queue administration (``toko-queue``, retention)."""

from __future__ import annotations

import asyncio
import sqlite3
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
from service.store.sqlite.queue import DETAIL_COLUMNS, ids_in_chunks
from service.store.sqlite.transport import SqliteTransport

# Jobs one `toko-queue retry` changes per commit: SQLite has one write lock,
# and toko-api's writes wait for it while a chunk commits.
RETRY_CHUNK = 1000


# Between two chunks of a long admin write (a retry, a purge), how long this
# process leaves the write lock alone. SQLite keeps no queue for it: a
# toko-api write waiting in its busy handler tries again 1, 2, 5, 10, 15 and
# 20 ms apart, and chunks back to back kept POSTs waiting up to 1.5 s.
CHUNK_PAUSE_SECONDS = 0.02


async def _let_others_write() -> None:
    await asyncio.sleep(CHUNK_PAUSE_SECONDS)


class SqliteAdmin(SqliteTransport):
    # queue administration (QueueAdmin) ---------------------------------------------
    async def queue_stats(self) -> QueueStats:
        def read(conn: sqlite3.Connection) -> QueueStats:
            figures = dict.fromkeys(JOB_STATES, 0)
            by_kind: dict[str, dict[str, int]] = {}
            for kind, state, count in conn.execute(
                "SELECT kind, state, count(*) FROM jobs GROUP BY kind, state ORDER BY kind"
            ).fetchall():
                figures[state] += count
                by_kind.setdefault(kind, dict.fromkeys(JOB_STATES, 0))[state] = count
            (oldest,) = conn.execute(
                "SELECT min(run_at) FROM jobs WHERE state = 'pending'"
            ).fetchone()
            return QueueStats(QueueCounts.of(figures, oldest, self._clock()), by_kind, oldest)

        return await self._read(read)

    async def list_jobs(self, state: JobState, limit: int) -> list[JobDetails]:
        def read(conn: sqlite3.Connection) -> list[JobDetails]:
            rows = conn.execute(list_jobs_sql(state), (limit,)).fetchall()
            return [details_from_row(row) for row in rows]

        return await self._read(read)

    async def job_details(self, job_id: int) -> JobDetails | None:
        def read(conn: sqlite3.Connection) -> JobDetails | None:
            row = conn.execute(
                f"SELECT {DETAIL_COLUMNS} FROM jobs WHERE id = ?", (job_id,)
            ).fetchone()
            return details_from_row(row) if row else None

        return await self._read(read)

    async def retry_now(
        self, job_ids: Sequence[int] | None, which: Retryable, chunk: int = RETRY_CHUNK
    ) -> list[int]:
        where = RETRYABLE_WHERE[which]
        if job_ids is None:
            # The ids first, from a reader (WAL: no lock on the writers), so
            # that each job is looked at once however the queue moves meanwhile.
            job_ids = await self._read(lambda conn: _retryable_ids(conn, where))
        # Chunks, each its own commit: toko-queue runs while toko-api writes,
        # and one update of a whole backlog held SQLite's write lock for
        # seconds (3.7 s for 667,000 waiting jobs), stalling every POST.
        retried: list[int] = []
        ids = list(job_ids)
        for start in range(0, len(ids), chunk):
            part = ids[start : start + chunk]
            if start:
                await _let_others_write()
            retried += await self._write(_retry_now, (part, where, self._clock()))
        return sorted(retried)

    async def purge_done(self, older_than: float, chunk: int = 1000) -> int:
        # Chunks, each its own commit: toko-recap purges while toko-api writes,
        # and one huge delete would hold SQLite's write lock past their busy timeout.
        total = 0
        while True:
            deleted = await self._write(_purge_done, (older_than, chunk))
            total += deleted
            if deleted < chunk:
                return total
            await _let_others_write()


def list_jobs_sql(state: JobState) -> str:
    """The query of ``list_jobs`` (parameter: the limit): done and failed jobs
    come in order from their own index (migration 4), not sorted from all."""
    return (
        f"SELECT {DETAIL_COLUMNS} FROM jobs WHERE {STATE_WHERE[state]} "
        "ORDER BY updated_at DESC, id DESC LIMIT ?"
    )


def _retryable_ids(conn: sqlite3.Connection, where: str) -> list[int]:
    # ``where`` is one of RETRYABLE_WHERE's constants, never input.
    return [row[0] for row in conn.execute(f"SELECT id FROM jobs WHERE {where} ORDER BY id")]


RetryArg = tuple[list[int], str, float]


def _retry_now(conn: sqlite3.Connection, items: list[RetryArg]) -> list[list[int]]:
    # attempts = 0: an admin's retry gets the full attempt budget again;
    # last_error stays as the history of why it had failed. ``where`` is one
    # of RETRYABLE_WHERE's constants, never input; it is checked again here,
    # so a job that changed since it was listed is left alone.
    results = []
    for ids, where, now in items:
        rows = []
        for chunk in ids_in_chunks(ids):
            rows += conn.execute(retry_by_id_sql(where, len(chunk)), [now, now, *chunk]).fetchall()
        results.append(sorted(row[0] for row in rows))
    return results


def retry_by_id_sql(where: str, ids: int) -> str:
    """The update of ``_retry_now`` for ``ids`` ids (parameters: now, now, the ids)."""
    # NOT INDEXED: SQLite would otherwise walk the state index through every
    # job in that state for each chunk (all the backlog, every 500 jobs); the
    # ids find their rows by primary key, which NOT INDEXED still allows.
    return (
        "UPDATE jobs NOT INDEXED SET state = 'pending', attempts = 0, run_at = ?, "
        f"lease_until = NULL, updated_at = ? WHERE {where} "
        f"AND id IN ({', '.join('?' * ids)}) RETURNING id"
    )


# One chunk of done jobs to purge (parameters: older_than, chunk). The newest
# job stays, however old: SQLite numbers a new row one past the largest id, so
# the next job would get the purged one's id (two jobs under one JOB_ID in the
# journal). Through jobs_done_updated_at, the last chunk, which finds few or
# none, reads only the old ones rather than every done job.
PURGE_DONE_SQL = (
    "SELECT id FROM jobs WHERE state = 'done' AND updated_at < ?"
    " AND id < (SELECT max(id) FROM jobs) LIMIT ?"
)


def _purge_done(conn: sqlite3.Connection, items: list[tuple[float, int]]) -> list[int]:
    counts = []
    for older_than, chunk in items:
        ids = [row[0] for row in conn.execute(PURGE_DONE_SQL, (older_than, chunk))]
        for part in ids_in_chunks(ids):
            marks = ", ".join("?" * len(part))
            # A recap keeps its row (that is what makes a period run once) but
            # lets go of its pruned email job; the foreign key would refuse otherwise.
            conn.execute(f"UPDATE recaps SET job_id = NULL WHERE job_id IN ({marks})", part)
            conn.execute(f"DELETE FROM jobs WHERE id IN ({marks})", part)
        counts.append(len(ids))
    return counts
