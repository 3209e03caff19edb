"""What the crash loops share: the POSTs clients make, and the SMTP server's moods.

tests/integration/test_crash_loop.py (SQLite, one toko-api) and
tests/postgres/test_crash_loop.py (two on one database) draw their plans
from these.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import Any

import aiohttp

from tests.support.http import build_request
from tests.support.service import ServiceProcess
from tests.support.smtp import SmtpServer

MAIL_FROM = "toko@toko.test"
# Products whose name holds this are refused for good (550) by the SMTP server.
REFUSED = "TOLAK"


@dataclass(frozen=True)
class Post:
    """One POST a client makes. ``hang_up``: "" (waits for the answer),
    "after" (sends it whole, then closes unread) or "during" (closes
    halfway through the body: must store nothing)."""

    nama: str
    harga: int
    key: str | None = None
    hang_up: str = ""


@dataclass
class Answer:
    post: Post
    status: int | None  # None: no answer (the process died, or we hung up)
    body: Any = None
    replayed: bool = False


def behave(smtp: SmtpServer, action: str, argument: float) -> int:
    """Switch the SMTP server; the connections it dropped."""
    if action == "drop":
        return smtp.drop_connections()
    smtp.reset()
    smtp.refuse_subject(REFUSED)
    if action == "slow":
        smtp.set_delay(argument)
    elif action == "defer":
        smtp.fail_next(1 + int(argument * 5))
    return 0


async def send(session: aiohttp.ClientSession, svc: ServiceProcess, post: Post) -> Answer:
    headers = {"Idempotency-Key": post.key} if post.key else {}
    try:
        async with session.post(
            svc.url("/produk"), json={"nama": post.nama, "harga": post.harga}, headers=headers
        ) as resp:
            body = await resp.json()
            replayed = resp.headers.get("Idempotent-Replayed") == "true"
            return Answer(post, resp.status, body, replayed)
    except (aiohttp.ClientConnectionError, aiohttp.ContentTypeError):
        return Answer(post, None)


async def hang_up(svc: ServiceProcess, post: Post) -> None:
    """Send the request (or half of its body), then close without reading."""
    body = json.dumps({"nama": post.nama, "harga": post.harga}).encode()
    headers = {"Content-Type": "application/json"}
    if post.key:
        headers["Idempotency-Key"] = post.key
    data = build_request("POST", "/produk", headers=headers, body=body)
    if post.hang_up == "during":
        data = data[: len(data) - len(body) // 2]
    with contextlib.suppress(OSError):
        _, writer = await asyncio.open_connection("127.0.0.1", svc.port)
        writer.write(data)
        with contextlib.suppress(OSError):
            await writer.drain()
        writer.transport.abort()
