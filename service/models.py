"""Plain data shared by the store, the queue and the HTTP layer."""

from __future__ import annotations

import functools
import json
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

JobState = Literal["pending", "running", "done", "failed"]
JOB_STATES: tuple[JobState, ...] = ("pending", "running", "done", "failed")


def iso_utc(epoch: float) -> str:
    """Seconds since the epoch as ISO-8601 UTC with milliseconds, e.g. 2026-11-29T18:00:00.123Z."""
    # Every response and log line formats a time; this is several times faster
    # than datetime.isoformat, and the second's text is cached.
    seconds = math.floor(epoch)  # not int(): before 1970 that would leave micros negative
    micros = round((epoch - seconds) * 1_000_000)  # rounded as datetime does
    if micros >= 1_000_000:
        seconds, micros = seconds + 1, micros - 1_000_000
    return f"{_second_text(seconds)}.{micros // 1000:03d}Z"


# Control characters but for tab and newline (C0, DEL, C1): a terminal acts on them.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable_text(text: str) -> str:
    """``text`` safe to store as UTF-8 and to show on a terminal.

    A mail server's reply in Latin-1 reaches us as surrogate escapes, which no
    UTF-8 database takes; those bytes, and control characters other than tab
    and newline, become backslash escapes (``Empf\\xe4nger``).
    """
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate that stands for no byte
        raw = text.encode("utf-8", "backslashreplace")
    text = raw.decode("utf-8", "backslashreplace")
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


@functools.lru_cache(maxsize=4)
def _second_text(seconds: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))


@dataclass(frozen=True)
class Product:
    id: int
    nama: str
    harga: int
    created_at: float
    # 1 when created, one more with each change (and with the delete): what
    # the ETag is made of. Not in to_json(): the body POST /produk answers
    # with is part of its contract.
    version: int = 1

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "nama": self.nama,
            "harga": self.harga,
            "created_at": iso_utc(self.created_at),
        }

    @property
    def etag(self) -> str:
        """A strong validator of this version (RFC 9110, 8.8.3): ``"3"``."""
        return f'"{self.version}"'


# What a product's fields may be changed to (PATCH): None leaves one as it is.
PRODUCT_CHANGE_FIELDS = ("nama", "harga")


@dataclass(frozen=True)
class ProductWritten:
    """A change or delete that went through (or found nothing to change).

    ``after`` is the product as stored now: for a delete, as it was when it
    went, at the version the delete gave it; for a change that changed
    nothing, ``before`` itself (no write, no new version). ``at`` is the
    store's time of the write, which a job it enqueued was stored with.
    """

    before: Product
    after: Product
    at: float
    job_id: int | None = None

    @property
    def fields(self) -> tuple[str, ...]:
        """The fields the write changed, in PRODUCT_CHANGE_FIELDS order."""
        return tuple(
            name
            for name in PRODUCT_CHANGE_FIELDS
            if getattr(self.before, name) != getattr(self.after, name)
        )


@dataclass(frozen=True)
class VersionMismatch:
    """A write refused: the product is not at a version the client named (If-Match)."""

    current: Product


# What a change or delete comes to; None: no such product (or it was deleted).
ProductWriteOutcome = ProductWritten | VersionMismatch | None


@dataclass(frozen=True)
class NewJob:
    """A job to enqueue; ``payload`` must be JSON-serialisable."""

    kind: str
    payload: dict[str, Any] = field(default_factory=dict)
    max_attempts: int = 5
    # Set when the enqueuing process runs the job itself: the row is written
    # already claimed (running, attempt 1, leased this many seconds), which
    # saves the claim's write; a crash leaves it to the lease like any claim.
    leased_for: float | None = None


@dataclass(frozen=True)
class Job:
    id: int
    kind: str
    payload: dict[str, Any]
    state: JobState
    attempts: int
    max_attempts: int
    run_at: float
    # When it was enqueued (jobs.created_at): with the id, it names the job's
    # email (its Message-ID), since a restore from backup hands ids out again.
    created_at: float
    last_error: str | None = None


def job_fields(job: Job) -> dict[str, object]:
    """Structured log fields for a job (journal fields under systemd)."""
    fields: dict[str, object] = {"JOB_ID": job.id, "JOB_KIND": job.kind, "ATTEMPT": job.attempts}
    if "product_id" in job.payload:
        fields["PRODUCT_ID"] = job.payload["product_id"]
    return fields


class PartlyDone(Exception):
    """An attempt that did part of its job. It is retried like any failure, but
    the next attempt gets ``payload``, which says only what is left to do (the
    recipients still waiting for an email, say), so what was done is not done
    twice."""

    def __init__(self, message: str, payload: dict[str, Any]) -> None:
        super().__init__(message)
        self.payload = payload


def stored_job(job_id: int, job: NewJob, created_at: float) -> Job:
    """The Job a store wrote for ``job`` enqueued at ``created_at`` (due then):
    pending, or already claimed when enqueued with ``leased_for``."""
    leased = job.leased_for is not None
    state: JobState = "running" if leased else "pending"
    return Job(
        id=job_id,
        kind=job.kind,
        payload=job.payload,
        state=state,
        attempts=1 if leased else 0,
        max_attempts=job.max_attempts,
        run_at=created_at,
        created_at=created_at,
    )


def job_from_row(row: Sequence[Any]) -> Job:
    """A Job from a row: id, kind, payload (JSON text), state, attempts,
    max_attempts, run_at, last_error, created_at; the column order both stores
    select."""
    return Job(
        id=row[0],
        kind=row[1],
        payload=json.loads(row[2]),
        state=row[3],
        attempts=row[4],
        max_attempts=row[5],
        run_at=row[6],
        last_error=row[7],
        created_at=row[8],
    )


@dataclass(frozen=True)
class QueueCounts:
    pending: int = 0
    running: int = 0
    done: int = 0
    failed: int = 0
    # How long the oldest pending job has been due and unclaimed, in seconds
    # (0: none is due). A stuck queue shows here first: its depth may look
    # normal while nothing is taken. Not in to_json(): /healthz's body is a contract.
    oldest_due_seconds: float = 0.0

    @classmethod
    def of(
        cls, figures: Mapping[JobState, int], oldest_pending_run_at: float | None, now: float
    ) -> QueueCounts:
        """From the jobs by state and the earliest ``run_at`` of a pending job.

        That earliest one is the oldest due job when it is due at all; when it
        is not, no pending job is (a retry waiting for its backoff is not late).
        """
        oldest = oldest_pending_run_at
        due = now - oldest if oldest is not None and oldest <= now else 0.0
        return cls(
            pending=figures["pending"],
            running=figures["running"],
            done=figures["done"],
            failed=figures["failed"],
            oldest_due_seconds=due,
        )

    def to_json(self) -> dict[str, int]:
        return {
            "pending": self.pending,
            "running": self.running,
            "failed": self.failed,
            "done": self.done,
        }
