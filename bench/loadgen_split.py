"""``bench.loadgen``'s open loop spread over several processes sharing one schedule.

One asyncio process with aiohttp's client costs a few hundred µs of CPU per
request; at 2,000/s on a 2-core machine that is most of a core, and a
generator that runs behind makes the server look slow (its lateness counts
as latency, by design). Here ``processes`` children each send every n-th
request of the same schedule (request ``i`` at ``t0 + i/rate``, ``t0`` one
``time.monotonic()`` instant they all share: CLOCK_MONOTONIC is system-wide),
and the parent merges their samples into one ``OpenLoopResult``, so the
figures and the lateness read exactly as a single generator's.

The children are spawned (not forked: the parent may run probe threads), say
when they are ready, get ``t0`` a little later, and are killed should
anything go wrong, so none outlives the call.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from bench.loadgen import OpenLoopResult, Sample, open_loop

# (index, scheduled, started, finished, status, error, product_id): cheap to pickle.
Row = tuple[int, float, float, float, int, str, int | None]


@dataclass(frozen=True)
class SplitResult:
    result: OpenLoopResult
    processes: int
    cpu_pct: list[float]  # each child's CPU over its own run, percent of one core


def _child(
    conn: Connection,
    url: str,
    rate: float,
    duration_s: float,
    token: str,
    max_connections: int,
    part: tuple[int, int],
    client: str,
) -> None:
    conn.send("ready")
    start_at = float(conn.recv())
    cpu0, wall0 = time.process_time(), time.monotonic()
    result = asyncio.run(
        open_loop(
            url,
            rate=rate,
            duration_s=duration_s,
            token=token,
            max_connections=max_connections,
            part=part,
            start_at=start_at,
            client=client,
        )
    )
    cpu = (time.process_time() - cpu0) / max(time.monotonic() - wall0, 1e-9) * 100
    rows: list[Row] = [
        (s.index, s.scheduled, s.started, s.finished, s.status, s.error, s.product_id)
        for s in result.samples
    ]
    conn.send((rows, result.wall_s, cpu))
    conn.close()


def merge(rate: float, duration_s: float, t0: float, parts: list[Any]) -> OpenLoopResult:
    """One result from the children's (rows, wall_s, cpu) messages, in schedule order."""
    merged = OpenLoopResult(rate=rate, duration_s=duration_s, t0_monotonic=t0)
    for rows, wall_s, _ in parts:
        merged.samples.extend(Sample(*row) for row in rows)
        merged.wall_s = max(merged.wall_s, float(wall_s))
    merged.samples.sort(key=lambda s: s.index)
    return merged


def open_loop_split(
    url: str,
    *,
    rate: float,
    duration_s: float,
    token: str,
    processes: int = 2,
    max_connections: int = 256,
    request_timeout_s: float = 10.0,
    lead_s: float = 0.5,
    client: str = "aiohttp",
) -> SplitResult:
    """``open_loop`` with ``processes`` children; ``max_connections`` is shared among them."""
    if processes < 1:
        raise ValueError("processes must be at least 1")
    ctx = multiprocessing.get_context("spawn")
    per_child = max(1, max_connections // processes)
    children: list[tuple[BaseProcess, Connection]] = []
    try:
        for k in range(processes):
            here, there = ctx.Pipe()
            child: BaseProcess = ctx.Process(
                target=_child,
                args=(there, url, rate, duration_s, token, per_child, (k, processes), client),
                name=f"loadgen-{k}",
                daemon=True,
            )
            child.start()
            there.close()
            children.append((child, here))
        for proc, conn in children:
            with contextlib.suppress(EOFError):
                if conn.poll(60) and conn.recv() == "ready":
                    continue
            raise RuntimeError(f"{proc.name} did not start (exit code {proc.exitcode})")
        t0 = time.monotonic() + lead_s
        for _, conn in children:
            conn.send(t0)
        # open_loop's own hard deadline is duration + request timeout + 5 s.
        deadline = t0 + duration_s + request_timeout_s + 30
        parts: list[Any] = []
        for proc, conn in children:
            if not conn.poll(max(1.0, deadline - time.monotonic())):
                raise TimeoutError(f"{proc.name} sent no result by its deadline")
            try:
                parts.append(conn.recv())
            except EOFError as exc:
                raise RuntimeError(f"{proc.name} died (exit code {proc.exitcode})") from exc
        for proc, _ in children:
            proc.join(10)
    finally:
        for proc, conn in children:
            conn.close()
            if proc.is_alive():
                proc.kill()
            with contextlib.suppress(AssertionError):
                proc.join(5)
    return SplitResult(
        merge(rate, duration_s, t0, parts),
        processes,
        [round(float(p[2]), 1) for p in parts],
    )
