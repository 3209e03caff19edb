"""The store's backends as tests see them: a settable clock, and what differs
between SQLite and PostgreSQL (how to look at the rows, how to break the
database). The fixtures that make them are in tests/conftest.py."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, closing
from pathlib import Path
from typing import Any

from service.store.postgres import PostgresStore
from service.store.postgres.migrations import LATEST_VERSION as PG_LATEST
from service.store.roles import Store
from service.store.sqlite import SqliteStore
from service.store.sqlite.migrations import LATEST_VERSION as SQLITE_LATEST
from tests.support.old_schema import make_postgres_at, make_sqlite_at
from tests.support.postgres import PostgresCluster, fetch


class FakeClock:
    """A settable clock: the only thing these tests mock."""

    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Backend:
    name: str
    latest_version: int

    def make_store(self, clock: Callable[[], float] | None = None) -> Store:
        raise NotImplementedError

    async def rows(self, sql: str) -> list[tuple[Any, ...]]:
        """Rows of ``sql`` read through a connection of its own (so: committed)."""
        raise NotImplementedError

    async def schema_version(self) -> int:
        raise NotImplementedError

    async def make_future_schema(self) -> None:
        """Mark the (empty) database as migrated by a newer toko."""
        raise NotImplementedError

    async def make_old_schema(self, version: int, *rows: str) -> None:
        """Make the (empty) database as the toko of schema ``version`` left
        it, holding ``rows`` (INSERT statements both dialects read alike)."""
        raise NotImplementedError

    def unopenable_store(self) -> tuple[Store, str]:
        """A store that cannot open, and the message StoreError must match."""
        raise NotImplementedError

    async def forget_since(self, product_id: int, job_id: int) -> None:
        """Do to the ids what restoring a backup from before this product and
        this job does: they, and those after them, are handed out again."""
        raise NotImplementedError

    def jobs_locked(self) -> AbstractAsyncContextManager[None]:
        """Another session holds the jobs table until the block ends (SQLite:
        the file's write lock; PostgreSQL: LOCK TABLE, as maintenance does):
        the store's writes to it wait, and on PostgreSQL its reads too."""
        raise NotImplementedError


class SqliteBackend(Backend):
    name = "sqlite"
    latest_version = SQLITE_LATEST

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.path = str(folder / "toko.db")

    def make_store(self, clock: Callable[[], float] | None = None) -> Store:
        return SqliteStore(self.path, clock=clock) if clock else SqliteStore(self.path)

    async def rows(self, sql: str) -> list[tuple[Any, ...]]:
        with closing(sqlite3.connect(self.path)) as conn:
            return [tuple(row) for row in conn.execute(sql).fetchall()]

    async def schema_version(self) -> int:
        return int((await self.rows("PRAGMA user_version"))[0][0])

    async def make_future_schema(self) -> None:
        with closing(sqlite3.connect(self.path)) as conn:
            conn.execute(f"PRAGMA user_version = {SQLITE_LATEST + 1}")

    async def make_old_schema(self, version: int, *rows: str) -> None:
        make_sqlite_at(self.path, version, *rows)

    def unopenable_store(self) -> tuple[Store, str]:
        (self.folder / "file").write_text("x")
        return SqliteStore(str(self.folder / "file" / "toko.db")), "cannot open database"

    async def forget_since(self, product_id: int, job_id: int) -> None:
        # SQLite numbers a new row one past the largest id: gone rows' ids come back.
        with closing(sqlite3.connect(self.path)) as conn, conn:
            conn.execute("DELETE FROM jobs WHERE id >= ?", (job_id,))
            conn.execute("DELETE FROM products WHERE id >= ?", (product_id,))

    @asynccontextmanager
    async def jobs_locked(self) -> AsyncIterator[None]:
        with closing(sqlite3.connect(self.path, isolation_level=None)) as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield
            finally:
                conn.execute("ROLLBACK")


class PostgresBackend(Backend):
    name = "postgres"
    latest_version = PG_LATEST

    def __init__(self, cluster: PostgresCluster, url: str) -> None:
        self.cluster = cluster
        self.url = url

    def make_store(self, clock: Callable[[], float] | None = None) -> Store:
        password = self.cluster.password
        if clock:
            return PostgresStore(self.url, password=password, clock=clock)
        return PostgresStore(self.url, password=password)

    async def rows(self, sql: str) -> list[tuple[Any, ...]]:
        return await fetch(self.cluster, self.url, sql)

    async def schema_version(self) -> int:
        return int((await self.rows("SELECT version FROM toko_schema"))[0][0])

    async def make_future_schema(self) -> None:
        await self.rows(
            "CREATE TABLE toko_schema (one boolean PRIMARY KEY DEFAULT true, version integer);"
        )
        await self.rows(f"INSERT INTO toko_schema (version) VALUES ({PG_LATEST + 1})")

    async def make_old_schema(self, version: int, *rows: str) -> None:
        conn = await self.cluster.connect(self.url.rsplit("/", 1)[1])
        try:
            await make_postgres_at(conn, version, *rows)
        finally:
            await conn.close()

    def unopenable_store(self) -> tuple[Store, str]:
        # The right server, the wrong password: refused at authentication.
        return PostgresStore(self.url, password="wrong"), "cannot open database"

    async def forget_since(self, product_id: int, job_id: int) -> None:
        # pg_restore puts the sequences back where the dump found them.
        await self.rows(f"DELETE FROM jobs WHERE id >= {int(job_id)}")
        await self.rows(f"DELETE FROM products WHERE id >= {int(product_id)}")
        await self.rows(f"SELECT setval('jobs_id_seq', {int(job_id)}, false)")
        await self.rows(f"SELECT setval('products_id_seq', {int(product_id)}, false)")

    @asynccontextmanager
    async def jobs_locked(self) -> AsyncIterator[None]:
        conn = await self.cluster.connect(self.url.rsplit("/", 1)[1])
        try:
            locked = conn.transaction()
            await locked.start()
            await conn.execute("LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE")
            try:
                yield
            finally:
                await locked.rollback()
        finally:
            await conn.close()
