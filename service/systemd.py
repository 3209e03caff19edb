"""The systemd service protocol: sd_notify, the watchdog and socket activation.

Every call is a no-op outside systemd (no ``NOTIFY_SOCKET``, no ``LISTEN_FDS``),
so the same process runs unchanged in a terminal.
"""

from __future__ import annotations

import logging
import socket

import sdnotify
from systemd import daemon

from service.logs import Throttle

log = logging.getLogger("toko.systemd")
_SEND_FAILURES = Throttle()


class Notifier:
    def __init__(self, notify_socket: str | None) -> None:
        # sdnotify opens its socket eagerly; only do that when systemd listens.
        self._notifier = sdnotify.SystemdNotifier() if notify_socket else None

    @property
    def enabled(self) -> bool:
        return self._notifier is not None

    def send(self, *lines: str) -> None:
        if self._notifier is None or self._notifier.socket is None:
            return
        # UTF-8, as systemd reads it, on sdnotify's socket: its notify() encodes
        # Latin-1 and drops the whole message, READY=1 and all, when a STATUS=
        # holds any other character (a database path in Cyrillic, say).
        message = "\n".join(lines).encode("utf-8", "backslashreplace")
        try:
            self._notifier.socket.sendall(message)
        except OSError as exc:
            _SEND_FAILURES.log(log, logging.WARNING, "could not notify systemd: %s", exc)

    def ready(self, status: str) -> None:
        self.send("READY=1", _status(status))

    def status(self, status: str) -> None:
        self.send(_status(status))

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")

    def stopping(self, status: str) -> None:
        self.send("STOPPING=1", _status(status))

    def extend_timeout(self, seconds: float, status: str) -> None:
        self.send(f"EXTEND_TIMEOUT_USEC={int(seconds * 1_000_000)}", _status(status))

    def close(self) -> None:
        if self._notifier is not None and self._notifier.socket is not None:
            self._notifier.socket.close()
        self._notifier = None


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
