"""Write-ahead log checkpoints kept off the commit path, the log kept bounded.

SQLite's automatic checkpoint runs inside the commit that crosses 1,000
pages of log: that commit copies the pages into the database file and syncs
it before it returns, and every request in its batch, and every one queued
behind it, waits for that sync. Here the writer's connection has it off
(``wal_autocheckpoint = 0``) and a thread of its own, on its own connection,
does the work: a PASSIVE checkpoint, which never takes the write lock,
copies the pages and syncs the database file while the writer goes on
committing.

A checkpoint on another connection cannot end the log, though: the log
starts over from its beginning only when a write transaction begins with
every page of it copied, and under a steady load the writer has always
appended more meanwhile (the log then grows without end). So when a round
leaves only a little behind, the writer finishes it itself, between two
batches and after answering the last: a few pages and one sync of a file
that was synced a moment ago. Should the thread fall far behind (a long
read holds the log's pages), the writer checkpoints all of it before the
log passes ``LIMIT_PAGES``, as SQLite itself would have. With
``synchronous = FULL`` on both connections, every checkpoint syncs the log
before it copies and the database file before the log can be reused:
nothing committed ever depends on a write that is not on disk.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable

from service.logs import Throttle

log = logging.getLogger("toko.store")

# The writer finishes a round once the log holds this many pages (SQLite's
# own threshold for its automatic checkpoint): the log starts over about as
# often as before, at a few pages' cost instead of all of them.
FINISH_AT_PAGES = 1000
# What the writer copies itself, at most, to finish a round.
FINISH_PAGES = 256
# The writer checkpoints all of the log rather than let it grow past this
# (64 MiB of 4 KiB pages); after such a time the file is cut back to it.
LIMIT_PAGES = 16384
LIMIT_BYTES = LIMIT_PAGES * 4096
# A round at most this often while commits come: each syncs the database file.
ROUND_INTERVAL_S = 0.25


class Checkpointer:
    """A thread that checkpoints the log on a connection of its own. The writer
    calls ``committed()`` after each commit and ``between_batches(conn)`` once
    it has answered a batch, on its own thread and connection."""

    def __init__(self, connect: Callable[[], sqlite3.Connection]) -> None:
        self._connect = connect
        self._conn: sqlite3.Connection | None = None
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._stopped = threading.Event()
        # Set by a round that leaves the writer a little to finish.
        self._finish = False
        # The writer's commits so far, and how many there were at its last
        # finish: a round with none since has nothing to leave it.
        self._commits = 0
        self._commits_at_finish = -1
        self.rounds = 0
        self.finishes = 0
        # One each: a Throttle is not thread-safe.
        self._round_failures = Throttle()
        self._finish_failures = Throttle()

    def start(self) -> None:
        # Opened now, not later by path: a connection opened after the file
        # was deleted would make an empty database there (see file_guard).
        self._conn = self._connect()
        self._thread = threading.Thread(
            target=self._run, name="toko-sqlite-checkpoint", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stopped.set()
            self._wake.set()
            self._thread.join()
            self._thread = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # the writer's thread ------------------------------------------------------
    def committed(self) -> None:
        self._commits += 1
        self._wake.set()

    def between_batches(self, conn: sqlite3.Connection) -> None:
        """Finish what the last round left, so that the next commit starts the
        log over."""
        if self._finish:
            self._finish = False
            self._checkpoint(conn, self._finish_failures)
            self._commits_at_finish = self._commits
            self.finishes += 1

    # the checkpoint thread ------------------------------------------------------
    def _run(self) -> None:
        assert self._conn is not None
        while True:
            self._wake.wait()
            if self._stopped.is_set():
                return
            self._wake.clear()
            self._round(self._conn)
            self._stopped.wait(ROUND_INTERVAL_S)  # pacing; a stop ends it

    def _round(self, conn: sqlite3.Connection) -> None:
        commits = self._commits
        pages, behind = self._checkpoint(conn, self._round_failures)
        self.rounds += 1
        # Even with nothing behind now, the writer's transaction under way
        # began before the round ended and appends to the log: only a
        # checkpoint between two of its transactions lets the log start over.
        # But with no commit since the writer's last finish there is no such
        # transaction: that finish left the log copied, and the next commit
        # starts it over (a round woken by an earlier commit can land there).
        self._finish = commits != self._commits_at_finish and (
            pages >= LIMIT_PAGES or (pages >= FINISH_AT_PAGES and behind <= FINISH_PAGES)
        )

    @staticmethod
    def _checkpoint(conn: sqlite3.Connection, failures: Throttle) -> tuple[int, int]:
        """A PASSIVE checkpoint on ``conn``: pages in the log, pages not copied."""
        try:
            _, pages, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        except sqlite3.Error as exc:  # a full disk, say: the next round tries again
            failures.log(log, logging.WARNING, "checkpoint failed: %s", exc)
            return 0, 0
        if pages < 0:  # not in WAL mode: nothing to copy
            return 0, 0
        return pages, pages - copied
