"""The systemd service protocol: sd_notify, the watchdog and socket activation.

Every call is a no-op outside systemd (no ``NOTIFY_SOCKET``, no ``LISTEN_FDS``),
so the same process runs unchanged in a terminal.
"""

from __future__ import annotations

import socket

import sdnotify
from systemd import daemon


class Notifier:
    def __init__(self, notify_socket: str | None) -> None:
        # sdnotify opens its socket eagerly; only do that when systemd listens.
        self._notifier = sdnotify.SystemdNotifier() if notify_socket else None

    @property
    def enabled(self) -> bool:
        return self._notifier is not None

    def send(self, *lines: str) -> None:
        if self._notifier is not None:
            self._notifier.notify("\n".join(lines))

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}")

    def status(self, status: str) -> None:
        self.send(f"STATUS={status}")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")

    def stopping(self, status: str) -> None:
        self.send("STOPPING=1", f"STATUS={status}")

    def extend_timeout(self, seconds: float, status: str) -> None:
        self.send(f"EXTEND_TIMEOUT_USEC={int(seconds * 1_000_000)}", f"STATUS={status}")

    def close(self) -> None:
        if self._notifier is not None and self._notifier.socket is not None:
            self._notifier.socket.close()
        self._notifier = None


def passed_listen_sockets() -> list[socket.socket]:
    """Listening sockets handed over by a .socket unit (LISTEN_FDS), if any."""
    return [socket.socket(fileno=fd) for fd in daemon.listen_fds()]
