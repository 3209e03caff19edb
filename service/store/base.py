"""What both stores share: their errors, write health, and the rules for
abandoned jobs and lost claims (the roles callers use are in ``roles``)."""

from __future__ import annotations

import logging

from service.models import Job, job_fields
from service.store.roles import Health

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


async def write_error(store: Health) -> str | None:
    """Why the store cannot write, probing first if it could not."""
    if store.write_error is not None:
        # Nobody else may be writing (a balancer may have taken toko out): try.
        await store.probe_write()
    return store.write_error
