"""A POST /produk retried with the same Idempotency-Key gets the first answer
again: one product and one email, however often and however concurrently it is
sent. This is what lets a client whose connection dropped before the 201
arrived send the request again safely."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from tests.support import db
from tests.support.api import wait_healthy
from tests.support.scrape import scrape
from tests.support.service import ServiceProcess, ready_service

REPLAYED = "Idempotent-Replayed"


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with ready_service(tmp_path_factory.mktemp("idempotency"), {}) as service:
        yield service


async def post(
    session: aiohttp.ClientSession, svc: ServiceProcess, body: dict[str, Any], key: str
) -> tuple[int, Any, dict[str, str]]:
    async with session.post(
        f"{svc.base_url}/produk", json=body, headers={"Idempotency-Key": key}
    ) as resp:
        return resp.status, await resp.json(), dict(resp.headers)


def products_named(svc: ServiceProcess, nama: str) -> list[dict[str, Any]]:
    return db.query(svc.database, "SELECT * FROM products WHERE nama = ?", (nama,))


def jobs_for(svc: ServiceProcess, product_id: int) -> list[dict[str, Any]]:
    return db.query(
        svc.database,
        "SELECT * FROM jobs WHERE json_extract(payload, '$.product_id') = ?",
        (product_id,),
    )


async def emails_for(session: aiohttp.ClientSession, svc: ServiceProcess, product_id: int) -> int:
    """Emails logged for the product once the queue is empty (the log mailer)."""
    await wait_healthy(
        session,
        svc.base_url,
        30,
        check=lambda b: b["queue"]["pending"] + b["queue"]["running"] == 0,
    )
    return len(svc.find_logs("email logged", PRODUCT_ID=product_id))


async def test_a_retry_with_the_same_key_gets_the_first_answer(svc: ServiceProcess) -> None:
    body = {"nama": "Kopi Ulang", "harga": 15000}
    async with aiohttp.ClientSession() as session:
        replays = (await scrape(session, svc.base_url)).value("toko_idempotent_replays_total")
        status, first, first_headers = await post(session, svc, body, "order-1")
        assert status == 201, first
        assert REPLAYED not in first_headers
        status, again, headers = await post(session, svc, body, "order-1")
        assert status == 201, again
        assert again == first
        assert headers["Location"] == first_headers["Location"] == f"/produk/{first['id']}"
        assert headers[REPLAYED] == "true"
        after = (await scrape(session, svc.base_url)).value("toko_idempotent_replays_total")
        assert after == replays + 1
        assert await emails_for(session, svc, first["id"]) == 1
    assert len(products_named(svc, "Kopi Ulang")) == 1
    assert len(jobs_for(svc, first["id"])) == 1


async def test_the_same_key_for_another_product_is_refused(svc: ServiceProcess) -> None:
    async with aiohttp.ClientSession() as session:
        status, first, _ = await post(session, svc, {"nama": "Teh", "harga": 5000}, "order-2")
        assert status == 201, first
        status, body, _ = await post(session, svc, {"nama": "Teh", "harga": 6000}, "order-2")
    assert status == 422
    assert body == {
        "error": f"Idempotency-Key order-2 was already used for another product (id {first['id']})"
    }
    assert [p["harga"] for p in products_named(svc, "Teh")] == [5000]


async def test_concurrent_requests_with_one_key_make_one_product(svc: ServiceProcess) -> None:
    body = {"nama": "Kopi Serentak", "harga": 12000}
    async with aiohttp.ClientSession() as session:
        answers = await asyncio.gather(*(post(session, svc, body, "order-3") for _ in range(20)))
        assert {status for status, _, _ in answers} == {201}
        assert len({answer["id"] for _, answer, _ in answers}) == 1
        # Exactly one of them made it; the rest were given its answer.
        assert sum(REPLAYED not in headers for _, _, headers in answers) == 1
        product_id = answers[0][1]["id"]
        assert await emails_for(session, svc, product_id) == 1
    assert len(products_named(svc, "Kopi Serentak")) == 1
    assert len(jobs_for(svc, product_id)) == 1


async def test_a_retry_after_the_connection_dropped_finds_the_product(svc: ServiceProcess) -> None:
    # The client sends its POST and loses the connection before the answer:
    # it cannot know whether the product was stored.
    payload = b'{"nama": "Kopi Putus", "harga": 9000}'
    request = (
        b"POST /produk HTTP/1.1\r\nHost: toko\r\nContent-Type: application/json\r\n"
        b"Idempotency-Key: order-4\r\n"
        b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload
    )
    with socket.create_connection(("127.0.0.1", svc.port), timeout=10) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)  # hang up without reading the answer
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while not products_named(svc, "Kopi Putus"):
        assert loop.time() < deadline, "the dropped request was never stored"
        await asyncio.sleep(0.05)  # a row has no event to await
    async with aiohttp.ClientSession() as session:
        status, body, headers = await post(
            session, svc, {"nama": "Kopi Putus", "harga": 9000}, "order-4"
        )
        assert status == 201, body
        assert headers[REPLAYED] == "true"
        assert await emails_for(session, svc, body["id"]) == 1
    assert [p["id"] for p in products_named(svc, "Kopi Putus")] == [body["id"]]


@pytest.mark.parametrize(
    ("key", "fragment"),
    [
        ("", "1 to 255"),
        ("x" * 256, "1 to 255"),
        ("kunci-\u00e9", "printable ASCII"),
    ],
)
async def test_a_malformed_key_is_a_400(svc: ServiceProcess, key: str, fragment: str) -> None:
    async with aiohttp.ClientSession() as session:
        status, body, _ = await post(session, svc, {"nama": "Kunci Buruk", "harga": 1}, key)
    assert status == 400
    assert fragment in body["error"]
    assert products_named(svc, "Kunci Buruk") == []
