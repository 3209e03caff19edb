"""A backup taken while toko-api writes hard is a consistent, complete copy.

The real toko-api takes concurrent POSTs while the real toko-backup runs, one
run after another. Each backup passes PRAGMA integrity_check, holds every
product with its email job (one transaction made both), and every product
whose 201 came before the run started, though many of those are still only in
the WAL: SQLite's online backup reads one snapshot, taken after those commits.
(A copy of the database file alone missed them. A third connection
checkpointing all the while hid that, and is left out.)
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from contextlib import closing
from pathlib import Path

import aiohttp

from tests.conftest import ServiceFactory
from tests.operability.cli import run
from tests.support.api import create_product

RUNS = 4
CLIENTS = 8


def contents(backup: Path) -> tuple[list[tuple[str]], set[int], set[int]]:
    with closing(sqlite3.connect(f"file:{backup}?mode=ro", uri=True)) as conn:
        check = conn.execute("PRAGMA integrity_check").fetchall()
        products = {pid for (pid,) in conn.execute("SELECT id FROM products")}
        payloads = conn.execute("SELECT payload FROM jobs WHERE kind = 'product_email'")
        emailed = {json.loads(payload)["product_id"] for (payload,) in payloads}
    return check, products, emailed


async def test_backups_under_write_load_hold_every_product_committed_before_them(
    service_factory: ServiceFactory, tmp_path: Path
) -> None:
    svc = service_factory().start()
    await svc.async_wait_ready(timeout=20)
    tools = {
        "TOKO_DATABASE": str(svc.database),
        "TOKO_BACKUP_DIR": str(tmp_path / "backups"),
        "TOKO_BACKUP_KEEP": str(RUNS),
    }
    created: list[int] = []
    grew = asyncio.Condition()
    stop_writing = asyncio.Event()

    async def client(session: aiohttp.ClientSession, n: int) -> None:
        while not stop_writing.is_set():
            product = await create_product(session, svc.base_url, f"Muat {n}", n)
            async with grew:
                created.append(product["id"])
                grew.notify_all()

    async def more_than(count: int) -> None:
        async with asyncio.timeout(30), grew:
            await grew.wait_for(lambda: len(created) > count)

    runs: list[tuple[set[int], Path]] = []
    async with aiohttp.ClientSession() as session:
        clients = [asyncio.create_task(client(session, n)) for n in range(CLIENTS)]
        try:
            for _ in range(RUNS):
                await more_than(len(created) + 100)  # writes between runs too
                before = set(created)
                done = await run("toko-backup", env=tools, timeout=60)
                assert done.returncode == 0, done.stderr
                runs.append((before, Path(done.stdout.splitlines()[-1])))
                await more_than(len(created) + 100)
        finally:
            stop_writing.set()
            await asyncio.gather(*clients)

    for before, backup in runs:
        check, products, emailed = await asyncio.to_thread(contents, backup)
        assert check == [("ok",)], backup
        assert before <= products, f"{len(before - products)} committed products missing"
        assert products == emailed  # each product with its job, nothing half-made
        assert len(products) < len(created), "not taken while writing"
