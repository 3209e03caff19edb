"""The PostgreSQL store's wake-ups: LISTEN toko_jobs on a connection of its own."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable

import asyncpg  # type: ignore[import-untyped]  # no stubs shipped

from service.store.postgres.checks import PostgresChecks
from service.store.postgres.migrations import JOBS_CHANNEL
from service.store.postgres.transport import COMMAND_TIMEOUT, DB_ERRORS

log = logging.getLogger("toko.store")

# Seconds between liveness probes of the idle LISTEN connection, and between
# reconnection attempts when it is gone.
LISTEN_PROBE_SECONDS = 30.0

LISTEN_RETRY_SECONDS = 1.0


def _set_event(event: asyncio.Event, *_: object) -> None:
    event.set()


class PostgresNotifications(PostgresChecks):
    # wake-ups ----------------------------------------------------------------------
    def add_wakeup_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` whenever any process commits a job (LISTEN toko_jobs)."""
        self._wakeup_callbacks.append(callback)
        if self._listener is None:
            self._listener = asyncio.create_task(self._listen_loop(), name="toko-pg-listen")

    def _wake(self, *_: object) -> None:
        for callback in self._wakeup_callbacks:
            callback()

    async def _listen_loop(self) -> None:
        # A long-lived loop: log and keep going. While it is down, the pool's
        # sweep still finds every job, only later.
        while True:
            conn: asyncpg.Connection | None = None
            try:
                conn = await asyncpg.connect(**self._connect_kwargs(), timeout=COMMAND_TIMEOUT)
                lost = asyncio.Event()
                conn.add_termination_listener(functools.partial(_set_event, lost))
                await conn.add_listener(JOBS_CHANNEL, self._wake)
                log.debug("listening for new jobs", extra={"CHANNEL": JOBS_CHANNEL})
                self._wake()  # jobs committed while we were not listening
                while not lost.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(lost.wait(), LISTEN_PROBE_SECONDS)
                    if not lost.is_set():
                        # An idle socket does not notice a vanished server; a query does.
                        await self._check_clock(conn)
                log.warning("the LISTEN connection closed; reconnecting")
            except DB_ERRORS as exc:
                self._listen_failures.log(
                    log, logging.WARNING, "LISTEN connection failed, retrying: %s", exc
                )
            finally:
                if conn is not None and not conn.is_closed():
                    with contextlib.suppress(*DB_ERRORS):
                        await conn.close(timeout=5)
            await asyncio.sleep(LISTEN_RETRY_SECONDS)
