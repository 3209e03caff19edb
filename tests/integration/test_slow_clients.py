"""Clients that are slow, silent or gone: TOKO_CLIENT_TIMEOUT bounds what they hold.

One toko-api with a 1 s client timeout. A connection that never sends a whole
request is closed, a body that stops arriving gets a 408, and a client that
hangs up mid-body is one INFO line. None of it creates a row or logs an error,
and the service keeps answering everyone else.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import pytest

from tests.support import db, http
from tests.support.service import ServiceProcess, ready_service

CLIENT_TIMEOUT_S = 1
# Far above the timeout, so only a server that never closes fails the wait.
CLOSE_WITHIN_S = 15
BODY = b'{"nama": "Kopi", "harga": 1000}'
POST_HEAD = (
    b"POST /produk HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n" % len(BODY)
)


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    env = {"TOKO_CLIENT_TIMEOUT": str(CLIENT_TIMEOUT_S)}
    with ready_service(tmp_path_factory.mktemp("slow-clients"), env) as svc:
        yield svc


@contextlib.asynccontextmanager
async def connection(port: int) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def read_until_closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends before it closes; fails if it never does."""
    async with asyncio.timeout(CLOSE_WITHIN_S):
        return await reader.read()


async def test_a_connection_that_sends_nothing_is_closed(api: ServiceProcess) -> None:
    async with connection(api.port) as (reader, _writer):
        assert await read_until_closed(reader) == b""


async def test_headers_trickled_without_end_are_cut_off(api: ServiceProcess) -> None:
    async with connection(api.port) as (reader, writer):
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        # Meanwhile the service answers others as usual.
        health = await http.request(api.port, "GET", "/healthz")
        assert health.status == 200, health
        assert await read_until_closed(reader) == b""


async def test_a_declared_body_over_the_limit_is_refused_before_it_arrives(
    api: ServiceProcess,
) -> None:
    # The client sends the headers and waits: it hears the 413 at once, not
    # the 408 that waiting for the body would end in.
    async with connection(api.port) as (reader, writer):
        writer.write(
            b"POST /produk HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000\r\n\r\n"
        )
        async with asyncio.timeout(CLOSE_WITHIN_S):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(re.search(rb"(?i)content-length: *(\d+)", head)[1])  # type: ignore[index]
            raw = head + await reader.readexactly(length)
    resp = http.parse_response(raw)
    assert resp.status == 413, resp
    assert resp.headers.get("connection", "").lower() == "close", resp
    assert "the limit is 65536 bytes" in json.loads(resp.body)["error"]
    assert db.product_count(api.database) == 0


async def test_an_idle_kept_alive_connection_is_closed_after_its_answer(
    api: ServiceProcess,
) -> None:
    async with connection(api.port) as (reader, writer):
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        raw = await read_until_closed(reader)
    resp = http.parse_response(raw)
    assert resp.status == 200, resp
    assert resp.headers.get("connection", "").lower() != "close", resp


async def test_a_body_that_stops_arriving_gets_a_408(api: ServiceProcess) -> None:
    before = db.product_count(api.database)
    async with connection(api.port) as (reader, writer):
        writer.write(POST_HEAD + BODY[:10])
        raw = await read_until_closed(reader)
    resp = http.parse_response(raw)
    assert resp.status == 408, resp
    assert resp.headers.get("connection", "").lower() == "close", resp
    assert resp.headers["content-type"].startswith("application/json"), resp
    assert resp.json() == {"error": f"the request body did not arrive within {CLIENT_TIMEOUT_S} s"}
    assert db.product_count(api.database) == before


async def test_a_body_sent_in_pieces_within_the_timeout_is_taken(api: ServiceProcess) -> None:
    before = db.product_count(api.database)
    async with connection(api.port) as (reader, writer):
        writer.write(POST_HEAD + BODY[:10])
        await writer.drain()
        # A slow client, well inside the 1 s it has: the pause is what is tested.
        await asyncio.sleep(0.2)
        writer.write(BODY[10:])
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), CLOSE_WITHIN_S)
    assert head.startswith(b"HTTP/1.1 201 "), head
    assert db.product_count(api.database) == before + 1


async def test_a_client_hanging_up_mid_body_is_one_info_line(api: ServiceProcess) -> None:
    before = db.product_count(api.database)
    async with connection(api.port) as (_reader, writer):
        writer.write(POST_HEAD + BODY[:10])
        await writer.drain()
        # The handler must be waiting on the body before the hang-up, or there
        # is nothing to observe: the service logs nothing for a request it
        # never started. /healthz answering after our bytes shows they were read.
        health = await http.request(api.port, "GET", "/healthz")
        assert health.status == 200, health

    def hang_up_line(records: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
        return next((r for r in records if "hung up" in r.get("message", "")), None)

    line = await api.logs.async_wait_for(hang_up_line, timeout=CLOSE_WITHIN_S, what="hang-up")
    assert line["level"] == "INFO", line
    assert "exception" not in line, line
    assert db.product_count(api.database) == before


def test_no_errors_were_logged_and_the_service_is_healthy(api: ServiceProcess) -> None:
    errors = [r for r in api.logs.snapshot() if r.get("level") in ("ERROR", "CRITICAL")]
    assert errors == [], json.dumps(errors, indent=1)
    assert api.returncode is None
