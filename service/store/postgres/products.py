"""The PostgreSQL store's products: rows inserted with their jobs, one statement a batch."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass

from service.models import NewJob, Product
from service.store.postgres.transport import PostgresTransport


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
            "SELECT id, nama, harga, created_at FROM products WHERE id = $1", product_id, retry=True
        )
        return Product(*row) if row else None

    async def list_products(self, after_id: int, limit: int) -> list[Product]:
        rows = await self._fetch(
            "SELECT id, nama, harga, created_at FROM products WHERE id > $1 ORDER BY id LIMIT $2",
            after_id,
            limit,
            retry=True,
        )
        return [Product(*row) for row in rows]

    async def _answer_known_keys(
        self, batch: list[ProductWrite]
    ) -> tuple[list[ProductWrite], list[ProductWrite]]:
        """Answer the writes whose key is stored already; return (to insert, to retry after).

        A key twice in one batch: the first is inserted, the rest wait for it.
        """
        keys = [write.key for write in batch if write.key is not None]
        if not keys:
            return batch, []
        rows = await self._fetch(
            "SELECT idempotency_key, id, nama, harga, created_at FROM products"
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
