"""procrastinate (PostgreSQL, psycopg connector) for bench/scenario_queue.py.

The worker is ``App.run_worker_async`` in this process with
``install_signal_handlers=False`` (the bench harness owns SIGTERM). Settings:
``{"worker": {...run_worker_async options}, "pool": {...AsyncConnectionPool
options}}``; empty means procrastinate's defaults (concurrency 1,
fetch_job_polling_interval 5 s with LISTEN/NOTIFY on, jobs kept after they
finish, psycopg_pool's 4 connections). Target: ``{"url": postgresql://...,
"password_file": path}``; the schema is applied by :func:`apply_schema`.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

from procrastinate import App, PsycopgConnector

from bench.queue_common import JobBody, Producer, RunningWorker


def make_app(target: dict[str, Any], pool: dict[str, Any] | None = None) -> App:
    password = Path(target["password_file"]).read_text().strip()
    connector = PsycopgConnector(
        conninfo=target["url"], kwargs={"password": password}, **(pool or {})
    )
    return App(connector=connector)


async def apply_schema(target: dict[str, Any]) -> None:
    app = make_app(target)
    async with app.open_async():
        await app.schema_manager.apply_schema_async()


def _register(app: App, bodies: dict[str, JobBody]) -> None:
    for name, body in bodies.items():

        async def job(p: dict[str, Any], body: JobBody = body) -> None:
            await body(p)

        app.task(name=name)(job)


class _Worker:
    def __init__(self, app: App, task: asyncio.Task[None]) -> None:
        self.app = app
        self.task = task

    async def stop(self) -> None:
        self.task.cancel()  # procrastinate's graceful stop: finish the jobs in flight
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        await self.app.close_async()


class _Producer:
    def __init__(self, app: App) -> None:
        self.app = app

    async def enqueue(self, kind: str, payload: dict[str, Any]) -> None:
        await self.app.tasks[kind].defer_async(p=payload)

    async def enqueue_many(self, kind: str, payloads: list[dict[str, Any]]) -> None:
        """Seeding only: one INSERT for many jobs (procrastinate's batch_defer)."""
        await self.app.tasks[kind].batch_defer_async(*({"p": p} for p in payloads))

    async def close(self) -> None:
        await self.app.close_async()


async def _noop_body(payload: dict[str, Any]) -> None:
    """Producers only defer; the task body they register never runs there."""


class ProcrastinateAdapter:
    name = "procrastinate"

    async def start_worker(
        self, target: dict[str, Any], settings: dict[str, Any], bodies: dict[str, JobBody]
    ) -> RunningWorker:
        app = make_app(target, settings.get("pool"))
        _register(app, bodies)
        await app.open_async()
        options = {**settings.get("worker", {}), "install_signal_handlers": False}
        task = asyncio.create_task(app.run_worker_async(**options), name="procrastinate")
        await asyncio.sleep(0.3)  # registered and listening (no hook says so)
        if task.done():
            task.result()
            raise RuntimeError("procrastinate worker ended at start")
        return _Worker(app, task)

    async def open_producer(self, target: dict[str, Any]) -> Producer:
        app = make_app(target)
        _register(app, {"noop": _noop_body, "sleep": _noop_body})
        await app.open_async()
        return _Producer(app)

    def local_producer(self, worker: RunningWorker) -> Producer | None:
        return None


ADAPTER = ProcrastinateAdapter()
