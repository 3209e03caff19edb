"""Changing and deleting products on a real toko-api (PATCH, DELETE /produk/{id}).

Optimistic concurrency end to end: every answer that carries a product has its
ETag, a change or delete needs it in If-Match, and of clients racing with one
ETag exactly one wins, on SQLite and on PostgreSQL (two toko-api processes on
one database there, as behind a load balancer). A price change emails the
admin through the outbox; a deleted product is gone from the API while its row,
and the emails queued for it, stay.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict

from tests.conftest import ServiceFactory
from tests.support import db
from tests.support.api import wait_healthy
from tests.support.postgres import PostgresCluster, fetch, pg_env
from tests.support.scrape import scrape
from tests.support.service import ServiceProcess
from tests.support.smtp import SmtpMessage, SmtpServer

TOKEN = "edit-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ROUTE = "/produk/{id}"


def _token_file(tmp_path: Path) -> str:
    path = tmp_path / "api-token"
    path.write_text(TOKEN + "\n")
    return str(path)


def _text(mail: SmtpMessage) -> str:
    content = mail.headers.get_content()
    assert isinstance(content, str)
    return content


async def _post(
    session: aiohttp.ClientSession, svc: ServiceProcess, body: dict[str, Any], **headers: str
) -> tuple[int, CIMultiDict[str], Any]:
    async with session.post(svc.url("/produk"), json=body, headers=headers) as resp:
        return resp.status, resp.headers.copy(), await resp.json()


async def _patch(
    session: aiohttp.ClientSession, svc: ServiceProcess, pid: int, body: Any, etag: str | None
) -> tuple[int, CIMultiDict[str], Any]:
    headers = {} if etag is None else {"If-Match": etag}
    async with session.patch(svc.url(f"/produk/{pid}"), json=body, headers=headers) as resp:
        return resp.status, resp.headers.copy(), await resp.json()


async def _delete(
    session: aiohttp.ClientSession, svc: ServiceProcess, pid: int, etag: str | None
) -> tuple[int, CIMultiDict[str], bytes]:
    headers = {} if etag is None else {"If-Match": etag}
    async with session.delete(svc.url(f"/produk/{pid}"), headers=headers) as resp:
        return resp.status, resp.headers.copy(), await resp.read()


async def _get(
    session: aiohttp.ClientSession, svc: ServiceProcess, pid: int
) -> tuple[int, CIMultiDict[str], Any]:
    async with session.get(svc.url(f"/produk/{pid}")) as resp:
        return resp.status, resp.headers.copy(), await resp.json()


async def test_change_then_delete_with_etags_and_the_price_email(
    service_factory: ServiceFactory, smtp: SmtpServer, tmp_path: Path
) -> None:
    svc = service_factory(
        {
            "TOKO_SMTP_URL": smtp.url,
            "TOKO_ADMIN_EMAIL": "bos@toko.test",
            "TOKO_API_TOKEN_FILE": _token_file(tmp_path),
        }
    ).start()
    await svc.async_wait_ready(timeout=20)
    async with aiohttp.ClientSession(headers=AUTH) as session:
        status, headers, kopi = await _post(session, svc, {"nama": "Kopi", "harga": 1000})
        assert (status, headers["ETag"]) == (201, '"1"')
        pid = kopi["id"]
        status, headers, read = await _get(session, svc, pid)
        assert (status, headers["ETag"], read) == (200, '"1"', kopi)

        # The write token, as for POST.
        async with aiohttp.ClientSession() as anonymous:
            for request in (
                anonymous.patch(svc.url(f"/produk/{pid}"), json={"harga": 1}),
                anonymous.delete(svc.url(f"/produk/{pid}"), headers={"If-Match": '"1"'}),
            ):
                async with request as resp:
                    assert resp.status == 401, await resp.text()

        # A new price: the next version, and the admin's email.
        status, headers, changed = await _patch(session, svc, pid, {"harga": 1500}, '"1"')
        assert (status, headers["ETag"]) == (200, '"2"')
        assert changed == {**kopi, "harga": 1500}
        await smtp.async_wait_delivered(2, timeout=15)
        (price_mail,) = [m for m in smtp.delivered() if "Harga berubah" in m.subject]
        assert "Harga berubah: Kopi" in price_mail.subject
        assert price_mail.to == ("bos@toko.test",)
        body = _text(price_mail)
        assert "Harga lama: Rp 1.000" in body and "Harga baru: Rp 1.500" in body, body

        # A rename alone: a new version, no email.
        status, headers, renamed = await _patch(session, svc, pid, {"nama": " Kopi Susu "}, '"2"')
        assert (status, headers["ETag"], renamed["nama"]) == (200, '"3"', "Kopi Susu")
        # The values it has: nothing written, the version stays.
        same = {"nama": "Kopi Susu", "harga": 1500}
        status, headers, unchanged = await _patch(session, svc, pid, same, '"3"')
        assert (status, headers["ETag"], unchanged) == (200, '"3"', renamed)
        # A client still at version 1 is told the product moved on.
        status, _, stale = await _patch(session, svc, pid, {"harga": 1}, '"1"')
        assert status == 412
        assert 'it is at version 3 now (ETag "3")' in stale["error"], stale

        status, headers, body_bytes = await _delete(session, svc, pid, '"3"')
        assert (status, headers["ETag"], body_bytes) == (204, '"4"', b"")
        status, headers, gone = await _get(session, svc, pid)
        assert status == 404 and "ETag" not in headers
        assert gone == {"error": f"no product with id {pid}"}
        async with session.get(svc.url("/produk")) as resp:
            assert await resp.json() == []
        status, _, _ = await _patch(session, svc, pid, {"harga": 1}, "*")
        assert status == 404

        metrics = await scrape(session, svc.base_url)
    # Its row stays: the recaps count it, and it says what it was last.
    (row,) = db.query(svc.database, "SELECT * FROM products")
    assert (row["nama"], row["harga"], row["version"]) == ("Kopi Susu", 1500, 4)
    assert row["deleted_at"] is not None
    assert (row["created_nama"], row["created_harga"]) == ("Kopi", 1000)
    assert [job["kind"] for job in db.jobs(svc.database)] == ["product_email", "price_email"]

    def requests(method: str, status: str) -> float:
        return metrics.value("toko_http_requests_total", route=ROUTE, method=method, status=status)

    assert requests("PATCH", "200") == 3
    assert requests("PATCH", "401") == requests("DELETE", "401") == 1
    assert requests("PATCH", "412") == requests("PATCH", "404") == 1
    assert requests("DELETE", "204") == 1
    assert metrics.value("toko_jobs_enqueued_total", kind="price_email") == 1

    # The journal: each change with its product, the fields changed and the version.
    changes = [
        (r["message"], r.get("FIELDS"), r["VERSION"], "JOB_ID" in r)
        for r in svc.logs.snapshot()
        if r.get("PRODUCT_ID") == pid and r.get("logger") == "toko.http"
    ]
    assert changes == [
        ("product changed", "harga", 2, True),
        ("product changed", "nama", 3, False),
        ("product change asks for the values it has; nothing written", None, 3, False),
        ("product write refused: it is at another version than If-Match names", None, 3, False),
        ("product deleted", None, 4, False),
    ]


async def test_emails_queued_for_a_product_go_out_as_queued_after_it_is_deleted(
    service_factory: ServiceFactory, smtp: SmtpServer
) -> None:
    smtp.fail_for(3.0)  # every attempt until then fails: the jobs wait to retry
    svc = service_factory(
        {"TOKO_SMTP_URL": smtp.url, "TOKO_JOB_BACKOFF": "0.2", "TOKO_JOB_MAX_ATTEMPTS": "10"}
    ).start()
    await svc.async_wait_ready(timeout=20)
    async with aiohttp.ClientSession() as session:
        _, _, kopi = await _post(session, svc, {"nama": "Kopi", "harga": 1000})
        pid = kopi["id"]
        assert (await _patch(session, svc, pid, {"nama": "Teh", "harga": 2000}, '"1"'))[0] == 200
        assert (await _delete(session, svc, pid, '"2"'))[0] == 204
        deleted_at = time.monotonic()  # the clock SmtpMessage.at is of
        assert "done" not in db.job_states(svc.database)
        await smtp.async_wait_delivered(2, timeout=30)
        # Acks are batched: done a moment after the server took the emails.
        await wait_healthy(session, svc.base_url, 10, check=lambda b: b["queue"]["done"] == 2)
    subjects = sorted(m.subject for m in smtp.delivered())
    assert subjects == ["Harga berubah: Teh", "Produk baru: Kopi"], subjects
    created, price = sorted(smtp.delivered(), key=lambda m: m.subject, reverse=True)
    assert "Nama:  Kopi" in _text(created) and "Rp 1.000" in _text(created)
    assert "Nama lama:  Kopi" in _text(price) and "Harga baru: Rp 2.000" in _text(price)
    # Sent after the delete, by attempts after the first (which the server refused).
    assert min(m.at for m in smtp.delivered()) > deleted_at
    assert all(job["state"] == "done" and job["attempts"] > 1 for job in db.jobs(svc.database))


async def test_a_post_retried_after_a_change_gets_the_first_answer_again(
    service_factory: ServiceFactory,
) -> None:
    svc = service_factory().start()
    await svc.async_wait_ready(timeout=20)
    async with aiohttp.ClientSession() as session:
        key = {"Idempotency-Key": "order-7"}
        status, first_headers, first = await _post(
            session, svc, {"nama": "Kopi", "harga": 1}, **key
        )
        assert status == 201
        assert (await _patch(session, svc, first["id"], {"harga": 2}, '"1"'))[0] == 200
        for _ in range(2):  # changed; then changed and deleted
            status, headers, again = await _post(session, svc, {"nama": "Kopi", "harga": 1}, **key)
            assert (status, again, headers["ETag"]) == (201, first, first_headers["ETag"])
            assert headers["Idempotent-Replayed"] == "true"
            # Another product under the key is still refused.
            status, _, _ = await _post(session, svc, {"nama": "Kopi", "harga": 2}, **key)
            assert status == 422
            await _delete(session, svc, first["id"], "*")
    assert db.product_count(svc.database) == 1


async def _race(
    session: aiohttp.ClientSession, instances: list[ServiceProcess], rounds: int, clients: int
) -> None:
    """Each round: ``clients`` PATCHes with one ETag (one wins, the rest 412),
    on every instance in turn; at the end as many DELETEs (one wins, the rest 404)."""
    turn = itertools.cycle(instances)
    svc = next(turn)
    _, _, product = await _post(session, svc, {"nama": "Rebutan", "harga": 0})
    pid = product["id"]
    for round_ in range(rounds):
        etag = f'"{round_ + 1}"'
        answers = await asyncio.gather(
            *(
                _patch(session, next(turn), pid, {"harga": 1000 * round_ + i + 1}, etag)
                for i in range(clients)
            )
        )
        statuses = sorted(status for status, _, _ in answers)
        assert statuses == [200] + [412] * (clients - 1), answers
        (winner,) = [body for status, _, body in answers if status == 200]
        now = f'"{round_ + 2}"'
        assert all(now in body["error"] for status, _, body in answers if status == 412), answers
        status, headers, read = await _get(session, next(turn), pid)
        assert (status, headers["ETag"], read) == (200, now, winner)
    etag = f'"{rounds + 1}"'
    answers = await asyncio.gather(
        *(_delete(session, next(turn), pid, etag) for _ in range(clients))
    )
    statuses = sorted(status for status, _, _ in answers)
    # The losers find it gone, not at another version: a deleted product is 404.
    assert statuses == [204] + [404] * (clients - 1), answers


ROUNDS, CLIENTS = 5, 8


async def test_clients_racing_with_one_etag_on_sqlite_exactly_one_wins(
    service_factory: ServiceFactory,
) -> None:
    svc = service_factory().start()
    await svc.async_wait_ready(timeout=20)
    async with aiohttp.ClientSession() as session:
        await _race(session, [svc], ROUNDS, CLIENTS)
    (row,) = db.query(svc.database, "SELECT version, deleted_at FROM products")
    assert row["version"] == ROUNDS + 2 and row["deleted_at"] is not None
    price_jobs = db.query(svc.database, "SELECT payload FROM jobs WHERE kind = 'price_email'")
    assert [json.loads(j["payload"])["version"] for j in price_jobs] == list(range(2, ROUNDS + 2))


async def test_clients_racing_with_one_etag_on_two_postgres_instances_exactly_one_wins(
    service_factory: ServiceFactory, pg_cluster: PostgresCluster, pg_url: str
) -> None:
    env = pg_env(pg_cluster, pg_url)
    instances = [service_factory(env).start() for _ in range(2)]
    await asyncio.gather(*(svc.async_wait_ready(timeout=30) for svc in instances))
    async with aiohttp.ClientSession() as session:
        await _race(session, instances, ROUNDS, CLIENTS)
    rows = await fetch(pg_cluster, pg_url, "SELECT version, deleted_at FROM products")
    assert len(rows) == 1 and rows[0][0] == ROUNDS + 2 and rows[0][1] is not None
    versions = await fetch(
        pg_cluster,
        pg_url,
        "SELECT (payload->>'version')::int FROM jobs WHERE kind = 'price_email' ORDER BY 1",
    )
    assert [v for (v,) in versions] == list(range(2, ROUNDS + 2))


@pytest.mark.parametrize("method", ["PATCH", "DELETE"])
async def test_a_request_waiting_to_send_its_body_is_refused_before_it_does(
    service_factory: ServiceFactory, method: str
) -> None:
    # Without If-Match the answer needs no body: a client that waits for
    # "100 Continue" gets the 428 instead, and sends none.
    svc = service_factory().start()
    await svc.async_wait_ready(timeout=20)
    reader, writer = await asyncio.open_connection("127.0.0.1", svc.port)
    try:
        writer.write(
            f"{method} /produk/1 HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Content-Length: 15\r\nExpect: 100-continue\r\n\r\n".encode()
        )
        await writer.drain()
        async with asyncio.timeout(10):
            head = await reader.readuntil(b"\r\n\r\n")
    finally:
        writer.close()
        await writer.wait_closed()
    assert head.startswith(b"HTTP/1.1 428 "), head
