"""One writer thread that commits many callers' writes in one transaction.

SQLite allows one writer at a time and each durable commit costs an fsync.
Callers on the event loop hand a write to the writer and await a future; the
writer takes everything queued since its last commit, runs it in one
transaction and commits once. Under load many requests share one fsync: this
is group commit, and it is why durability costs little throughput.

A write is a *batch function* plus one argument: the writer gives each batch
function all the arguments queued for it at once (``fn(conn, [a, b, c])`` must
return one result per argument, in order), so N inserts can be one multi-row
statement. That matters beyond SQLite's own cost: every statement releases
and re-takes the GIL, and each re-take may wait behind the event loop.

Should a batch function raise, the transaction is rolled back whole (nothing
is half-written) and each write is retried alone, so one caller's failure
costs the others nothing.

Should the thread itself end (a ``BaseException``, which nothing in toko
raises), every write fails at once and ``on_death(exc)`` is called, on the
writer thread, so that the process can stop and systemd restart it.

``upkeep``, if given, hears of each commit (``committed()``) and may use the
connection once a batch is answered (``between_batches(conn)``): the log's
checkpoints (service.store.sqlite.checkpoints).

An optional ``verify(conn)`` runs after each commit. Once it raises a
``sqlite3.Error``, the writes of that batch and of every later one fail with
it: the writer refuses for good (the SQLite file was deleted, say).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import queue
import sqlite3
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from service.logs import Throttle

A = TypeVar("A")
R = TypeVar("R")
BatchFn = Callable[[sqlite3.Connection, list[A]], Sequence[R]]
log = logging.getLogger("toko.store")

# Upper bound on one batch so a flood cannot hold the write lock for long.
MAX_BATCH = 512


class Upkeep(Protocol):
    def committed(self) -> None: ...
    def between_batches(self, conn: sqlite3.Connection) -> None: ...


@dataclass
class _Op:
    fn: BatchFn[Any, Any]
    arg: Any
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


_Result = tuple[_Op, Any, BaseException | None]
_STOP = object()


class _BatchFailed(Exception):
    def __init__(self, cause: Exception) -> None:
        super().__init__(str(cause))
        self.cause = cause


class GroupCommitWriter:
    def __init__(
        self,
        connect: Callable[[], sqlite3.Connection],
        verify: Callable[[sqlite3.Connection], None] | None = None,
        on_death: Callable[[BaseException], None] | None = None,
        upkeep: Upkeep | None = None,
    ) -> None:
        self._connect = connect
        self._upkeep = upkeep
        self._verify = verify
        self._on_death = on_death
        self._refused: sqlite3.Error | None = None  # what verify raised, for good
        self._ops: queue.SimpleQueue[_Op | object] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._ended = False  # set by the thread as it ends; later writes fail at once
        self.batches = 0
        self.ops = 0
        # A full disk fails every batch; used by the writer thread only.
        self._commit_failures = Throttle()
        self._faults = Throttle()  # the same for a fault of ours (a bug)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="toko-sqlite-writer", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise self._start_error

    async def run(self, fn: BatchFn[A, R], arg: A) -> R:
        """Run ``fn(conn, [..., arg, ...])`` in the next batch; return once it is durable."""
        if self._thread is None or self._ended:
            raise RuntimeError("the SQLite writer is not running")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        self._ops.put(_Op(fn, arg, future, loop))
        if self._ended:  # it ended between the check and the put: nobody will take it
            self._fail_waiting()
        return await future

    def stop(self) -> None:
        """Commit what is queued, then end the thread."""
        if self._thread is None:
            return
        self._ops.put(_STOP)
        self._thread.join()
        self._thread = None

    # writer thread ---------------------------------------------------------
    def _run(self) -> None:
        try:
            conn = self._connect()
        except BaseException as exc:
            self._start_error = exc
            self._started.set()
            return
        self._started.set()
        ops: list[_Op] = []  # the batch in hand, failed should the thread end under it
        died: BaseException | None = None
        try:
            stopping = False
            while not stopping:
                first = self._ops.get()
                if first is _STOP:
                    return
                batch = [first]
                while len(batch) < MAX_BATCH:
                    try:
                        nxt = self._ops.get_nowait()
                    except queue.Empty:
                        break
                    if nxt is _STOP:
                        stopping = True
                        break
                    batch.append(nxt)
                ops = [op for op in batch if isinstance(op, _Op)]
                self._commit_or_fail(conn, ops)
                ops = []
                if self._upkeep is not None:
                    self._upkeep.between_batches(conn)
        except BaseException as exc:  # to the journal; threading would only print it to stderr
            log.critical("SQLite writer thread died", exc_info=True)
            died = exc
        finally:
            self._ended = True
            if died is None and self._refused is None:
                # One last look before the connection closes: the file may have
                # gone since the last commit, and then only this connection still
                # sees what was written (verify saves it).
                try:
                    self._refusal(conn)
                except Exception:
                    log.exception("SQLite writer: the last check of the database file failed")
            conn.close()
            self._fail_waiting(ops)
        if died is not None and self._on_death is not None:
            self._on_death(died)

    def _commit_or_fail(self, conn: sqlite3.Connection, ops: list[_Op]) -> None:
        """Commit ``ops``. A fault of ours (not the database's) fails them, and the
        writer carries on rather than leave every later write waiting."""
        try:
            self._commit(conn, ops)
        except Exception as exc:
            self._faults.log(
                log, logging.ERROR, "SQLite writer: a batch failed: %r", exc, exc_info=exc
            )
            with contextlib.suppress(sqlite3.Error):
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
            fault = RuntimeError(f"the SQLite writer failed: {exc!r}")
            _send_results([(op, None, fault) for op in ops])

    def _fail_waiting(self, in_hand: Sequence[_Op] = ()) -> None:
        """Fail ``in_hand`` and every write still queued: nobody is left to run them,
        and failing beats leaving their callers waiting forever."""
        waiting = list(in_hand)
        while True:
            try:
                op = self._ops.get_nowait()
            except queue.Empty:
                break
            if isinstance(op, _Op):
                waiting.append(op)
        ended = RuntimeError("the SQLite writer has stopped")
        _send_results([(op, None, ended) for op in waiting])

    def _commit(self, conn: sqlite3.Connection, batch: list[_Op]) -> None:
        if self._refused is not None:
            results: list[_Result] = [(op, None, _fresh(self._refused)) for op in batch]
        else:
            results = self._run_batch(conn, batch)
            if self._upkeep is not None:
                self._upkeep.committed()
            self._refused = self._refusal(conn)
            if self._refused is not None:  # committed, but not where it counts
                results = [(op, None, err or _fresh(self._refused)) for op, _, err in results]
        self.batches += 1
        self.ops += len(batch)
        _send_results(results)

    def _run_batch(self, conn: sqlite3.Connection, batch: list[_Op]) -> list[_Result]:
        try:
            return _run_in_transaction(conn, batch)
        except _BatchFailed:
            results: list[_Result] = []
            for op in batch:
                try:
                    results.extend(_run_in_transaction(conn, [op]))
                except _BatchFailed as failed:
                    results.append((op, None, failed.cause))
                except sqlite3.Error as exc:
                    results.append((op, None, exc))
            return results
        except sqlite3.Error as exc:
            # The commit itself failed (disk full, I/O error): nothing is durable.
            self._commit_failures.log(log, logging.ERROR, "SQLite commit failed: %s", exc)
            return [(op, None, exc) for op in batch]

    def _refusal(self, conn: sqlite3.Connection) -> sqlite3.Error | None:
        """Why ``verify`` says the connection must not be written to (None: it may)."""
        if self._verify is None:
            return None
        try:
            self._verify(conn)
        except sqlite3.Error as exc:
            # Kept for good: without its traceback, whose frames reach back
            # into the batch that found the file gone and its callers' writes.
            return exc.with_traceback(None)
        return None


def _fresh(refused: sqlite3.Error) -> sqlite3.Error:
    """A copy of ``refused`` for one caller to raise.

    Every raise of one exception object adds the raising frames to its
    traceback, and the writer keeps that object for good: each refused write
    left its frames (its arguments, a product's name) alive, until memory ran out.
    """
    return copy.copy(refused)


def _run_in_transaction(conn: sqlite3.Connection, batch: list[_Op]) -> list[_Result]:
    """Run every batch function once over its arguments, then commit."""
    groups: dict[BatchFn[Any, Any], list[_Op]] = {}
    for op in batch:
        groups.setdefault(op.fn, []).append(op)
    results: list[_Result] = []
    conn.execute("BEGIN IMMEDIATE")
    try:
        for fn, ops in groups.items():
            try:
                values = fn(conn, [op.arg for op in ops])
            except Exception as exc:
                raise _BatchFailed(exc) from exc
            if len(values) != len(ops):
                raise _BatchFailed(RuntimeError(f"{fn.__name__} returned the wrong count"))
            results.extend((op, value, None) for op, value in zip(ops, values, strict=True))
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return results


def _send_results(results: list[_Result]) -> None:
    # One hop back to each loop per batch, not one per caller.
    by_loop: dict[asyncio.AbstractEventLoop, list[_Result]] = {}
    for item in results:
        by_loop.setdefault(item[0].loop, []).append(item)
    for loop, items in by_loop.items():
        # A closed loop means its callers are gone; nothing to resolve.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_resolve_all, items)


def _resolve_all(items: list[_Result]) -> None:
    for op, value, exc in items:
        if not op.future.done():
            if exc is None:
                op.future.set_result(value)
            else:
                op.future.set_exception(exc)
