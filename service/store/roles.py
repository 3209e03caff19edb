"""What callers need of a store, by role; every backend has them all.

The API reads and writes products (``ProductStore``), the workers run the
queue (``JobQueue``), toko-recap records periods (``RecapStore``),
toko-queue and the retention administer jobs (``QueueAdmin``); toko-api
also opens, supervises and probes the store (``Lifecycle``, ``Health``).
A function asks for the role it uses; ``open_store()`` returns a ``Store``,
which is all of them, so no caller has to probe what a store can do.
Every method is a coroutine and never blocks the event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol, runtime_checkable

from service.models import Job, JobState, NewJob, Product, ProductWriteOutcome, QueueCounts
from service.store.admin import JobDetails, QueueStats, Retryable


class Lifecycle(Protocol):
    async def open(self) -> None:
        """Connect and apply pending schema migrations."""

    async def close(self) -> None: ...

    async def wait_broken(self) -> None:
        """Raise StoreError once the store cannot work again until a restart
        (a task or thread it cannot work without has ended); wait until then.

        toko-api supervises it like its other side tasks and stops, for
        systemd to restart it.
        """

    @property
    def writer_stats(self) -> tuple[int, int]:
        """(batches committed, writes committed): writes/batches is the group-commit factor."""


class Health(Protocol):
    async def ping(self) -> None:
        """Raise StoreError unless the store answers."""

    @property
    def write_error(self) -> str | None:
        """Why a write failed; None once a product is stored or a probe succeeds."""

    async def probe_write(self) -> None:
        """Make the smallest durable write there is; updates ``write_error``, never raises."""


class ProductStore(Protocol):
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
        ``nama``/``harga``; the caller decides what that means). It is
        returned as it was created (version 1, its first nama and harga),
        whatever was changed since, and even once deleted: a retried request
        gets the answer the first one got, and never makes a second product.
        """

    async def get_product(self, product_id: int) -> Product | None:
        """The product as it is now; None if there is none or it was deleted."""

    async def list_products(self, after_id: int, limit: int) -> list[Product]:
        """Products not deleted with an id above ``after_id``, in id order."""

    async def update_product(
        self,
        product_id: int,
        nama: str | None,
        harga: int | None,
        versions: Collection[int] | None,
        make_job: Callable[[Product, Product], NewJob | None],
    ) -> ProductWriteOutcome:
        """Set ``nama`` and/or ``harga`` (None: leave it), if the product is at
        one of ``versions`` (None: at whatever version it is: If-Match: *).

        One durable transaction: the new values, the next version, and the job
        ``make_job(before, after)`` returns (None: no job); a ``make_job``
        that raises writes nothing. Values that change nothing write nothing
        either (the version stays). Among writes racing with one version,
        exactly one goes through; the others get VersionMismatch. None: no
        such product, or it was deleted (whatever ``versions`` says).
        """

    async def delete_product(
        self, product_id: int, versions: Collection[int] | None
    ) -> ProductWriteOutcome:
        """Mark the product deleted at its next version, if it is at one of
        ``versions`` (None: any), in one durable transaction.

        Its row stays (recaps count it; jobs enqueued for it run with their
        own payload), but get and list no longer return it. None, VersionMismatch:
        as for update_product.
        """


class JobQueue(Protocol):
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

    async def counts(self) -> QueueCounts:
        """Jobs by state, and how long the oldest due job has waited unclaimed
        (by this store's clock): one query, read at every scrape and health check."""

    def add_wakeup_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when another process enqueues a job (LISTEN/NOTIFY).

        In-process enqueues wake the pool directly; a store that cannot hear
        other processes does nothing here and the pool's sweep catches up.
        """

    async def get_job(self, job_id: int) -> Job | None: ...


class RecapStore(Protocol):
    async def product_counts(self, start: float, end: float) -> tuple[int, int]:
        """(products created before ``end``, products created in [start, end))."""

    async def record_recap(
        self, period: str, products_total: int, products_new: int, job: NewJob
    ) -> int | None:
        """Record a period's recap and enqueue its email once; None if already recorded.

        Must hold across processes and hosts: two runs for one period record one row.
        """

    async def last_recap_before(self, period: str) -> str | None:
        """The latest recorded period earlier than ``period`` (ISO dates sort as text)."""

    async def database_time(self) -> float | None:
        """The clock the hosts sharing the database agree on (its server's), in
        seconds since the epoch; None when there is only this host's."""


@runtime_checkable
class QueueAdmin(Protocol):
    async def queue_stats(self) -> QueueStats: ...

    async def list_jobs(self, state: JobState, limit: int) -> list[JobDetails]:
        """Jobs in ``state``, most recently updated first."""

    async def job_details(self, job_id: int) -> JobDetails | None: ...

    async def retry_now(self, job_ids: Sequence[int] | None, which: Retryable) -> list[int]:
        """``which`` jobs (these, or all when None) pending and due now, attempts reset.

        Returns the ids that were ``which`` and are now due; others are untouched.
        """

    async def purge_done(self, older_than: float, chunk: int = 1000) -> int:
        """Delete done jobs last updated before the epoch ``older_than``; how many."""


class Store(Lifecycle, Health, ProductStore, JobQueue, RecapStore, QueueAdmin, Protocol):
    """Every role: what ``open_store()`` returns."""
