"""Crash: kill -9 with emails pending behind a slow SMTP server, then restart.

The transactional outbox promises that every product acknowledged with a 201
gets its email, whatever happens to the process afterwards. Delivery is
at-least-once, so a duplicate (same Message-ID twice) is allowed and reported.
"""

from __future__ import annotations

import aiohttp

from tests.conftest import ServiceFactory
from tests.support import db
from tests.support.api import create_products
from tests.support.smtp import SmtpServer

PRODUCTS = 24


async def test_kill_9_then_restart_delivers_every_email(
    service_factory: ServiceFactory, smtp: SmtpServer
) -> None:
    smtp.set_delay(1.5)
    env = {
        "TOKO_SMTP_URL": smtp.url,
        "TOKO_WORKERS": "3",
        "TOKO_JOB_BACKOFF": "0.05",
        "TOKO_JOB_TIMEOUT": "10",
    }
    first = service_factory(env).start()
    await first.async_wait_ready(timeout=20)
    names = [f"Crash {i:02d}" for i in range(PRODUCTS)]
    async with aiohttp.ClientSession() as session:
        products = await create_products(session, first.base_url, names)
    assert len({p["id"] for p in products}) == PRODUCTS
    # Three sends in flight at the slow server, the rest queued: now crash.
    await smtp.arrivals.async_wait_for(lambda xs: len(xs) >= 3, timeout=10, what="3 in flight")
    first.kill()
    assert await first.async_wait_exit(timeout=10) == -9
    delivered_before = smtp.delivered_ids()
    assert len(delivered_before) < PRODUCTS, "nothing was pending at the crash; test proves nothing"
    states = db.job_states(first.database)
    assert sum(states.values()) == PRODUCTS, states
    assert states.get("pending", 0) + states.get("running", 0) > 0, states
    assert db.product_count(first.database) == PRODUCTS

    smtp.reset()  # fast again
    second = service_factory(env).start()  # same database file
    await second.async_wait_ready(timeout=20)
    ids = await smtp.async_wait_delivered(PRODUCTS, timeout=60)
    assert len(ids) == PRODUCTS
    subjects = {m.subject for m in smtp.delivered()}
    for name in names:
        assert any(f"Produk baru: {name}" in s for s in subjects), f"no email for {name}"
    # Every job ends done once its email is out.
    async with aiohttp.ClientSession() as session:
        await _wait_all_done(session, second.base_url, PRODUCTS)
    assert db.job_states(second.database) == {"done": PRODUCTS}
    duplicates = smtp.duplicates()
    print(
        f"crash test: {PRODUCTS} products, {len(delivered_before)} delivered before kill -9, "
        f"{len(smtp.delivered())} deliveries in all, duplicates (at-least-once): {duplicates}"
    )
    # A duplicate can only come from a send that was in flight at the crash.
    assert sum(n - 1 for n in duplicates.values()) <= 3, duplicates
    second.terminate()
    assert await second.async_wait_exit(timeout=20) == 0


async def _wait_all_done(session: aiohttp.ClientSession, base_url: str, count: int) -> None:
    from tests.support.api import wait_healthy

    await wait_healthy(session, base_url, timeout=15, check=lambda b: b["queue"]["done"] == count)
