"""Databases as an older toko left them, to upgrade with today's.

Each shipped schema version ``n`` is the migration list's first ``n`` steps:
shipped steps are never edited, only appended to (see the migration modules).
"""

from __future__ import annotations

from contextlib import closing

import asyncpg

from service.store.postgres import migrations as pg_migrations
from service.store.sqlite import connect, migrations


def make_sqlite_at(path: str, version: int, *rows: str) -> None:
    """A SQLite file at schema ``version`` holding ``rows`` (INSERT statements)."""
    steps = migrations.MIGRATIONS[:version]
    statements = [part for step in steps for part in migrations.statements_of(step)]
    with closing(connect(path)) as conn:
        conn.execute("BEGIN IMMEDIATE")
        for statement in [*statements, *rows]:
            conn.execute(statement)
        conn.execute(f"PRAGMA user_version = {int(version)}")
        conn.execute("COMMIT")


async def make_postgres_at(conn: asyncpg.Connection, version: int, *rows: str) -> None:
    """The database of ``conn`` at schema ``version`` holding ``rows``."""
    async with conn.transaction():
        await conn.execute(pg_migrations.SCHEMA_TABLE)
        for step in pg_migrations.MIGRATIONS[:version]:
            await conn.execute(step)
        await conn.execute("INSERT INTO toko_schema (version) VALUES ($1)", version)
        for row in rows:
            await conn.execute(row)
