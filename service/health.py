"""The store's figures for the health answers (/healthz, /metrics, STATUS=), in bounded time.

A store that hangs rather than fails (a PostgreSQL host gone silent, a table
locked by a long maintenance command) makes a read wait for the store's own
command timeout, 30 s. That is longer than a load balancer's health check or
Prometheus' scrape waits, so /healthz would time out instead of saying 503, and
``toko_store_up 0`` would never be scraped. Each read here is awaited for at
most ``limit`` seconds and then counts as "the store did not answer".

A read still running when the next health check comes is shared rather than
started again, so a hanging store cannot pile up a read (and a pool
connection) per check.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from service.models import QueueCounts
from service.store.base import StoreError, write_error
from service.store.roles import Store

T = TypeVar("T")

HEALTH_READ_SECONDS = 5.0


class StoreNotAnswering(StoreError):
    pass


class HealthReads:
    def __init__(self, store: Store, limit: float = HEALTH_READ_SECONDS) -> None:
        self._store = store
        self._limit = limit
        self._running: dict[str, asyncio.Task[Any]] = {}

    async def counts(self) -> QueueCounts:
        """The queue figures; StoreError when the store fails or does not answer in time."""
        return await self._shared("counts", self._store.counts)

    async def write_error(self) -> str | None:
        """Why the store cannot write (probing if it could not); None if it can."""
        try:
            return await self._shared("write_error", lambda: write_error(self._store))
        except StoreNotAnswering as exc:
            return str(exc)

    async def close(self) -> None:
        """Cancel the reads still waiting on the store, before it closes."""
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._running.clear()

    async def _shared(self, name: str, read: Callable[[], Awaitable[T]]) -> T:
        task = self._running.get(name)
        if task is None or task.done():
            task = asyncio.ensure_future(read())
            # A read that ends after every caller gave up: nobody awaits it, and
            # its exception must not be logged as never retrieved.
            task.add_done_callback(_retrieve)
            self._running[name] = task
        try:
            # shield: a caller that gives up must not cancel the read others share.
            return await asyncio.wait_for(asyncio.shield(task), self._limit)
        except TimeoutError:
            raise StoreNotAnswering(f"the store did not answer within {self._limit:g} s") from None


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()
