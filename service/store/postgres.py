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
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
import ssl
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit, urlunsplit

import asyncpg  # type: ignore[import-untyped]  # no stubs shipped

from service.logs import Throttle
from service.models import JOB_STATES, Job, JobState, NewJob, Product, QueueCounts, job_from_row
from service.store.admin import RETRYABLE_WHERE, STATE_WHERE, JobDetails, QueueStats, Retryable
from service.store.base import (
    ABANDONED_AGAIN_SQL,
    ABANDONED_ERROR,
    LoginRefused,
    StoreError,
    WriteHealth,
    note_lost_claims,
    without_abandoned,
)
from service.store.pg_migrations import JOBS_CHANNEL, RECAP_LOCK_CLASS, SchemaTooNew, migrate

T = TypeVar("T")
log = logging.getLogger("toko.store")

_JOB_COLUMNS = (
    "id, kind, payload::text, state, attempts, max_attempts, run_at, last_error, created_at"
)
_DETAIL_COLUMNS = f"{_JOB_COLUMNS}, updated_at, lease_until"
# Upper bound on one batch so a flood cannot make one statement huge.
MAX_BATCH = 512
# Seconds between liveness probes of the idle LISTEN connection, and between
# reconnection attempts when it is gone.
LISTEN_PROBE_SECONDS = 30.0
LISTEN_RETRY_SECONDS = 1.0
COMMAND_TIMEOUT = 30.0
# Jobs one `toko-queue retry` changes per statement (see retry_now).
RETRY_CHUNK = 1000
# How long close() waits for the database before dropping the connections.
CLOSE_SECONDS = 5.0
# Leases and retry times are this host's wall clock, compared on every host:
# a clock this far from the database server's is worth a warning. Trouble
# (a job run twice at once) starts once it nears the lease, 30 s or more.
CLOCK_SKEW_WARN_SECONDS = 5.0
SERVER_TIME_SQL = "SELECT extract(epoch FROM clock_timestamp())::float8"
# How long open() waits for an unreachable server (below TimeoutStartSec=60s).
OPEN_RETRY_SECONDS = 20.0
# Connection failures: the server is down or gone, not a bad statement.
_CONNECTION_ERRORS = (
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
_DB_ERRORS = (asyncpg.PostgresError, *_CONNECTION_ERRORS)
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


def _rows(status: str) -> int:
    """How many rows a command changed, from its status ("UPDATE 3")."""
    return int(status.rpartition(" ")[2] or 0)


# toko sets neither: a role's or database's own setting cut the call short.
_SERVER_TIMEOUTS = {"statement timeout": "statement_timeout", "lock timeout": "lock_timeout"}


def _timeout_note(exc: BaseException) -> str:
    """Where the server cut a call short for a setting toko never sets, what
    to add to its message ("canceling statement due to statement timeout")
    so that it names the setting."""
    if isinstance(exc, asyncpg.PostgresError):
        for words, setting in _SERVER_TIMEOUTS.items():
            if words in str(exc):
                return f" (the {setting} set for this role or database is too short for it)"
    return ""


# libpq and asyncpg also take the password as a query parameter (?password=).
_QUERY_PASSWORD = re.compile(r"(?<![^&])password=([^&]*)")


def redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    return _replace_password(url, "***")[0]


def without_password(url: str) -> tuple[str, str | None]:
    """``url`` with no password in it, for a command line; and the password
    it held (decoded), the one in the user part first, as libpq takes it."""
    return _replace_password(url, None)


def _replace_password(url: str, mask: str | None) -> tuple[str, str | None]:
    parts = urlsplit(url)
    in_query = _QUERY_PASSWORD.search(parts.query)
    if parts.password is None and in_query is None:
        return url, None
    password = parts.password if parts.password is not None else in_query and in_query[1]
    netloc = parts.netloc
    if parts.password is not None:
        user = parts.username or ""
        hosts = netloc.rpartition("@")[2]
        netloc = f"{user}@{hosts}" if mask is None else f"{user}:{mask}@{hosts}"
    query = _QUERY_PASSWORD.sub("" if mask is None else f"password={mask}", parts.query)
    query = "&".join(param for param in query.split("&") if param)
    return urlunsplit(parts._replace(netloc=netloc, query=query)), unquote(password or "")


def _set_event(event: asyncio.Event, *_: object) -> None:
    event.set()


def _details_from_row(row: Sequence[Any]) -> JobDetails:
    return JobDetails(job=job_from_row(row[:9]), updated_at=row[9], lease_until=row[10])


def list_jobs_sql(state: JobState) -> str:
    """The query of ``list_jobs`` (parameter: the limit): done and failed jobs
    come in order from their own indexes (migrations 2 and 5), not the table."""
    return (
        f"SELECT {_DETAIL_COLUMNS} FROM jobs WHERE {STATE_WHERE[state]} "
        "ORDER BY updated_at DESC, id DESC LIMIT $1"
    )


# One chunk of purge_done (parameters: older_than, chunk), through jobs_done_updated_at.
PURGE_DONE_SQL = """
    WITH doomed AS (
        SELECT id FROM jobs WHERE state = 'done' AND updated_at < $1
         LIMIT $2 FOR UPDATE SKIP LOCKED
    ), unlinked AS (
        UPDATE recaps SET job_id = NULL WHERE job_id IN (SELECT id FROM doomed)
    ), deleted AS (
        DELETE FROM jobs WHERE id IN (SELECT id FROM doomed) RETURNING 1
    )
    SELECT count(*) FROM deleted
"""


@dataclass
class _ProductWrite:
    nama: str
    harga: int
    make_job: Callable[[Product], NewJob]
    future: asyncio.Future[tuple[Product, int | None]]
    key: str | None = None


class _Lane:
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
            except _CONNECTION_ERRORS:
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
            with contextlib.suppress(*_DB_ERRORS):
                await pool.release(conn, timeout=COMMAND_TIMEOUT)
        else:
            await self.release(pool)

    async def release(self, pool: asyncpg.Pool) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(*_DB_ERRORS):
                await pool.release(conn, timeout=COMMAND_TIMEOUT)


def _usable(conn: asyncpg.Connection) -> bool:
    try:
        return not conn.is_closed()
    except asyncpg.InterfaceError:  # detached: the pool took it back when it closed
        return False


async def _keep_session(conn: asyncpg.Connection) -> None:
    """Release a pooled connection as it is (asyncpg still rolls back an open transaction).

    asyncpg's default reset sends ``RESET ALL; UNLISTEN *; CLOSE ALL;
    pg_advisory_unlock_all()``: one more round trip per store call, 12-16 % of
    a draining worker's time. Pooled connections never hold session state
    here: locks are transaction-scoped, LISTEN has its own connection.
    """


class PostgresStore:
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
        self._writes: asyncio.Queue[_ProductWrite | None] = asyncio.Queue()
        self._writer: asyncio.Task[None] | None = None
        self._wakeup_callbacks: list[Callable[[], None]] = []
        self._listener: asyncio.Task[None] | None = None
        self._claims = _Lane()
        self._acks = _Lane()
        self._enqueues = _Lane()
        self._product_writes = _Lane()
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
            except _CONNECTION_ERRORS as exc:
                if time.monotonic() + delay > deadline:
                    raise
                log.warning("database not reachable yet, retrying: %s", exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

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
            self._pool = await asyncpg.create_pool(
                **self._connect_kwargs(),
                min_size=1,
                max_size=self._pool_size,
                command_timeout=COMMAND_TIMEOUT,
                reset=_keep_session,
            )
        except SchemaTooNew as exc:
            raise StoreError(str(exc)) from exc
        except (*_DB_ERRORS, ValueError) as exc:
            # One line: asyncpg puts its HINT on a line of its own.
            why = " ".join(str(exc).split()) + _timeout_note(exc)
            # A server asking for a password we do not have answers with
            # InvalidPasswordError too (asyncpg then sends an empty one).
            refused = isinstance(exc, asyncpg.InvalidAuthorizationSpecificationError)
            error = LoginRefused if refused else StoreError
            raise error(f"cannot open database {redact(self.url)}: {why}") from exc
        self._writer = asyncio.create_task(self._write_loop(), name="toko-pg-writer")

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
        with contextlib.suppress(*_DB_ERRORS):
            await closing

    async def _close_gracefully(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            self._writes.put_nowait(None)  # writes queued before this still commit
            # One that died (wait_broken said so) must not stop the rest closing.
            await asyncio.wait([writer])
            if not writer.cancelled():
                writer.exception()
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
        lane: _Lane | None = None,
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
        lane: _Lane | None,
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
                raise StoreError(f"database call failed: {exc}{_timeout_note(exc)}") from exc
            except _CONNECTION_ERRORS as exc:
                if attempt == attempts or self._pool is None:
                    raise StoreError(f"database call failed: {exc}") from exc
                self._lost_connections.log(
                    log, logging.WARNING, "database connection lost, trying again: %s", exc
                )
            except asyncpg.PostgresError as exc:
                raise StoreError(f"database call failed: {exc}{_timeout_note(exc)}") from exc
        raise AssertionError("unreachable")

    async def _fetch(
        self,
        sql: str,
        *args: Any,
        retry: bool = False,
        lane: _Lane | None = None,
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
        lane: _Lane | None = None,
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
        lane: _Lane | None = None,
        write: bool = False,
    ) -> str:
        return await self._db(
            lambda conn: conn.execute(sql, *args), retry=retry, lane=lane, write=write
        )

    # products ------------------------------------------------------------------
    async def create_product(
        self,
        nama: str,
        harga: int,
        make_job: Callable[[Product], NewJob],
        idempotency_key: str | None = None,
    ) -> tuple[Product, int | None]:
        if self._writer is None or self._writer.done():
            raise StoreError("the store is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[tuple[Product, int | None]] = loop.create_future()
        self._writes.put_nowait(_ProductWrite(nama, harga, make_job, future, idempotency_key))
        return await future

    async def _write_loop(self) -> None:
        while True:
            first = await self._writes.get()
            batch = [first] if first is not None else []
            stop = first is None
            while not stop and len(batch) < MAX_BATCH and not self._writes.empty():
                item = self._writes.get_nowait()
                if item is None:
                    stop = True
                else:
                    batch.append(item)
            # A caller that gave up (a POST cancelled at shutdown, past its
            # grace, behind a locked table) got no answer: make neither its
            # product nor its job, leased to a process that is stopping.
            batch = [write for write in batch if not write.future.cancelled()]
            if batch:
                await self._commit_products(batch)
            if stop:
                return

    async def _commit_products(
        self, batch: list[_ProductWrite], *, asked_again: bool = False
    ) -> None:
        try:
            await self._insert_products(batch)
        except StoreError as exc:
            cause = exc.__cause__
            if isinstance(cause, asyncpg.UniqueViolationError) and not asked_again:
                # Another instance stored one of these Idempotency-Keys since we
                # looked (the statement failed whole): look again, then insert.
                # Not the writes answered meanwhile: a caller that gave up, or
                # a write whose job could not be made, is not written again.
                waiting = [write for write in batch if not write.future.done()]
                if waiting:
                    await self._commit_products(waiting, asked_again=True)
                return
            bad_row = isinstance(cause, asyncpg.PostgresError) and not isinstance(
                cause, _CONNECTION_ERRORS
            )
            # A lost connection may have committed: never write the batch again.
            if len(batch) == 1 or not bad_row:
                for write in batch:
                    if not write.future.done():
                        write.future.set_exception(exc)
                return
            # A bad row fails the whole statement: give each write its own.
            for write in batch:
                if not write.future.done():
                    await self._commit_products([write])
        except Exception as exc:  # a bug here must not kill the writer
            log.exception("product write failed")
            for write in batch:
                if not write.future.done():
                    write.future.set_exception(StoreError(f"database write failed: {exc}"))

    async def _insert_products(self, batch: list[_ProductWrite]) -> None:
        batch, later = await self._answer_known_keys(batch)
        if batch:
            await self._insert_new_products(batch)
        if later:
            # Their keys came earlier in this batch: now stored, they are answered.
            await self._commit_products(later)

    async def _answer_known_keys(
        self, batch: list[_ProductWrite]
    ) -> tuple[list[_ProductWrite], list[_ProductWrite]]:
        """Answer the writes whose key is stored already; return (to insert, to retry after).

        A key twice in one batch: the first is inserted, the rest wait for it.
        """
        keys = [write.key for write in batch if write.key is not None]
        if not keys:
            return batch, []
        rows = await self._fetch(
            "SELECT idempotency_key, id, nama, harga, created_at FROM products"
            " WHERE idempotency_key = ANY($1::text[])",
            keys,
            retry=True,
            lane=self._product_writes,
        )
        known = {key: Product(*product) for key, *product in rows}
        fresh: list[_ProductWrite] = []
        later: list[_ProductWrite] = []
        taken: set[str] = set()
        for write in batch:
            if write.key is None:
                fresh.append(write)
            elif write.key in known:
                if not write.future.done():
                    write.future.set_result((known[write.key], None))
            elif write.key in taken:
                later.append(write)
            else:
                taken.add(write.key)
                fresh.append(write)
        return fresh, later

    async def _insert_new_products(self, batch: list[_ProductWrite]) -> None:
        now = self._clock()
        # Ids first (sequences are not transactional): the job payload needs
        # the product id, and make_job is our caller's Python code.
        ids = await self._fetch(
            "SELECT nextval('products_id_seq'), nextval('jobs_id_seq') FROM generate_series(1, $1)",
            len(batch),
            retry=True,
            write=True,
            lane=self._product_writes,
        )
        rows: list[tuple[_ProductWrite, Product, int, NewJob, str]] = []
        for write, (product_id, job_id) in zip(batch, sorted(ids), strict=True):
            product = Product(product_id, write.nama, write.harga, now)
            try:
                job = write.make_job(product)
                payload = json.dumps(job.payload)
            except Exception as exc:  # this write alone fails; nothing of it is stored
                if not write.future.done():  # the caller may have gone (cancelled)
                    write.future.set_exception(exc)
                continue
            rows.append((write, product, job_id, job, payload))
        if not rows:
            return
        # One statement is one transaction: both rows of every write, or none.
        await self._execute(
            """
            WITH p AS (
                INSERT INTO products (id, nama, harga, created_at, idempotency_key)
                SELECT * FROM unnest($1::bigint[], $2::text[], $3::bigint[], $4::float8[],
                                     $10::text[])
            )
            INSERT INTO jobs (id, kind, payload, max_attempts, run_at, created_at, updated_at,
                              state, attempts, lease_until)
            SELECT j.id, j.kind, j.payload::jsonb, j.max_attempts, $4[1], $4[1], $4[1],
                   -- leased_for: claimed by the enqueuing instance itself, as claim() would
                   CASE WHEN j.leased_for IS NULL THEN 'pending' ELSE 'running' END,
                   CASE WHEN j.leased_for IS NULL THEN 0 ELSE 1 END,
                   $4[1] + j.leased_for
              FROM unnest($5::bigint[], $6::text[], $7::text[], $8::int[], $9::float8[])
                   AS j (id, kind, payload, max_attempts, leased_for)
            """,
            [r[1].id for r in rows],
            [r[1].nama for r in rows],
            [r[1].harga for r in rows],
            [now] * len(rows),
            [r[2] for r in rows],
            [r[3].kind for r in rows],
            [r[4] for r in rows],
            [r[3].max_attempts for r in rows],
            [r[3].leased_for for r in rows],
            [r[0].key for r in rows],
            write=True,
            lane=self._product_writes,
        )
        self.batches += 1
        self.ops += len(rows)
        self._write_health.proven()
        for write, product, job_id, _, _ in rows:
            if not write.future.done():  # the caller may have gone (cancelled)
                write.future.set_result((product, job_id))

    async def get_product(self, product_id: int) -> Product | None:
        row = await self._fetchrow(
            "SELECT id, nama, harga, created_at FROM products WHERE id = $1", product_id, retry=True
        )
        return Product(*row) if row else None

    async def list_products(self, after_id: int, limit: int) -> list[Product]:
        rows = await self._fetch(
            "SELECT id, nama, harga, created_at FROM products WHERE id > $1 ORDER BY id LIMIT $2",
            after_id,
            limit,
            retry=True,
        )
        return [Product(*row) for row in rows]

    async def product_counts(self, start: float, end: float) -> tuple[int, int]:
        """(products created before ``end``, products created in [start, end))."""
        row = await self._fetchrow(
            "SELECT count(*) FILTER (WHERE created_at < $2),"
            "       count(*) FILTER (WHERE created_at >= $1 AND created_at < $2)"
            "  FROM products",
            start,
            end,
            retry=True,
        )
        assert row is not None
        return int(row[0]), int(row[1])

    # queue -----------------------------------------------------------------------
    async def enqueue(self, job: NewJob) -> int:
        now = self._clock()
        leased = job.leased_for is not None
        row = await self._fetchrow(
            "INSERT INTO jobs (kind, payload, max_attempts, run_at, created_at, updated_at,"
            " state, attempts, lease_until)"
            " VALUES ($1, $2::jsonb, $3, $4, $4, $4, $5, $6, $7) RETURNING id",
            job.kind,
            json.dumps(job.payload),
            job.max_attempts,
            now,
            "running" if leased else "pending",
            1 if leased else 0,
            now + job.leased_for if job.leased_for is not None else None,
            write=True,
            lane=self._enqueues,
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
            RETURNING {", ".join(f"jobs.{c}" for c in _JOB_COLUMNS.split(", "))}
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
        note_lost_claims(len(jobs), _rows(status), "done")

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
        note_lost_claims(1, _rows(status), state)

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
        for state, count in await self._fetch(
            "SELECT state, count(*) FROM jobs GROUP BY state", retry=True
        ):
            figures[state] = int(count)
        return QueueCounts(**figures)

    async def get_job(self, job_id: int) -> Job | None:
        row = await self._fetchrow(
            f"SELECT {_JOB_COLUMNS} FROM jobs WHERE id = $1", job_id, retry=True
        )
        return job_from_row(row) if row else None

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
            except _DB_ERRORS as exc:
                self._listen_failures.log(
                    log, logging.WARNING, "LISTEN connection failed, retrying: %s", exc
                )
            finally:
                if conn is not None and not conn.is_closed():
                    with contextlib.suppress(*_DB_ERRORS):
                        await conn.close(timeout=5)
            await asyncio.sleep(LISTEN_RETRY_SECONDS)

    async def _insist_on_utf8(self, conn: asyncpg.Connection) -> None:
        """Refuse a database that cannot hold every name a client may send.

        `createdb` takes the cluster's encoding, SQL_ASCII where initdb ran
        under the C locale (a Debian without locales). asyncpg talks UTF-8,
        and the server then fails every statement with a character beyond
        ASCII: each such product would be a 503 for good, not a bad start.
        """
        encoding = await conn.fetchval("SHOW server_encoding", timeout=COMMAND_TIMEOUT)
        if encoding != "UTF8":
            raise StoreError(
                f"the database {redact(self.url)} is in {encoding}, not UTF8, so names beyond"
                " ASCII cannot be stored: create it with createdb --encoding=UTF8"
                " --template=template0"
            )

    async def _insist_on_durable_commits(self, conn: asyncpg.Connection) -> None:
        """A 201 promises the product survives a crash, the database's included.

        With synchronous_commit off (a default some servers set for speed), a
        commit returns before its WAL is flushed, and a database crash loses
        the last fraction of a second of answered requests. toko's sessions
        then ask for on; any other value already flushes locally and is kept
        (remote_apply waits for standbys too).
        """
        setting = await conn.fetchval("SHOW synchronous_commit", timeout=COMMAND_TIMEOUT)
        if setting == "off":
            self._session_settings["synchronous_commit"] = "on"
            log.info(
                "the database's synchronous_commit is off: toko's own sessions use on,"
                " so that every 201 survives a database crash"
            )

    async def _stay_connected_while_idle(self, conn: asyncpg.Connection) -> None:
        """Keep the database's idle_session_timeout off toko's own sessions.

        Managed servers often set one (PostgreSQL 14+, per role or database).
        toko's connections are idle by design: the LISTEN connection waits for
        NOTIFYs and probes only every 30 s, pooled ones wait for requests.
        Under such a timeout the server closed the LISTEN connection every few
        seconds: a warning each time, and the jobs other processes enqueued
        while it reconnected waited for the sweep instead of starting at once.
        The pool is bounded (see the README), so nothing piles up.
        """
        # NULL before PostgreSQL 14, which has no such setting (and would
        # refuse it as a connection parameter).
        setting = await conn.fetchval(
            "SELECT current_setting('idle_session_timeout', true)", timeout=COMMAND_TIMEOUT
        )
        if setting not in (None, "0"):
            self._session_settings["idle_session_timeout"] = "0"
            log.info(
                "the database's idle_session_timeout is %s: toko's own sessions use 0 (none),"
                " since its LISTEN and pooled connections wait idle by design",
                setting,
            )

    async def _check_clock(self, conn: asyncpg.Connection) -> None:
        """Warn when this host's clock strays from the database server's, and
        say when it is back: every host compares leases with its own clock."""
        before = self._clock()
        server = await conn.fetchval(SERVER_TIME_SQL, timeout=COMMAND_TIMEOUT)
        skew = (before + self._clock()) / 2 - server
        skewed = abs(skew) > CLOCK_SKEW_WARN_SECONDS
        if skewed and not self._clock_skewed:
            log.warning(
                "this host's clock is %+.1f s off the database server's: job leases and"
                " retry times compare clocks across hosts, so keep them in sync (NTP)",
                skew,
                extra={"CLOCK_SKEW_SECONDS": round(skew, 1)},
            )
        elif self._clock_skewed and not skewed:
            log.info(
                "this host's clock agrees with the database server's again",
                extra={"CLOCK_SKEW_SECONDS": round(skew, 1)},
            )
        self._clock_skewed = skewed

    # recaps ------------------------------------------------------------------------
    async def record_recap(
        self, period: str, products_total: int, products_new: int, job: NewJob
    ) -> int | None:
        """Record a period's recap and enqueue its email, once: None if already recorded."""
        now = self._clock()

        async def run(conn: asyncpg.Connection) -> int | None:
            async with conn.transaction():
                # Racing runs (timers on every host) queue here; the winner's
                # row is visible to the rest once they get the lock.
                await conn.execute(
                    "SELECT pg_advisory_xact_lock($1, hashtext($2))", RECAP_LOCK_CLASS, period
                )
                if await conn.fetchval("SELECT 1 FROM recaps WHERE period = $1", period):
                    return None
                job_id: int = await conn.fetchval(
                    "INSERT INTO jobs (kind, payload, max_attempts, run_at, created_at,"
                    " updated_at) VALUES ($1, $2::jsonb, $3, $4, $4, $4) RETURNING id",
                    job.kind,
                    json.dumps(job.payload),
                    job.max_attempts,
                    now,
                )
                await conn.execute(
                    "INSERT INTO recaps (period, products_total, products_new, job_id,"
                    " created_at) VALUES ($1, $2, $3, $4, $5)",
                    period,
                    products_total,
                    products_new,
                    job_id,
                    now,
                )
                return job_id

        return await self._db(run, write=True)

    async def database_time(self) -> float:
        """The database server's clock (SharedClock): a recap's day is over when it says so."""
        row = await self._fetchrow(SERVER_TIME_SQL, retry=True)
        assert row is not None
        return float(row[0])

    async def last_recap_before(self, period: str) -> str | None:
        """The latest recorded period earlier than ``period`` (ISO dates sort as text)."""
        row = await self._fetchrow(
            "SELECT max(period) FROM recaps WHERE period < $1", period, retry=True
        )
        assert row is not None
        return None if row[0] is None else str(row[0])

    # queue administration (QueueAdmin: toko-queue, retention) -----------------------
    async def queue_stats(self) -> QueueStats:
        figures = dict.fromkeys(JOB_STATES, 0)
        by_kind: dict[str, dict[str, int]] = {}
        rows = await self._fetch(
            "SELECT kind, state, count(*) FROM jobs GROUP BY kind, state ORDER BY kind", retry=True
        )
        for kind, state, count in rows:
            figures[state] += int(count)
            by_kind.setdefault(kind, dict.fromkeys(JOB_STATES, 0))[state] = int(count)
        oldest = await self._fetchrow(
            "SELECT min(run_at) FROM jobs WHERE state = 'pending'", retry=True
        )
        return QueueStats(QueueCounts(**figures), by_kind, oldest[0] if oldest else None)

    async def list_jobs(self, state: JobState, limit: int) -> list[JobDetails]:
        rows = await self._fetch(list_jobs_sql(state), limit, retry=True)
        return [_details_from_row(row) for row in rows]

    async def job_details(self, job_id: int) -> JobDetails | None:
        row = await self._fetchrow(
            f"SELECT {_DETAIL_COLUMNS} FROM jobs WHERE id = $1", job_id, retry=True
        )
        return _details_from_row(row) if row else None

    async def retry_now(
        self, job_ids: Sequence[int] | None, which: Retryable, chunk: int = RETRY_CHUNK
    ) -> list[int]:
        where = RETRYABLE_WHERE[which]
        if job_ids is None:
            rows = await self._fetch(f"SELECT id FROM jobs WHERE {where} ORDER BY id", retry=True)
            job_ids = [int(row[0]) for row in rows]
        # Chunks, each its own statement: one update of a whole backlog
        # (300,000 failed jobs) outlasted a statement_timeout of 500 ms set for
        # the role or database, and `retry --all-failed` could never succeed.
        ids = list(job_ids)
        retried: list[int] = []
        for start in range(0, len(ids), chunk):
            retried += await self._retry_chunk(ids[start : start + chunk], where)
        return sorted(retried)

    async def _retry_chunk(self, job_ids: list[int], where: str) -> list[int]:
        # attempts = 0: an admin's retry gets the full attempt budget again;
        # last_error stays as the history of why it had failed. ``where`` is
        # checked again, so a job that changed since it was listed is left
        # alone. The jobs are due now, so every instance hears of them
        # (NOTIFY, same transaction).
        rows = await self._fetch(
            f"""
            WITH retried AS (
                UPDATE jobs SET state = 'pending', attempts = 0, run_at = $2,
                       lease_until = NULL, updated_at = $2
                 WHERE {where} AND id = ANY($1::bigint[])
                RETURNING id
            ), told AS (
                SELECT pg_notify('{JOBS_CHANNEL}', '') WHERE EXISTS (SELECT 1 FROM retried)
            )
            SELECT id FROM retried, (SELECT count(*) FROM told) AS t
            """,
            job_ids,
            self._clock(),
            write=True,
        )
        return [int(row[0]) for row in rows]

    async def purge_done(self, older_than: float, chunk: int = 1000) -> int:
        # Chunks, each its own transaction: no long lock on a big table while
        # every instance keeps acking. A recap keeps its row (that is what makes
        # a period run once) but lets go of its pruned email job.
        total = 0
        while True:
            row = await self._fetchrow(PURGE_DONE_SQL, older_than, chunk, write=True)
            deleted = int(row[0]) if row else 0
            total += deleted
            if deleted < chunk:
                return total
