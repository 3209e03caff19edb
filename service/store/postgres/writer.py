"""The PostgreSQL store's group-commit writer for products.

``create_product`` queues a write; one task takes every write queued since
its last commit and inserts their product and job rows in one statement (one
implicit transaction), so a burst of requests shares one WAL flush and one
NOTIFY. PostgreSQL serialises the commits of transactions that NOTIFY, so one
transaction per request would cap throughput at one fsync per request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import asyncpg  # type: ignore[import-untyped]  # no stubs shipped

from service.models import NewJob, Product
from service.store.base import StoreError
from service.store.postgres.products import PostgresProducts, ProductWrite
from service.store.postgres.transport import CONNECTION_ERRORS

log = logging.getLogger("toko.store")

# Upper bound on one batch so a flood cannot make one statement huge.
MAX_BATCH = 512


class PostgresWriter(PostgresProducts):
    _writer: asyncio.Task[None] | None = None
    _writes: asyncio.Queue[ProductWrite | None]

    def _start_writer(self) -> None:
        self._writes = asyncio.Queue()
        self._writer = asyncio.create_task(self._write_loop(), name="toko-pg-writer")

    async def _stop_writer(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            self._writes.put_nowait(None)  # writes queued before this still commit
            # One that died (wait_broken said so) must not stop the rest closing.
            await asyncio.wait([writer])
            if not writer.cancelled():
                writer.exception()

    # products ------------------------------------------------------------------
    async def create_product(
        self,
        nama: str,
        harga: int,
        make_job: Callable[[Product], NewJob],
        idempotency_key: str | None = None,
    ) -> tuple[Product, int | None]:
        if self._writer is None or self._writer.done():
            raise StoreError("the store is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[tuple[Product, int | None]] = loop.create_future()
        self._writes.put_nowait(ProductWrite(nama, harga, make_job, future, idempotency_key))
        return await future

    async def _write_loop(self) -> None:
        while True:
            first = await self._writes.get()
            batch = [first] if first is not None else []
            stop = first is None
            while not stop and len(batch) < MAX_BATCH and not self._writes.empty():
                item = self._writes.get_nowait()
                if item is None:
                    stop = True
                else:
                    batch.append(item)
            # A caller that gave up (a POST cancelled at shutdown, past its
            # grace, behind a locked table) got no answer: make neither its
            # product nor its job, leased to a process that is stopping.
            batch = [write for write in batch if not write.future.cancelled()]
            if batch:
                await self._commit_products(batch)
            if stop:
                return

    async def _commit_products(
        self, batch: list[ProductWrite], *, asked_again: bool = False
    ) -> None:
        try:
            await self._insert_products(batch)
        except StoreError as exc:
            cause = exc.__cause__
            if isinstance(cause, asyncpg.UniqueViolationError) and not asked_again:
                # Another instance stored one of these Idempotency-Keys since we
                # looked (the statement failed whole): look again, then insert.
                # Not the writes answered meanwhile: a caller that gave up, or
                # a write whose job could not be made, is not written again.
                waiting = [write for write in batch if not write.future.done()]
                if waiting:
                    await self._commit_products(waiting, asked_again=True)
                return
            bad_row = isinstance(cause, asyncpg.PostgresError) and not isinstance(
                cause, CONNECTION_ERRORS
            )
            # A lost connection may have committed: never write the batch again.
            if len(batch) == 1 or not bad_row:
                for write in batch:
                    if not write.future.done():
                        write.future.set_exception(exc)
                return
            # A bad row fails the whole statement: give each write its own.
            for write in batch:
                if not write.future.done():
                    await self._commit_products([write])
        except Exception as exc:  # a bug here must not kill the writer
            log.exception("product write failed")
            for write in batch:
                if not write.future.done():
                    write.future.set_exception(StoreError(f"database write failed: {exc}"))

    async def _insert_products(self, batch: list[ProductWrite]) -> None:
        batch, later = await self._answer_known_keys(batch)
        if batch:
            await self._insert_new_products(batch)
        if later:
            # Their keys came earlier in this batch: now stored, they are answered.
            await self._commit_products(later)
