"""SMTP connections kept open between emails.

Opening one costs TCP, EHLO, STARTTLS with its handshake, and AUTH: about ten
round trips to a provider, and most of an email's CPU with TLS. A run of
emails (the backlog after an outage, a burst of new products) shares one
connection per worker instead. Postfix's own SMTP client does the same, and
the limits below are its defaults: an idle connection is closed after 2 s
(``smtp_connection_cache_time_limit``), so none holds a server's slot for
nothing, and none is used for more than 300 s
(``smtp_connection_reuse_time_limit``).

Only a connection whose last mail transaction went through whole is kept; any
error closes it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiosmtplib

IDLE_SECONDS = 2.0
REUSE_SECONDS = 300.0
# A goodbye (QUIT) to a server that does not answer must not hold up a stop.
QUIT_SECONDS = 1.0


@dataclass(eq=False)
class Connection:
    client: aiosmtplib.SMTP
    opened: float  # on the cache's clock
    expiry: asyncio.TimerHandle | None = field(default=None, repr=False)


class ConnectionCache:
    """Idle, connected SMTP clients, the most recently used first."""

    def __init__(
        self,
        idle_seconds: float = IDLE_SECONDS,
        reuse_seconds: float = REUSE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._idle_seconds = idle_seconds
        self._reuse_seconds = reuse_seconds
        self._clock = clock
        self._idle: list[Connection] = []
        self._goodbyes: set[asyncio.Task[None]] = set()
        self._closed = False

    def opened(self, client: aiosmtplib.SMTP) -> Connection:
        """``client``, just connected, as a connection this cache can keep."""
        return Connection(client, self._clock())

    def take(self) -> Connection | None:
        """An idle connection to send on, or None (open a new one)."""
        while self._idle:
            connection = self._pop_idle()
            if self._clock() - connection.opened >= self._reuse_seconds:
                self._say_goodbye(connection)
            # The server may have closed it meanwhile (its idle timeout).
            elif connection.client.is_connected:
                return connection
            else:
                connection.client.close()
        return None

    def keep(self, connection: Connection) -> None:
        """Keep ``connection``, whose transaction went through, for the next email."""
        if self._closed or not connection.client.is_connected:
            self._say_goodbye(connection)
            return
        loop = asyncio.get_running_loop()
        connection.expiry = loop.call_later(self._idle_seconds, self._expire, connection)
        self._idle.append(connection)

    async def close(self) -> None:
        """Say goodbye to every idle connection; keep none from now on."""
        self._closed = True
        while self._idle:
            self._say_goodbye(self._pop_idle())
        if self._goodbyes:
            await asyncio.wait(self._goodbyes)

    def _pop_idle(self) -> Connection:
        """The most recently used idle connection, its idle timer stopped."""
        connection = self._idle.pop()
        if connection.expiry is not None:
            connection.expiry.cancel()
        return connection

    def _expire(self, connection: Connection) -> None:
        # take() and close() cancel this timer: the connection is still idle.
        self._idle.remove(connection)
        self._say_goodbye(connection)

    def _say_goodbye(self, connection: Connection) -> None:
        task = asyncio.get_running_loop().create_task(_quit(connection.client))
        self._goodbyes.add(task)
        task.add_done_callback(self._goodbyes.discard)


async def _quit(client: aiosmtplib.SMTP) -> None:
    try:
        async with asyncio.timeout(QUIT_SECONDS):
            await client.quit()
    except (aiosmtplib.SMTPException, OSError, TimeoutError):
        pass  # it is closed either way
    finally:
        client.close()
