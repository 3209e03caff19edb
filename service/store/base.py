"""The storage interface the API, the workers and the timer jobs rely on.

SQLite implements it today; a PostgreSQL backend slots in behind the same
methods. Every method is a coroutine and never blocks the event loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol, runtime_checkable

from service.models import Job, NewJob, Product, QueueCounts, job_fields

log = logging.getLogger("toko.store")

# A job left running by a process that died (a crash, kill -9, the watchdog,
# a stop that outlasted the drain) is tried again even when that was its last
# attempt: it may never have started (POST /produk writes its job already
# claimed). One that was left so with an attempt beyond its last is kept as
# failed instead, so a job that takes toko down cannot restart it forever.
# Both stores test this SQL against the row as it was before the update.
ABANDONED_AGAIN_SQL = "jobs.state = 'running' AND jobs.attempts > jobs.max_attempts"
ABANDONED_ERROR = "abandoned: the process running it died, in an attempt beyond its last"


def without_abandoned(jobs: list[Job]) -> list[Job]:
    """The jobs of a claim or recovery, less those it kept as failed (logged here)."""
    for job in jobs:
        if job.state == "failed":
            log.error("job failed permanently", extra={**job_fields(job), "ERROR": ABANDONED_ERROR})
    return [job for job in jobs if job.state != "failed"]


# Its own logger, so toko-queue (which logs nothing else) can show this line.
schema_log = logging.getLogger("toko.store.schema")


def note_schema_migrated(before: int, after: int) -> None:
    """Say that the schema changed (called once its transaction committed):
    an admin who upgraded toko finds in the journal when the database did."""
    fields = {"SCHEMA_VERSION_BEFORE": before, "SCHEMA_VERSION": after}
    if before == 0:
        schema_log.info("database schema created at version %d", after, extra=fields)
    elif before < after:
        schema_log.info(
            "database schema upgraded from version %d to %d", before, after, extra=fields
        )


def note_lost_claims(expected: int, changed: int, outcome: str) -> None:
    """Log outcomes the store dropped because their claim was no longer held."""
    if changed < expected:
        log.warning(
            "job outcome (%s) not recorded: the job is no longer this worker's (its lease"
            " ran out and it was claimed again, or a retried write recorded it already)",
            outcome,
            extra={"JOBS": expected - changed},
        )


class StoreError(RuntimeError):
    """The store failed (disk, lock, corruption): our fault, never the client's."""


class LoginRefused(StoreError):
    """The database server refused our login: a wrong or missing password, or a
    user it does not let in. Unlike an unreachable server, waiting cannot fix it."""


class WriteHealth:
    """Whether the store can write, and why not.

    A full disk or a database gone read-only (a failover to a standby) fails
    every write while reads go on: /healthz must say so, and must notice when
    the writes work again even if nobody writes meanwhile (a load balancer
    that took toko out would send none), hence the probe.

    Any failed write sets the error; only a stored product or a successful
    probe clears it. On a nearly full disk a small write (an ack) can still
    succeed where products no longer fit, so that proves nothing.
    """

    def __init__(self) -> None:
        self.error: str | None = None

    def proven(self) -> None:
        self.error = None

    def failed(self, exc: BaseException) -> None:
        self.error = str(exc)


async def write_error(store: Store) -> str | None:
    """Why the store cannot write, probing first if it could not."""
    if store.write_error is not None:
        # Nobody else may be writing (a balancer may have taken toko out): try.
        await store.probe_write()
    return store.write_error


class Store(Protocol):
    async def open(self) -> None:
        """Connect and apply pending schema migrations."""

    async def close(self) -> None: ...

    async def wait_broken(self) -> None:
        """Raise StoreError once the store cannot work again until a restart
        (a task or thread it cannot work without has ended); wait until then.

        toko-api supervises it like its other side tasks and stops, for
        systemd to restart it.
        """

    # products -------------------------------------------------------------
    async def create_product(
        self,
        nama: str,
        harga: int,
        make_job: Callable[[Product], NewJob],
        idempotency_key: str | None = None,
    ) -> tuple[Product, int | None]:
        """Insert a product and its job in one durable transaction; return both.

        The job's created_at is the product's, to the bit: the caller can
        build the stored job (``stored_job``) without reading it back.

        A product already stored with ``idempotency_key`` is returned instead,
        with None for the job id: nothing is written (it may differ from
        ``nama``/``harga``; the caller decides what that means).
        """

    async def get_product(self, product_id: int) -> Product | None: ...

    async def list_products(self, after_id: int, limit: int) -> list[Product]: ...

    async def product_counts(self, start: float, end: float) -> tuple[int, int]:
        """(products created before ``end``, products created in [start, end))."""

    # queue ----------------------------------------------------------------
    async def enqueue(self, job: NewJob) -> int: ...

    async def claim(
        self, limit: int, lease_seconds: float, held: Collection[int] = ()
    ) -> list[Job]:
        """Lease up to ``limit`` due jobs (pending and due, or running with an expired lease).

        A running job whose lease expired in an attempt beyond its last is
        kept as failed instead (``ABANDONED_AGAIN_SQL``).

        Never one in ``held``: the jobs the claiming process still runs or has
        yet to ack. Their leases can look expired to it after its wall clock
        steps forward (NTP correcting a board without a battery-backed clock),
        and taking them again would run them twice at once.
        """

    # The outcome of an attempt is written for the claim that made it: the job
    # as claimed (its id, attempt and run_at). A claim no longer held, whose
    # lease ran out and another host claimed the job again, writes nothing: a
    # late outcome must not undo that host's claim or its result. The attempt
    # alone does not tell claims apart once an admin's retry_now has reset the
    # attempts: the claim after it is attempt 1 again. run_at does: retry_now
    # makes the job due at its own time, after the lease of every earlier
    # claim ran out, and a claim never changes run_at.

    async def complete(self, jobs: Sequence[Job]) -> None:
        """Mark jobs done (acks are batched: one write for many jobs)."""

    async def retry(
        self, job: Job, error: str, run_at: float, payload: dict[str, Any] | None = None
    ) -> None:
        """Put a failed attempt back as pending, due at ``run_at``; with a new
        ``payload`` when the attempt did part of the job."""

    async def fail(self, job: Job, error: str, payload: dict[str, Any] | None = None) -> None:
        """Keep a job that used its last attempt as ``failed`` (the dead letter);
        with a new ``payload`` when the attempt did part of the job."""

    async def release(self, jobs: Sequence[Job]) -> None:
        """Return claimed-but-unstarted jobs to pending without counting an attempt."""

    async def recover_abandoned(self) -> int:
        """At start-up: jobs left running by a dead process become pending again
        (or failed, as ``claim`` does, past their last attempt).

        SQLite (one toko-api per file) re-queues every running job. A shared
        backend must not touch jobs other live instances hold: there, expired
        leases alone bring jobs back, and this returns 0.
        """

    async def next_due_at(self, held: Collection[int] = ()) -> float | None:
        """When the next claim can take a job: the earliest pending job's due
        time or running job's lease expiry (None when there is neither).

        Leases of jobs in ``held`` do not count: ``claim`` never takes those,
        so a held lease that looks expired must not make the claimer spin.
        """

    async def counts(self) -> QueueCounts: ...

    def add_wakeup_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when another process enqueues a job (LISTEN/NOTIFY).

        In-process enqueues wake the pool directly; a store that cannot hear
        other processes does nothing here and the pool's sweep catches up.
        """

    async def get_job(self, job_id: int) -> Job | None: ...

    async def ping(self) -> None:
        """Raise StoreError unless the store answers."""

    @property
    def write_error(self) -> str | None:
        """Why a write failed; None once a product is stored or a probe succeeds."""

    async def probe_write(self) -> None:
        """Make the smallest durable write there is; updates ``write_error``, never raises."""

    # recaps ---------------------------------------------------------------
    async def record_recap(
        self, period: str, products_total: int, products_new: int, job: NewJob
    ) -> int | None:
        """Record a period's recap and enqueue its email once; None if already recorded.

        Must hold across processes and hosts: two runs for one period record one row.
        """

    async def last_recap_before(self, period: str) -> str | None:
        """The latest recorded period earlier than ``period`` (ISO dates sort as text)."""


@runtime_checkable
class SharedClock(Protocol):
    """A store shared by several hosts, whose database server has the one clock they share."""

    async def database_time(self) -> float:
        """The database server's clock, in seconds since the epoch."""
