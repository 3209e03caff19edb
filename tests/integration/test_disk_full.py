"""A full disk: writes are refused with a 503, nothing is half-written, the log
holds a sample of the failures rather than one line each, /healthz says the
store cannot write, and writes resume once there is room again.

The disk is a real tmpfs of a few hundred KiB, mounted for the test (root).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.conftest import ServiceFactory
from tests.support import db
from tests.support.api import healthz
from tests.support.scrape import scrape

pytestmark = pytest.mark.root

THROTTLE_S = 10  # service.logs.Throttle's interval
STATUS_SECONDS = 5  # service.runner's STATUS= cadence
STORE_DOWN = {"error": "storage is unavailable; try again shortly"}


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.fail(
            "mounting a small tmpfs needs root (deselect with -m 'not root')", pytrace=False
        )
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "toko-test", mount], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "--lazy", mount], check=False)


def grow(mount: Path) -> None:
    subprocess.run(["mount", "-o", "remount,size=20m", mount], check=True)


async def post(session: aiohttp.ClientSession, url: str, n: int) -> tuple[int, object]:
    async with session.post(f"{url}/produk", json={"nama": f"Kopi {n}", "harga": n}) as resp:
        return resp.status, await resp.json()


def error_lines(svc_logs: list[dict[str, object]], prefix: str) -> list[dict[str, object]]:
    return [r for r in svc_logs if str(r.get("message", "")).startswith(prefix)]


async def test_a_full_disk_refuses_writes_cleanly_and_recovers(
    service_factory: ServiceFactory, small_disk: Path
) -> None:
    database = small_disk / "toko.db"
    svc = service_factory(database=database).start()
    await svc.async_wait_ready(timeout=20)
    created = 0
    async with aiohttp.ClientSession() as session:
        # Fill the disk: every 201 is a stored product. A 503 alone does not
        # mean it stays full: a checkpoint round copies the log into pages the
        # database file already has, the log starts over, and writes fit again.
        # It stays full once the database file itself has no room to grow: the
        # round then fails, and the log can never start over.
        first_refusal: float | None = None
        for n in range(5000):
            status, body = await post(session, svc.base_url, n)
            if status == 201:
                created += 1
                continue
            assert (status, body) == (503, STORE_DOWN)
            first_refusal = first_refusal or time.monotonic()
            if error_lines(svc.logs.snapshot(), "checkpoint failed: database or disk is full"):
                break
        else:
            pytest.fail("400 KiB never filled up")
        assert created > 0
        assert first_refusal is not None

        # A burst of writes while it stays full: each one refused alike.
        answers = await asyncio.gather(*(post(session, svc.base_url, n) for n in range(300)))
        elapsed = time.monotonic() - first_refusal
        # Counted, not listed: a list's diff of 300 answers takes minutes.
        assert Counter(repr(a) for a in answers) == {repr((503, STORE_DOWN)): 300}
        async with session.get(f"{svc.base_url}/produk/1") as resp:
            assert resp.status == 200, "reads go on while writes cannot"

        # One line per interval, not 301: enough to see it, not a flood that
        # makes journald drop lines of its own choosing.
        logs = svc.logs.snapshot()
        allowed = 1 + int(elapsed // THROTTLE_S) + 1
        assert 1 <= len(error_lines(logs, "storage failure")) <= allowed
        assert 1 <= len(error_lines(logs, "SQLite commit failed")) <= allowed

        # Monitoring sees it: the store answers reads but cannot write.
        status, health = await healthz(session, svc.base_url)
        assert status == 503
        assert health["error"].startswith("storage cannot write: database or disk is full"), health
        assert {"pending", "running", "failed"} <= set(health["queue"]), "reads still answer"
        assert (await scrape(session, svc.base_url)).value("toko_store_writable") == 0
        # And `systemctl status` does: the 5 s STATUS= line says so.
        assert svc.notify is not None
        await svc.notify.log.async_wait_for(
            lambda notes: next((n for n in notes if "cannot write" in str(n.get("STATUS"))), None),
            3 * STATUS_SECONDS,
            "STATUS=...; cannot write: ...",
        )

        grow(small_disk)
        # Nobody writes in between (a balancer would have taken toko out):
        # /healthz's own probe finds that writes work again.
        status, health = await healthz(session, svc.base_url)
        assert (status, health["status"]) == (200, "ok"), health
        assert (await scrape(session, svc.base_url)).value("toko_store_writable") == 1
        status, body = await post(session, svc.base_url, 9999)
        assert status == 201, body
        created += 1

    svc.terminate()
    assert await svc.async_wait_exit(timeout=30) == 0
    assert db.query(database, "PRAGMA integrity_check") == [{"integrity_check": "ok"}]
    # Every stored product has exactly its one email job, and nothing else was
    # stored: no product without its job, no job without its product.
    assert db.product_count(database) == created
    orphans = db.query(
        database,
        "SELECT p.id FROM products p WHERE (SELECT count(*) FROM jobs j"
        " WHERE j.kind = 'product_email'"
        " AND json_extract(j.payload, '$.product_id') = p.id) != 1",
    )
    assert orphans == []
    assert len(db.jobs(database)) == created
