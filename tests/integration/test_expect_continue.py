"""``Expect: 100-continue`` on a real toko-api: the body is asked for only once it is wanted.

A client that sends ``Expect: 100-continue`` holds its body back until the
server says ``100 Continue``, or answers at once. A request refused on its
headers alone (no token, not JSON, too large) gets that answer instead, so
the client never uploads a body that would be thrown away.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import db
from tests.support.http import parse_response
from tests.support.service import ServiceProcess, ready_service

TOKEN = "tok-" + secrets.token_hex(20)
PRODUCT = json.dumps({"nama": "Kopi Susu", "harga": 18000}).encode()
LIMIT = 64 * 1024  # the default TOKO_MAX_BODY_BYTES
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    workdir = tmp_path_factory.mktemp("expect")
    token_file = Path(workdir, "api-token")
    token_file.write_text(TOKEN)
    with ready_service(workdir, {"TOKO_API_TOKEN_FILE": str(token_file)}) as svc:
        yield svc


def _head(headers: dict[str, str], length: int) -> bytes:
    # No "Connection: close": the server is to close after a refusal by itself.
    lines = ["POST /produk HTTP/1.1", "Host: 127.0.0.1", "Expect: 100-continue"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


GOOD = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
REFUSED_ON_HEADERS = {
    "no token": ({"Content-Type": "application/json"}, len(PRODUCT), 401),
    "a wrong token": ({**GOOD, "Authorization": "Bearer nope"}, len(PRODUCT), 401),
    "not JSON": ({**GOOD, "Content-Type": "text/plain"}, len(PRODUCT), 415),
    "an unknown coding": ({**GOOD, "Content-Encoding": "br"}, len(PRODUCT), 415),
    "a declared size over the limit": (GOOD, LIMIT + 1, 413),
}


@pytest.mark.parametrize("case", REFUSED_ON_HEADERS)
async def test_a_request_refused_on_its_headers_gets_no_100_continue(
    api: ServiceProcess, case: str
) -> None:
    headers, length, status = REFUSED_ON_HEADERS[case]
    reader, writer = await asyncio.open_connection("127.0.0.1", api.port)
    try:
        writer.write(_head(headers, length))
        # The body is held back, as a client waiting for 100 Continue holds it;
        # the answer comes instead, and the connection closes (read() returns).
        async with asyncio.timeout(5):
            first = await reader.readline()
            assert not first.startswith(b"HTTP/1.1 100"), (case, first)
            answer = parse_response(first + await reader.read())
    finally:
        writer.close()
    assert answer.status == status, (case, answer)
    assert answer.headers["connection"] == "close", (case, answer)
    assert set(answer.json()) == {"error"}, (case, answer)
    assert db.product_count(api.database) == 0


async def test_a_wanted_body_is_asked_for_then_created(api: ServiceProcess) -> None:
    before = db.product_count(api.database)
    reader, writer = await asyncio.open_connection("127.0.0.1", api.port)
    try:
        writer.write(_head({**GOOD, "Connection": "close"}, len(PRODUCT)))
        async with asyncio.timeout(10):
            assert await reader.readexactly(len(CONTINUE)) == CONTINUE
            writer.write(PRODUCT)
            answer = parse_response(await reader.read())
    finally:
        writer.close()
    assert answer.status == 201, answer
    assert answer.json()["nama"] == "Kopi Susu"
    assert db.product_count(api.database) == before + 1
