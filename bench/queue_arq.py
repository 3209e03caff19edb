"""arq (Redis) for bench/scenario_queue.py.

The worker is ``arq.worker.Worker`` in this process with ``handle_signals=False``
(the bench harness owns SIGTERM); settings are passed to it as they are, so
``{}`` means arq's defaults (max_jobs 10, poll_delay 0.5 s, keep_result 1 h,
queue_read_limit max(5 x max_jobs, 100), log_results on; logging itself stays
at WARNING for every system in the bench). Target: ``{"port": int}`` of a
Redis server on 127.0.0.1 (bench.redis_server).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from arq import create_pool
from arq.connections import ArqRedis, RedisSettings
from arq.worker import Worker, func

from bench.queue_common import JobBody, Producer, RunningWorker


def redis_settings(target: dict[str, Any]) -> RedisSettings:
    return RedisSettings(host="127.0.0.1", port=int(target["port"]))


def _job(name: str, body: JobBody) -> Any:
    async def job(ctx: dict[str, Any], payload: dict[str, Any]) -> None:
        await body(payload)

    job.__qualname__ = name
    return func(job, name=name)


class _ArqWorker:
    def __init__(self, worker: Worker, task: asyncio.Task[None]) -> None:
        self.worker = worker
        self.task = task

    async def stop(self) -> None:
        self.task.cancel()  # the poll loop; the jobs in flight finish
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        await asyncio.gather(*self.worker.tasks.values(), return_exceptions=True)
        with contextlib.suppress(asyncio.CancelledError):
            await self.worker.close()


class _ArqProducer:
    def __init__(self, pool: ArqRedis) -> None:
        self.pool = pool

    async def enqueue(self, kind: str, payload: dict[str, Any]) -> None:
        await self.pool.enqueue_job(kind, payload)

    async def close(self) -> None:
        await self.pool.aclose()


class ArqAdapter:
    name = "arq"

    async def start_worker(
        self, target: dict[str, Any], settings: dict[str, Any], bodies: dict[str, JobBody]
    ) -> RunningWorker:
        started = asyncio.Event()

        async def on_startup(ctx: dict[str, Any]) -> None:
            started.set()

        worker = Worker(
            [_job(name, body) for name, body in bodies.items()],
            redis_settings=redis_settings(target),
            handle_signals=False,
            on_startup=on_startup,
            **settings,
        )
        task = asyncio.create_task(worker.async_run(), name="arq-worker")
        waiter = asyncio.create_task(started.wait())
        await asyncio.wait([task, waiter], timeout=30, return_when=asyncio.FIRST_COMPLETED)
        if not started.is_set():
            waiter.cancel()
            if task.done():
                task.result()  # raises what went wrong
            raise RuntimeError("arq worker did not start within 30 s")
        return _ArqWorker(worker, task)

    async def open_producer(self, target: dict[str, Any]) -> Producer:
        return _ArqProducer(await create_pool(redis_settings(target)))

    def local_producer(self, worker: RunningWorker) -> Producer | None:
        return None


ADAPTER = ArqAdapter()
