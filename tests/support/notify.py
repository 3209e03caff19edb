"""A real sd_notify receiver: an AF_UNIX datagram socket bound in a temp dir.

Usage::

    with NotifyListener() as notify:          # env NOTIFY_SOCKET=notify.path
        ...start the process...
        ready = await notify.async_wait_for_field("READY", "1", timeout=10)
        notify.count("WATCHDOG", since=ready.at, until=ready.at + 2)
        notify.first("STOPPING")              # Notification or None

A thread receives the datagrams and records each in :attr:`NotifyListener.log`,
stamped with the moment the kernel queued it (on the ``time.monotonic()``
scale): when the service sent it, however late this thread gets to run.
Optional ``hooks`` run in that thread *before* the datagram is recorded (and
so before any waiter wakes): this is where a test checks something at the very
moment a message arrives, e.g. that the service's port already accepts
connections when READY=1 comes.

:meth:`NotifyListener.away` makes it stop reading, as a PID 1 that is busy or
stuck, with the socket's queue full (of other programs' messages) from that
moment; :meth:`NotifyListener.back` reads again. ``hooks=[away_after_ready]``
goes away the moment READY=1 arrives.
"""

from __future__ import annotations

import contextlib
import select
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from tests.support.recorder import Recorder


@dataclass(frozen=True)
class Notification:
    """One datagram: its arrival time and its ``KEY=VALUE`` lines."""

    at: float  # when the kernel queued it, on the time.monotonic() scale
    raw: str
    fields: dict[str, str]

    def get(self, key: str) -> str | None:
        return self.fields.get(key)


Hook = Callable[[Notification], None]

# Linux's SO_TIMESTAMPNS (asm-generic), which the socket module does not name:
# each datagram then carries the CLOCK_REALTIME moment the kernel queued it, as
# a struct timespec (two longs).
SO_TIMESTAMPNS = 35
# What NotifyListener.fill() queues, standing in for other services' messages.
FILLER = "X_TEST_FILLER=1"
TIMESPEC = struct.Struct("@qq")


class NotifyListener:
    """Receives sd_notify datagrams on a fresh socket; a context manager."""

    def __init__(self, hooks: Sequence[Hook] = ()) -> None:
        self.hooks: list[Hook] = list(hooks)
        self.log: Recorder[Notification] = Recorder("notify")
        self.hook_errors: list[BaseException] = []
        # AF_UNIX paths are limited to ~107 bytes; pytest's tmp_path can be longer.
        self._dir = tempfile.mkdtemp(prefix="toko-notify-", dir="/tmp")
        self.path = str(Path(self._dir) / "notify.sock")
        self._sock: socket.socket | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread: threading.Thread | None = None
        self._flushes = 0
        self._reading = True  # changed by away()/back(), read by the thread

    def start(self) -> NotifyListener:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        # Stamped by the kernel, not by this thread: on a loaded machine the
        # thread may wake late (the GIL, the scheduler) and stamp a run of
        # evenly spaced pings as one gap and a burst.
        self._sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        self._sock.bind(self.path)
        self._thread = threading.Thread(target=self._run, name="notify-listener", daemon=True)
        self._thread.start()
        return self

    def away(self) -> int:
        """Stop reading, with the queue full from now on: everything the service
        sends finds no room until back(). How many fillers that took."""
        self._reading = False
        self._wake_w.send(b"p")
        return self.fill()

    def back(self) -> float:
        """Read again (the fillers first); the moment, on the time.monotonic() scale."""
        at = time.monotonic()
        self._reading = True
        self._wake_w.send(b"p")
        return at

    def fill(self) -> int:
        """Fill the socket's queue with other programs' messages (``X_TEST_FILLER=1``)."""
        sent = 0
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as other_program:
            other_program.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                while True:
                    other_program.sendto(FILLER.encode(), self.path)
                    sent += 1
        return sent

    def service_messages(self, since: float = 0.0) -> list[Notification]:
        """What the service sent, arrived at/after ``since``: no fillers or flush tokens."""
        return [
            n
            for n in self.log.snapshot()
            if n.at >= since and n.raw != FILLER and not n.raw.startswith("X_TEST_FLUSH=")
        ]

    def stop(self) -> None:
        if self._thread is not None:
            self._wake_w.send(b"x")
            self._thread.join(5)
            self._thread = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._wake_r.close()
        self._wake_w.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> NotifyListener:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _run(self) -> None:
        assert self._sock is not None
        while True:
            watched = [self._sock, self._wake_r] if self._reading else [self._wake_r]
            readable, _, _ = select.select(watched, [], [])
            if self._wake_r in readable:
                if self._wake_r.recv(1) == b"x":
                    return
                continue
            data, ancillary, _, _ = self._sock.recvmsg(65536, socket.CMSG_SPACE(TIMESPEC.size))
            at = _queued_at(ancillary)
            text = data.decode("utf-8", errors="replace")
            fields: dict[str, str] = {}
            for line in text.split("\n"):
                if line:
                    key, _, value = line.partition("=")
                    fields[key] = value
            note = Notification(at=at, raw=text, fields=fields)
            for hook in self.hooks:
                try:
                    hook(note)
                except Exception as exc:  # surfaced by tests via hook_errors
                    self.hook_errors.append(exc)
            self.log.append(note)

    def flush(self, timeout: float = 5.0) -> None:
        """Return once every datagram sent before this call has been recorded.

        Sends a sentinel to our own socket and waits for it: a datagram socket
        delivers in order, so anything the service sent earlier is in the log.
        Use it before asserting that something was *not* sent.
        """
        self._flushes += 1
        token = f"X_TEST_FLUSH={self._flushes}"
        send(self.path, token)
        self.log.wait_for(lambda xs: any(n.raw == token for n in xs), timeout, token)

    # -- queries -----------------------------------------------------------

    def messages(self, key: str | None = None) -> list[Notification]:
        """All notifications, or those carrying ``key``."""
        return [n for n in self.log.snapshot() if key is None or key in n.fields]

    def first(self, key: str, value: str | None = None) -> Notification | None:
        for n in self.log.snapshot():
            if key in n.fields and (value is None or n.fields[key] == value):
                return n
        return None

    def count(self, key: str, since: float = 0.0, until: float = float("inf")) -> int:
        """How many notifications carrying ``key`` arrived in [since, until)."""
        return sum(1 for n in self.log.snapshot() if key in n.fields and since <= n.at < until)

    def times(self, key: str) -> list[float]:
        """Arrival times of the notifications carrying ``key``."""
        return [n.at for n in self.log.snapshot() if key in n.fields]

    def wait_for_field(
        self, key: str, value: str | None = None, timeout: float = 10.0, since: float = 0.0
    ) -> Notification:
        """Block until a notification with ``key`` (= ``value``) arrives at/after ``since``."""
        return self.log.wait_for(_match(key, value, since), timeout, _what(key, value))

    async def async_wait_for_field(
        self,
        key: str,
        value: str | None = None,
        timeout: float = 10.0,  # noqa: ASYNC109
        since: float = 0.0,
    ) -> Notification:
        """Await a notification with ``key`` (= ``value``) arriving at/after ``since``."""
        return await self.log.async_wait_for(_match(key, value, since), timeout, _what(key, value))


def away_after_ready(listener: NotifyListener) -> Hook:
    """A hook: ``listener`` goes away the moment READY=1 arrives."""

    def hook(note: Notification) -> None:
        if note.get("READY") == "1":
            listener.away()

    return hook


def _queued_at(ancillary: list[tuple[int, int, bytes]]) -> float:
    """When the kernel queued a datagram, on the time.monotonic() scale (now
    if it did not say)."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
            seconds, nanoseconds = TIMESPEC.unpack(data[: TIMESPEC.size])
            # How long ago, by the wall clock, taken from the monotonic now.
            age = time.time() - (seconds + nanoseconds / 1e9)
            return time.monotonic() - max(age, 0.0)
    return time.monotonic()


def _what(key: str, value: str | None) -> str:
    return key if value is None else f"{key}={value}"


def _match(
    key: str, value: str | None, since: float
) -> Callable[[Sequence[Notification]], Notification | None]:
    def predicate(items: Sequence[Notification]) -> Notification | None:
        for n in items:
            if n.at >= since and key in n.fields and (value is None or n.fields[key] == value):
                return n
        return None

    return predicate


def send(path: str, message: str) -> None:
    """Send one datagram to ``path`` like sd_notify does (for tests of this module)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(path)
        s.send(message.encode())


__all__ = ["Notification", "NotifyListener", "away_after_ready", "send"]
