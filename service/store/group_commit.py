"""One writer thread that commits many callers' writes in one transaction.

SQLite allows one writer at a time and each durable commit costs an fsync.
Callers on the event loop hand a function to the writer and await a future;
the writer takes everything queued since its last commit, runs each function
inside its own SAVEPOINT (so one failing write does not undo the others), and
commits the batch once. Under load many requests share one fsync: this is
group commit, and it is why durability costs little throughput.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger("toko.store")

# Upper bound on one batch so a flood cannot hold the write lock for long.
MAX_BATCH = 512


@dataclass
class _Op:
    fn: Callable[[sqlite3.Connection], Any]
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


_STOP = object()


class GroupCommitWriter:
    def __init__(self, connect: Callable[[], sqlite3.Connection]) -> None:
        self._connect = connect
        self._ops: queue.SimpleQueue[_Op | object] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self.batches = 0
        self.ops = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="toko-sqlite-writer", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise self._start_error

    async def run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn(conn)`` in the next batch; return once that batch is durable."""
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("the SQLite writer is not running")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._ops.put(_Op(fn, future, loop))
        return await future

    def stop(self) -> None:
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
        try:
            while True:
                first = self._ops.get()
                if first is _STOP:
                    return
                batch = [first]
                stop_after = False
                while len(batch) < MAX_BATCH:
                    try:
                        nxt = self._ops.get_nowait()
                    except queue.Empty:
                        break
                    if nxt is _STOP:
                        stop_after = True
                        break
                    batch.append(nxt)
                self._commit_batch(conn, [op for op in batch if isinstance(op, _Op)])
                if stop_after:
                    return
        finally:
            conn.close()

    def _commit_batch(self, conn: sqlite3.Connection, grouped: list[_Op]) -> None:
        results: list[tuple[_Op, Any, BaseException | None]] = []
        try:
            conn.execute("BEGIN IMMEDIATE")
            for op in grouped:
                conn.execute("SAVEPOINT op")
                try:
                    value = op.fn(conn)
                except Exception as exc:
                    conn.execute("ROLLBACK TO op")
                    conn.execute("RELEASE op")
                    results.append((op, None, exc))
                else:
                    conn.execute("RELEASE op")
                    results.append((op, value, None))
            conn.execute("COMMIT")
        except Exception as exc:
            # The batch as a whole did not commit: nobody's write is durable.
            log.error("SQLite commit failed: %s", exc)
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            results = [(op, None, exc) for op in grouped]
        self.batches += 1
        self.ops += len(grouped)
        # One hop back to each loop per batch, not one per caller.
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Op, Any, BaseException | None]]] = {}
        for item in results:
            by_loop.setdefault(item[0].loop, []).append(item)
        for loop, items in by_loop.items():
            # A closed loop means its callers are gone; nothing to resolve.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve_all, items)


def _resolve_all(items: list[tuple[_Op, Any, BaseException | None]]) -> None:
    for op, value, exc in items:
        if not op.future.done():
            if exc is None:
                op.future.set_result(value)
            else:
                op.future.set_exception(exc)
