"""What every queue system's bench worker and producer share (bench/scenario_queue.py).

A system module (``bench.queue_toko``, ``bench.queue_arq``,
``bench.queue_procrastinate``) implements :class:`Adapter`: start a worker
with two job kinds, open a producer, and nothing else. :func:`main` turns it
into a command line::

    python -m bench.queue_worker arq worker  --target JSON --settings JSON --kind noop \\
        --expect 10000 --out result.json --ready ready.json --timeout 120
    python -m bench.queue_worker arq produce --target JSON --rate 200 --seconds 10 \\
        --out produced.json

Every job runs the same body, whatever the system: its first line records
``time.time()`` (and, when the payload carries the enqueue time ``t``, the
enqueue→start latency); ``sleep`` jobs then await 10 ms; the last line records
the end. The worker writes its result file once ``--expect`` jobs have ended,
on SIGTERM, or at ``--timeout``, whichever comes first, with the process's
peak RSS (VmHWM) read at that moment; then it stops its system and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

KINDS = ("noop", "sleep")
SLEEP_SECONDS = 0.01
# How long a worker may take to stop its system once the measurement is over.
STOP_SECONDS = 20.0

JobBody = Callable[[dict[str, Any]], Awaitable[None]]


class RunningWorker(Protocol):
    async def stop(self) -> None: ...


class Producer(Protocol):
    async def enqueue(self, kind: str, payload: dict[str, Any]) -> None: ...

    async def close(self) -> None: ...


class Adapter(Protocol):
    """One queue system, seen from the bench."""

    name: str

    async def start_worker(
        self, target: dict[str, Any], settings: dict[str, Any], bodies: dict[str, JobBody]
    ) -> RunningWorker:
        """Start consuming; return once the worker is connected and polling."""

    async def open_producer(self, target: dict[str, Any]) -> Producer: ...

    def local_producer(self, worker: RunningWorker) -> Producer | None:
        """A producer inside the worker process (toko SQLite), or None."""


# -- recording (pure) ---------------------------------------------------------------


@dataclass
class Recorder:
    """Start and end times of the jobs a worker ran, and their enqueue→start latencies."""

    expect: int
    started: int = 0
    finished: int = 0
    first_start: float | None = None
    last_end: float | None = None
    latencies_ms: list[float] = field(default_factory=list)
    on_complete: Callable[[], None] | None = None

    def start(self, payload: dict[str, Any], now: float) -> None:
        if self.first_start is None:
            self.first_start = now
        self.started += 1
        enqueued = payload.get("t")
        if isinstance(enqueued, (int, float)):
            self.latencies_ms.append((now - enqueued) * 1000.0)

    def end(self, now: float) -> None:
        self.finished += 1
        self.last_end = now
        if self.finished == self.expect and self.on_complete is not None:
            self.on_complete()

    def result(self) -> dict[str, Any]:
        return {
            "expect": self.expect,
            "started": self.started,
            "finished": self.finished,
            "complete": self.finished >= self.expect,
            "first_start": self.first_start,
            "last_end": self.last_end,
            "jobs_per_s": jobs_per_second(self.finished, self.first_start, self.last_end),
            "latencies_ms": [round(v, 4) for v in self.latencies_ms],
        }


def jobs_per_second(
    finished: int, first_start: float | None, last_end: float | None
) -> float | None:
    """Jobs/s from the first job's start to the last job's end (None without an interval)."""
    if finished <= 0 or first_start is None or last_end is None or last_end <= first_start:
        return None
    return finished / (last_end - first_start)


def job_bodies(recorder: Recorder, clock: Callable[[], float] = time.time) -> dict[str, JobBody]:
    """The two job kinds every system runs: ``noop`` and ``sleep`` (awaits 10 ms)."""

    async def noop(payload: dict[str, Any]) -> None:
        recorder.start(payload, clock())
        recorder.end(clock())

    async def sleep(payload: dict[str, Any]) -> None:
        recorder.start(payload, clock())
        await asyncio.sleep(SLEEP_SECONDS)
        recorder.end(clock())

    return {"noop": noop, "sleep": sleep}


def due_times(t0: float, rate: float, seconds: float) -> list[float]:
    """When each job of an open-loop load at ``rate``/s for ``seconds`` is due: t0 + i/rate."""
    if rate <= 0 or seconds <= 0:
        raise ValueError("rate and seconds must be positive")
    count = math.floor(rate * seconds + 1e-9)
    return [t0 + i / rate for i in range(count)]


def status_kib(text: str) -> dict[str, int]:
    """VmRSS, VmHWM (peak), Threads from the text of /proc/<pid>/status."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in {"VmRSS", "VmHWM", "Threads"} and value.split():
            out[key] = int(value.split()[0])
    return out


def own_memory_kib() -> dict[str, int]:
    return status_kib(Path(f"/proc/{os.getpid()}/status").read_text())


# -- producing (open loop) --------------------------------------------------------------


async def produce(
    producer: Producer, kind: str, rate: float, seconds: float, limit_s: float
) -> dict[str, Any]:
    """Enqueue at ``rate``/s for ``seconds``, open loop: job i is sent at t0 + i/rate.

    Each enqueue is a task of its own, so a slow commit never delays the next
    job's send. The payload's ``t`` is ``time.time()`` taken just before the
    enqueue call. Bounded: ``rate*seconds`` jobs, and ``limit_s`` for the lot.
    """
    loop = asyncio.get_running_loop()
    mono0 = loop.time() + 0.05
    dues = due_times(mono0, rate, seconds)
    lateness_ms: list[float] = []
    call_ms: list[float] = []
    errors: list[str] = []

    async def one() -> None:
        t = time.time()
        c0 = time.perf_counter()
        try:
            await producer.enqueue(kind, {"t": t})
        except Exception as exc:  # counted, not fatal: the worker will miss it
            errors.append(repr(exc)[:200])
            return
        call_ms.append((time.perf_counter() - c0) * 1000.0)

    tasks: list[asyncio.Task[None]] = []
    deadline = mono0 + limit_s
    for due in dues:
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        if loop.time() > deadline:
            break
        lateness_ms.append(max(0.0, (loop.time() - due) * 1000.0))
        tasks.append(asyncio.create_task(one()))
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=max(1.0, deadline - loop.time()))
        for task in pending:
            task.cancel()
    return {
        "scheduled": len(dues),
        "sent": len(tasks),
        "enqueued": len(call_ms),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "lateness_ms": _summary(lateness_ms),
        "enqueue_call_ms": _summary(call_ms),
    }


def _summary(values: list[float]) -> dict[str, float] | None:
    from bench.stats import percentile

    if not values:
        return None
    return {
        "p50": round(percentile(values, 50), 3),
        "p99": round(percentile(values, 99), 3),
        "max": round(max(values), 3),
    }


# -- the worker process -------------------------------------------------------------------


async def _worker(adapter: Adapter, args: argparse.Namespace) -> int:
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, done.set)
    recorder = Recorder(expect=args.expect, on_complete=done.set)
    target = json.loads(args.target)
    settings = json.loads(args.settings)
    worker = await adapter.start_worker(target, settings, job_bodies(recorder))
    produced: dict[str, Any] | None = None
    producing: asyncio.Task[dict[str, Any]] | None = None
    try:
        _write_json(args.ready, {"pid": os.getpid(), "at": time.time()})
        if args.produce_rate:
            local = adapter.local_producer(worker)
            if local is None:
                raise SystemExit(f"{adapter.name} has no in-process producer")
            await asyncio.sleep(args.produce_after)
            producing = asyncio.create_task(
                produce(local, args.kind, args.produce_rate, args.produce_seconds, args.timeout)
            )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), args.timeout)
        memory = own_memory_kib()
        if producing is not None:
            if producing.done():
                produced = producing.result()
            else:
                producing.cancel()
        _write_json(args.out, {**recorder.result(), "memory_kib": memory, "produced": produced})
    finally:
        try:
            await asyncio.wait_for(worker.stop(), STOP_SECONDS)
        except TimeoutError:
            print(f"bench: {adapter.name} worker did not stop in {STOP_SECONDS}s", file=sys.stderr)
    return 0


async def _producer(adapter: Adapter, args: argparse.Namespace) -> int:
    producer = await adapter.open_producer(json.loads(args.target))
    try:
        result = await produce(producer, args.kind, args.rate, args.seconds, args.timeout)
    finally:
        await producer.close()
    _write_json(args.out, result)
    return 0


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)  # readers never see half a file


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="a queue system's bench worker or producer")
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("worker")
    w.add_argument("--target", required=True, help="JSON: where the queue lives")
    w.add_argument("--settings", default="{}", help="JSON: worker settings")
    w.add_argument("--kind", choices=KINDS, default="noop")
    w.add_argument("--expect", type=int, required=True, help="jobs to wait for")
    w.add_argument("--out", type=Path, required=True)
    w.add_argument("--ready", type=Path, required=True)
    w.add_argument("--timeout", type=float, default=300.0)
    w.add_argument("--produce-rate", type=float, default=0.0, help="in-process producer")
    w.add_argument("--produce-seconds", type=float, default=10.0)
    w.add_argument("--produce-after", type=float, default=1.0)
    pr = sub.add_parser("produce")
    pr.add_argument("--target", required=True)
    pr.add_argument("--kind", choices=KINDS, default="noop")
    pr.add_argument("--rate", type=float, required=True)
    pr.add_argument("--seconds", type=float, required=True)
    pr.add_argument("--timeout", type=float, default=60.0)
    pr.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def main(adapter: Adapter, argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "worker":
        return asyncio.run(_worker(adapter, args))
    return asyncio.run(_producer(adapter, args))


async def seed(adapter: Adapter, target: dict[str, Any], kind: str, jobs: int) -> float:
    """Enqueue ``jobs`` jobs through the system's own producer (batches of 200 at once).

    A producer with ``enqueue_many`` (procrastinate's batch defer) gets the
    batches whole: seeding is not measured, only waited for.
    """
    t0 = time.monotonic()
    producer = await adapter.open_producer(target)
    try:
        many = getattr(producer, "enqueue_many", None)
        for start in range(0, jobs, 200):
            if many is not None:
                await many(kind, [{"i": i} for i in range(start, min(jobs, start + 200))])
                continue
            await asyncio.gather(
                *(producer.enqueue(kind, {"i": i}) for i in range(start, min(jobs, start + 200)))
            )
    finally:
        await producer.close()
    return time.monotonic() - t0
