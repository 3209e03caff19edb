"""Crash loop: seeded random bursts of POSTs, SMTP faults and kills, then a drain.

The promise under test: a 201 means the product and its email job are
committed; nothing accepted is lost by a crash or kill -9; delivery is
at-least-once, with a Message-ID derived from the job id, the same on every
attempt. From a seed, several cycles of: start toko-api; concurrent clients
send a burst of POST /produk (some with an Idempotency-Key, some repeating an
earlier key, some with another body under an earlier key, some hanging up
mid-request); the SMTP server switches at random between fast, slow,
deferring a few emails (451) and dropping its connections, and refuses (550) products
whose name says so; at a random moment toko-api gets kill -9 (sometimes a
SIGTERM). A last start runs until the queue has drained, and then every
answer a client got is checked against the SQLite file (read only) and
against what the SMTP server recorded.

The plan is drawn from the seed; the interleaving is the machine's. The suite
runs one short seed; run more with ``TOKO_CRASH_SEEDS=20 TOKO_CRASH_CYCLES=8``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from tests.conftest import ServiceFactory
from tests.support import db
from tests.support.api import wait_healthy
from tests.support.crash_loop import (
    MAIL_FROM,
    REFUSED,
    Answer,
    Post,
    SmtpStep,
    behave,
    check_logs,
    check_store_and_emails,
    draw_clients,
    draw_smtp_steps,
    hang_up,
    send,
)
from tests.support.service import ServiceProcess
from tests.support.smtp import SmtpServer

SEEDS = range(int(os.environ.get("TOKO_CRASH_SEEDS", "1")))
CYCLES = int(os.environ.get("TOKO_CRASH_CYCLES", "4"))
WORKERS = 3
ENV = {
    "TOKO_WORKERS": str(WORKERS),
    "TOKO_MAIL_FROM": MAIL_FROM,
    # A 550 is retried like a 451 until the last attempt: these two make a
    # refused email a dead letter within about 4 s, while the few deferrals
    # and kills a good email meets leave it attempts to spare.
    "TOKO_JOB_BACKOFF": "0.01",
    "TOKO_JOB_MAX_ATTEMPTS": "10",
    "TOKO_JOB_TIMEOUT": "10",
    "TOKO_DRAIN_TIMEOUT": "3",
}

# -- the plan ------------------------------------------------------------------


@dataclass(frozen=True)
class Cycle:
    clients: list[list[Post]]
    stop_after: float  # seconds after READY=1
    stop_with: signal.Signals
    smtp_steps: list[SmtpStep]


def plan(seed: int, cycles: int) -> list[Cycle]:
    rng = random.Random(seed)
    keyed: list[Post] = []  # every POST that carried a key, to repeat one
    plan = []
    for c in range(cycles):
        clients = draw_clients(rng, f"s{seed} c{c}", lambda name: _draw_post(rng, name, keyed))
        steps = draw_smtp_steps(rng)
        stop_with = signal.SIGTERM if rng.random() < 0.25 else signal.SIGKILL
        plan.append(Cycle(clients, rng.uniform(0.0, 1.5), stop_with, steps))
    return plan


def _draw_post(rng: random.Random, name: str, keyed: list[Post]) -> Post:
    roll = rng.random()
    if keyed and roll < 0.15:  # the same request again: a client's retry
        earlier = rng.choice(keyed)
        return Post(earlier.nama, earlier.harga, earlier.key)
    if keyed and roll < 0.2:  # an earlier key with another product: one wins
        earlier = rng.choice(keyed)
        return Post(f"{name} other", rng.randint(0, 10**12), earlier.key)
    nama = f"{name} {REFUSED}" if rng.random() < 0.08 else name
    key = f"key-{name.replace(' ', '-')}" if rng.random() < 0.5 else None
    hang_up = rng.choice(("after", "during")) if rng.random() < 0.12 else ""
    post = Post(nama, rng.randint(0, 10**12), key, hang_up)
    if key is not None and not hang_up:
        keyed.append(post)
    return post


# -- what happened -------------------------------------------------------------


@dataclass
class Record:
    answers: list[Answer] = field(default_factory=list)
    kills: int = 0
    terms: int = 0
    dropped_connections: int = 0
    services: list[ServiceProcess] = field(default_factory=list)


# -- the run -------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
async def test_crash_loop_loses_nothing(
    seed: int, service_factory: ServiceFactory, smtp: SmtpServer
) -> None:
    env = {**ENV, "TOKO_SMTP_URL": smtp.url}
    record = Record()
    behave(smtp, "fast", 0)
    for cycle in plan(seed, CYCLES):
        await run_cycle(cycle, service_factory(env), smtp, record)
    behave(smtp, "fast", 0)
    last = service_factory(env).start()
    record.services.append(last)
    await last.async_wait_ready(timeout=20)
    async with aiohttp.ClientSession() as session:
        await wait_healthy(session, last.base_url, timeout=60, check=_drained)
    last.terminate()
    assert await last.async_wait_exit(timeout=20) == 0
    check(record, smtp, last)


async def run_cycle(
    cycle: Cycle,
    svc: ServiceProcess,
    smtp: SmtpServer,
    record: Record,
) -> None:
    svc.start()
    record.services.append(svc)
    await svc.async_wait_ready(timeout=20)
    exited = asyncio.Event()
    faults = asyncio.create_task(switch_smtp(cycle, smtp, record, exited))
    clients = [asyncio.create_task(run_client(svc, posts, record)) for posts in cycle.clients]
    await asyncio.sleep(cycle.stop_after)  # the randomized moment of the crash
    svc.send_signal(cycle.stop_with)
    code = await svc.async_wait_exit(timeout=20)
    exited.set()
    if cycle.stop_with == signal.SIGKILL:
        record.kills += 1
        assert code == -9, svc.output_tail()
    else:
        record.terms += 1
        assert code == 0, svc.output_tail()
    await asyncio.gather(faults, *clients)


async def switch_smtp(
    cycle: Cycle, smtp: SmtpServer, record: Record, exited: asyncio.Event
) -> None:
    for pause, action, argument in cycle.smtp_steps:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(pause):
                await exited.wait()
        if exited.is_set():
            return
        record.dropped_connections += behave(smtp, action, argument)


async def run_client(svc: ServiceProcess, posts: list[Post], record: Record) -> None:
    timeout = aiohttp.ClientTimeout(total=15)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for post in posts:
            if post.hang_up:
                await hang_up(svc, post)
                record.answers.append(Answer(post, None))
                continue
            record.answers.append(await send(session, svc, post))


def _drained(body: dict[str, Any]) -> bool:
    queue = body["queue"]
    return bool(queue["pending"] == 0 and queue["running"] == 0)


# -- the checks ----------------------------------------------------------------


def check(record: Record, smtp: SmtpServer, last: ServiceProcess) -> None:
    database = last.database
    products = {p["id"]: p for p in db.query(database, "SELECT * FROM products")}
    jobs = [j for j in db.jobs(database) if j["kind"] == "product_email"]
    answered = [a for a in record.answers if a.status is not None]
    created = [a for a in answered if a.status == 201]
    for a in answered:
        assert a.status in (201, 422), f"unexpected answer: {a}"
    job_by_product, delivered = check_store_and_emails(record.answers, products, jobs, smtp)

    # Duplicates only where a kill, a stop or a dropped connection explains them.
    duplicates = sum(n - 1 for n in delivered.values())
    stops = record.kills + record.terms
    bound = stops * WORKERS + record.dropped_connections
    unanswered = len(record.answers) - len(answered)
    print(
        f"crash loop: {len(record.answers)} POSTs ({len(created)} x 201, {unanswered} unanswered), "
        f"{len(products)} products, {record.kills} kill -9, {record.terms} SIGTERM, "
        f"{record.dropped_connections} SMTP connections dropped, "
        f"{sum(delivered.values())} deliveries, {duplicates} duplicates (bound {bound})"
    )
    assert duplicates <= bound, delivered

    check_logs(record.services, products, job_by_product)
