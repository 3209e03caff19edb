"""The SQLite store's job queue: enqueue, claim with a lease, and each outcome.

The batch functions here run on the group-commit writer: each takes every
argument queued for it since the last commit and returns one result per
argument, in order. Multi-row statements keep the statement count per
commit low.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Collection, Sequence
from typing import Any

from service.models import JOB_STATES, Job, NewJob, QueueCounts, job_from_row
from service.store.base import (
    ABANDONED_AGAIN_SQL,
    ABANDONED_ERROR,
    note_lost_claims,
    without_abandoned,
)
from service.store.sqlite.transport import SqliteTransport

JOB_COLUMNS = "id, kind, payload, state, attempts, max_attempts, run_at, last_error, created_at"

DETAIL_COLUMNS = f"{JOB_COLUMNS}, updated_at, lease_until"


class SqliteQueue(SqliteTransport):
    # queue -----------------------------------------------------------------------
    async def enqueue(self, job: NewJob) -> int:
        return await self._write(insert_jobs, (job, self._clock()))

    async def claim(
        self, limit: int, lease_seconds: float, held: Collection[int] = ()
    ) -> list[Job]:
        now = self._clock()
        jobs = await self._write(_claim, (limit, now, now + lease_seconds, json.dumps(list(held))))
        return without_abandoned(jobs)

    async def complete(self, jobs: Sequence[Job]) -> None:
        if jobs:
            claims = [_claim_of(job) for job in jobs]
            changed = await self._write(_complete, (claims, self._clock()))
            note_lost_claims(len(jobs), changed, "done")

    async def retry(
        self, job: Job, error: str, run_at: float, payload: dict[str, Any] | None = None
    ) -> None:
        arg: StateArg = (_claim_of(job), "pending", error, run_at, _json_or_none(payload))
        note_lost_claims(1, await self._write(_set_state, (arg, self._clock())), "pending")

    async def fail(self, job: Job, error: str, payload: dict[str, Any] | None = None) -> None:
        arg: StateArg = (_claim_of(job), "failed", error, None, _json_or_none(payload))
        note_lost_claims(1, await self._write(_set_state, (arg, self._clock())), "failed")

    async def release(self, jobs: Sequence[Job]) -> None:
        if jobs:
            claims = [_claim_of(job) for job in jobs]
            await self._write(_release, (claims, self._clock()))

    async def recover_abandoned(self) -> int:
        return len(without_abandoned(await self._write(_recover_abandoned, self._clock())))

    def add_wakeup_listener(self, callback: Callable[[], None]) -> None:
        # Other processes (toko-recap) are heard by the pool's one-second sweep.
        pass

    async def next_due_at(self, held: Collection[int] = ()) -> float | None:
        held_ids = json.dumps(list(held))

        def read(conn: sqlite3.Connection) -> float | None:
            (due,) = conn.execute("SELECT min(run_at) FROM jobs WHERE state = 'pending'").fetchone()
            (lease,) = conn.execute(
                "SELECT min(lease_until) FROM jobs WHERE state = 'running'"
                " AND id NOT IN (SELECT value FROM json_each(?))",
                (held_ids,),
            ).fetchone()
            times = [t for t in (due, lease) if t is not None]
            return min(times) if times else None

        return await self._read(read)

    async def counts(self) -> QueueCounts:
        def read(conn: sqlite3.Connection) -> QueueCounts:
            figures = dict.fromkeys(JOB_STATES, 0)
            oldest_pending = None
            # Done and failed as the triggers keep them (schema step 6), the
            # live queue counted; one statement, so one snapshot. min(run_at)
            # in the same pass: jobs_state_run_at covers both columns.
            for state, count, oldest in conn.execute(
                "SELECT state, n, NULL FROM job_counts UNION ALL"
                " SELECT state, count(*), min(run_at) FROM jobs"
                " WHERE state IN ('pending', 'running') GROUP BY state"
            ).fetchall():
                figures[state] = count
                if state == "pending":
                    oldest_pending = oldest
            return QueueCounts.of(figures, oldest_pending, self._clock())

        return await self._read(read)

    async def get_job(self, job_id: int) -> Job | None:
        def read(conn: sqlite3.Connection) -> Job | None:
            row = conn.execute(f"SELECT {JOB_COLUMNS} FROM jobs WHERE id = ?", (job_id,)).fetchone()
            return job_from_row(row) if row else None

        return await self._read(read)


def _values(rows: int, columns: int) -> str:
    row = "(" + ", ".join("?" * columns) + ")"
    return ", ".join([row] * rows)


def insert_rows(
    conn: sqlite3.Connection, table: str, columns: Sequence[str], rows: list[tuple[Any, ...]]
) -> list[int]:
    """Insert ``rows`` in one statement; return their ids, in order.

    Without RETURNING: it hands back one row per step, and each step gives
    up the GIL and must win it back from the busy event loop (under bench
    (g)'s load the writer's statements took a fifth less time without it).
    Each new rowid is the table's largest plus one, so one statement's rows
    get consecutive ids ending at ``lastrowid`` (toko never writes an id
    itself, so they stay far below 2**63 - 1, past which SQLite would pick
    them at random).
    """
    flat = [value for row in rows for value in row]
    last = conn.execute(
        f"INSERT INTO {table} ({', '.join(columns)}) VALUES {_values(len(rows), len(columns))}",
        flat,
    ).lastrowid
    assert last is not None
    return list(range(last - len(rows) + 1, last + 1))


def insert_jobs(conn: sqlite3.Connection, items: list[tuple[NewJob, float]]) -> list[int]:
    return insert_rows(
        conn,
        "jobs",
        _JOB_INSERT_COLUMNS,
        [_job_insert_row(job, now) for job, now in items],
    )


_JOB_INSERT_COLUMNS = (
    "kind",
    "payload",
    "max_attempts",
    "run_at",
    "created_at",
    "updated_at",
    "state",
    "attempts",
    "lease_until",
)


def _job_insert_row(job: NewJob, now: float) -> tuple[Any, ...]:
    payload = json.dumps(job.payload)
    if job.leased_for is None:
        return (job.kind, payload, job.max_attempts, now, now, now, "pending", 0, None)
    # Claimed by the enqueuing process itself, exactly as _claim would.
    lease = now + job.leased_for
    return (job.kind, payload, job.max_attempts, now, now, now, "running", 1, lease)


def _claim(conn: sqlite3.Connection, items: list[tuple[int, float, float, str]]) -> list[list[Job]]:
    claimed = []
    for limit, now, lease, held in items:
        rows = conn.execute(
            f"""
            UPDATE jobs
               SET state = CASE WHEN {ABANDONED_AGAIN_SQL} THEN 'failed' ELSE 'running' END,
                   attempts = CASE WHEN {ABANDONED_AGAIN_SQL} THEN attempts ELSE attempts + 1 END,
                   lease_until = CASE WHEN {ABANDONED_AGAIN_SQL} THEN NULL ELSE :lease END,
                   last_error = CASE WHEN {ABANDONED_AGAIN_SQL} THEN :abandoned
                                ELSE last_error END,
                   updated_at = :now
             WHERE id IN (
                   -- Each side stops after :limit rows of the (state, run_at)
                   -- index, so a claim costs the same with a backlog of millions.
                   SELECT id FROM (
                       SELECT id FROM jobs WHERE state = 'pending' AND run_at <= :now
                        ORDER BY run_at, id LIMIT :limit)
                   UNION ALL
                   SELECT id FROM (
                       SELECT id FROM jobs WHERE state = 'running' AND lease_until < :now
                          AND id NOT IN (SELECT value FROM json_each(:held))
                        LIMIT :limit)
                   LIMIT :limit)
            RETURNING {JOB_COLUMNS}
            """,
            {
                "now": now,
                "lease": lease,
                "limit": limit,
                "held": held,
                "abandoned": ABANDONED_ERROR,
            },
        ).fetchall()
        claimed.append(sorted((job_from_row(row) for row in rows), key=lambda job: job.id))
    return claimed


def ids_in_chunks(ids: list[int], size: int = 500) -> list[list[int]]:
    return [ids[i : i + size] for i in range(0, len(ids), size)]


# (job id, attempt, run_at): a claim, as the worker that holds it knows it
# (see the outcome methods of Store, in base).
Claim = tuple[int, int, float]


def _claim_of(job: Job) -> Claim:
    return (job.id, job.attempts, job.run_at)


def _complete(conn: sqlite3.Connection, items: list[tuple[list[Claim], float]]) -> list[int]:
    changed = []
    for claims, now in items:
        cur = conn.executemany(
            "UPDATE jobs SET state = 'done', lease_until = NULL, updated_at = ?"
            " WHERE id = ? AND attempts = ? AND run_at = ? AND state = 'running'",
            [(now, *claim) for claim in claims],
        )
        changed.append(cur.rowcount)
    return changed


# the claim, state, error, run_at, payload (JSON text; None keeps it)
StateArg = tuple[Claim, str, str | None, float | None, str | None]


def _json_or_none(payload: dict[str, Any] | None) -> str | None:
    return None if payload is None else json.dumps(payload)


def _set_state(conn: sqlite3.Connection, items: list[tuple[StateArg, float]]) -> list[int]:
    changed = []
    for (claim, state, error, run_at, payload), now in items:
        cur = conn.execute(
            """
            UPDATE jobs SET state = ?, last_error = coalesce(?, last_error),
                   run_at = coalesce(?, run_at), payload = coalesce(?, payload),
                   lease_until = NULL, updated_at = ?
             WHERE id = ? AND attempts = ? AND run_at = ? AND state = 'running'
            """,
            (state, error, run_at, payload, now, *claim),
        )
        changed.append(cur.rowcount)
    return changed


def _release(conn: sqlite3.Connection, items: list[tuple[list[Claim], float]]) -> list[None]:
    conn.executemany(
        """
        UPDATE jobs SET state = 'pending', attempts = max(attempts - 1, 0),
               lease_until = NULL, updated_at = ?
         WHERE id = ? AND attempts = ? AND run_at = ? AND state = 'running'
        """,
        [(now, *claim) for claims, now in items for claim in claims],
    )
    return [None] * len(items)


def _recover_abandoned(conn: sqlite3.Connection, items: list[float]) -> list[list[Job]]:
    # A single SQLite file has a single toko-api (it holds the instance lock),
    # so any running job belongs to a process that is gone.
    recovered = []
    for now in items:
        rows = conn.execute(
            f"""
            UPDATE jobs
               SET state = CASE WHEN {ABANDONED_AGAIN_SQL} THEN 'failed' ELSE 'pending' END,
                   last_error = CASE WHEN {ABANDONED_AGAIN_SQL} THEN :abandoned
                                ELSE last_error END,
                   lease_until = NULL, updated_at = :now
             WHERE state = 'running'
            RETURNING {JOB_COLUMNS}
            """,
            {"now": now, "abandoned": ABANDONED_ERROR},
        ).fetchall()
        recovered.append([job_from_row(row) for row in rows])
    return recovered
