"""The PostgreSQL store's products: rows inserted with their jobs, one statement
a batch; changed or deleted one transaction each, the row locked."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable, Collection
from dataclasses import dataclass

import asyncpg  # type: ignore[import-untyped]  # no stubs shipped

from service.models import (
    NewJob,
    Product,
    ProductWriteOutcome,
    ProductWritten,
    VersionMismatch,
)
from service.store.postgres.queue import INSERT_JOB, insert_job_args
from service.store.postgres.transport import PostgresTransport

PRODUCT_COLUMNS = "id, nama, harga, created_at, version"


@dataclass
class ProductWrite:
    nama: str
    harga: int
    make_job: Callable[[Product], NewJob]
    future: asyncio.Future[tuple[Product, int | None]]
    key: str | None = None


class PostgresProducts(PostgresTransport):
    async def get_product(self, product_id: int) -> Product | None:
        row = await self._fetchrow(
            f"SELECT {PRODUCT_COLUMNS} FROM products WHERE id = $1 AND deleted_at IS NULL",
            product_id,
            retry=True,
        )
        return Product(*row) if row else None

    async def list_products(self, after_id: int, limit: int) -> list[Product]:
        rows = await self._fetch(
            f"SELECT {PRODUCT_COLUMNS} FROM products"
            " WHERE id > $1 AND deleted_at IS NULL ORDER BY id LIMIT $2",
            after_id,
            limit,
            retry=True,
        )
        return [Product(*row) for row in rows]

    async def update_product(
        self,
        product_id: int,
        nama: str | None,
        harga: int | None,
        versions: Collection[int] | None,
        make_job: Callable[[Product, Product], NewJob | None],
    ) -> ProductWriteOutcome:
        now = self._clock()

        async def run(conn: asyncpg.Connection) -> ProductWriteOutcome:
            async with _one_at_a_time(conn):
                before = await _locked_product(conn, product_id)
                if before is None:
                    return None
                if versions is not None and before.version not in versions:
                    return VersionMismatch(before)
                after = dataclasses.replace(
                    before,
                    nama=before.nama if nama is None else nama,
                    harga=before.harga if harga is None else harga,
                )
                if after == before:  # nothing to change: nothing written, the version stays
                    return ProductWritten(before, before, now)
                after = dataclasses.replace(after, version=before.version + 1)
                # Before any write; one that raises rolls the transaction back.
                job = make_job(before, after)
                await conn.execute(
                    # The right-hand sides read the row as it was: the first
                    # change keeps what the product was created with.
                    "UPDATE products SET nama = $2, harga = $3, version = $4,"
                    " created_nama = coalesce(created_nama, nama),"
                    " created_harga = coalesce(created_harga, harga)"
                    " WHERE id = $1",
                    after.id,
                    after.nama,
                    after.harga,
                    after.version,
                )
                job_id = None if job is None else await _insert_job(conn, job, now)
                return ProductWritten(before, after, now, job_id)

        # Not tried again on a lost connection: the commit may have happened.
        return self._proven(await self._db(run, write=True))

    async def delete_product(
        self, product_id: int, versions: Collection[int] | None
    ) -> ProductWriteOutcome:
        now = self._clock()

        async def run(conn: asyncpg.Connection) -> ProductWriteOutcome:
            async with _one_at_a_time(conn):
                before = await _locked_product(conn, product_id)
                if before is None:
                    return None
                if versions is not None and before.version not in versions:
                    return VersionMismatch(before)
                after = dataclasses.replace(before, version=before.version + 1)
                await conn.execute(
                    "UPDATE products SET version = $2, deleted_at = $3 WHERE id = $1",
                    after.id,
                    after.version,
                    now,
                )
                return ProductWritten(before, after, now)

        return self._proven(await self._db(run, write=True))

    def _proven(self, outcome: ProductWriteOutcome) -> ProductWriteOutcome:
        # Only a commit that wrote something shows the database takes writes.
        if isinstance(outcome, ProductWritten) and outcome.after != outcome.before:
            self._write_health.proven()
        return outcome

    async def _answer_known_keys(
        self, batch: list[ProductWrite]
    ) -> tuple[list[ProductWrite], list[ProductWrite]]:
        """Answer the writes whose key is stored already; return (to insert, to retry after).

        A key twice in one batch: the first is inserted, the rest wait for it.
        """
        keys = [write.key for write in batch if write.key is not None]
        if not keys:
            return batch, []
        # As created (version 1), changed or deleted since or not: the first answer.
        rows = await self._fetch(
            "SELECT idempotency_key, id, coalesce(created_nama, nama),"
            " coalesce(created_harga, harga), created_at FROM products"
            " WHERE idempotency_key = ANY($1::text[])",
            keys,
            retry=True,
            lane=self._product_writes,
        )
        known = {key: Product(*product) for key, *product in rows}
        fresh: list[ProductWrite] = []
        later: list[ProductWrite] = []
        taken: set[str] = set()
        for write in batch:
            if write.key is None:
                fresh.append(write)
            elif write.key in known:
                if not write.future.done():
                    write.future.set_result((known[write.key], None))
            elif write.key in taken:
                later.append(write)
            else:
                taken.add(write.key)
                fresh.append(write)
        return fresh, later

    async def _insert_new_products(self, batch: list[ProductWrite]) -> None:
        now = self._clock()
        # Ids first (sequences are not transactional): the job payload needs
        # the product id, and make_job is our caller's Python code.
        ids = await self._fetch(
            "SELECT nextval('products_id_seq'), nextval('jobs_id_seq') FROM generate_series(1, $1)",
            len(batch),
            retry=True,
            write=True,
            lane=self._product_writes,
        )
        rows: list[tuple[ProductWrite, Product, int, NewJob, str]] = []
        for write, (product_id, job_id) in zip(batch, sorted(ids), strict=True):
            product = Product(product_id, write.nama, write.harga, now)
            try:
                job = write.make_job(product)
                payload = json.dumps(job.payload)
            except Exception as exc:  # this write alone fails; nothing of it is stored
                if not write.future.done():  # the caller may have gone (cancelled)
                    write.future.set_exception(exc)
                continue
            rows.append((write, product, job_id, job, payload))
        if not rows:
            return
        # One statement is one transaction: both rows of every write, or none.
        await self._execute(
            """
            WITH p AS (
                INSERT INTO products (id, nama, harga, created_at, idempotency_key)
                SELECT * FROM unnest($1::bigint[], $2::text[], $3::bigint[], $4::float8[],
                                     $10::text[])
            )
            INSERT INTO jobs (id, kind, payload, max_attempts, run_at, created_at, updated_at,
                              state, attempts, lease_until)
            SELECT j.id, j.kind, j.payload::jsonb, j.max_attempts, $4[1], $4[1], $4[1],
                   -- leased_for: claimed by the enqueuing instance itself, as claim() would
                   CASE WHEN j.leased_for IS NULL THEN 'pending' ELSE 'running' END,
                   CASE WHEN j.leased_for IS NULL THEN 0 ELSE 1 END,
                   $4[1] + j.leased_for
              FROM unnest($5::bigint[], $6::text[], $7::text[], $8::int[], $9::float8[])
                   AS j (id, kind, payload, max_attempts, leased_for)
            """,
            [r[1].id for r in rows],
            [r[1].nama for r in rows],
            [r[1].harga for r in rows],
            [now] * len(rows),
            [r[2] for r in rows],
            [r[3].kind for r in rows],
            [r[4] for r in rows],
            [r[3].max_attempts for r in rows],
            [r[3].leased_for for r in rows],
            [r[0].key for r in rows],
            write=True,
            lane=self._product_writes,
        )
        self.batches += 1
        self.ops += len(rows)
        self._write_health.proven()
        for write, product, job_id, _, _ in rows:
            if not write.future.done():  # the caller may have gone (cancelled)
                write.future.set_result((product, job_id))


def _one_at_a_time(conn: asyncpg.Connection) -> asyncpg.transaction.Transaction:
    """A transaction in which the row lock orders racing writes of one product.

    Read committed whatever the database's default: the second of two writes
    waits for the first's lock, then reads the row as the first left it (and
    finds it at another version), where repeatable read or serializable would
    fail it with a serialization error.
    """
    return conn.transaction(isolation="read_committed")


async def _locked_product(conn: asyncpg.Connection, product_id: int) -> Product | None:
    row = await conn.fetchrow(
        f"SELECT {PRODUCT_COLUMNS} FROM products"
        " WHERE id = $1 AND deleted_at IS NULL FOR NO KEY UPDATE",
        product_id,
    )
    return Product(*row) if row else None


async def _insert_job(conn: asyncpg.Connection, job: NewJob, now: float) -> int:
    job_id: int = await conn.fetchval(INSERT_JOB, *insert_job_args(job, now))
    return job_id
