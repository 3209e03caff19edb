"""The PostgreSQL store's job queue: claims with FOR UPDATE SKIP LOCKED, leases, outcomes."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Collection, Sequence
from typing import Any

from service.models import JOB_STATES, Job, NewJob, QueueCounts, job_from_row
from service.store.base import (
    ABANDONED_AGAIN_SQL,
    ABANDONED_ERROR,
    StoreError,
    note_lost_claims,
    without_abandoned,
)
from service.store.postgres.migrations import JOBS_CHANNEL
from service.store.postgres.transport import PostgresTransport, rows

JOB_COLUMNS = (
    "id, kind, payload::text, state, attempts, max_attempts, run_at, last_error, created_at"
)

DETAIL_COLUMNS = f"{JOB_COLUMNS}, updated_at, lease_until"

# Done and failed as the triggers keep them (schema step 7), with how many
# changes hold them; pending and running counted, each through its partial
# index, with the oldest pending job's due time: one round trip.
COUNTS_SQL = (
    "SELECT state, sum(n)::bigint, count(*), NULL::double precision"
    " FROM job_count_changes GROUP BY state"
    " UNION ALL SELECT 'pending', count(*), 0, min(run_at) FROM jobs WHERE state = 'pending'"
    " UNION ALL SELECT 'running', count(*), 0, NULL FROM jobs WHERE state = 'running'"
)
# A read that finds more changes than this folds them into one a state. Each
# fold deletes only the changes committed when it began: another host's fold
# at the same time waits for this one, then finds those gone.
FOLD_CHANGES = 1000
FOLD_CHANGES_SQL = (
    "WITH folded AS (DELETE FROM job_count_changes RETURNING state, n)"
    " INSERT INTO job_count_changes (state, n) SELECT state, sum(n) FROM folded GROUP BY state"
)


# One job row, as enqueue() writes it and as a product change writes it in its
# own transaction (products.py).
INSERT_JOB = (
    "INSERT INTO jobs (kind, payload, max_attempts, run_at, created_at, updated_at,"
    " state, attempts, lease_until)"
    " VALUES ($1, $2::jsonb, $3, $4, $4, $4, $5, $6, $7) RETURNING id"
)


def insert_job_args(job: NewJob, now: float) -> tuple[Any, ...]:
    leased = job.leased_for is not None
    return (
        job.kind,
        json.dumps(job.payload),
        job.max_attempts,
        now,
        # leased_for: claimed by the enqueuing instance itself, as claim() would.
        "running" if leased else "pending",
        1 if leased else 0,
        now + job.leased_for if job.leased_for is not None else None,
    )


class PostgresQueue(PostgresTransport):
    # queue -----------------------------------------------------------------------
    async def enqueue(self, job: NewJob) -> int:
        row = await self._fetchrow(
            INSERT_JOB, *insert_job_args(job, self._clock()), write=True, lane=self._enqueues
        )
        assert row is not None
        return int(row[0])

    async def claim(
        self, limit: int, lease_seconds: float, held: Collection[int] = ()
    ) -> list[Job]:
        now = self._clock()
        # FOR UPDATE cannot sit under a UNION, hence one CTE per source. Each
        # stops after ``limit`` rows of its partial index; SKIP LOCKED lets
        # claimers on other instances take the next rows instead of waiting.
        rows = await self._fetch(
            f"""
            WITH due AS (
                SELECT id FROM jobs WHERE state = 'pending' AND run_at <= $1
                 ORDER BY run_at, id LIMIT $3 FOR UPDATE SKIP LOCKED
            ), expired AS (
                SELECT id FROM jobs WHERE state = 'running' AND lease_until < $1
                   AND NOT (id = ANY($4::bigint[]))
                 LIMIT $3 FOR UPDATE SKIP LOCKED
            ), picked AS (
                SELECT id FROM due UNION ALL SELECT id FROM expired LIMIT $3
            )
            UPDATE jobs
               SET state = CASE WHEN {ABANDONED_AGAIN_SQL} THEN 'failed' ELSE 'running' END,
                   attempts = CASE WHEN {ABANDONED_AGAIN_SQL} THEN attempts ELSE attempts + 1 END,
                   lease_until = CASE WHEN {ABANDONED_AGAIN_SQL} THEN NULL ELSE $2::float8 END,
                   last_error = CASE WHEN {ABANDONED_AGAIN_SQL} THEN $5::text ELSE last_error END,
                   updated_at = $1
              FROM picked WHERE jobs.id = picked.id
            RETURNING {", ".join(f"jobs.{c}" for c in JOB_COLUMNS.split(", "))}
            """,
            now,
            now + lease_seconds,
            limit,
            list(held),
            ABANDONED_ERROR,
            write=True,
            lane=self._claims,
        )
        jobs = sorted((job_from_row(row) for row in rows), key=lambda job: job.id)
        return without_abandoned(jobs)

    async def complete(self, jobs: Sequence[Job]) -> None:
        if not jobs:
            return
        # Fenced on the claim (id, attempt and run_at): see Store.
        status = await self._execute(
            """
            UPDATE jobs SET state = 'done', lease_until = NULL, updated_at = $3
              FROM unnest($1::bigint[], $2::int[], $4::float8[])
                   AS claim(job_id, attempt, run_at)
             WHERE jobs.id = claim.job_id AND jobs.attempts = claim.attempt
               AND jobs.run_at = claim.run_at AND jobs.state = 'running'
            """,
            [job.id for job in jobs],
            [job.attempts for job in jobs],
            self._clock(),
            [job.run_at for job in jobs],
            retry=True,
            write=True,
            lane=self._acks,
        )
        note_lost_claims(len(jobs), rows(status), "done")

    async def retry(
        self, job: Job, error: str, run_at: float, payload: dict[str, Any] | None = None
    ) -> None:
        await self._set_state(job, "pending", error, run_at, payload)

    async def fail(self, job: Job, error: str, payload: dict[str, Any] | None = None) -> None:
        await self._set_state(job, "failed", error, None, payload)

    async def _set_state(
        self,
        job: Job,
        state: str,
        error: str | None,
        run_at: float | None,
        payload: dict[str, Any] | None,
    ) -> None:
        status = await self._execute(
            """
            UPDATE jobs SET state = $2, last_error = coalesce($3, last_error),
                   run_at = coalesce($4, run_at), payload = coalesce($6::jsonb, payload),
                   lease_until = NULL, updated_at = $5
             WHERE id = $1 AND attempts = $7 AND run_at = $8 AND state = 'running'
            """,
            job.id,
            state,
            error,
            run_at,
            self._clock(),
            None if payload is None else json.dumps(payload),
            job.attempts,
            job.run_at,
            retry=True,
            write=True,
        )
        note_lost_claims(1, rows(status), state)

    async def release(self, jobs: Sequence[Job]) -> None:
        if not jobs:
            return
        # Released jobs are due now: tell the other instances, in the same transaction.
        await self._execute(
            f"""
            WITH released AS (
                UPDATE jobs SET state = 'pending', attempts = greatest(attempts - 1, 0),
                       lease_until = NULL, updated_at = $3
                  FROM unnest($1::bigint[], $2::int[], $4::float8[])
                       AS claim(job_id, attempt, run_at)
                 WHERE jobs.id = claim.job_id AND jobs.attempts = claim.attempt
                   AND jobs.run_at = claim.run_at AND jobs.state = 'running'
                RETURNING jobs.id
            )
            SELECT pg_notify('{JOBS_CHANNEL}', '') WHERE EXISTS (SELECT 1 FROM released)
            """,
            [job.id for job in jobs],
            [job.attempts for job in jobs],
            self._clock(),
            [job.run_at for job in jobs],
            # Not tried again: a release puts attempts back, so another host's
            # claim of a job released already matches this fence, and a second
            # try after a lost answer would hand a running job back to the
            # queue. A release that failed leaves its jobs to their lease.
            write=True,
        )

    async def recover_abandoned(self) -> int:
        # Other instances share this database: a running job may be theirs.
        # Expired leases alone bring a dead instance's jobs back (see claim).
        return 0

    async def next_due_at(self, held: Collection[int] = ()) -> float | None:
        row = await self._fetchrow(
            "SELECT least((SELECT min(run_at) FROM jobs WHERE state = 'pending'),"
            "             (SELECT min(lease_until) FROM jobs WHERE state = 'running'"
            "                 AND NOT (id = ANY($1::bigint[]))))",
            list(held),
            retry=True,
        )
        return None if row is None or row[0] is None else float(row[0])

    async def counts(self) -> QueueCounts:
        figures = dict.fromkeys(JOB_STATES, 0)
        oldest_pending = None
        changes = 0
        for state, count, state_changes, oldest in await self._fetch(COUNTS_SQL, retry=True):
            figures[state] = int(count)
            changes += state_changes
            if state == "pending" and oldest is not None:
                oldest_pending = float(oldest)
        if changes > FOLD_CHANGES:
            # Best effort: a fold that fails (a full disk, say) leaves the
            # changes to the next read, and the figures read stand.
            with contextlib.suppress(StoreError):
                await self._execute(FOLD_CHANGES_SQL)
        return QueueCounts.of(figures, oldest_pending, self._clock())

    async def get_job(self, job_id: int) -> Job | None:
        row = await self._fetchrow(
            f"SELECT {JOB_COLUMNS} FROM jobs WHERE id = $1", job_id, retry=True
        )
        return job_from_row(row) if row else None
