"""The name this host gives in EHLO, looked up once, on a thread of its own."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import threading
import time
from collections.abc import Callable

log = logging.getLogger("toko.mail")

# How long looking up the host's name may hold up an email. A resolver that
# does not answer takes 5 s per server and attempt (resolv.conf), often more.
EHLO_LOOKUP_SECONDS = 3.0


class EhloName:
    """The name this host gives in EHLO: its FQDN, looked up once.

    aiosmtplib would look it up again for every connection: a lookup on a
    thread that costs a seventh of an email's CPU, a DNS round trip where the
    name is not in /etc/hosts, and no time limit. Here one lookup serves every
    worker and email; a renamed host is picked up at the next start.

    The lookup runs on a daemon thread of its own: with DNS broken it blocks
    for as long as the resolver likes, and a thread of the default executor
    would also hold up the process's exit (asyncio.run waits for those). An
    email waits for it at most ``limit`` seconds from its start; after that,
    this email and every later one say ``fallback()``, the short host name.
    """

    def __init__(
        self,
        lookup: Callable[[], str] = socket.getfqdn,
        fallback: Callable[[], str] = socket.gethostname,
        limit: float = EHLO_LOOKUP_SECONDS,
    ) -> None:
        self._lookup = lookup
        self._fallback = fallback
        self._limit = limit
        self._name: str | None = None
        self._found: concurrent.futures.Future[str] | None = None
        self._deadline = 0.0

    async def get(self) -> str:
        if self._name is not None:
            return self._name
        found = asyncio.wrap_future(self._started())
        remaining = max(0.0, self._deadline - time.monotonic())
        done, _ = await asyncio.wait({found}, timeout=remaining)
        if not done:
            found.cancel()  # this wait only: the thread runs on, ignored
            return self._settle(None, f"took over {self._limit:g} s")
        error = found.exception()
        if error is not None:
            return self._settle(None, f"failed: {error}")
        return self._settle(found.result(), "")

    def _started(self) -> concurrent.futures.Future[str]:
        if self._found is None:
            self._found = concurrent.futures.Future()
            # Running: a waiter that gives up cannot cancel it for the others.
            self._found.set_running_or_notify_cancel()
            self._deadline = time.monotonic() + self._limit
            threading.Thread(
                target=self._look_up, args=(self._found,), name="ehlo-name", daemon=True
            ).start()
        return self._found

    def _look_up(self, found: concurrent.futures.Future[str]) -> None:
        try:
            found.set_result(self._lookup())
        except Exception as exc:
            found.set_exception(exc)

    def _settle(self, name: str | None, problem: str) -> str:
        # Emails waiting together all get here: the first decides, and logs.
        if self._name is None:
            if name is None:
                name = self._fallback()
                log.warning(
                    "looking up this host's name for EHLO %s; saying %s instead",
                    problem,
                    name,
                    extra={"EHLO_NAME": name},
                )
            self._name = name
        return self._name


# One per process: all workers' connections, however many mailers.
EHLO_NAME = EhloName()
