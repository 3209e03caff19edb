"""The SQLite store: one file under the state directory, WAL, durable commits.

Writes go through :class:`GroupCommitWriter` (one thread, batched commits with
``synchronous=FULL``); reads run on a small pool of read-only connections, which
WAL lets proceed while the writer commits. No SQLite call runs on the event loop.

Usage from other code (toko-recap, toko-backup, tests)::

    store = SqliteStore("/var/lib/toko/toko.db")
    await store.open()
    try:
        ...
    finally:
        await store.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from service.models import JOB_STATES, Job, JobState, NewJob, Product, QueueCounts, job_from_row
from service.store.admin import RETRYABLE_WHERE, STATE_WHERE, JobDetails, QueueStats, Retryable
from service.store.base import (
    ABANDONED_AGAIN_SQL,
    ABANDONED_ERROR,
    StoreError,
    WriteHealth,
    note_lost_claims,
    without_abandoned,
)
from service.store.checkpoints import LIMIT_BYTES, Checkpointer
from service.store.file_guard import FileGuard
from service.store.group_commit import BatchFn, GroupCommitWriter
from service.store.migrations import migrate

T = TypeVar("T")
A = TypeVar("A")
log = logging.getLogger("toko.store")

_JOB_COLUMNS = "id, kind, payload, state, attempts, max_attempts, run_at, last_error, created_at"
_DETAIL_COLUMNS = f"{_JOB_COLUMNS}, updated_at, lease_until"


BUSY_TIMEOUT_SECONDS = 10.0
# While another process writes at start (a toko-queue command, a sqlite3
# shell), open() waits for it in slices this long: a stop ends the wait.
OPEN_WAIT_SLICE_SECONDS = 0.1
# Jobs one `toko-queue retry` changes per commit: SQLite has one write lock,
# and toko-api's writes wait for it while a chunk commits.
RETRY_CHUNK = 1000
# Between two chunks of a long admin write (a retry, a purge), how long this
# process leaves the write lock alone. SQLite keeps no queue for it: a
# toko-api write waiting in its busy handler tries again 1, 2, 5, 10, 15 and
# 20 ms apart, and chunks back to back kept POSTs waiting up to 1.5 s.
CHUNK_PAUSE_SECONDS = 0.02
# After a failed write, the health probe wants this much room on the
# database's filesystem before it calls the store writable again.
PROBE_MIN_FREE = 1 << 20


def connect(path: str, *, read_only: bool = False) -> sqlite3.Connection:
    """A connection set up the way every toko process needs it."""
    # isolation_level=None: we issue BEGIN/COMMIT ourselves (group commit, migrations).
    conn = sqlite3.connect(
        path, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_SECONDS
    )
    conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_SECONDS * 1000)}")
    if read_only:
        conn.execute("PRAGMA query_only = 1")
    else:
        _use_wal(conn)
        # FULL: a commit is on disk before we answer 201, power cut included.
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute("PRAGMA foreign_keys = ON")
    return conn


def _use_wal(conn: sqlite3.Connection) -> None:
    # Switching a brand-new file to WAL needs an exclusive lock. When several
    # connections race for it (toko-api and a timer job at first boot), SQLite
    # answers some of them "database is locked" at once instead of through the
    # busy handler, to avoid a deadlock: wait and try again, as the handler would.
    deadline = time.monotonic() + BUSY_TIMEOUT_SECONDS
    delay = 0.001
    while True:
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            busy = getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_BUSY
            if not busy or time.monotonic() + delay > deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def _migrate_when_free(conn: sqlite3.Connection, path: str, cancelled: threading.Event) -> None:
    """migrate(), waiting up to the busy timeout for another process's write
    transaction to end, in short slices so that ``cancelled`` ends the wait."""
    deadline = time.monotonic() + BUSY_TIMEOUT_SECONDS
    conn.execute(f"PRAGMA busy_timeout = {int(OPEN_WAIT_SLICE_SECONDS * 1000)}")
    said = False
    while True:
        try:
            migrate(conn)
            return
        except sqlite3.OperationalError as exc:
            busy = getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_BUSY
            if not busy or cancelled.is_set() or time.monotonic() >= deadline:
                raise
        if not said:
            # Otherwise start-up just stalls, and an admin wonders why.
            log.warning(
                "database is locked by another process; waiting for it",
                extra={"DATABASE": path, "WAIT_S": BUSY_TIMEOUT_SECONDS},
            )
            said = True


async def _let_others_write() -> None:
    await asyncio.sleep(CHUNK_PAUSE_SECONDS)


def _details_from_row(row: Sequence[Any]) -> JobDetails:
    return JobDetails(job=job_from_row(row[:9]), updated_at=row[9], lease_until=row[10])


# SQLite's result codes for a damaged file (a failing disk): no retry or probe
# makes such a database whole again.
_DAMAGE_CODES = frozenset({sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB})


def _is_damage(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)  # the extended code: its low byte is primary
    return code is not None and code & 0xFF in _DAMAGE_CODES


class SqliteStore:
    def __init__(
        self, path: str, *, clock: Callable[[], float] = time.time, readers: int = 2
    ) -> None:
        self.path = path
        self._clock = clock
        self._file_guard = FileGuard(path)
        self._checkpointer = Checkpointer(self._connect_checkpointer)
        self._writer = GroupCommitWriter(
            self._connect_writer,
            self._file_guard.check,
            on_death=self._writer_died,
            upkeep=self._checkpointer,
        )
        # Set (from the writer thread) if the writer dies: see wait_broken().
        self._broken: asyncio.Future[None] | None = None
        self._reader_count = readers
        self._readers: ThreadPoolExecutor | None = None
        # One connection per reader thread, lent out for each read.
        self._idle_readers: queue.SimpleQueue[sqlite3.Connection] = queue.SimpleQueue()
        self._write_health = WriteHealth()
        # Why the file is damaged, from SQLite's first report of it; kept until a
        # restart (see _noticed).
        self._damage: str | None = None

    # lifecycle ---------------------------------------------------------------
    async def open(self) -> None:
        loop = asyncio.get_running_loop()
        self._broken = loop.create_future()
        # Set when open() is cancelled (a stop during start-up): the thread
        # that waits for another process's write lock gives up at once, rather
        # than hold the exit for the rest of the busy timeout.
        cancelled = threading.Event()
        try:
            await asyncio.to_thread(self._prepare, cancelled)
            self._writer.start()
            await asyncio.to_thread(self._checkpointer.start)
            await asyncio.to_thread(self._open_readers)
        except (OSError, sqlite3.Error, RuntimeError) as exc:
            await self.close()
            raise StoreError(f"cannot open database {self.path}: {exc}") from exc
        except asyncio.CancelledError:
            cancelled.set()
            await self.close()
            raise
        self._readers = ThreadPoolExecutor(self._reader_count, "toko-sqlite-reader")

    def _prepare(self, cancelled: threading.Event) -> None:
        parent = Path(self.path).parent
        parent.mkdir(parents=True, exist_ok=True)
        conn = connect(self.path)
        try:
            _migrate_when_free(conn, self.path, cancelled)
        finally:
            conn.close()

    def _open_readers(self) -> None:
        # All at start, not when a reader thread first needs one: opened by
        # path after the file was deleted, a connection would create an empty
        # database there (see file_guard). The first read also opens the WAL,
        # which SQLite otherwise opens by path on a connection's first read.
        for _ in range(self._reader_count):
            conn = connect(self.path, read_only=True)
            self._idle_readers.put(conn)
            conn.execute("SELECT count(*) FROM sqlite_schema").fetchone()

    def _connect_writer(self) -> sqlite3.Connection:
        conn = connect(self.path)
        # Checkpoints are the Checkpointer's, off the commit path; after a
        # long log the file is cut back once it starts over.
        conn.execute("PRAGMA wal_autocheckpoint = 0")
        conn.execute(f"PRAGMA journal_size_limit = {LIMIT_BYTES}")
        self._file_guard.opened(conn)
        return conn

    def _connect_checkpointer(self) -> sqlite3.Connection:
        conn = connect(self.path)
        conn.execute("PRAGMA wal_autocheckpoint = 0")  # it never commits, but say so
        return conn

    async def close(self) -> None:
        await asyncio.to_thread(self._checkpointer.stop)
        await asyncio.to_thread(self._writer.stop)
        if self._broken is not None and self._broken.done():
            self._broken.exception()  # wait_broken() told whoever asked; nobody else will
        if self._readers is not None:
            self._readers.shutdown(wait=True)  # after which every reader is idle
            self._readers = None
        while not self._idle_readers.empty():
            self._idle_readers.get_nowait().close()

    async def wait_broken(self) -> None:
        """Raise StoreError once no write can succeed until a restart (the writer
        thread died, the write-ahead log was deleted): toko-api supervises this
        like its other side tasks."""
        if self._broken is None:
            raise StoreError("the store is not open")
        await asyncio.shield(self._broken)

    def _writer_died(self, exc: BaseException) -> None:  # on the writer thread
        broken = self._broken
        if broken is None:
            return
        failure = StoreError(f"the SQLite writer thread died: {exc!r}")
        # A closed loop has nobody left to tell.
        with contextlib.suppress(RuntimeError):
            broken.get_loop().call_soon_threadsafe(self._break, failure)

    def _break(self, failure: StoreError) -> None:
        """Tell wait_broken()'s caller that only a restart makes the store work again."""
        if self._broken is not None and not self._broken.done():
            self._broken.set_exception(failure)

    @property
    def writer_stats(self) -> tuple[int, int]:
        """(batches committed, writes committed): ops/batches is the group-commit factor."""
        return self._writer.batches, self._writer.ops

    # plumbing ------------------------------------------------------------------
    async def _write(self, fn: BatchFn[A, T], arg: A) -> T:
        try:
            result = await self._writer.run(fn, arg)
        except sqlite3.Error as exc:
            self._noticed(exc)
            if self._file_guard.restart_heals:
                self._break(StoreError(f"the database needs a restart: {exc}"))
            # A constraint a row broke says nothing about whether we can write.
            if not isinstance(exc, sqlite3.IntegrityError):
                self._write_health.failed(exc)
            raise StoreError(f"database write failed: {exc}") from exc
        except RuntimeError as exc:
            self._write_health.failed(exc)
            raise StoreError(str(exc)) from exc
        return result

    async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        if self._readers is None:
            raise StoreError("the store is closed")
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._readers, self._in_reader, fn)
        except sqlite3.Error as exc:
            self._noticed(exc)
            raise StoreError(f"database read failed: {exc}") from exc

    def _noticed(self, exc: sqlite3.Error) -> None:
        """A damaged file (SQLite: "database disk image is malformed") is
        unhealthy until a restart, and said once at critical priority.

        Only the requests that touch a damaged page fail; the health probe's
        one-page write would succeed and call the store healthy again, while
        every POST failed. The damage is for the admin to repair (restore a
        backup), and no later success undoes it.
        """
        if self._damage is None and _is_damage(exc):
            self._damage = f"the database file is damaged: {exc} (README: A damaged database)"
            log.critical(
                "%s; what needs the damaged part fails with 503 until it is restored",
                self._damage,
                extra={"DATABASE": self.path},
            )

    def _in_reader(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        # As many connections as threads: one is always idle for this thread.
        conn = self._idle_readers.get_nowait()
        try:
            return fn(conn)
        finally:
            self._idle_readers.put(conn)

    # products ------------------------------------------------------------------
    async def create_product(
        self,
        nama: str,
        harga: int,
        make_job: Callable[[Product], NewJob],
        idempotency_key: str | None = None,
    ) -> tuple[Product, int | None]:
        arg = (nama, harga, self._clock(), make_job, idempotency_key)
        result = await self._write(_create_products, arg)
        self._write_health.proven()
        return result

    async def get_product(self, product_id: int) -> Product | None:
        def read(conn: sqlite3.Connection) -> Product | None:
            row = conn.execute(
                "SELECT id, nama, harga, created_at FROM products WHERE id = ?", (product_id,)
            ).fetchone()
            return Product(*row) if row else None

        return await self._read(read)

    async def list_products(self, after_id: int, limit: int) -> list[Product]:
        def read(conn: sqlite3.Connection) -> list[Product]:
            rows = conn.execute(
                "SELECT id, nama, harga, created_at FROM products WHERE id > ? ORDER BY id LIMIT ?",
                (after_id, limit),
            ).fetchall()
            return [Product(*row) for row in rows]

        return await self._read(read)

    async def product_counts(self, start: float, end: float) -> tuple[int, int]:
        """(products created before ``end``, products created in [start, end))."""

        def read(conn: sqlite3.Connection) -> tuple[int, int]:
            (total,) = conn.execute(
                "SELECT count(*) FROM products WHERE created_at < ?", (end,)
            ).fetchone()
            (new,) = conn.execute(
                "SELECT count(*) FROM products WHERE created_at >= ? AND created_at < ?",
                (start, end),
            ).fetchone()
            return int(total), int(new)

        return await self._read(read)

    # queue -----------------------------------------------------------------------
    async def enqueue(self, job: NewJob) -> int:
        return await self._write(_insert_jobs, (job, self._clock()))

    async def claim(
        self, limit: int, lease_seconds: float, held: Collection[int] = ()
    ) -> list[Job]:
        now = self._clock()
        jobs = await self._write(_claim, (limit, now, now + lease_seconds, json.dumps(list(held))))
        return without_abandoned(jobs)

    async def complete(self, jobs: Sequence[Job]) -> None:
        if jobs:
            claims = [_claim_of(job) for job in jobs]
            changed = await self._write(_complete, (claims, self._clock()))
            note_lost_claims(len(jobs), changed, "done")

    async def retry(
        self, job: Job, error: str, run_at: float, payload: dict[str, Any] | None = None
    ) -> None:
        arg: StateArg = (_claim_of(job), "pending", error, run_at, _json_or_none(payload))
        note_lost_claims(1, await self._write(_set_state, (arg, self._clock())), "pending")

    async def fail(self, job: Job, error: str, payload: dict[str, Any] | None = None) -> None:
        arg: StateArg = (_claim_of(job), "failed", error, None, _json_or_none(payload))
        note_lost_claims(1, await self._write(_set_state, (arg, self._clock())), "failed")

    async def release(self, jobs: Sequence[Job]) -> None:
        if jobs:
            claims = [_claim_of(job) for job in jobs]
            await self._write(_release, (claims, self._clock()))

    async def recover_abandoned(self) -> int:
        return len(without_abandoned(await self._write(_recover_abandoned, self._clock())))

    def add_wakeup_listener(self, callback: Callable[[], None]) -> None:
        # Other processes (toko-recap) are heard by the pool's one-second sweep.
        pass

    async def next_due_at(self, held: Collection[int] = ()) -> float | None:
        held_ids = json.dumps(list(held))

        def read(conn: sqlite3.Connection) -> float | None:
            (due,) = conn.execute("SELECT min(run_at) FROM jobs WHERE state = 'pending'").fetchone()
            (lease,) = conn.execute(
                "SELECT min(lease_until) FROM jobs WHERE state = 'running'"
                " AND id NOT IN (SELECT value FROM json_each(?))",
                (held_ids,),
            ).fetchone()
            times = [t for t in (due, lease) if t is not None]
            return min(times) if times else None

        return await self._read(read)

    async def counts(self) -> QueueCounts:
        def read(conn: sqlite3.Connection) -> QueueCounts:
            figures = dict.fromkeys(JOB_STATES, 0)
            for state, count in conn.execute(
                "SELECT state, count(*) FROM jobs GROUP BY state"
            ).fetchall():
                figures[state] = count
            return QueueCounts(**figures)

        return await self._read(read)

    async def get_job(self, job_id: int) -> Job | None:
        def read(conn: sqlite3.Connection) -> Job | None:
            row = conn.execute(
                f"SELECT {_JOB_COLUMNS} FROM jobs WHERE id = ?", (job_id,)
            ).fetchone()
            return job_from_row(row) if row else None

        return await self._read(read)

    async def ping(self) -> None:
        await self._read(lambda conn: conn.execute("SELECT 1").fetchone())

    @property
    def write_error(self) -> str | None:
        return self._damage or self._write_health.error

    async def probe_write(self) -> None:
        # A one-page write can still fit where a batch of products does not
        # (SQLite reuses its WAL file's space), so a nearly full disk counts
        # as full until it has room to spare again.
        if self._file_guard.gone or self._damage:
            return  # unhealthy until a restart, whatever a write would do now
        try:
            free = await asyncio.to_thread(_free_bytes, self.path)
        except OSError as exc:  # its folder is gone, say
            self._write_health.failed(exc)
            return
        if free < PROBE_MIN_FREE:
            self._write_health.failed(
                OSError(f"database or disk is full ({free // 1024} KiB free beside the database)")
            )
            return
        with contextlib.suppress(StoreError):
            await self._write(_rewrite_schema_version, None)
            self._write_health.proven()

    # recaps ------------------------------------------------------------------------
    async def record_recap(
        self, period: str, products_total: int, products_new: int, job: NewJob
    ) -> int | None:
        """Record a period's recap and enqueue its email, once: None if already recorded."""
        return await self._write(
            _record_recap, (period, products_total, products_new, job, self._clock())
        )

    async def last_recap_before(self, period: str) -> str | None:
        """The latest recorded period earlier than ``period`` (ISO dates sort as text)."""

        def read(conn: sqlite3.Connection) -> str | None:
            (last,) = conn.execute(
                "SELECT max(period) FROM recaps WHERE period < ?", (period,)
            ).fetchone()
            return str(last) if last is not None else None

        return await self._read(read)

    # queue administration (QueueAdmin) ---------------------------------------------
    async def queue_stats(self) -> QueueStats:
        def read(conn: sqlite3.Connection) -> QueueStats:
            figures = dict.fromkeys(JOB_STATES, 0)
            by_kind: dict[str, dict[str, int]] = {}
            for kind, state, count in conn.execute(
                "SELECT kind, state, count(*) FROM jobs GROUP BY kind, state ORDER BY kind"
            ).fetchall():
                figures[state] += count
                by_kind.setdefault(kind, dict.fromkeys(JOB_STATES, 0))[state] = count
            (oldest,) = conn.execute(
                "SELECT min(run_at) FROM jobs WHERE state = 'pending'"
            ).fetchone()
            return QueueStats(QueueCounts(**figures), by_kind, oldest)

        return await self._read(read)

    async def list_jobs(self, state: JobState, limit: int) -> list[JobDetails]:
        def read(conn: sqlite3.Connection) -> list[JobDetails]:
            rows = conn.execute(list_jobs_sql(state), (limit,)).fetchall()
            return [_details_from_row(row) for row in rows]

        return await self._read(read)

    async def job_details(self, job_id: int) -> JobDetails | None:
        def read(conn: sqlite3.Connection) -> JobDetails | None:
            row = conn.execute(
                f"SELECT {_DETAIL_COLUMNS} FROM jobs WHERE id = ?", (job_id,)
            ).fetchone()
            return _details_from_row(row) if row else None

        return await self._read(read)

    async def retry_now(
        self, job_ids: Sequence[int] | None, which: Retryable, chunk: int = RETRY_CHUNK
    ) -> list[int]:
        where = RETRYABLE_WHERE[which]
        if job_ids is None:
            # The ids first, from a reader (WAL: no lock on the writers), so
            # that each job is looked at once however the queue moves meanwhile.
            job_ids = await self._read(lambda conn: _retryable_ids(conn, where))
        # Chunks, each its own commit: toko-queue runs while toko-api writes,
        # and one update of a whole backlog held SQLite's write lock for
        # seconds (3.7 s for 667,000 waiting jobs), stalling every POST.
        retried: list[int] = []
        ids = list(job_ids)
        for start in range(0, len(ids), chunk):
            part = ids[start : start + chunk]
            if start:
                await _let_others_write()
            retried += await self._write(_retry_now, (part, where, self._clock()))
        return sorted(retried)

    async def purge_done(self, older_than: float, chunk: int = 1000) -> int:
        # Chunks, each its own commit: toko-recap purges while toko-api writes,
        # and one huge delete would hold SQLite's write lock past their busy timeout.
        total = 0
        while True:
            deleted = await self._write(_purge_done, (older_than, chunk))
            total += deleted
            if deleted < chunk:
                return total
            await _let_others_write()


def list_jobs_sql(state: JobState) -> str:
    """The query of ``list_jobs`` (parameter: the limit): done and failed jobs
    come in order from their own index (migration 4), not sorted from all."""
    return (
        f"SELECT {_DETAIL_COLUMNS} FROM jobs WHERE {STATE_WHERE[state]} "
        "ORDER BY updated_at DESC, id DESC LIMIT ?"
    )


# Batch functions for the group-commit writer: each takes every argument queued
# for it since the last commit and returns one result per argument, in order.
# Multi-row statements keep the statement count per commit low.


def _values(rows: int, columns: int) -> str:
    row = "(" + ", ".join("?" * columns) + ")"
    return ", ".join([row] * rows)


def _insert_returning_ids(
    conn: sqlite3.Connection, table: str, columns: Sequence[str], rows: list[tuple[Any, ...]]
) -> list[int]:
    flat = [value for row in rows for value in row]
    cur = conn.execute(
        f"INSERT INTO {table} ({', '.join(columns)}) "
        f"VALUES {_values(len(rows), len(columns))} RETURNING id",
        flat,
    )
    # Rowids are handed out in increasing order within one statement, while we
    # hold the write lock; RETURNING's own order is unspecified, so sort.
    return sorted(row[0] for row in cur.fetchall())


ProductArg = tuple[str, int, float, Callable[[Product], NewJob], str | None]


def _create_products(
    conn: sqlite3.Connection, items: list[ProductArg]
) -> list[tuple[Product, int | None]]:
    """Insert each product with its job; a key stored before (or earlier in
    this batch) inserts nothing and answers with that product and no job id."""
    keys = {item[4] for item in items if item[4] is not None}
    if not keys:
        return list(_insert_products(conn, items))
    stored = _products_by_key(conn, keys)
    fresh: list[ProductArg] = []
    taken: set[str] = set()
    for item in items:
        key = item[4]
        if key is None or (key not in stored and key not in taken):
            fresh.append(item)
            if key is not None:
                taken.add(key)
    created = iter(_insert_products(conn, fresh))
    results: list[tuple[Product, int | None]] = []
    for item in items:
        key = item[4]
        if key is not None and key in stored:
            results.append((stored[key], None))
            continue
        product, job_id = next(created)
        if key is not None:
            stored[key] = product  # later items with this key answer with it
        results.append((product, job_id))
    return results


def _products_by_key(conn: sqlite3.Connection, keys: set[str]) -> dict[str, Product]:
    rows = conn.execute(
        "SELECT idempotency_key, id, nama, harga, created_at FROM products"
        " WHERE idempotency_key IN (SELECT value FROM json_each(?))",
        (json.dumps(sorted(keys)),),
    ).fetchall()
    return {key: Product(*product) for key, *product in rows}


def _insert_products(
    conn: sqlite3.Connection, items: list[ProductArg]
) -> list[tuple[Product, int]]:
    if not items:
        return []
    ids = _insert_returning_ids(
        conn,
        "products",
        ("nama", "harga", "created_at", "idempotency_key"),
        [(nama, harga, now, key) for nama, harga, now, _, key in items],
    )
    products = [
        Product(pid, nama, harga, now)
        for pid, (nama, harga, now, _, _) in zip(ids, items, strict=True)
    ]
    jobs = [
        (make_job(p), p.created_at)
        for p, (_, _, _, make_job, _) in zip(products, items, strict=True)
    ]
    job_ids = _insert_jobs(conn, jobs)
    return list(zip(products, job_ids, strict=True))


def _insert_jobs(conn: sqlite3.Connection, items: list[tuple[NewJob, float]]) -> list[int]:
    return _insert_returning_ids(
        conn,
        "jobs",
        _JOB_INSERT_COLUMNS,
        [_job_insert_row(job, now) for job, now in items],
    )


_JOB_INSERT_COLUMNS = (
    "kind",
    "payload",
    "max_attempts",
    "run_at",
    "created_at",
    "updated_at",
    "state",
    "attempts",
    "lease_until",
)


def _job_insert_row(job: NewJob, now: float) -> tuple[Any, ...]:
    payload = json.dumps(job.payload)
    if job.leased_for is None:
        return (job.kind, payload, job.max_attempts, now, now, now, "pending", 0, None)
    # Claimed by the enqueuing process itself, exactly as _claim would.
    lease = now + job.leased_for
    return (job.kind, payload, job.max_attempts, now, now, now, "running", 1, lease)


def _claim(conn: sqlite3.Connection, items: list[tuple[int, float, float, str]]) -> list[list[Job]]:
    claimed = []
    for limit, now, lease, held in items:
        rows = conn.execute(
            f"""
            UPDATE jobs
               SET state = CASE WHEN {ABANDONED_AGAIN_SQL} THEN 'failed' ELSE 'running' END,
                   attempts = CASE WHEN {ABANDONED_AGAIN_SQL} THEN attempts ELSE attempts + 1 END,
                   lease_until = CASE WHEN {ABANDONED_AGAIN_SQL} THEN NULL ELSE :lease END,
                   last_error = CASE WHEN {ABANDONED_AGAIN_SQL} THEN :abandoned
                                ELSE last_error END,
                   updated_at = :now
             WHERE id IN (
                   -- Each side stops after :limit rows of the (state, run_at)
                   -- index, so a claim costs the same with a backlog of millions.
                   SELECT id FROM (
                       SELECT id FROM jobs WHERE state = 'pending' AND run_at <= :now
                        ORDER BY run_at, id LIMIT :limit)
                   UNION ALL
                   SELECT id FROM (
                       SELECT id FROM jobs WHERE state = 'running' AND lease_until < :now
                          AND id NOT IN (SELECT value FROM json_each(:held))
                        LIMIT :limit)
                   LIMIT :limit)
            RETURNING {_JOB_COLUMNS}
            """,
            {
                "now": now,
                "lease": lease,
                "limit": limit,
                "held": held,
                "abandoned": ABANDONED_ERROR,
            },
        ).fetchall()
        claimed.append(sorted((job_from_row(row) for row in rows), key=lambda job: job.id))
    return claimed


def _ids_in_chunks(ids: list[int], size: int = 500) -> list[list[int]]:
    return [ids[i : i + size] for i in range(0, len(ids), size)]


# (job id, attempt, run_at): a claim, as the worker that holds it knows it
# (see the outcome methods of Store, in base).
Claim = tuple[int, int, float]


def _claim_of(job: Job) -> Claim:
    return (job.id, job.attempts, job.run_at)


def _complete(conn: sqlite3.Connection, items: list[tuple[list[Claim], float]]) -> list[int]:
    changed = []
    for claims, now in items:
        cur = conn.executemany(
            "UPDATE jobs SET state = 'done', lease_until = NULL, updated_at = ?"
            " WHERE id = ? AND attempts = ? AND run_at = ? AND state = 'running'",
            [(now, *claim) for claim in claims],
        )
        changed.append(cur.rowcount)
    return changed


# the claim, state, error, run_at, payload (JSON text; None keeps it)
StateArg = tuple[Claim, str, str | None, float | None, str | None]


def _json_or_none(payload: dict[str, Any] | None) -> str | None:
    return None if payload is None else json.dumps(payload)


def _set_state(conn: sqlite3.Connection, items: list[tuple[StateArg, float]]) -> list[int]:
    changed = []
    for (claim, state, error, run_at, payload), now in items:
        cur = conn.execute(
            """
            UPDATE jobs SET state = ?, last_error = coalesce(?, last_error),
                   run_at = coalesce(?, run_at), payload = coalesce(?, payload),
                   lease_until = NULL, updated_at = ?
             WHERE id = ? AND attempts = ? AND run_at = ? AND state = 'running'
            """,
            (state, error, run_at, payload, now, *claim),
        )
        changed.append(cur.rowcount)
    return changed


def _release(conn: sqlite3.Connection, items: list[tuple[list[Claim], float]]) -> list[None]:
    conn.executemany(
        """
        UPDATE jobs SET state = 'pending', attempts = max(attempts - 1, 0),
               lease_until = NULL, updated_at = ?
         WHERE id = ? AND attempts = ? AND run_at = ? AND state = 'running'
        """,
        [(now, *claim) for claims, now in items for claim in claims],
    )
    return [None] * len(items)


def _free_bytes(path: str) -> int:
    stat = os.statvfs(Path(path).parent)
    return stat.f_bavail * stat.f_frsize


def _rewrite_schema_version(conn: sqlite3.Connection, items: list[None]) -> list[None]:
    # The smallest durable write every toko database can take: the header
    # page with its own version in it, one WAL frame and one fsync.
    (version,) = conn.execute("PRAGMA user_version").fetchone()
    conn.execute(f"PRAGMA user_version = {int(version)}")
    return [None] * len(items)


def _recover_abandoned(conn: sqlite3.Connection, items: list[float]) -> list[list[Job]]:
    # A single SQLite file has a single toko-api (it holds the instance lock),
    # so any running job belongs to a process that is gone.
    recovered = []
    for now in items:
        rows = conn.execute(
            f"""
            UPDATE jobs
               SET state = CASE WHEN {ABANDONED_AGAIN_SQL} THEN 'failed' ELSE 'pending' END,
                   last_error = CASE WHEN {ABANDONED_AGAIN_SQL} THEN :abandoned
                                ELSE last_error END,
                   lease_until = NULL, updated_at = :now
             WHERE state = 'running'
            RETURNING {_JOB_COLUMNS}
            """,
            {"now": now, "abandoned": ABANDONED_ERROR},
        ).fetchall()
        recovered.append([job_from_row(row) for row in rows])
    return recovered


RecapArg = tuple[str, int, int, NewJob, float]


def _record_recap(conn: sqlite3.Connection, items: list[RecapArg]) -> list[int | None]:
    results: list[int | None] = []
    for period, total, new, job, now in items:
        if conn.execute("SELECT 1 FROM recaps WHERE period = ?", (period,)).fetchone():
            results.append(None)
            continue
        (job_id,) = _insert_jobs(conn, [(job, now)])
        conn.execute(
            "INSERT INTO recaps (period, products_total, products_new, job_id, created_at) "
            "VALUES (?, ?, ?, ?, ?)",
            (period, total, new, job_id, now),
        )
        results.append(job_id)
    return results


def _retryable_ids(conn: sqlite3.Connection, where: str) -> list[int]:
    # ``where`` is one of RETRYABLE_WHERE's constants, never input.
    return [row[0] for row in conn.execute(f"SELECT id FROM jobs WHERE {where} ORDER BY id")]


RetryArg = tuple[list[int], str, float]


def _retry_now(conn: sqlite3.Connection, items: list[RetryArg]) -> list[list[int]]:
    # attempts = 0: an admin's retry gets the full attempt budget again;
    # last_error stays as the history of why it had failed. ``where`` is one
    # of RETRYABLE_WHERE's constants, never input; it is checked again here,
    # so a job that changed since it was listed is left alone.
    results = []
    for ids, where, now in items:
        rows = []
        for chunk in _ids_in_chunks(ids):
            rows += conn.execute(retry_by_id_sql(where, len(chunk)), [now, now, *chunk]).fetchall()
        results.append(sorted(row[0] for row in rows))
    return results


def retry_by_id_sql(where: str, ids: int) -> str:
    """The update of ``_retry_now`` for ``ids`` ids (parameters: now, now, the ids)."""
    # NOT INDEXED: SQLite would otherwise walk the state index through every
    # job in that state for each chunk (all the backlog, every 500 jobs); the
    # ids find their rows by primary key, which NOT INDEXED still allows.
    return (
        "UPDATE jobs NOT INDEXED SET state = 'pending', attempts = 0, run_at = ?, "
        f"lease_until = NULL, updated_at = ? WHERE {where} "
        f"AND id IN ({', '.join('?' * ids)}) RETURNING id"
    )


# One chunk of done jobs to purge (parameters: older_than, chunk). The newest
# job stays, however old: SQLite numbers a new row one past the largest id, so
# the next job would get the purged one's id (two jobs under one JOB_ID in the
# journal). Through jobs_done_updated_at, the last chunk, which finds few or
# none, reads only the old ones rather than every done job.
PURGE_DONE_SQL = (
    "SELECT id FROM jobs WHERE state = 'done' AND updated_at < ?"
    " AND id < (SELECT max(id) FROM jobs) LIMIT ?"
)


def _purge_done(conn: sqlite3.Connection, items: list[tuple[float, int]]) -> list[int]:
    counts = []
    for older_than, chunk in items:
        ids = [row[0] for row in conn.execute(PURGE_DONE_SQL, (older_than, chunk))]
        for part in _ids_in_chunks(ids):
            marks = ", ".join("?" * len(part))
            # A recap keeps its row (that is what makes a period run once) but
            # lets go of its pruned email job; the foreign key would refuse otherwise.
            conn.execute(f"UPDATE recaps SET job_id = NULL WHERE job_id IN ({marks})", part)
            conn.execute(f"DELETE FROM jobs WHERE id IN ({marks})", part)
        counts.append(len(ids))
    return counts
