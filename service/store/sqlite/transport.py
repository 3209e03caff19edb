"""The SQLite store's transport: the file, its connections and threads, and errors.

Writes go through the group-commit writer (one thread, batched commits with
``synchronous=FULL``); reads run on a small pool of read-only connections,
which WAL lets proceed while the writer commits. No SQLite call runs on the
event loop. The concerns (products, queue, recaps, admin) are mixins on
:class:`SqliteTransport`, put together as ``SqliteStore``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from service.store.base import StoreError, WriteHealth
from service.store.sqlite.checkpoints import LIMIT_BYTES, Checkpointer
from service.store.sqlite.file_guard import FileGuard
from service.store.sqlite.migrations import migrate
from service.store.sqlite.writer import BatchFn, GroupCommitWriter

T = TypeVar("T")
A = TypeVar("A")
log = logging.getLogger("toko.store")


BUSY_TIMEOUT_SECONDS = 10.0


# While another process writes at start (a toko-queue command, a sqlite3
# shell), open() waits for it in slices this long: a stop ends the wait.
OPEN_WAIT_SLICE_SECONDS = 0.1


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


# SQLite's result codes for a damaged file (a failing disk): no retry or probe
# makes such a database whole again.
_DAMAGE_CODES = frozenset({sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB})


def _is_damage(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)  # the extended code: its low byte is primary
    return code is not None and code & 0xFF in _DAMAGE_CODES


class SqliteTransport:
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
            self._damage = (
                f"the database file is damaged: {exc}"
                " (see /usr/share/doc/toko/docs/how-to/damaged-database.md)"
            )
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

    # health ----------------------------------------------------------------------
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


def _free_bytes(path: str) -> int:
    stat = os.statvfs(Path(path).parent)
    return stat.f_bavail * stat.f_frsize


def _rewrite_schema_version(conn: sqlite3.Connection, items: list[None]) -> list[None]:
    # The smallest durable write every toko database can take: the header
    # page with its own version in it, one WAL frame and one fsync.
    (version,) = conn.execute("PRAGMA user_version").fetchone()
    conn.execute(f"PRAGMA user_version = {int(version)}")
    return [None] * len(items)
