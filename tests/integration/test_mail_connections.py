"""toko-api keeps an SMTP connection between emails, and says goodbye at stop."""

from __future__ import annotations

import aiohttp

from tests.conftest import ServiceFactory
from tests.support.api import create_products
from tests.support.smtp import SmtpServer


async def test_a_run_of_emails_shares_connections_and_a_stop_closes_them_with_a_quit(
    service_factory: ServiceFactory, smtp: SmtpServer
) -> None:
    svc = service_factory({"TOKO_SMTP_URL": smtp.url, "TOKO_WORKERS": "2"}).start()
    await svc.async_wait_ready(timeout=20)
    async with aiohttp.ClientSession() as session:
        await create_products(session, svc.base_url, [f"Kopi {n}" for n in range(8)])
    await smtp.async_wait_delivered(8, timeout=15)
    # Two workers: two connections at a time at most, each kept for the next
    # email (a connection idle for 2 s is closed, so a very slow machine
    # could open a few more, but never one per email).
    opened = len(smtp.connections)
    assert opened < 8, [m.connection for m in smtp.delivered()]
    svc.terminate()
    assert await svc.async_wait_exit(timeout=20) == 0
    # None is left for the server to time out: every one got a QUIT.
    assert sorted(set(smtp.quits.snapshot())) == list(range(1, opened + 1))
