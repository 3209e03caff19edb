"""Three toko-api processes on one PostgreSQL database; one dies by kill -9.

A client posts to all three, as a load balancer would, and moves to another
instance when one stops answering. With a slow SMTP server every instance has
sends in flight when one is killed: the jobs it held come back when their
leases expire and another instance sends them. Every product committed gets
its email (distinct Message-IDs == products); delivery is at-least-once, so
duplicates are counted and printed, not forbidden.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import aiohttp

from service.mail_message import message_id
from tests.conftest import ServiceFactory
from tests.support.api import create_product
from tests.support.postgres import PostgresCluster, fetch, pg_env
from tests.support.service import ServiceProcess
from tests.support.smtp import SmtpServer

INSTANCES = 3
BEFORE_KILL = 30
AFTER_KILL = 30
JOB_TIMEOUT = 3.0
LEASE = JOB_TIMEOUT * 2 + 30  # PoolConfig.lease_seconds


async def post_somewhere(
    session: aiohttp.ClientSession, instances: list[ServiceProcess], turn: int, name: str
) -> dict[str, Any]:
    """POST to the instance whose turn it is; on a dead one, the next (a load balancer)."""
    errors = []
    for offset in range(len(instances)):
        svc = instances[(turn + offset) % len(instances)]
        try:
            return await create_product(session, svc.base_url, name, 1000)
        except aiohttp.ClientError as exc:
            errors.append(f"{svc.port}: {exc!r}")
    raise AssertionError(f"no instance took {name}: {errors}")


def started_and_finished(svc: ServiceProcess) -> tuple[set[int], set[int]]:
    started = {int(r["JOB_ID"]) for r in svc.find_logs("job started")}
    finished = {int(r["JOB_ID"]) for r in svc.find_logs("email sent")}
    finished |= {int(r["JOB_ID"]) for r in svc.find_logs("job failed, will retry")}
    return started, finished


async def test_kill_9_one_of_three_instances_every_email_still_arrives(
    service_factory: ServiceFactory,
    smtp: SmtpServer,
    pg_cluster: PostgresCluster,
    pg_url: str,
) -> None:
    smtp.set_delay(1.0)
    env = pg_env(
        pg_cluster,
        pg_url,
        TOKO_SMTP_URL=smtp.url,
        TOKO_WORKERS="3",
        TOKO_JOB_TIMEOUT=str(JOB_TIMEOUT),
        TOKO_JOB_BACKOFF="0.05",
        TOKO_LOG_LEVEL="debug",  # "job started" tells which jobs a process holds
    )
    instances = [service_factory(env).start() for _ in range(INSTANCES)]
    await asyncio.gather(*(svc.async_wait_ready(timeout=30) for svc in instances))
    victim = instances[1]
    products: list[dict[str, Any]] = []
    turns = itertools.count()
    async with aiohttp.ClientSession() as session:
        products += await asyncio.gather(
            *(
                post_somewhere(session, instances, next(turns), f"Host A{i:02d}")
                for i in range(BEFORE_KILL)
            )
        )
        # The victim is sending (behind the slow server) when it dies.
        await victim.async_wait_log("job started", timeout=20)
        posting = asyncio.gather(
            *(
                post_somewhere(session, instances, next(turns), f"Host B{i:02d}")
                for i in range(AFTER_KILL)
            )
        )
        victim.kill()
        killed_at = time.monotonic()
        assert await victim.async_wait_exit(timeout=10) == -9
        products += await posting
    started, finished = started_and_finished(victim)
    held = started - finished
    assert held, "the victim held no job in flight; the test proves nothing"

    jobs = await fetch(
        pg_cluster,
        pg_url,
        "SELECT id, (payload->>'product_id')::bigint, created_at FROM jobs"
        " WHERE kind = 'product_email'",
    )
    committed = await fetch(pg_cluster, pg_url, "SELECT id FROM products")
    assert len(jobs) == len(committed) >= BEFORE_KILL + AFTER_KILL
    assert {pid for _, pid, _ in jobs} == {pid for (pid,) in committed}
    assert {p["id"] for p in products} <= {pid for (pid,) in committed}

    expected = {message_id(job_id, created_at, "localhost") for job_id, _, created_at in jobs}
    delivered = await smtp.async_wait_delivered(len(expected), timeout=LEASE + 60)
    assert delivered == expected
    recovered_after = time.monotonic() - killed_at

    # Every job ends done; those the victim held ran again elsewhere.
    deadline = time.monotonic() + 30
    while True:
        states = dict(
            await fetch(pg_cluster, pg_url, "SELECT state, count(*) FROM jobs GROUP BY state")
        )
        if states == {"done": len(jobs)} or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)  # no event for a row change; poll with a deadline
    assert states == {"done": len(jobs)}, states
    rerun = await fetch(
        pg_cluster, pg_url, "SELECT id, attempts FROM jobs WHERE id = ANY($1::bigint[])", list(held)
    )
    assert all(attempts >= 2 for _, attempts in rerun), rerun
    survivors = [svc for svc in instances if svc is not victim]
    sent_by = [len(svc.find_logs("email sent")) for svc in survivors]
    assert all(sent_by), f"a surviving instance sent nothing: {sent_by}"

    duplicates = smtp.duplicates()
    print(
        f"several hosts: {len(jobs)} products on {INSTANCES} instances, kill -9 of one holding "
        f"{len(held)} job(s); all {len(expected)} emails delivered {recovered_after:.1f}s after "
        f"the kill (lease {LEASE:.0f}s); {len(smtp.delivered())} deliveries, duplicates "
        f"(at-least-once): {len(duplicates)} {duplicates}; sent by survivors: {sent_by}"
    )
    # A duplicate can only come from a send the victim had in flight.
    assert sum(n - 1 for n in duplicates.values()) <= len(held), duplicates
    for svc in survivors:
        svc.terminate()
    for svc in survivors:
        assert await svc.async_wait_exit(timeout=30) == 0
