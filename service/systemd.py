"""The systemd service protocol: sd_notify, the watchdog and socket activation.

Every call is a no-op outside systemd (no ``NOTIFY_SOCKET``, no ``LISTEN_FDS``),
so the same process runs unchanged in a terminal.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import errno
import logging
import socket
import time
from dataclasses import dataclass

import sdnotify
from systemd import daemon

from service.logs import Throttle

log = logging.getLogger("toko.systemd")


class _Kind(enum.Enum):
    KEPT = "kept"  # READY=1, STOPPING=1, EXTEND_TIMEOUT_USEC=: never dropped
    STATUS = "status"  # a STATUS= alone: only the latest matters
    WATCHDOG = "watchdog"  # WATCHDOG=1: one pending at most


@dataclass(frozen=True)
class _Message:
    kind: _Kind
    data: bytes
    has_status: bool


class Notifier:
    """sd_notify messages to systemd, sent without ever blocking the event loop.

    The socket is non-blocking. While systemd does not read it (a long
    ``daemon-reload``, PID 1 stuck, a container manager in between) and its
    queue (``net.unix.max_dgram_qlen``) is full, messages wait here and the
    loop watches the socket for room: READY=1, STOPPING=1 and
    EXTEND_TIMEOUT_USEC= all wait and go out in order; a STATUS= replaces
    the one still waiting, and a WATCHDOG=1 with one waiting already is
    skipped, so systemd reads the latest of each when it comes back. One
    line says when it stopped reading and one, with the counts, when it read
    again, throttled: never a line per message.

    Call it from the event loop. Without a running loop (a plain call) what
    waits goes out with the next message.
    """

    # How long aclose() waits at exit for systemd to take what still waits:
    # it must not hold up the exit a stop has a timeout for.
    FLUSH_TIMEOUT_S = 2.0

    def __init__(self, notify_socket: str | None) -> None:
        # sdnotify opens its socket eagerly; only do that when systemd listens.
        notifier = sdnotify.SystemdNotifier() if notify_socket else None
        self._sock: socket.socket | None = notifier.socket if notifier is not None else None
        if self._sock is not None:
            self._sock.setblocking(False)
        self._waiting: collections.deque[_Message] = collections.deque()
        self._watching: asyncio.AbstractEventLoop | None = None  # whose writer waits for room
        self._all_sent = asyncio.Event()
        self._all_sent.set()
        self._away_since: float | None = None
        # Replaced or skipped since the last line that said so.
        self.replaced_statuses = 0
        self.skipped_pings = 0
        self._away_lines = Throttle()
        self._back_lines = Throttle()
        self._send_failures = Throttle()

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    @property
    def waiting(self) -> int:
        """Messages that systemd has not taken yet."""
        return len(self._waiting)

    def ready(self, status: str) -> None:
        self._send(_Kind.KEPT, "READY=1", _status(status))

    def status(self, status: str) -> None:
        self._send(_Kind.STATUS, _status(status))

    def watchdog(self) -> None:
        self._send(_Kind.WATCHDOG, "WATCHDOG=1")

    def stopping(self, status: str) -> None:
        self._send(_Kind.KEPT, "STOPPING=1", _status(status))

    def extend_timeout(self, seconds: float, status: str) -> None:
        self._send(_Kind.KEPT, f"EXTEND_TIMEOUT_USEC={int(seconds * 1_000_000)}", _status(status))

    async def aclose(self, timeout: float = FLUSH_TIMEOUT_S) -> None:  # noqa: ASYNC109
        """Wait up to ``timeout`` for systemd to take what still waits, then close."""
        if self._sock is None:
            return
        self._send_waiting()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._all_sent.wait(), timeout)
        if self._waiting:
            kept = [_first_line(m) for m in self._waiting if m.kind is _Kind.KEPT]
            log.warning(
                "systemd did not read notifications within %g s of exit; not sent: %s",
                timeout,
                ", ".join(kept) or "a status update",
                extra={"NOT_SENT": len(self._waiting)},
            )
        self._stop_watching()
        self._sock.close()
        self._sock = None

    # -- sending -----------------------------------------------------------

    def _send(self, kind: _Kind, *lines: str) -> None:
        if self._sock is None:
            return
        # UTF-8, as systemd reads it: sdnotify's own notify() encodes Latin-1
        # and drops the whole message, READY=1 and all, when a STATUS= holds
        # any other character (a database path in Cyrillic, say).
        data = "\n".join(lines).encode("utf-8", "backslashreplace")
        message = _Message(kind, data, any(line.startswith("STATUS=") for line in lines))
        self._send_waiting()  # what waits goes first
        if self._waiting or not self._offer(message):
            self._wait(message)

    def _offer(self, message: _Message) -> bool:
        """Whether ``message`` is done with: sent, or refused for good (logged);
        False if systemd's queue is full now."""
        assert self._sock is not None
        try:
            self._sock.send(message.data)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            if exc.errno == errno.ENOBUFS:
                return False
            self._send_failures.log(log, logging.WARNING, "could not notify systemd: %s", exc)
        return True

    def _wait(self, message: _Message) -> None:
        if not self._waiting:
            self._away_since = time.monotonic()
            self._away_lines.log(
                log,
                logging.WARNING,
                "systemd is not reading notifications; they wait (the latest status, one"
                " watchdog ping) and go out when it reads again",
            )
            self._all_sent.clear()
        if message.kind is _Kind.WATCHDOG and any(m.kind is _Kind.WATCHDOG for m in self._waiting):
            self.skipped_pings += 1
            return
        if message.has_status:  # it says the latest status: older ones alone can go
            kept = [m for m in self._waiting if m.kind is not _Kind.STATUS]
            self.replaced_statuses += len(self._waiting) - len(kept)
            self._waiting = collections.deque(kept)
        self._waiting.append(message)
        self._watch()

    def _send_waiting(self) -> None:
        if not self._waiting:
            return
        while self._waiting:
            if not self._offer(self._waiting[0]):
                return
            self._waiting.popleft()
        self._stop_watching()
        self._all_sent.set()
        self._say_back()

    def _say_back(self) -> None:
        away = time.monotonic() - (self._away_since or time.monotonic())
        self._away_since = None
        held = self._back_lines.allow()
        if held is None:  # counted into the next line that is logged
            return
        log.info(
            "systemd reads notifications again after %.1f s; %d status updates were"
            " replaced by later ones and %d watchdog pings skipped%s",
            away,
            self.replaced_statuses,
            self.skipped_pings,
            f" ({held} more such pauses in the {self._back_lines.interval:g} s before)"
            if held
            else "",
            extra={"REPLACED": self.replaced_statuses, "SKIPPED_PINGS": self.skipped_pings},
        )
        self.replaced_statuses = self.skipped_pings = 0

    def _watch(self) -> None:
        """Have the running loop send what waits as soon as the socket has room."""
        if self._watching is not None or self._sock is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop: the next message sends what waits
            return
        loop.add_writer(self._sock.fileno(), self._send_waiting)
        self._watching = loop

    def _stop_watching(self) -> None:
        if self._watching is not None and self._sock is not None:
            self._watching.remove_writer(self._sock.fileno())
        self._watching = None


def _first_line(message: _Message) -> str:
    return message.data.split(b"\n", 1)[0].decode("utf-8", "replace")


def _status(text: str) -> str:
    """``STATUS=text`` on one line: each line of a notify message is an
    assignment, so an error's line break would start another (even a
    ``WATCHDOG=1``) and cut the status short."""
    return "STATUS=" + " ".join(text.splitlines())


class SocketActivationError(Exception):
    """A descriptor passed by socket activation cannot be served on."""


def passed_listen_sockets() -> list[socket.socket]:
    """Listening sockets handed over by a .socket unit (LISTEN_FDS), if any.

    Each must be a listening stream socket (ListenStream=): anything else
    (ListenDatagram=, a FIFO) is a unit to fix, not something a restart mends.
    """
    fds = daemon.listen_fds()
    for fd in fds:
        if not daemon.is_socket(fd, type=socket.SOCK_STREAM, listening=1):
            raise SocketActivationError(
                f"socket activation passed descriptor {fd}, which is not a listening stream"
                " socket; toko-api.socket must use ListenStream= only"
            )
    return [socket.socket(fileno=fd) for fd in fds]
