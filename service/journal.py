"""Journal entries sent without ever waiting for journald (see JournalSender)."""

from __future__ import annotations

import array
import collections
import contextlib
import errno
import fcntl
import os
import select
import socket
import struct
import threading
import time
from typing import Any

JOURNAL_SOCKET = "/run/systemd/journal/socket"
# Room for a burst of lines while journald is busy (libsystemd asks for the same);
# the kernel caps it at net.core.wmem_max.
_SNDBUF = 8 * 1024 * 1024


class JournalSender:
    """Sends journal entries (journald's native protocol) without ever waiting for journald.

    systemd-python's ``journal.send`` writes to a blocking socket and holds the
    GIL while it waits: once journald stopped reading (SIGSTOP, a stuck disk)
    and its queue of 10 datagrams (net.unix.max_dgram_qlen) was full, the
    next log line froze the event loop, and every request with it, until the
    watchdog killed toko-api. Here an entry journald cannot take at once waits
    in a backlog, sent in order before the next entry and retried by a thread
    meanwhile: that rides out a restart of journald and the moments a busy
    one falls behind. While journald does not read at all, the backlog fills
    and later lines are dropped and counted; the first line that fits again
    is preceded by one saying how many were lost. Nothing is raised to
    logging's handleError either: that prints to stderr, which under systemd
    is a stream to the same stopped journald.

    A line may also come while this thread is sending: the garbage collector
    runs finalizers at any allocation, the error a busy journald returns
    included, and asyncio's log ("Task was destroyed but it is pending!").
    That line joins the backlog, which the send under way takes in turn.
    """

    # About 5 MB of typical entries: seconds of the log mailer at full speed.
    MAX_BACKLOG = 10_000
    # What logging.shutdown() at exit waits at most for journald to take the
    # backlog, unless told otherwise: toko-api's stop has systemd's timeout to keep.
    FLUSH_TIMEOUT_S = 2.0
    # How often the backlog is offered again while no new line comes to send it.
    RETRY_S = 0.05

    def __init__(
        self,
        path: str = JOURNAL_SOCKET,
        max_backlog: int = MAX_BACKLOG,
        flush_timeout: float = FLUSH_TIMEOUT_S,
    ) -> None:
        self.path = path
        self.max_backlog = max_backlog
        self.flush_timeout = flush_timeout
        # Set by stop_waiting(): flush() gives up on journald at once.
        self._stop_waiting = False
        self.dropped = 0
        self._backlog: collections.deque[bytes] = collections.deque()
        # Held while the backlog changes: by the caller, or by the retry thread.
        # Re-entrant for a finalizer that logs (above); StructuredJournalHandler
        # makes it its own lock too.
        self.lock = threading.RLock()
        # Whether this sender is sending, so a line logged meanwhile (by the
        # thread holding the lock: no other can) is only queued.
        self._sending = False
        self._retrier: threading.Thread | None = None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._sock.setblocking(False)
        # Without it the default buffer still works, it only fills sooner.
        with contextlib.suppress(OSError):
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SNDBUF)

    def __call__(self, message: str, **fields: Any) -> None:
        entry = _native_entry({"MESSAGE": message, **fields})
        with self.lock:
            if self._sending:
                self._enqueue(entry, fields)
                return
            self._sending = True
            try:
                self._send_in_order()
                if self._enqueue(entry, fields) and self._send_in_order():
                    self._start_retrier()
            finally:
                self._sending = False

    @property
    def backlog(self) -> int:
        return len(self._backlog)

    def flush(self) -> None:
        """At exit only: send the backlog, waiting up to ``flush_timeout`` for
        journald; what it still holds then is lost, and stderr says how much."""
        deadline = time.monotonic() + self.flush_timeout
        while self.send_backlog() and time.monotonic() < deadline and not self._stop_waiting:
            time.sleep(0.01)
        with self.lock:
            lost = len(self._backlog) + self.dropped
            self._backlog.clear()
            self.dropped = 0
        if lost:
            when = (
                "before the program was stopped at exit"
                if self._stop_waiting
                else f"within {self.flush_timeout:g} s of exit"
            )
            _tell_stderr(f"{lost} log lines were lost: the journal did not take them {when}\n")

    def stop_waiting(self) -> None:
        """End flush()'s wait for journald now (a SIGTERM at exit). Safe in a
        signal handler: it only sets a flag, and takes no lock the interrupted
        flush() may hold."""
        self._stop_waiting = True

    def close(self) -> None:
        self._sock.close()

    def _enqueue(self, entry: bytes, fields: dict[str, Any]) -> bool:
        """Put ``entry`` behind the waiting ones; False if the backlog is full
        (it is dropped and counted)."""
        if len(self._backlog) >= self.max_backlog:
            self.dropped += 1
            return False
        if self.dropped:
            self._backlog.append(self._dropped_notice(fields))
            self.dropped = 0
        self._backlog.append(entry)
        return True

    def _start_retrier(self) -> None:
        if self._retrier is None:
            self._retrier = threading.Thread(
                target=self._retry, name="journal-backlog", daemon=True
            )
            self._retrier.start()

    def _retry(self) -> None:
        while True:
            time.sleep(self.RETRY_S)
            with self.lock:
                if not self.send_backlog():
                    self._retrier = None
                    return

    def send_backlog(self) -> bool:
        """Offer the waiting entries to journald now; whether some are still left."""
        with self.lock:
            if self._sending:  # a line logged while this thread sends: it is queued
                return bool(self._backlog)
            self._sending = True
            try:
                return self._send_in_order()
            finally:
                self._sending = False

    def _send_in_order(self) -> bool:
        """Send waiting entries in order; whether some are left (journald not taking them)."""
        while self._backlog:
            if not self._offer(self._backlog[0]):
                return True
            self._backlog.popleft()
        return False

    def _dropped_notice(self, fields: dict[str, Any]) -> bytes:
        return _native_entry(
            {
                "MESSAGE": f"{self.dropped} log lines were dropped: the journal did not take them",
                "PRIORITY": "4",
                "DROPPED": self.dropped,
                "SYSLOG_IDENTIFIER": fields.get("SYSLOG_IDENTIFIER", "toko"),
                "LOGGER": __name__,
            }
        )

    def _offer(self, entry: bytes) -> bool:
        """Whether ``entry`` is done with: sent, or refused for good (counted as
        dropped); False if journald cannot take it now."""
        try:
            try:
                self._sock.sendto(entry, self.path)
            except OSError as exc:
                if exc.errno != errno.EMSGSIZE:
                    raise
                self._send_as_file(entry)
        except OSError as exc:
            if exc.errno in _JOURNALD_BUSY_OR_GONE:
                return False
            self.dropped += 1
        return True

    def _send_as_file(self, entry: bytes) -> None:
        """An entry too large for a datagram goes as a sealed memfd, as libsystemd does."""
        fd = os.memfd_create("toko-journal-entry", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.write(fd, entry)
            seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
            self._sock.sendmsg([], rights, 0, self.path)
        finally:
            os.close(fd)


def _tell_stderr(line: str) -> None:
    """``line`` on stderr if it can go without waiting: under systemd, stderr is
    a stream to journald too, whose buffer holds it until journald reads again."""
    with contextlib.suppress(OSError, ValueError):
        _, writable, _ = select.select([], [2], [], 0)
        if writable:
            os.write(2, line.encode())


# Journald's queue is full (EAGAIN, ENOBUFS), or journald is stopped
# (ECONNREFUSED) or its socket is gone (ENOENT): it may take the entry later.
_JOURNALD_BUSY_OR_GONE = frozenset({errno.EAGAIN, errno.ENOBUFS, errno.ECONNREFUSED, errno.ENOENT})


def _native_entry(fields: dict[str, Any]) -> bytes:
    """``fields`` in journald's native format: ``KEY=value`` lines; a value with a
    line break as ``KEY``, its length (64-bit little-endian) and the raw bytes."""
    out = bytearray()
    for key, value in fields.items():
        data = value if isinstance(value, bytes) else str(value).encode("utf-8", "replace")
        if b"\n" in data:
            out += key.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += key.encode() + b"=" + data + b"\n"
    return bytes(out)
