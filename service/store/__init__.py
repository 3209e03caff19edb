"""Persistence: products, the job queue and recaps, by role (``roles``), on
SQLite (``sqlite``) or PostgreSQL (``postgres``); shared parts in ``base``
and ``admin``."""

from __future__ import annotations

from service.settings import ToolSettings
from service.store.base import StoreError, write_error
from service.store.roles import Store

__all__ = ["Store", "StoreError", "open_store", "write_error"]


def open_store(settings: ToolSettings, *, application_name: str = "toko-api") -> Store:
    """The store TOKO_DATABASE names (not yet opened: call ``await store.open()``).

    ``application_name`` labels PostgreSQL connections (pg_stat_activity), so
    ``toko-backup --restore`` can tell that a toko-api is connected.
    """
    if settings.store.is_postgres:
        from service.store.postgres import PostgresStore

        return PostgresStore(
            settings.store.database,
            password=settings.store.database_password,
            application_name=application_name,
        )
    from service.store.sqlite import SqliteStore

    return SqliteStore(settings.store.database)
