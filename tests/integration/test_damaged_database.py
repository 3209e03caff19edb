"""A SQLite file damaged on disk (bit rot, a failing disk) under toko-api.

Only the requests that touch a damaged page fail; /healthz used to probe with
a one-page write, which succeeded, and called the store healthy while every
POST failed. It now reports the damage until a restart.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp

from tests.conftest import ServiceFactory
from tests.support import db
from tests.support.api import create_products, healthz
from tests.support.scrape import scrape

STORE_DOWN = {"error": "storage is unavailable; try again shortly"}
DAMAGED = (
    "storage cannot write: the database file is damaged: database disk image is malformed"
    " (see /usr/share/doc/toko/docs/how-to/damaged-database.md)"
)


async def test_a_damaged_database_file_turns_healthz_503_until_a_restart(
    service_factory: ServiceFactory, tmp_path: Path
) -> None:
    database = tmp_path / "toko.db"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        svc = service_factory(database=database).start()
        await svc.async_wait_ready(timeout=20)
        await create_products(session, svc.base_url, [f"Teh {n}" for n in range(5)])
        svc.terminate()
        assert await svc.async_wait_exit(15) == 0
        db.damage_products_table(database)

        svc = service_factory(database=database).start()
        await svc.async_wait_ready(timeout=20)
        assert (await healthz(session, svc.base_url))[0] == 200  # nothing has touched it yet
        async with session.post(f"{svc.base_url}/produk", json={"nama": "x", "harga": 1}) as resp:
            assert (resp.status, await resp.json()) == (503, STORE_DOWN)
        for _ in range(2):  # the health probe's own write succeeds: it still says so
            status, body = await healthz(session, svc.base_url)
            assert (status, body["error"]) == (503, DAMAGED)
        assert (await scrape(session, svc.base_url)).value("toko_store_writable") == 0
        critical = [r for r in svc.logs.snapshot() if r["level"] == "CRITICAL"]
        assert [r["message"] for r in critical] == [
            DAMAGED.removeprefix("storage cannot write: ")
            + "; what needs the damaged part fails with 503 until it is restored"
        ]
        assert critical[0]["DATABASE"] == str(database)
