"""A constant-rate, open-loop HTTP load generator for POST /produk.

Why not wrk here: wrk is closed-loop. Its Lua ``delay()`` pacing waits after
each response on each connection, so a slow response postpones the next
request instead of queueing it (coordinated omission): the stall is hidden
from the latency figures and the offered rate drops exactly when the service
is struggling. wrk2's ``-R`` fixes that but is not packaged in Debian 12.

Here request ``i`` is *scheduled* at ``t0 + i/rate`` regardless of how earlier
requests fare, and its latency is measured from that scheduled instant to the
end of the response. Time spent waiting for a free connection in the client
pool, or because the generator itself fell behind, counts as latency: that is
the figure a user at a steady arrival rate would see. The generator's own
lateness (actual send minus scheduled) is reported separately so a slow
client cannot pass for a slow server.

The run is bounded in count (``rate * duration`` requests) and time (a hard
deadline of ``duration + request timeout + grace``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from yarl import URL

from bench.rawhttp import HttpError, Pool
from bench.stats import percentile

CLIENTS = ("aiohttp", "raw")


@dataclass
class Sample:
    index: int
    scheduled: float  # seconds since t0
    started: float = 0.0  # when the request task began (generator lateness = started - scheduled)
    finished: float = 0.0
    status: int = 0  # 0: no HTTP response
    error: str = ""
    product_id: int | None = None

    @property
    def latency_ms(self) -> float:
        return (self.finished - self.scheduled) * 1000.0

    @property
    def ok(self) -> bool:
        return self.status == 201 and self.product_id is not None and not self.error


@dataclass
class OpenLoopResult:
    rate: float
    duration_s: float
    samples: list[Sample] = field(default_factory=list)
    wall_s: float = 0.0
    t0_monotonic: float = 0.0  # loop.time() is time.monotonic() on Linux

    def product_ids(self) -> list[int]:
        return [s.product_id for s in self.samples if s.product_id is not None]

    def summary(self) -> dict[str, Any]:
        done = [s for s in self.samples if s.finished > 0]
        ok = [s for s in self.samples if s.ok]
        lat = [s.latency_ms for s in done]
        late = [(s.started - s.scheduled) * 1000.0 for s in done]
        errors: dict[str, int] = {}
        for s in self.samples:
            if not s.ok:
                key = s.error or f"HTTP {s.status}"
                errors[key] = errors.get(key, 0) + 1
        last_sched = max((s.scheduled for s in self.samples), default=0.0)
        out: dict[str, Any] = {
            "target_rate": self.rate,
            "duration_s": self.duration_s,
            "requests": len(self.samples),
            "ok_201": len(ok),
            "errors": sum(errors.values()),
            "error_kinds": errors,
            "achieved_rate": len(self.samples) / last_sched if last_sched > 0 else 0.0,
            "wall_s": self.wall_s,
        }
        if lat:
            out["latency_ms"] = latency_summary(lat)
            out["generator_lateness_ms"] = latency_summary(late)
        out["per_second"] = per_second(done)
        return out


def latency_summary(values: Sequence[float]) -> dict[str, float]:
    return {
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "p999": percentile(values, 99.9),
        "max": max(values),
        "mean": sum(values) / len(values),
    }


def per_second(samples: Sequence[Sample]) -> list[dict[str, float]]:
    """Latency per one-second bucket of scheduled time: shows stalls (checkpoints, GC)."""
    buckets: dict[int, list[float]] = {}
    for s in samples:
        buckets.setdefault(int(s.scheduled), []).append(s.latency_ms)
    return [
        {
            "second": sec,
            "n": len(v),
            "p50_ms": round(percentile(v, 50), 3),
            "p99_ms": round(percentile(v, 99), 3),
            "max_ms": round(max(v), 3),
        }
        for sec, v in sorted(buckets.items())
    ]


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    sample: Sample,
    t0: float,
    token: str,
) -> None:
    loop = asyncio.get_running_loop()
    sample.started = loop.time() - t0
    body = json.dumps({"nama": f"bench-{token}-{sample.index}", "harga": 1000 + sample.index})
    try:
        async with session.post(
            url, data=body, headers={"Content-Type": "application/json"}
        ) as resp:
            raw = await resp.read()
            sample.status = resp.status
            if resp.status == 201:
                try:
                    sample.product_id = int(json.loads(raw)["id"])
                except (ValueError, KeyError, TypeError):
                    sample.error = "201 without a product id"
    except (aiohttp.ClientError, TimeoutError) as exc:
        sample.error = type(exc).__name__
    sample.finished = loop.time() - t0


async def _one_raw(pool: Pool, url: URL, sample: Sample, t0: float, token: str) -> None:
    """``_one`` through ``bench.rawhttp``: the same request, a fraction of the client's CPU."""
    loop = asyncio.get_running_loop()
    sample.started = loop.time() - t0
    body = json.dumps(
        {"nama": f"bench-{token}-{sample.index}", "harga": 1000 + sample.index}
    ).encode()
    head = (
        f"POST {url.raw_path_qs} HTTP/1.1\r\nHost: {url.raw_authority}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    try:
        status, raw = await pool.request(head.encode() + body)
        sample.status = status
        if status == 201:
            try:
                sample.product_id = int(json.loads(raw)["id"])
            except (ValueError, KeyError, TypeError):
                sample.error = "201 without a product id"
    except (HttpError, TimeoutError) as exc:
        sample.error = type(exc).__name__
    sample.finished = loop.time() - t0


async def open_loop(
    url: str,
    *,
    rate: float,
    duration_s: float,
    token: str,
    max_connections: int = 256,
    request_timeout_s: float = 10.0,
    part: tuple[int, int] = (0, 1),
    start_at: float | None = None,
    client: str = "aiohttp",
) -> OpenLoopResult:
    """Send ``rate * duration_s`` POSTs on a fixed schedule; see the module docstring.

    ``part=(k, n)`` sends only requests ``i`` with ``i % n == k``, and ``start_at``
    (a ``time.monotonic()`` instant, shared by every part) is the schedule's t0:
    so ``n`` processes can offer one schedule between them (``bench.loadgen_split``).
    ``client="raw"`` sends through ``bench.rawhttp`` instead of aiohttp's client.
    """
    total = int(rate * duration_s)
    k, n = part
    if not 0 <= k < n:
        raise ValueError(f"part {k} of {n}")
    if client not in CLIENTS:
        raise ValueError(f"client {client!r} is not one of {CLIENTS}")
    result = OpenLoopResult(rate=rate, duration_s=duration_s)
    samples = [Sample(i, i / rate) for i in range(k, total, n)]
    result.samples = samples
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    connector = aiohttp.TCPConnector(limit=max_connections, force_close=False)
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()
    # Allocation-heavy loops trigger full GCs; freezing what exists now keeps
    # the generator's own pauses out of the figures it reports.
    gc.collect()
    gc.freeze()
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            t0 = loop.time() if start_at is None else start_at
            result.t0_monotonic = t0
            parsed = URL(url)
            pool = Pool(
                parsed.host or "127.0.0.1", parsed.port or 80, max_connections, request_timeout_s
            )

            def send(sample: Sample) -> Coroutine[Any, Any, None]:
                if client == "raw":
                    return _one_raw(pool, parsed, sample, t0, token)
                return _one(session, url, sample, t0, token)

            await _launch_on_schedule(samples, t0, send, tasks)
            await _finish(tasks, request_timeout_s + 5)
            result.wall_s = loop.time() - t0
            pool.close()
    finally:
        gc.unfreeze()
        for task in tasks:
            task.cancel()
    for s in samples:
        if s.finished == 0.0 and not s.error:
            s.error = "not completed"
    return result


async def _launch_on_schedule(
    samples: list[Sample],
    t0: float,
    send: Callable[[Sample], Coroutine[Any, Any, None]],
    tasks: set[asyncio.Task[None]],
) -> None:
    loop = asyncio.get_running_loop()
    nxt = 0
    mine = len(samples)
    while nxt < mine:
        now = loop.time() - t0
        # Launch everything due by now: catching up keeps the schedule
        # open-loop even when the generator slept too long.
        while nxt < mine and samples[nxt].scheduled <= now:
            task = asyncio.create_task(send(samples[nxt]))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            nxt += 1
        if nxt < mine:
            await asyncio.sleep(max(0.0, samples[nxt].scheduled - (loop.time() - t0)))


async def _finish(tasks: set[asyncio.Task[None]], timeout: float) -> None:  # noqa: ASYNC109
    """Wait for the requests in flight; cancel what is still out after ``timeout``."""
    if not tasks:
        return
    _, pending = await asyncio.wait(set(tasks), timeout=timeout)
    for task in pending:
        task.cancel()
    for task in pending:
        with contextlib.suppress(asyncio.CancelledError):
            await task
