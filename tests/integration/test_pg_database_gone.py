"""The database goes away under toko-api and stays away (dropped, or a server
that does not come back), or hangs: /healthz, /metrics and `systemctl status`
say so, in time, the journal gets a sample of the failures rather than one
line a second, and a SIGTERM still ends it cleanly."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import aiohttp

from service.health import HEALTH_READ_SECONDS
from service.store.postgres import CLOSE_SECONDS
from service.workers import STOP_WRITE_SECONDS
from tests.conftest import ServiceFactory
from tests.support.api import create_products, healthz, wait_healthy
from tests.support.notify import Notification
from tests.support.postgres import PostgresCluster, pg_env
from tests.support.scrape import scrape
from tests.support.smtp import SmtpServer

STATUS_SECONDS = 5  # service.runner's STATUS= cadence
THROTTLE_S = 10  # service.logs.Throttle's interval
UNIT = Path(__file__).parents[2] / "deploy" / "systemd" / "toko-api.service"


async def test_a_database_that_is_gone_shows_in_health_and_status(
    service_factory: ServiceFactory, pg_cluster: PostgresCluster, pg_url: str
) -> None:
    api = service_factory(pg_env(pg_cluster, pg_url)).start()
    await api.async_wait_ready(timeout=30)
    assert api.notify is not None
    async with aiohttp.ClientSession() as session:
        await create_products(session, api.base_url, ["sebelum"])
        await pg_cluster.async_drop_database(pg_url)  # WITH (FORCE): every session ends

        status, health = await healthz(session, api.base_url)
        assert status == 503
        assert health["error"] == "storage is unavailable"
        note = await api.notify.log.async_wait_for(
            lambda notes: next(
                (n for n in notes if str(n.get("STATUS")).startswith("store unavailable: ")), None
            ),
            3 * STATUS_SECONDS,
            "STATUS=store unavailable: ...",
        )
        assert "does not exist" in str(note.get("STATUS")), note
        # Two more updates, still down: the claimer and the LISTEN connection
        # retried every second and the status loop every 5 s, yet each logged
        # about once per interval.
        await api.notify.log.async_wait_for(
            lambda notes: (
                notes
                if sum("store unavailable" in str(n.get("STATUS")) for n in notes) >= 3
                else None
            ),
            4 * STATUS_SECONDS,
            "three STATUS=store unavailable lines",
        )
    for message in ("claiming jobs failed", "status update failed", "LISTEN connection failed"):
        lines = [r for r in api.logs.snapshot() if str(r.get("message")).startswith(message)]
        assert 1 <= len(lines) <= 2, (message, lines)
    # asyncpg's pool retries its connections too, and logged a traceback each time.
    reconnects = [r for r in api.logs.snapshot() if r.get("logger") == "asyncpg.pool"]
    assert reconnects, "asyncpg's pool tried to reconnect"
    for line in reconnects:
        assert "exception" not in line, line
        assert str(line["message"]).endswith("does not exist"), line
    api.terminate()
    assert await api.async_wait_exit(timeout=30) == 0


async def test_metrics_show_no_queue_figures_while_the_store_is_down(
    service_factory: ServiceFactory, pg_cluster: PostgresCluster, pg_url: str
) -> None:
    api = service_factory(pg_env(pg_cluster, pg_url)).start()
    await api.async_wait_ready(timeout=30)
    async with aiohttp.ClientSession() as session:
        await create_products(session, api.base_url, ["sebelum"])
        before = await scrape(session, api.base_url)
        assert before.value("toko_store_up") == 1
        assert ("toko_queue_jobs", frozenset({("state", "pending")})) in before.samples

        await pg_cluster.async_drop_database(pg_url)
        after = await scrape(session, api.base_url)
    assert after.value("toko_store_up") == 0
    # Not the figures of the last scrape that worked, as if they were current.
    stale = [key for key in after.samples if key[0] == "toko_queue_jobs"]
    assert stale == [], after.samples
    api.terminate()
    assert await api.async_wait_exit(timeout=30) == 0


async def test_health_answers_in_time_while_the_store_hangs(
    service_factory: ServiceFactory, pg_cluster: PostgresCluster, pg_url: str
) -> None:
    # A table locked by maintenance (or a silent database host) makes every
    # query wait for the store's 30 s command timeout: longer than a load
    # balancer or a Prometheus scrape waits, so without a limit of its own
    # /healthz timed out instead of saying 503 and toko_store_up 0 was never seen.
    api = service_factory(pg_env(pg_cluster, pg_url)).start()
    await api.async_wait_ready(timeout=30)
    client_gives_up = aiohttp.ClientTimeout(total=HEALTH_READ_SECONDS + 3)
    locker = await pg_cluster.connect(pg_url.rsplit("/", 1)[1])
    try:
        async with aiohttp.ClientSession(timeout=client_gives_up) as session:
            await create_products(session, api.base_url, ["sebelum"])
            locked = locker.transaction()
            await locked.start()
            await locker.execute("LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE")

            status, health = await healthz(session, api.base_url)
            assert (status, health["error"]) == (503, "storage is unavailable"), health
            during = await scrape(session, api.base_url)
            assert during.value("toko_store_up") == 0

            await locked.rollback()
            await wait_healthy(session, api.base_url, timeout=15)
    finally:
        await locker.close()
    said = [str(r.get("message")) for r in api.logs.snapshot()]
    assert any(f"did not answer within {HEALTH_READ_SECONDS:g} s" in line for line in said), said
    api.terminate()
    assert await asyncio.wait_for(api.async_wait_exit(timeout=30), 40) == 0


async def test_a_store_that_hangs_at_ready_is_reported_not_fatal(
    service_factory: ServiceFactory, pg_cluster: PostgresCluster, pg_url: str
) -> None:
    # The store opened and the pool started, but the queue figures of READY's
    # STATUS= did not come in time (the jobs table locked by maintenance): the
    # process exited 1 "cannot start: the store did not answer within 5 s",
    # and went on doing so at every restart while the lock was held, where a
    # running toko-api stays up, answers 503 and says "store unavailable".
    first = service_factory(pg_env(pg_cluster, pg_url)).start()
    await first.async_wait_ready(timeout=30)  # the schema, so the lock has a table
    first.terminate()
    assert await first.async_wait_exit(timeout=30) == 0
    locker = await pg_cluster.connect(pg_url.rsplit("/", 1)[1])
    try:
        locked = locker.transaction()
        await locked.start()
        await locker.execute("LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE")
        api = service_factory(pg_env(pg_cluster, pg_url)).start()
        ready = await api.async_wait_ready(timeout=30)
        said = f"store unavailable: the store did not answer within {HEALTH_READ_SECONDS:g} s"
        assert ready.get("STATUS") == said, ready
        client_gives_up = aiohttp.ClientTimeout(total=HEALTH_READ_SECONDS + 3)
        async with aiohttp.ClientSession(timeout=client_gives_up) as session:
            status, health = await healthz(session, api.base_url)
            assert (status, health["error"]) == (503, "storage is unavailable"), health
            await locked.rollback()
            await wait_healthy(session, api.base_url, timeout=15)
    finally:
        await locker.close()
    assert api.returncode is None
    api.terminate()
    assert await asyncio.wait_for(api.async_wait_exit(timeout=30), 40) == 0


async def test_a_stop_while_the_database_is_silent_ends_before_systemd_kills(
    service_factory: ServiceFactory,
    pg_cluster: PostgresCluster,
    pg_url: str,
    smtp: SmtpServer,
) -> None:
    # Each write at stop (jobs put back, jobs marked done) and the pool's close
    # waited for the 30 s command timeout of a database host that went silent:
    # 76 s from SIGTERM to an exit 1 that blamed start-up ("cannot start"), so
    # systemd would SIGKILL at TimeoutStopSec= and mark the unit failed.
    smtp.set_delay(2)  # two emails in flight and two claimed behind them
    env = pg_env(pg_cluster, pg_url, TOKO_SMTP_URL=smtp.url, TOKO_WORKERS="2")
    api = service_factory(env).start()
    await api.async_wait_ready(timeout=30)
    assert api.notify is not None
    async with aiohttp.ClientSession() as session:
        await create_products(session, api.base_url, [f"p{i}" for i in range(6)])
    await smtp.arrivals.async_wait_for(lambda xs: len(xs) >= 2, timeout=10, what="2 in flight")
    with pg_cluster.frozen():
        asked = time.monotonic()
        api.terminate()
        code = await api.async_wait_exit(timeout=60)
        exited = time.monotonic()
    assert code == 0
    deadline = systemd_stop_deadline(asked, api.notify.log.snapshot(), timeout_stop_seconds())
    assert exited < deadline, (exited - asked, deadline - asked)
    said = [str(r.get("message")) for r in api.logs.snapshot()]
    gave_up = f"the store did not answer within {STOP_WRITE_SECONDS:g} s while stopping"
    assert any(line.startswith(gave_up) for line in said), said
    dropped = f"the database did not answer within {CLOSE_SECONDS:g} s while closing"
    assert any(line.startswith(dropped) for line in said), said
    assert not any(line.startswith("cannot start") for line in said), said


def timeout_stop_seconds() -> float:
    match = re.search(r"^TimeoutStopSec=(\d+)s$", UNIT.read_text(), re.MULTILINE)
    assert match is not None, "toko-api.service sets TimeoutStopSec="
    return float(match.group(1))


def systemd_stop_deadline(asked: float, notes: list[Notification], timeout_stop: float) -> float:
    """When systemd would SIGKILL a stop asked at ``asked``: TimeoutStopSec= after
    the SIGTERM, or later if EXTEND_TIMEOUT_USEC kept the timer moving (each
    one allows that long from its arrival, if it comes before the deadline)."""
    deadline = asked + timeout_stop
    for note in sorted(notes, key=lambda n: n.at):
        extend = note.get("EXTEND_TIMEOUT_USEC")
        if extend is not None and asked <= note.at <= deadline:
            deadline = max(deadline, note.at + int(extend) / 1_000_000)
    return deadline
