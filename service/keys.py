"""Typed keys for everything the application object carries."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from service.health import HealthReads
from service.metrics import Metrics
from service.requests_first import RequestsFirst
from service.settings import Settings
from service.store.roles import Store
from service.systemd import Notifier
from service.workers import WorkerPool


@dataclass
class HttpState:
    # Set on SIGTERM: answers then carry "Connection: close", so clients open
    # their next connection to the new process instead of reusing this one.
    draining: bool = False


SETTINGS = web.AppKey("settings", Settings)
STORE = web.AppKey("store", Store)
POOL = web.AppKey("pool", WorkerPool)
NOTIFIER = web.AppKey("notifier", Notifier)
METRICS = web.AppKey("metrics", Metrics)
REQUESTS_FIRST = web.AppKey("requests_first", RequestsFirst)
HEALTH = web.AppKey("health", HealthReads)
HTTP_STATE = web.AppKey("http_state", HttpState)
