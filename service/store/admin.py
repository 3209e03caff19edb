"""What queue administration (``toko-queue``, retention) shows and selects,
the same on both stores: the role itself is ``roles.QueueAdmin``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from service.models import JOB_STATES, Job, JobState, QueueCounts, iso_utc, job_from_row


@dataclass(frozen=True)
class JobDetails:
    """A job with the bookkeeping an admin looks at."""

    job: Job
    updated_at: float
    lease_until: float | None

    def to_json(self) -> dict[str, Any]:
        j = self.job
        return {
            "id": j.id,
            "kind": j.kind,
            "state": j.state,
            "attempts": j.attempts,
            "max_attempts": j.max_attempts,
            "run_at": iso_utc(j.run_at),
            "created_at": iso_utc(j.created_at),
            "updated_at": iso_utc(self.updated_at),
            "lease_until": iso_utc(self.lease_until) if self.lease_until is not None else None,
            "last_error": j.last_error,
            "payload": j.payload,
        }


def details_from_row(row: Sequence[Any]) -> JobDetails:
    """A row of the job columns followed by ``updated_at, lease_until``, as
    both stores select them."""
    return JobDetails(job=job_from_row(row[:9]), updated_at=row[9], lease_until=row[10])


@dataclass(frozen=True)
class QueueStats:
    counts: QueueCounts
    by_kind: dict[str, dict[str, int]]  # kind -> state -> jobs
    oldest_pending_run_at: float | None

    def to_json(self, now: float) -> dict[str, Any]:
        oldest = self.oldest_pending_run_at
        return {
            "queue": self.counts.to_json(),
            "by_kind": self.by_kind,
            "oldest_pending_due_seconds_ago": round(now - oldest, 3) if oldest else None,
        }


# What an admin can send again now: jobs kept as failed, or pending jobs that
# failed before and wait for their next attempt (up to an hour away).
Retryable = Literal["failed", "waiting"]
RETRYABLE_WHERE: dict[Retryable, str] = {
    "failed": "state = 'failed'",
    "waiting": "state = 'pending' AND attempts > 0",
}


# A job state written into the query as a literal, never bound: both planners
# use a partial index (``WHERE state = 'failed'``) only when the query's own
# WHERE implies its condition, and ``state = ?`` implies nothing (SQLite at
# prepare time; PostgreSQL once it settles on a generic plan).
STATE_WHERE: dict[JobState, str] = {state: f"state = '{state}'" for state in JOB_STATES}
