"""Persistence: products, the job queue and recaps behind one small interface."""

from service.store.base import Store, StoreError

__all__ = ["Store", "StoreError"]
