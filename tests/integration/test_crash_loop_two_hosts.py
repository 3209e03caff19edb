"""Crash loop on PostgreSQL: two toko-api instances on one database, faults at random.

The SQLite crash loop (tests/integration/test_crash_loop.py) with the
several-hosts setup of the README: two toko-api processes share one
PostgreSQL database, as two hosts behind a load balancer would. From a seed,
several cycles of: clients send bursts of POST /produk to both instances
(some with an Idempotency-Key, some repeating a key at the other instance,
some with another body under an earlier key, some hanging up mid-request);
the SMTP server switches between fast, slow, deferring and dropping its
connections, and refuses (550) products whose name says so; at a random
moment one fault: kill -9 of one instance, SIGTERM of one, or
pg_terminate_backend of every toko-api connection; then whatever stopped is
started again. A last drain waits for the queue to empty, then every answer
a client got is checked against the database and the SMTP server's record,
and both instances must still be healthy.

A job a killed instance held comes back only when its lease runs out
(2 x TOKO_JOB_TIMEOUT + 30 s, by design: the other instance cannot tell a
dead host from a slow one), and so does a job whose claim's answer a cut
connection swallowed. The suite's default run therefore leaves kill -9 out
(SIGTERM and cuts only, about 10 s); any run that names its seeds draws kill
-9 too and gives the drain the lease's time::

    TOKO_PG_CRASH_SEEDS=20 TOKO_PG_CRASH_CYCLES=6 pytest tests/integration -k pg_crash_loop
    TOKO_PG_CRASH_FAULTS=kill pytest ...   # only these faults (kill, term, cut)
    TOKO_PG_CRASH_FIRST_SEED=100 ...       # seeds 100, 101, ... instead of 0, 1, ...
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import aiohttp
import pytest

from tests.conftest import ServiceFactory
from tests.support.api import healthz, wait_healthy
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
from tests.support.postgres import PostgresCluster, fetch, pg_env
from tests.support.service import ServiceProcess
from tests.support.smtp import SmtpServer

_SEEDS_SET = "TOKO_PG_CRASH_SEEDS" in os.environ
_FIRST_SEED = int(os.environ.get("TOKO_PG_CRASH_FIRST_SEED", "0"))
SEEDS = range(_FIRST_SEED, _FIRST_SEED + int(os.environ.get("TOKO_PG_CRASH_SEEDS", "1")))
CYCLES = int(os.environ.get("TOKO_PG_CRASH_CYCLES", "4"))
FAULTS = tuple(
    os.environ.get("TOKO_PG_CRASH_FAULTS", "kill,term,cut" if _SEEDS_SET else "term,cut").split(",")
)
INSTANCES = 2
WORKERS = 3
JOB_TIMEOUT = 2.0
LEASE = JOB_TIMEOUT * 2 + 30  # PoolConfig.lease_seconds
ENV = {
    "TOKO_WORKERS": str(WORKERS),
    "TOKO_MAIL_FROM": MAIL_FROM,
    # As in the SQLite loop: a refused email is a dead letter within seconds,
    # while a good one has attempts to spare for the deferrals and faults.
    "TOKO_JOB_BACKOFF": "0.01",
    "TOKO_JOB_MAX_ATTEMPTS": "10",
    # Short, for a short lease; still above the slowest SMTP reply (0.6 s).
    "TOKO_JOB_TIMEOUT": str(JOB_TIMEOUT),
    "TOKO_DRAIN_TIMEOUT": "3",
    "TOKO_LOG_LEVEL": "debug",  # "job started" tells which jobs a killed instance held
}
CUT_SQL = (
    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
    " WHERE datname = current_database() AND application_name = 'toko-api'"
)
# How long after a cut an ERROR may still be its doing: a call cut short that
# is not tried again (a claim: its jobs may be leased already; a product
# write: it may have committed, and its client gets a 503) is logged as it fails.
CUT_ERRORS_SECONDS = 5.0

# -- the plan ------------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    post: Post
    to: int  # the instance, by index


@dataclass(frozen=True)
class Cycle:
    clients: list[list[Send]]
    fault_after: float  # seconds after the burst began
    fault: str  # "kill", "term" or "cut"
    victim: int  # the instance a kill or term stops
    smtp_steps: list[SmtpStep]


def plan(seed: int, cycles: int, faults: tuple[str, ...]) -> list[Cycle]:
    rng = random.Random(seed)
    keyed: list[Send] = []  # every POST that carried a key, to repeat one
    plan = []
    for c in range(cycles):
        clients = draw_clients(rng, f"s{seed} c{c}", lambda name: _draw_send(rng, name, keyed))
        steps = draw_smtp_steps(rng)
        fault = rng.choice(faults)
        plan.append(Cycle(clients, rng.uniform(0.0, 1.5), fault, rng.randrange(INSTANCES), steps))
    return plan


def _draw_send(rng: random.Random, name: str, keyed: list[Send]) -> Send:
    roll = rng.random()
    if keyed and roll < 0.15:  # the same request again, often at the other instance
        earlier = rng.choice(keyed)
        post = Post(earlier.post.nama, earlier.post.harga, earlier.post.key)
        return Send(post, 1 - earlier.to if rng.random() < 0.7 else earlier.to)
    if keyed and roll < 0.2:  # an earlier key with another product: one wins
        earlier = rng.choice(keyed)
        return Send(Post(f"{name} other", rng.randint(0, 10**12), earlier.post.key), 1 - earlier.to)
    nama = f"{name} {REFUSED}" if rng.random() < 0.08 else name
    key = f"key-{name.replace(' ', '-')}" if rng.random() < 0.5 else None
    hang = rng.choice(("after", "during")) if rng.random() < 0.12 else ""
    sent = Send(Post(nama, rng.randint(0, 10**12), key, hang), rng.randrange(INSTANCES))
    if key is not None and not hang:
        keyed.append(sent)
    return sent


# -- what happened -------------------------------------------------------------


@dataclass
class Record:
    answers: list[tuple[Answer, str]] = field(default_factory=list)  # with its cycle's fault
    faults: Counter[str] = field(default_factory=Counter)
    cut_connections: int = 0
    cut_at: list[float] = field(default_factory=list)  # wall clock, as the logs' ts
    held_at_kills: int = 0  # jobs a killed instance had started and not finished
    dropped_connections: int = 0
    services: list[ServiceProcess] = field(default_factory=list)


# -- the run -------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
# Each cycle takes a few seconds (a restart, its burst); the drain up to a lease.
@pytest.mark.timeout(60 + 10 * CYCLES + LEASE)
async def test_pg_crash_loop_two_instances_lose_nothing(
    seed: int,
    service_factory: ServiceFactory,
    smtp: SmtpServer,
    pg_cluster: PostgresCluster,
    pg_url: str,
) -> None:
    env = pg_env(pg_cluster, pg_url, TOKO_SMTP_URL=smtp.url, **ENV)
    record = Record()
    behave(smtp, "fast", 0)
    instances = [service_factory(env).start() for _ in range(INSTANCES)]
    record.services += instances
    await asyncio.gather(*(svc.async_wait_ready(timeout=30) for svc in instances))
    for cycle in plan(seed, CYCLES, FAULTS):
        await run_cycle(cycle, instances, smtp, record, pg_cluster, pg_url)
        stopped = cycle.victim if cycle.fault != "cut" else None
        if stopped is not None:  # started again, as systemd would
            instances[stopped] = service_factory(env).start()
            record.services.append(instances[stopped])
            await instances[stopped].async_wait_ready(timeout=30)
    behave(smtp, "fast", 0)
    started = time.monotonic()
    async with aiohttp.ClientSession() as session:
        # Jobs a kill -9 (or a cut claim) left leased come back after their lease.
        await wait_healthy(session, instances[0].base_url, timeout=LEASE + 30, check=_drained)
        drained_in = time.monotonic() - started
        for svc in instances:
            status, body = await healthz(session, svc.base_url)
            assert status == 200, (svc.port, body)
    for svc in instances:
        svc.terminate()
    for svc in instances:
        assert await svc.async_wait_exit(timeout=30) == 0, svc.output_tail()
    await check(record, smtp, pg_cluster, pg_url, drained_in)


async def run_cycle(
    cycle: Cycle,
    instances: list[ServiceProcess],
    smtp: SmtpServer,
    record: Record,
    cluster: PostgresCluster,
    url: str,
) -> None:
    done = asyncio.Event()
    faults = asyncio.create_task(switch_smtp(cycle, smtp, record, done))
    clients = [
        asyncio.create_task(run_client(list(instances), sends, cycle.fault, record))
        for sends in cycle.clients
    ]
    await asyncio.sleep(cycle.fault_after)  # the randomized moment of the fault
    record.faults[cycle.fault] += 1
    if cycle.fault == "cut":
        record.cut_at.append(time.time())  # before: toko sees it during the call
        (killed,) = await fetch(cluster, url, CUT_SQL)
        record.cut_connections += killed[0]
    else:
        victim = instances[cycle.victim]
        victim.send_signal(signal.SIGKILL if cycle.fault == "kill" else signal.SIGTERM)
        code = await victim.async_wait_exit(timeout=30)
        assert code == (-9 if cycle.fault == "kill" else 0), victim.output_tail()
        if cycle.fault == "kill":
            record.held_at_kills += len(in_flight(victim))
    await asyncio.gather(*clients)
    done.set()
    await faults


async def switch_smtp(cycle: Cycle, smtp: SmtpServer, record: Record, done: asyncio.Event) -> None:
    for pause, action, argument in cycle.smtp_steps:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(pause):
                await done.wait()
        if done.is_set():
            return
        record.dropped_connections += behave(smtp, action, argument)


async def run_client(
    instances: list[ServiceProcess], sends: list[Send], fault: str, record: Record
) -> None:
    timeout = aiohttp.ClientTimeout(total=40)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for s in sends:
            svc = instances[s.to]
            if s.post.hang_up:
                await hang_up(svc, s.post)
                record.answers.append((Answer(s.post, None), fault))
                continue
            record.answers.append((await send(session, svc, s.post), fault))


def in_flight(svc: ServiceProcess) -> set[int]:
    """The jobs ``svc`` started and did not finish (by its debug log)."""
    started = {int(r["JOB_ID"]) for r in svc.find_logs("job started")}
    finished = {int(r["JOB_ID"]) for r in svc.find_logs("job succeeded")}
    finished |= {int(r["JOB_ID"]) for r in svc.find_logs("job failed, will retry")}
    finished |= {int(r["JOB_ID"]) for r in svc.find_logs("job failed permanently")}
    return started - finished


def _drained(body: dict[str, Any]) -> bool:
    queue = body["queue"]
    return bool(queue["pending"] == 0 and queue["running"] == 0)


# -- the checks ----------------------------------------------------------------


async def check(
    record: Record, smtp: SmtpServer, cluster: PostgresCluster, url: str, drained_in: float
) -> None:
    products = {
        row[0]: dict(zip(("id", "nama", "harga", "idempotency_key"), row, strict=True))
        for row in await fetch(
            cluster, url, "SELECT id, nama, harga, idempotency_key FROM products"
        )
    }
    jobs = [
        dict(zip(("id", "payload", "state", "created_at"), row, strict=True))
        for row in await fetch(
            cluster,
            url,
            "SELECT id, payload::text, state, created_at FROM jobs WHERE kind = 'product_email'",
        )
    ]
    answers = [a for a, _ in record.answers]
    answered = [a for a in answers if a.status is not None]
    created = [a for a in answered if a.status == 201]

    for a, fault in record.answers:
        # A 503 ("try again") only where the database cut the connections.
        allowed = (201, 422, 503) if fault == "cut" else (201, 422)
        assert a.status is None or a.status in allowed, f"unexpected answer in a {fault} cycle: {a}"
    job_by_product, delivered = check_store_and_emails(answers, products, jobs, smtp)

    # A duplicate needs an email that went out and whose outcome was never
    # recorded, so that its lease ran out and it ran again:
    # - kill -9: the jobs its workers were sending (at most WORKERS) and
    #   those sent whose ack had not committed yet (the batch in flight and
    #   the one behind it, about one per worker at this rate): 2 x WORKERS;
    # - SIGTERM: acks are written before the exit, so only a send still in
    #   flight when the drain timed out: WORKERS;
    # - a cut: acks are tried again on fresh connections, so only jobs whose
    #   every try failed, at most the WORKERS of each instance;
    # - an SMTP connection dropped between the server's 250 and the client
    #   reading it: one each.
    duplicates = sum(n - 1 for n in delivered.values())
    per_fault = {"kill": 2 * WORKERS, "term": WORKERS, "cut": INSTANCES * WORKERS}
    bound = sum(n * per_fault[f] for f, n in record.faults.items()) + record.dropped_connections
    unanswered = len(answers) - len(answered)
    print(
        f"pg crash loop: {len(answers)} POSTs ({len(created)} x 201, {unanswered} unanswered,"
        f" {sum(a.status == 503 for a in answered)} x 503), {len(products)} products,"
        f" {record.faults['kill']} kill -9 (holding {record.held_at_kills} jobs),"
        f" {record.faults['term']} SIGTERM,"
        f" {record.faults['cut']} cuts ({record.cut_connections} connections),"
        f" {record.dropped_connections} SMTP connections dropped,"
        f" {sum(delivered.values())} deliveries, {duplicates} duplicates (bound {bound}),"
        f" drained {drained_in:.1f} s after the last cycle"
    )
    assert duplicates <= bound, delivered
    check_logs(
        record.services,
        products,
        job_by_product,
        lambda r: "database call failed" in str(r.get("message")) and _soon_after_cut(record, r),
    )


def _soon_after_cut(record: Record, log_record: dict[str, Any]) -> bool:
    at = datetime.fromisoformat(log_record["ts"].replace("Z", "+00:00")).timestamp()
    return any(0 <= at - cut < CUT_ERRORS_SECONDS for cut in record.cut_at)
