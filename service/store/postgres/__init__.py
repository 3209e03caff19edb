"""The PostgreSQL store: one database shared by toko-api on several hosts.

Same contract as the SQLite store, through asyncpg (no thread, no blocking):

- ``create_product`` goes through a group-commit writer task: the product
  and job rows of every request queued since the last commit are inserted by
  one statement (one implicit transaction), so a burst of requests shares one
  WAL flush and one NOTIFY. That matters: PostgreSQL serialises the commits of
  transactions that NOTIFY, so one transaction per request would cap
  throughput at one fsync per request.
- Claims lease due jobs with ``FOR UPDATE SKIP LOCKED``: workers on every
  instance take disjoint jobs without waiting on each other. Leases of a dead
  instance expire and the next claim anywhere takes those jobs; nothing else
  re-queues, since a running job may belong to a live instance elsewhere.
- A trigger NOTIFYs ``toko_jobs`` in every transaction that inserts pending
  jobs (one enqueued already leased runs on its own instance);
  :meth:`add_wakeup_listener` LISTENs on a dedicated connection (reconnecting
  when it drops) so idle workers everywhere wake at once.
- Recaps take a transaction-scoped advisory lock on the period, then insert
  the period's unique row: three hosts racing record one row, one email job.

Times are epoch seconds from the injected clock, as on SQLite; hosts sharing
a database need synchronised clocks (NTP), which leases tolerate by minutes.

Split by concern: the transport (pool, kept connections, errors:
``transport``), the server checks (``checks``), wake-ups (``notifications``),
the products and their group-commit writer (``products``, ``writer``), the
queue, recaps and admin, and the schema (``migrations``). Opening and closing
put them together here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import asyncpg  # type: ignore[import-untyped]  # no stubs shipped

from service.redaction import redact
from service.store.base import LoginRefused, StoreError
from service.store.postgres.admin import PostgresAdmin
from service.store.postgres.migrations import SchemaTooNew, migrate
from service.store.postgres.notifications import PostgresNotifications
from service.store.postgres.queue import PostgresQueue
from service.store.postgres.recaps import PostgresRecaps
from service.store.postgres.transport import (
    CLOSE_SECONDS,
    DB_ERRORS,
    timeout_note,
)
from service.store.postgres.writer import PostgresWriter

log = logging.getLogger("toko.store")


class PostgresStore(
    PostgresWriter, PostgresQueue, PostgresNotifications, PostgresRecaps, PostgresAdmin
):
    """Every role of :class:`~service.store.roles.Store`, on one PostgreSQL database."""

    async def open(self) -> None:
        try:
            conn = await self._first_connection()
            try:
                await self._insist_on_utf8(conn)
                await migrate(conn)
                await self._check_clock(conn)
                await self._insist_on_durable_commits(conn)
                await self._stay_connected_while_idle(conn)
            finally:
                await conn.close()
            self._pool = await self._create_pool()
        except SchemaTooNew as exc:
            raise StoreError(str(exc)) from exc
        except (*DB_ERRORS, ValueError) as exc:
            # One line: asyncpg puts its HINT on a line of its own.
            why = " ".join(str(exc).split()) + timeout_note(exc)
            # A server asking for a password we do not have answers with
            # InvalidPasswordError too (asyncpg then sends an empty one).
            refused = isinstance(exc, asyncpg.InvalidAuthorizationSpecificationError)
            error = LoginRefused if refused else StoreError
            raise error(f"cannot open database {redact(self.url)}: {why}") from exc
        self._start_writer()

    async def wait_broken(self) -> None:
        """Raise StoreError once the product writer or the LISTEN task has ended.

        Both only end when the store closes, or through a bug: then writes (or
        wake-ups) have stopped for good, and a restart is the way back.
        """
        tasks = [task for task in (self._writer, self._listener) if task is not None]
        if not tasks:
            raise StoreError("the store is not open")
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        task = done.pop()
        reason = "cancelled" if task.cancelled() else repr(task.exception())
        raise StoreError(f"{task.get_name()} ended: {reason}")

    async def close(self) -> None:
        """Close, waiting at most CLOSE_SECONDS for the database to answer.

        A database that hangs (a silent host) would otherwise hold each step
        for the command timeout, past systemd's TimeoutStopSec=; its
        connections are dropped instead, as a killed process would drop them.
        """
        pool = self._pool
        closing = asyncio.create_task(self._close_gracefully(), name="toko-store-close")
        done, _ = await asyncio.wait([closing], timeout=CLOSE_SECONDS)
        if not done and pool is not None:
            log.warning(
                "the database did not answer within %g s while closing; dropping its connections",
                CLOSE_SECONDS,
            )
            pool.terminate()
        with contextlib.suppress(*DB_ERRORS):
            await closing

    async def _close_gracefully(self) -> None:
        await self._stop_writer()
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listener
            self._listener = None
        if self._pool is not None:
            pool, self._pool = self._pool, None
            for lane in (self._claims, self._acks, self._enqueues, self._product_writes):
                await lane.close(pool)
            await pool.close()
