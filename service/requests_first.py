"""Requests before jobs: a job waits while requests keep the event loop busy.

The workers share the event loop with the HTTP server. Left alone, sixteen
workers sending email as fast as the SMTP server answers take most of the
loop from the requests, whose answers then wait behind the emails. The queue
is durable, so an email can wait a little; a client should not. So before
each job a worker asks for its turn. It goes at once when no request is in
flight, or when the loop's thread was busy for less than BUSY_SHARE of the
last WINDOW_SECONDS; otherwise it pauses and asks again, for at most
LONGEST_WAIT_SECONDS, so that under a load that never ends every worker
still starts a job that often.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

# The loop is busy when its thread ran for this share of the last window
# (measured: with 0.8, jobs still took half the loop from 16 connections).
BUSY_SHARE = 0.5
WINDOW_SECONDS = 0.02
# How long a held job pauses before it asks again.
PAUSE_SECONDS = 0.01
# The longest a job is held: 3 workers still start 30 jobs a second
# under a load that keeps the loop busy all the time.
LONGEST_WAIT_SECONDS = 0.1


class RequestsFirst:
    """Call ``turn()`` in the loop's thread only (it reads that thread's CPU clock)."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        cpu_clock: Callable[[], float] = time.thread_time,
    ) -> None:
        self._clock = clock
        self._cpu_clock = cpu_clock
        # No window yet: the first question starts one (in the loop's thread).
        self._window_start = float("-inf")
        self._window_cpu = 0.0
        self._busy = False
        self.in_flight = 0
        self.held = 0  # jobs that had to wait, so far

    @property
    def middleware(self) -> Middleware:
        @web.middleware
        async def count_in_flight(request: web.Request, handler: Handler) -> web.StreamResponse:
            self.in_flight += 1
            try:
                return await handler(request)
            finally:
                self.in_flight -= 1

        return count_in_flight

    async def turn(self) -> None:
        """Return when a job may start (see the module's docstring)."""
        if not self.in_flight or not self._loop_busy():
            return
        self.held += 1
        give_up = self._clock() + LONGEST_WAIT_SECONDS
        while True:
            left = give_up - self._clock()
            if left <= 0:
                return
            await asyncio.sleep(min(PAUSE_SECONDS, left))
            if not self.in_flight or not self._loop_busy():
                return

    def _loop_busy(self) -> bool:
        now = self._clock()
        elapsed = now - self._window_start
        if elapsed >= WINDOW_SECONDS:
            cpu = self._cpu_clock()
            # A window long past (nobody asked) says little about now: start afresh.
            stale = elapsed > 4 * WINDOW_SECONDS
            self._busy = not stale and (cpu - self._window_cpu) >= BUSY_SHARE * elapsed
            self._window_start, self._window_cpu = now, cpu
        return self._busy
