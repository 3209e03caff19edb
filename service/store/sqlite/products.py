"""The SQLite store's products: each created with its email job in one commit."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable

from service.models import NewJob, Product
from service.store.sqlite.queue import insert_jobs, insert_returning_ids
from service.store.sqlite.transport import SqliteTransport


class SqliteProducts(SqliteTransport):
    # products ------------------------------------------------------------------
    async def create_product(
        self,
        nama: str,
        harga: int,
        make_job: Callable[[Product], NewJob],
        idempotency_key: str | None = None,
    ) -> tuple[Product, int | None]:
        arg = (nama, harga, self._clock(), make_job, idempotency_key)
        result = await self._write(create_products, arg)
        self._write_health.proven()
        return result

    async def get_product(self, product_id: int) -> Product | None:
        def read(conn: sqlite3.Connection) -> Product | None:
            row = conn.execute(
                "SELECT id, nama, harga, created_at FROM products WHERE id = ?", (product_id,)
            ).fetchone()
            return Product(*row) if row else None

        return await self._read(read)

    async def list_products(self, after_id: int, limit: int) -> list[Product]:
        def read(conn: sqlite3.Connection) -> list[Product]:
            rows = conn.execute(
                "SELECT id, nama, harga, created_at FROM products WHERE id > ? ORDER BY id LIMIT ?",
                (after_id, limit),
            ).fetchall()
            return [Product(*row) for row in rows]

        return await self._read(read)


ProductArg = tuple[str, int, float, Callable[[Product], NewJob], str | None]


def create_products(
    conn: sqlite3.Connection, items: list[ProductArg]
) -> list[tuple[Product, int | None]]:
    """Insert each product with its job; a key stored before (or earlier in
    this batch) inserts nothing and answers with that product and no job id."""
    keys = {item[4] for item in items if item[4] is not None}
    if not keys:
        return list(_insert_products(conn, items))
    stored = _products_by_key(conn, keys)
    fresh: list[ProductArg] = []
    taken: set[str] = set()
    for item in items:
        key = item[4]
        if key is None or (key not in stored and key not in taken):
            fresh.append(item)
            if key is not None:
                taken.add(key)
    created = iter(_insert_products(conn, fresh))
    results: list[tuple[Product, int | None]] = []
    for item in items:
        key = item[4]
        if key is not None and key in stored:
            results.append((stored[key], None))
            continue
        product, job_id = next(created)
        if key is not None:
            stored[key] = product  # later items with this key answer with it
        results.append((product, job_id))
    return results


def _products_by_key(conn: sqlite3.Connection, keys: set[str]) -> dict[str, Product]:
    rows = conn.execute(
        "SELECT idempotency_key, id, nama, harga, created_at FROM products"
        " WHERE idempotency_key IN (SELECT value FROM json_each(?))",
        (json.dumps(sorted(keys)),),
    ).fetchall()
    return {key: Product(*product) for key, *product in rows}


def _insert_products(
    conn: sqlite3.Connection, items: list[ProductArg]
) -> list[tuple[Product, int]]:
    if not items:
        return []
    ids = insert_returning_ids(
        conn,
        "products",
        ("nama", "harga", "created_at", "idempotency_key"),
        [(nama, harga, now, key) for nama, harga, now, _, key in items],
    )
    products = [
        Product(pid, nama, harga, now)
        for pid, (nama, harga, now, _, _) in zip(ids, items, strict=True)
    ]
    jobs = [
        (make_job(p), p.created_at)
        for p, (_, _, _, make_job, _) in zip(products, items, strict=True)
    ]
    job_ids = insert_jobs(conn, jobs)
    return list(zip(products, job_ids, strict=True))
