"""The SQLite store's products: each created, changed or deleted with its
email job in one commit, through the group-commit writer."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from collections.abc import Callable, Collection
from dataclasses import dataclass

from service.models import (
    NewJob,
    Product,
    ProductWriteOutcome,
    ProductWritten,
    VersionMismatch,
)
from service.store.sqlite.queue import insert_jobs, insert_rows
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
            return _live_product(conn, product_id)

        return await self._read(read)

    async def list_products(self, after_id: int, limit: int) -> list[Product]:
        def read(conn: sqlite3.Connection) -> list[Product]:
            rows = conn.execute(
                f"SELECT {PRODUCT_COLUMNS} FROM products"
                " WHERE id > ? AND deleted_at IS NULL ORDER BY id LIMIT ?",
                (after_id, limit),
            ).fetchall()
            return [Product(*row) for row in rows]

        return await self._read(read)

    async def update_product(
        self,
        product_id: int,
        nama: str | None,
        harga: int | None,
        versions: Collection[int] | None,
        make_job: Callable[[Product, Product], NewJob | None],
    ) -> ProductWriteOutcome:
        wanted = None if versions is None else frozenset(versions)
        edit = ProductEdit(product_id, wanted, self._clock(), nama, harga, make_job)
        return self._proven(await self._write(edit_products, edit))

    async def delete_product(
        self, product_id: int, versions: Collection[int] | None
    ) -> ProductWriteOutcome:
        wanted = None if versions is None else frozenset(versions)
        edit = ProductEdit(product_id, wanted, self._clock(), delete=True)
        return self._proven(await self._write(edit_products, edit))

    def _proven(self, outcome: ProductWriteOutcome) -> ProductWriteOutcome:
        # Only a commit that wrote something shows the disk takes writes.
        if isinstance(outcome, ProductWritten) and outcome.after != outcome.before:
            self._write_health.proven()
        return outcome


PRODUCT_COLUMNS = "id, nama, harga, created_at, version"


def _live_product(conn: sqlite3.Connection, product_id: int) -> Product | None:
    row = conn.execute(
        f"SELECT {PRODUCT_COLUMNS} FROM products WHERE id = ? AND deleted_at IS NULL",
        (product_id,),
    ).fetchone()
    return Product(*row) if row else None


@dataclass(frozen=True)
class ProductEdit:
    """A change (PATCH) or delete of one product, as the writer thread gets it."""

    product_id: int
    versions: frozenset[int] | None  # None: any (If-Match: *)
    now: float
    nama: str | None = None
    harga: int | None = None
    make_job: Callable[[Product, Product], NewJob | None] | None = None
    delete: bool = False


def edit_products(conn: sqlite3.Connection, edits: list[ProductEdit]) -> list[ProductWriteOutcome]:
    """Apply each edit in turn, in the order they were queued: of two with
    the same version, the first moves the product on and the second finds it
    at another version. One transaction, as every batch."""
    return [_edit_product(conn, edit) for edit in edits]


def _edit_product(conn: sqlite3.Connection, edit: ProductEdit) -> ProductWriteOutcome:
    before = _live_product(conn, edit.product_id)
    if before is None:
        return None
    if edit.versions is not None and before.version not in edit.versions:
        return VersionMismatch(before)
    version = before.version + 1
    if edit.delete:
        conn.execute(
            "UPDATE products SET version = ?, deleted_at = ? WHERE id = ?",
            (version, edit.now, before.id),
        )
        return ProductWritten(before, dataclasses.replace(before, version=version), edit.now)
    after = dataclasses.replace(
        before,
        nama=before.nama if edit.nama is None else edit.nama,
        harga=before.harga if edit.harga is None else edit.harga,
    )
    if after == before:  # nothing to change: nothing written, the version stays
        return ProductWritten(before, before, edit.now)
    after = dataclasses.replace(after, version=version)
    # Before any write: a make_job that raises leaves the batch to roll back.
    job = edit.make_job(before, after) if edit.make_job is not None else None
    conn.execute(
        # The right-hand sides read the row as it was: the first change keeps
        # what the product was created with.
        "UPDATE products SET nama = ?, harga = ?, version = ?,"
        " created_nama = coalesce(created_nama, nama),"
        " created_harga = coalesce(created_harga, harga)"
        " WHERE id = ?",
        (after.nama, after.harga, after.version, after.id),
    )
    job_id = None
    if job is not None:
        (job_id,) = insert_jobs(conn, [(job, edit.now)])
    return ProductWritten(before, after, edit.now, job_id)


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
    # As created (version 1), changed or deleted since or not: the first answer.
    rows = conn.execute(
        "SELECT idempotency_key, id, coalesce(created_nama, nama),"
        " coalesce(created_harga, harga), created_at FROM products"
        " WHERE idempotency_key IN (SELECT value FROM json_each(?))",
        (json.dumps(sorted(keys)),),
    ).fetchall()
    return {key: Product(*product) for key, *product in rows}


def _insert_products(
    conn: sqlite3.Connection, items: list[ProductArg]
) -> list[tuple[Product, int]]:
    if not items:
        return []
    ids = insert_rows(
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
