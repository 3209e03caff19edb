"""The SQLite store: one file under the state directory, WAL, durable commits.

Split by concern: the transport (the file, its writer and reader threads,
errors and health: ``transport``), the group-commit writer (``writer``) and
its checkpoints (``checkpoints``), the guard of the file itself
(``file_guard``), the schema (``migrations``), and what callers use:
``products``, ``queue``, ``recaps``, ``admin``.

Usage from other code (toko-recap, toko-backup, tests)::

    store = SqliteStore("/var/lib/toko/toko.db")
    await store.open()
    try:
        ...
    finally:
        await store.close()
"""

from __future__ import annotations

from service.store.sqlite.admin import SqliteAdmin
from service.store.sqlite.products import SqliteProducts
from service.store.sqlite.queue import SqliteQueue
from service.store.sqlite.recaps import SqliteRecaps
from service.store.sqlite.transport import connect


class SqliteStore(SqliteProducts, SqliteQueue, SqliteRecaps, SqliteAdmin):
    """Every role of :class:`~service.store.roles.Store`, on one SQLite file."""


__all__ = ["SqliteStore", "connect"]
