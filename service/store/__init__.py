"""Persistence: products, the job queue and recaps behind one small interface."""

from __future__ import annotations

from service.settings import Settings
from service.store.base import Store, StoreError

__all__ = ["Store", "StoreError", "open_store"]


def open_store(settings: Settings) -> Store:
    """The store TOKO_DATABASE names (not yet opened: call ``await store.open()``)."""
    if settings.is_postgres:
        raise StoreError("the PostgreSQL backend is not part of this release")
    from service.store.sqlite import SqliteStore

    return SqliteStore(settings.database)
