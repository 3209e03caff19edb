"""TOKO_ADMIN_EMAIL with several addresses: one email to all of them, and to
each of them once, whatever the server refuses for now or for good."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

import aiohttp

from tests.conftest import ServiceFactory
from tests.operability.cli import run
from tests.support import db
from tests.support.api import create_products, wait_healthy
from tests.support.service import ServiceProcess
from tests.support.smtp import SmtpMessage, SmtpServer

OWNERS = "bos@toko.test, kasir@toko.test"
BOS, KASIR = "bos@toko.test", "kasir@toko.test"


async def one_product_for_the_owners(
    service_factory: ServiceFactory, smtp: SmtpServer, **env: str
) -> ServiceProcess:
    svc = service_factory(
        {"TOKO_SMTP_URL": smtp.url, "TOKO_ADMIN_EMAIL": OWNERS, "TOKO_JOB_BACKOFF": "0.05", **env}
    ).start()
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


def delivered_to(address: str) -> Callable[[Sequence[SmtpMessage]], list[SmtpMessage] | None]:
    """A Recorder predicate: the messages delivered to ``address`` so far, once there is one."""

    def predicate(messages: Sequence[SmtpMessage]) -> list[SmtpMessage] | None:
        found = [m for m in messages if m.outcome == "delivered" and address in m.to]
        return found or None

    return predicate


def asked(smtp: SmtpServer, address: str) -> list[int]:
    """The reply codes of every RCPT TO:<address> so far."""
    return [code for rcpt, code in smtp.rcpts.snapshot() if rcpt == address]


async def test_an_admin_the_server_defers_gets_the_same_email_later_and_the_other_only_once(
    service_factory: ServiceFactory, smtp: SmtpServer
) -> None:
    smtp.defer_recipient(KASIR, 1)
    svc = await one_product_for_the_owners(service_factory, smtp)
    retry = await svc.async_wait_log("job failed, will retry", 15)
    assert "recipients deferred: kasir@toko.test: 450" in retry["ERROR"], retry
    await smtp.log.async_wait_for(delivered_to(KASIR), 15, "the email delivered to kasir")
    async with aiohttp.ClientSession() as session:
        await wait_healthy(session, svc.base_url, timeout=10, check=lambda b: b["queue"]["done"])

    first, second = smtp.delivered()
    assert (first.to, second.to) == ((BOS,), (KASIR,))  # bos is not sent it twice
    assert first.message_id == second.message_id  # the same email, late for kasir
    assert str(second.headers["To"]) == OWNERS
    (job,) = db.jobs(svc.database)
    assert (job["state"], job["attempts"]) == ("done", 2), job
    assert json.loads(job["payload"])["resend_to"] == [KASIR]


async def test_an_admin_refused_for_good_is_not_asked_again_while_one_deferred_is(
    service_factory: ServiceFactory, smtp: SmtpServer
) -> None:
    smtp.refuse_recipient(BOS)
    smtp.defer_recipient(KASIR, 1)
    svc = await one_product_for_the_owners(service_factory, smtp)
    await smtp.log.async_wait_for(delivered_to(KASIR), 15, "the email delivered to kasir")
    async with aiohttp.ClientSession() as session:
        await wait_healthy(session, svc.base_url, timeout=10, check=lambda b: b["queue"]["done"])

    (mail,) = smtp.delivered()
    assert mail.to == (KASIR,)
    assert asked(smtp, BOS) == [550]  # once: a retry would only be refused again
    assert asked(smtp, KASIR) == [450, 250]
    (job,) = db.jobs(svc.database)
    assert (job["state"], job["attempts"]) == ("done", 2), job


async def test_an_admin_deferred_past_the_last_attempt_gets_it_from_an_admins_retry(
    service_factory: ServiceFactory, smtp: SmtpServer
) -> None:
    smtp.defer_recipient(KASIR, 1000)
    svc = await one_product_for_the_owners(service_factory, smtp, TOKO_JOB_MAX_ATTEMPTS="3")
    failed = await svc.async_wait_log("job failed permanently", 15)
    assert "kasir@toko.test: 450" in failed["ERROR"], failed
    (job,) = db.jobs(svc.database)
    assert job["state"] == "failed", job
    assert json.loads(job["payload"])["resend_to"] == [KASIR]  # kept for the retry
    assert asked(smtp, KASIR) == [450, 450, 450]
    assert asked(smtp, BOS) == [250]

    smtp.reset()
    retried = await run(
        "toko-queue", "retry", str(job["id"]), env={"TOKO_DATABASE": str(svc.database)}
    )
    assert retried.returncode == 0, retried
    await smtp.log.async_wait_for(delivered_to(KASIR), 15, "the email delivered to kasir")
    first, second = smtp.delivered()
    assert (first.to, second.to) == ((BOS,), (KASIR,))
    assert first.message_id == second.message_id
