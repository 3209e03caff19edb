"""SMTP faults: temporary failures are retried, permanent ones end as dead letters."""

from __future__ import annotations

import aiohttp

from tests.conftest import ServiceFactory
from tests.support import db
from tests.support.api import create_product, create_products, healthz, wait_healthy
from tests.support.smtp import SmtpServer


async def test_temporary_failures_are_retried_until_delivered(
    service_factory: ServiceFactory, smtp: SmtpServer
) -> None:
    smtp.fail_next(3)
    svc = service_factory(
        {"TOKO_SMTP_URL": smtp.url, "TOKO_JOB_BACKOFF": "0.05", "TOKO_JOB_MAX_ATTEMPTS": "5"}
    ).start()
    await svc.async_wait_ready(timeout=20)
    async with aiohttp.ClientSession() as session:
        product = await create_product(session, svc.base_url, "Coba Lagi", 100)
        (mid,) = await smtp.async_wait_delivered(1, timeout=20)
        assert [m.outcome for m in smtp.messages()] == ["tempfailed"] * 3 + ["delivered"]
        assert {m.message_id for m in smtp.messages()} == {mid}
        body = await wait_healthy(
            session, svc.base_url, timeout=10, check=lambda b: b["queue"]["done"] == 1
        )
    assert body["queue"]["failed"] == 0
    (job,) = db.jobs(svc.database)
    assert job["state"] == "done"
    assert job["attempts"] == 4
    retries = svc.find_logs("job failed, will retry")
    assert len(retries) == 3, retries
    assert {str(r.get("JOB_ID")) for r in retries} == {str(job["id"])}
    assert f"Produk baru: {product['nama']}" in smtp.delivered()[0].subject


async def test_temporary_outage_for_a_while_loses_nothing(
    service_factory: ServiceFactory, smtp: SmtpServer
) -> None:
    svc = service_factory(
        {"TOKO_SMTP_URL": smtp.url, "TOKO_JOB_BACKOFF": "0.05", "TOKO_JOB_MAX_ATTEMPTS": "20"}
    ).start()
    await svc.async_wait_ready(timeout=20)
    # The outage lasts until every email has met it: a fixed second was not
    # always enough for six first attempts on a loaded machine.
    smtp.fail_for(3600)
    async with aiohttp.ClientSession() as session:
        await create_products(session, svc.base_url, [f"Outage {i}" for i in range(6)])
    await smtp.log.async_wait_for(
        lambda xs: len({m.message_id for m in xs if m.outcome == "tempfailed"}) >= 6,
        timeout=30,
        what="a failed first attempt for each of the 6 emails",
    )
    smtp.reset()  # the server is back
    ids = await smtp.async_wait_delivered(6, timeout=30)
    tempfailed = {m.message_id for m in smtp.messages("tempfailed")}
    assert tempfailed == ids, "every email should have met the outage and been retried"
    assert smtp.duplicates() == {}


async def test_permanent_failure_ends_failed_while_others_flow(
    service_factory: ServiceFactory, smtp: SmtpServer
) -> None:
    max_attempts = 3
    smtp.refuse_subject("TOLAK")
    svc = service_factory(
        {
            "TOKO_SMTP_URL": smtp.url,
            "TOKO_WORKERS": "2",
            "TOKO_JOB_BACKOFF": "0.05",
            "TOKO_JOB_MAX_ATTEMPTS": str(max_attempts),
        }
    ).start()
    await svc.async_wait_ready(timeout=20)
    async with aiohttp.ClientSession() as session:
        bad = await create_product(session, svc.base_url, "Barang TOLAK", 1)
        good = await create_products(session, svc.base_url, [f"Bagus {i}" for i in range(5)])
        dead = await svc.async_wait_log("job failed permanently", timeout=20)
        await smtp.async_wait_delivered(5, timeout=20)
        # The queue is not wedged by its dead letter: later products flow too.
        later = await create_products(session, svc.base_url, [f"Nanti {i}" for i in range(3)])
        await smtp.async_wait_delivered(8, timeout=20)
        body = await wait_healthy(
            session, svc.base_url, timeout=10, check=lambda b: b["queue"]["done"] == 8
        )
        code, _ = await healthz(session, svc.base_url)
    assert code == 200, "a dead letter must not make the service unhealthy"
    assert body["queue"]["failed"] == 1
    assert body["queue"]["pending"] == 0
    refused = smtp.messages("refused")
    assert len(refused) == max_attempts, [m.outcome for m in smtp.messages()]
    assert len({m.message_id for m in refused}) == 1
    assert all("Barang TOLAK" in m.subject for m in refused)
    delivered_subjects = " | ".join(m.subject for m in smtp.delivered())
    for p in [*good, *later]:
        assert f"Produk baru: {p['nama']}" in delivered_subjects
    assert "TOLAK" not in delivered_subjects
    failed = db.query(svc.database, "SELECT * FROM jobs WHERE state = 'failed'")
    assert len(failed) == 1, failed
    assert failed[0]["attempts"] == max_attempts
    assert failed[0]["last_error"], "the dead letter keeps its last error"
    assert str(dead.get("JOB_ID")) == str(failed[0]["id"])
    assert db.job_states(svc.database) == {"done": 8, "failed": 1}
    assert str(bad["id"]) in failed[0]["payload"]
    # A refusal retries cannot fix is an error from the first attempt on
    # (journalctl -p err), not only when the last one fails.
    retries = svc.find_logs("job failed, will retry")
    assert len(retries) == max_attempts - 1, retries
    assert {r["level"] for r in retries} == {"ERROR"}
    assert all("SMTP 550" in r["ERROR"] for r in retries), retries
