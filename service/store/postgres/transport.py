"""The PostgreSQL store's transport: the pool, the kept connections, and errors.

Every call goes through :meth:`PostgresTransport._db`, which turns database
failures into StoreError, tries safe calls again on a fresh connection when
one died under them, and keeps /healthz told whether writes succeed. The
concerns (products and their writer, queue, wake-ups, server checks,
recaps, admin) are mixins on it, put together as ``PostgresStore``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import asyncpg  # type: ignore[import-untyped]  # no stubs shipped

from service.logs import Throttle
from service.store.base import StoreError, WriteHealth

T = TypeVar("T")
log = logging.getLogger("toko.store")

COMMAND_TIMEOUT = 30.0


# How long close() waits for the database before dropping the connections.
CLOSE_SECONDS = 5.0


# How long open() waits for an unreachable server (below TimeoutStartSec=60s).
OPEN_RETRY_SECONDS = 20.0


# Connection failures: the server is down or gone, not a bad statement.
CONNECTION_ERRORS = (
    OSError,
    TimeoutError,
    asyncpg.InterfaceError,
    asyncpg.PostgresConnectionError,
    asyncpg.CannotConnectNowError,
    # Raised, for one, when the server kills a connection mid-operation
    # ("cannot switch to state ...; another operation is in progress").
    asyncpg.InternalClientError,
    # 57P01 and friends: the server is shutting down or was told to end us.
    asyncpg.exceptions.OperatorInterventionError,
)


DB_ERRORS = (asyncpg.PostgresError, *CONNECTION_ERRORS)


# Connection errors that waiting cannot fix: the URL's TLS settings (a missing
# sslrootcert file) or a server certificate that does not check out.
_MISCONFIGURED = (asyncpg.ClientConfigurationError, ssl.SSLCertVerificationError)


class _ReconnectFailures(logging.Filter):
    """asyncpg's pool logs each failed attempt to reconnect (every 1 s to 60 s
    while the database is down) as a WARNING with a whole traceback. toko says
    that the database is down in its own lines already: the cause on one line
    is all this one needs to add."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None:
            cause = str(exc).partition("\n")[0] or type(exc).__name__
            record.msg, record.args = "%s: %s", (record.getMessage(), cause)
            record.exc_info, record.exc_text = None, None
        return True


logging.getLogger("asyncpg.pool").addFilter(_ReconnectFailures())


def rows(status: str) -> int:
    """How many rows a command changed, from its status ("UPDATE 3")."""
    return int(status.rpartition(" ")[2] or 0)


# toko sets neither: a role's or database's own setting cut the call short.
_SERVER_TIMEOUTS = {"statement timeout": "statement_timeout", "lock timeout": "lock_timeout"}


def timeout_note(exc: BaseException) -> str:
    """Where the server cut a call short for a setting toko never sets, what
    to add to its message ("canceling statement due to statement timeout")
    so that it names the setting."""
    if isinstance(exc, asyncpg.PostgresError):
        for words, setting in _SERVER_TIMEOUTS.items():
            if words in str(exc):
                return f" (the {setting} set for this role or database is too short for it)"
    return ""


class Lane:
    """A pooled connection kept for one hot path (claims, acks, enqueues, product writes).

    asyncpg's acquire and release cost a few event-loop turns each (release is
    a shielded task), 0.1-0.2 ms a call: a fifth of a job's enqueue-to-start
    time. Claims, acks and product writes each come from one task at a time,
    so keeping their connection costs no parallelism; enqueues (alerts, recap
    jobs) are rare and take turns on the lock. A connection that failed goes
    back to the pool (which replaces it) and the next call takes a fresh one.
    """

    def __init__(self) -> None:
        self._conn: asyncpg.Connection | None = None
        self._lock = asyncio.Lock()

    async def run(self, pool: asyncpg.Pool, fn: Callable[[asyncpg.Connection], Awaitable[T]]) -> T:
        async with self._lock:
            if self._conn is not None and not _usable(self._conn):
                await self.release(pool)
            if self._conn is None:
                self._conn = await pool.acquire(timeout=COMMAND_TIMEOUT)
            try:
                return await fn(self._conn)
            except CONNECTION_ERRORS:
                await self.release(pool)
                raise

    async def close(self, pool: asyncpg.Pool) -> None:
        """Give the connection back, or drop it if a call is still on it.

        Such a call is one that stop gave up waiting for, say an ack behind a
        locked table. Given back busy, asyncpg cancels it on the server, and
        the job whose email went out runs again after its lease. Dropped,
        the server still commits it once the lock goes, as after a kill.
        """
        if self._lock.locked() and self._conn is not None:
            conn, self._conn = self._conn, None
            conn.terminate()
            with contextlib.suppress(*DB_ERRORS):
                await pool.release(conn, timeout=COMMAND_TIMEOUT)
        else:
            await self.release(pool)

    async def release(self, pool: asyncpg.Pool) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(*DB_ERRORS):
                await pool.release(conn, timeout=COMMAND_TIMEOUT)


def _usable(conn: asyncpg.Connection) -> bool:
    try:
        return not conn.is_closed()
    except asyncpg.InterfaceError:  # detached: the pool took it back when it closed
        return False


async def keep_session(conn: asyncpg.Connection) -> None:
    """Release a pooled connection as it is (asyncpg still rolls back an open transaction).

    asyncpg's default reset sends ``RESET ALL; UNLISTEN *; CLOSE ALL;
    pg_advisory_unlock_all()``: one more round trip per store call, 12-16 % of
    a draining worker's time. Pooled connections never hold session state
    here: locks are transaction-scoped, LISTEN has its own connection.
    """


class PostgresTransport:
    def __init__(
        self,
        url: str,
        *,
        password: str | None = None,
        application_name: str = "toko-api",
        clock: Callable[[], float] = time.time,
        pool_size: int = 8,
    ) -> None:
        self.url = url
        self._password = password
        self._application_name = application_name
        self._clock = clock
        self._pool_size = pool_size
        self._pool: asyncpg.Pool | None = None
        self._wakeup_callbacks: list[Callable[[], None]] = []
        self._listener: asyncio.Task[None] | None = None
        self._claims = Lane()
        self._acks = Lane()
        self._enqueues = Lane()
        self._product_writes = Lane()
        self.batches = 0
        self.ops = 0
        # While the server is down every call hits this: a sample, not each.
        self._lost_connections = Throttle()
        self._listen_failures = Throttle()
        self._clock_skewed = False  # last said: this host's clock is off
        # Settings every pooled session starts with, beyond the application name.
        self._session_settings: dict[str, str] = {}
        self._write_health = WriteHealth()

    # lifecycle ---------------------------------------------------------------
    def _connect_kwargs(self) -> dict[str, Any]:
        return {
            "dsn": self.url,
            "password": self._password,
            # toko-backup --restore looks for application_name = toko-api.
            "server_settings": {
                "application_name": self._application_name,
                **self._session_settings,
            },
        }

    async def _first_connection(self) -> asyncpg.Connection:
        # At boot the database (or the network to it) may come up after us:
        # keep trying for a while rather than fail and hit systemd's start
        # limit. Refusals (bad password, no such database) and TLS settings
        # that cannot work fail at once.
        deadline = time.monotonic() + OPEN_RETRY_SECONDS
        delay = 0.25
        while True:
            try:
                return await asyncpg.connect(**self._connect_kwargs(), timeout=COMMAND_TIMEOUT)
            except _MISCONFIGURED:
                raise
            except CONNECTION_ERRORS as exc:
                if time.monotonic() + delay > deadline:
                    raise
                log.warning("database not reachable yet, retrying: %s", exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def _create_pool(self) -> asyncpg.Pool:
        return await asyncpg.create_pool(
            **self._connect_kwargs(),
            min_size=1,
            max_size=self._pool_size,
            command_timeout=COMMAND_TIMEOUT,
            reset=keep_session,
        )

    @property
    def writer_stats(self) -> tuple[int, int]:
        """(batches committed, writes committed): ops/batches is the group-commit factor."""
        return self.batches, self.ops

    # plumbing ------------------------------------------------------------------
    async def _db(
        self,
        fn: Callable[[asyncpg.Connection], Awaitable[T]],
        *,
        retry: bool = False,
        lane: Lane | None = None,
        write: bool = False,
    ) -> T:
        """Run ``fn`` on a pooled connection; database failures become StoreError.

        ``retry``: the call is safe to repeat (a read, an idempotent update), so
        a connection that died under it (server restart, failover, an admin's
        pg_terminate_backend; the pool may hold several dead ones) is replaced
        and the call made again, instead of failing an ack or a health check.
        ``write``: the call writes; its failure makes /healthz report the store unwritable.
        """
        if not write:
            return await self._run_db(fn, retry=retry, lane=lane)
        try:
            result = await self._run_db(fn, retry=retry, lane=lane)
        except StoreError as exc:
            # A constraint a row broke says nothing about whether we can write.
            if not isinstance(exc.__cause__, asyncpg.IntegrityConstraintViolationError):
                self._write_health.failed(exc.__cause__ or exc)
            raise
        return result

    async def _run_db(
        self,
        fn: Callable[[asyncpg.Connection], Awaitable[T]],
        *,
        retry: bool,
        lane: Lane | None,
    ) -> T:
        if self._pool is None:
            raise StoreError("the store is closed")
        attempts = self._pool_size + 1 if retry else 1
        for attempt in range(1, attempts + 1):
            try:
                if lane is not None:
                    return await lane.run(self._pool, fn)
                async with self._pool.acquire(timeout=COMMAND_TIMEOUT) as conn:
                    return await fn(conn)
            except TimeoutError as exc:
                # Not tried again: this already waited COMMAND_TIMEOUT (a lock
                # held elsewhere, a pool all in use, a silent network), and each
                # try more would wait as long, past a job's 90 s lease.
                raise StoreError(
                    f"database call failed: no answer within {COMMAND_TIMEOUT:g} s"
                ) from exc
            except asyncpg.QueryCanceledError as exc:
                # asyncpg files it under operator intervention, with the lost
                # connections, but the connection is fine: the server cancelled
                # the statement (its statement_timeout, an admin's
                # pg_cancel_backend), and trying again would be cancelled again.
                raise StoreError(f"database call failed: {exc}{timeout_note(exc)}") from exc
            except CONNECTION_ERRORS as exc:
                if attempt == attempts or self._pool is None:
                    raise StoreError(f"database call failed: {exc}") from exc
                self._lost_connections.log(
                    log, logging.WARNING, "database connection lost, trying again: %s", exc
                )
            except asyncpg.PostgresError as exc:
                raise StoreError(f"database call failed: {exc}{timeout_note(exc)}") from exc
        raise AssertionError("unreachable")

    async def _fetch(
        self,
        sql: str,
        *args: Any,
        retry: bool = False,
        lane: Lane | None = None,
        write: bool = False,
    ) -> list[asyncpg.Record]:
        return await self._db(
            lambda conn: conn.fetch(sql, *args), retry=retry, lane=lane, write=write
        )

    async def _fetchrow(
        self,
        sql: str,
        *args: Any,
        retry: bool = False,
        lane: Lane | None = None,
        write: bool = False,
    ) -> asyncpg.Record | None:
        return await self._db(
            lambda conn: conn.fetchrow(sql, *args), retry=retry, lane=lane, write=write
        )

    async def _execute(
        self,
        sql: str,
        *args: Any,
        retry: bool = False,
        lane: Lane | None = None,
        write: bool = False,
    ) -> str:
        return await self._db(
            lambda conn: conn.execute(sql, *args), retry=retry, lane=lane, write=write
        )

    async def ping(self) -> None:
        await self._fetchrow("SELECT 1", retry=True)

    @property
    def write_error(self) -> str | None:
        return self._write_health.error

    async def probe_write(self) -> None:
        # The smallest durable write every toko database can take: the schema
        # row with its own version in it. A standby or a read-only database
        # refuses it like any other write.
        with contextlib.suppress(StoreError):
            await self._execute("UPDATE toko_schema SET version = version", retry=True, write=True)
            self._write_health.proven()
