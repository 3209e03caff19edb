"""TOKO_ADMIN_EMAIL with several addresses: one email to all of them."""

from __future__ import annotations

import aiohttp

from tests.conftest import ServiceFactory
from tests.support import db
from tests.support.api import create_products, wait_healthy
from tests.support.service import ServiceProcess
from tests.support.smtp import SmtpServer

OWNERS = "bos@toko.test, kasir@toko.test"


async def one_product_for_the_owners(
    service_factory: ServiceFactory, smtp: SmtpServer
) -> ServiceProcess:
    svc = service_factory({"TOKO_SMTP_URL": smtp.url, "TOKO_ADMIN_EMAIL": OWNERS}).start()
    await svc.async_wait_ready(timeout=20)
    async with aiohttp.ClientSession() as session:
        await create_products(session, svc.base_url, ["Teh Hijau"])
    return svc


async def test_one_email_reaches_every_admin(
    service_factory: ServiceFactory, smtp: SmtpServer
) -> None:
    await one_product_for_the_owners(service_factory, smtp)
    await smtp.async_wait_delivered(1, timeout=15)
    (mail,) = smtp.delivered()
    assert mail.to == ("bos@toko.test", "kasir@toko.test")  # one transaction, two RCPTs
    assert str(mail.headers["To"]) == OWNERS


async def test_a_refused_admin_costs_the_others_nothing(
    service_factory: ServiceFactory, smtp: SmtpServer
) -> None:
    smtp.refuse_recipient("kasir@toko.test")
    svc = await one_product_for_the_owners(service_factory, smtp)
    warning = await svc.async_wait_log("email sent, but some recipients were refused", 15)
    assert warning["REFUSED"].startswith("kasir@toko.test: 550"), warning
    async with aiohttp.ClientSession() as session:
        await wait_healthy(session, svc.base_url, timeout=10, check=lambda b: b["queue"]["done"])
    (mail,) = smtp.delivered()
    assert mail.to == ("bos@toko.test",)
    # Done after one attempt: a retry would send bos the same email again.
    (job,) = db.jobs(svc.database)
    assert (job["state"], job["attempts"]) == ("done", 1), job
    assert len(smtp.delivered()) == 1
