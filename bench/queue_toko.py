"""toko's own queue for bench/scenario_queue.py: the store plus ``WorkerPool``, no HTTP.

Built the way toko-api builds it (service/app.py, service/runner.py): the
store (``SqliteStore`` or ``PostgresStore``), a ``WorkerPool`` with
``PoolConfig(workers=...)``, ``store.add_wakeup_listener(pool.notify)`` (LISTEN/
NOTIFY on PostgreSQL), with Python's default GIL switch interval as toko-api
keeps it. The in-process producer enqueues the way ``POST /produk`` does,
through ``pool.enqueue_here()``: the job committed already leased when a slot
is free and handed over, else committed pending and the claimer woken.
Target: ``{"database": path-or-URL, "password_file": ...}``; settings:
``{"workers": int}``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench.queue_common import JobBody, Producer, RunningWorker
from service.mail import LogMailer
from service.models import Job, NewJob, stored_job
from service.store.postgres import PostgresStore
from service.store.roles import Store
from service.store.sqlite import SqliteStore
from service.tasks import Handler, JobContext
from service.workers import PoolConfig, WorkerPool

DEFAULT_SETTINGS: dict[str, Any] = {"workers": 10, "job_timeout": 30.0}
MAX_ATTEMPTS = 5


def open_store(target: dict[str, Any], application_name: str = "toko-bench") -> Store:
    database = str(target["database"])
    if database.startswith("postgresql://"):
        password_file = target.get("password_file")
        password = Path(password_file).read_text().strip() if password_file else None
        return PostgresStore(database, password=password, application_name=application_name)
    return SqliteStore(database)


def _handler(body: JobBody) -> Handler:
    async def handle(job: Job, ctx: JobContext) -> None:
        await body(job.payload)

    return handle


class _StoreProducer:
    def __init__(self, store: Store, pool: WorkerPool | None, owned: bool) -> None:
        self.store = store
        self.pool = pool
        self.owned = owned

    async def enqueue(self, kind: str, payload: dict[str, Any]) -> None:
        pool = self.pool
        if pool is None:  # another process: the worker hears of it (LISTEN or sweep)
            await self.store.enqueue(NewJob(kind, payload, MAX_ATTEMPTS))
            return

        # As POST /produk does (service/routes.py): with a worker slot free the
        # job is written already leased and handed straight to the pool.
        async def write(leased_for: float | None) -> tuple[None, Job]:
            job = NewJob(kind, payload, MAX_ATTEMPTS, leased_for)
            # store.enqueue() tells the id alone: the enqueue time here is a
            # moment off the stored one, which the bench's jobs (no email, no
            # Message-ID) never look at, and reading it back would cost a query.
            enqueued_about = time.time()
            return None, stored_job(await self.store.enqueue(job), job, enqueued_about)

        await pool.enqueue_here(write)

    async def close(self) -> None:
        if self.owned:
            await self.store.close()


class _TokoWorker:
    def __init__(self, store: Store, pool: WorkerPool) -> None:
        self.store = store
        self.pool = pool

    async def stop(self) -> None:
        try:
            await self.pool.stop(10.0, lambda busy: None)
        finally:
            await self.store.close()


class TokoAdapter:
    name = "toko"

    async def start_worker(
        self, target: dict[str, Any], settings: dict[str, Any], bodies: dict[str, JobBody]
    ) -> RunningWorker:
        s = {**DEFAULT_SETTINGS, **settings}
        store = open_store(target)
        await store.open()
        context = JobContext(LogMailer(), "bench@toko.invalid", ("admin@toko.invalid",))
        handlers = {kind: _handler(body) for kind, body in bodies.items()}
        config = PoolConfig(workers=int(s["workers"]), job_timeout=float(s["job_timeout"]))
        pool = WorkerPool(store, context, handlers, config)
        store.add_wakeup_listener(pool.notify)
        await pool.start()
        return _TokoWorker(store, pool)

    async def open_producer(self, target: dict[str, Any]) -> Producer:
        store = open_store(target, "toko-bench-producer")
        await store.open()
        return _StoreProducer(store, None, owned=True)

    def local_producer(self, worker: RunningWorker) -> Producer | None:
        assert isinstance(worker, _TokoWorker)
        return _StoreProducer(worker.store, worker.pool, owned=False)


ADAPTER = TokoAdapter()
