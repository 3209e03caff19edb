"""Small aiohttp helpers for well-formed calls to a running toko-api."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import aiohttp

NEXT_LINK = re.compile(r'<([^>]+)>\s*;\s*rel="?next"?')


async def create_product(
    session: aiohttp.ClientSession, base_url: str, nama: str, harga: int
) -> dict[str, Any]:
    """POST /produk; asserts the 201 and returns the product."""
    async with session.post(f"{base_url}/produk", json={"nama": nama, "harga": harga}) as resp:
        body = await resp.json()
        assert resp.status == 201, (resp.status, body)
        assert isinstance(body, dict)
        return body


async def create_products(
    session: aiohttp.ClientSession, base_url: str, names: list[str], harga: int = 1000
) -> list[dict[str, Any]]:
    """Create the products concurrently; returns them in ``names`` order."""
    return list(await asyncio.gather(*(create_product(session, base_url, n, harga) for n in names)))


async def healthz(session: aiohttp.ClientSession, base_url: str) -> tuple[int, dict[str, Any]]:
    async with session.get(f"{base_url}/healthz") as resp:
        return resp.status, await resp.json()


async def wait_healthy(
    session: aiohttp.ClientSession,
    base_url: str,
    timeout: float,  # noqa: ASYNC109
    check: Any = None,
) -> dict[str, Any]:
    """Poll /healthz until 200 (and ``check(body)``); healthz has no event to await."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: tuple[int, dict[str, Any]] = (0, {})
    while loop.time() < deadline:
        last = await healthz(session, base_url)
        if last[0] == 200 and (check is None or check(last[1])):
            return last[1]
        await asyncio.sleep(0.05)
    raise AssertionError(f"/healthz not healthy within {timeout}s; last: {last}")


def next_link(link_header: str | None) -> str | None:
    """The target of a ``Link: <...>; rel="next"`` header, if any."""
    if not link_header:
        return None
    match = NEXT_LINK.search(link_header)
    return match.group(1) if match else None
