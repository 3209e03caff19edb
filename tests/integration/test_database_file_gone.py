"""The SQLite file deleted or replaced under a running toko-api.

An open connection would go on writing to the file it opened, so every 201
after an ``rm`` (or a ``mv`` over the file) would be a product the next start
cannot see. toko-api notices after the next commit (the claimer commits every
second even when idle), refuses every write from then on, says so on
/healthz, and saves what it still has open so nothing acknowledged is lost.
The same for its write-ahead log (``rm toko.db-*``), which holds every commit
since the last checkpoint: that goes into the database file, still there.
"""

from __future__ import annotations

import re
import shutil
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import ServiceFactory
from tests.operability.cli import run
from tests.support import db
from tests.support.api import create_product, healthz
from tests.support.scrape import scrape
from tests.support.service import ServiceProcess

STORE_DOWN = {"error": "storage is unavailable; try again shortly"}
GONE = "was deleted or replaced while toko-api ran; restart toko-api"


async def started(service_factory: ServiceFactory, database: Path) -> ServiceProcess:
    svc = service_factory(database=database).start()
    await svc.async_wait_ready(timeout=20)
    return svc


async def gone_line(svc: ServiceProcess, start: str = "database file ") -> dict[str, Any]:
    """The one CRITICAL line that says the file is gone (within the claimer's 1 s sweep)."""
    record: dict[str, Any] = await svc.logs.async_wait_for(
        lambda records: next(
            (r for r in records if str(r.get("message", "")).startswith(start)), None
        ),
        10,
        f"{start}... while running",
    )
    assert record["level"] == "CRITICAL", record
    return record


async def assert_refusing(session: aiohttp.ClientSession, svc: ServiceProcess) -> None:
    async with session.post(f"{svc.base_url}/produk", json={"nama": "x", "harga": 1}) as resp:
        assert (resp.status, await resp.json()) == (503, STORE_DOWN)
    status, health = await healthz(session, svc.base_url)
    assert status == 503
    assert GONE in health["error"], health
    assert (await scrape(session, svc.base_url)).value("toko_store_writable") == 0


def remove_database(folder: Path) -> None:
    """rm toko.db toko.db-shm toko.db-wal, in that order (the instance lock stays).

    The order a shell's ``rm toko.db*`` takes. In another (``rm toko.db-wal
    toko.db``) a commit between the two unlinks finds the log gone first; that
    moment is tested in tests/unit/test_file_guard.py.
    """
    for path in sorted(folder.glob("toko.db*")):
        if not path.name.endswith(".lock"):
            path.unlink()


def remove_log(database: Path) -> None:
    """rm toko.db-wal toko.db-shm: SQLite's write-ahead log and its index."""
    for suffix in ("-wal", "-shm"):
        Path(f"{database}{suffix}").unlink()


def assert_whole(database: Path, products: list[dict[str, Any]]) -> None:
    """Every acknowledged product, each with its one email job, in a sound file."""
    assert db.query(database, "PRAGMA integrity_check") == [{"integrity_check": "ok"}]
    stored = {row["id"] for row in db.query(database, "SELECT id FROM products")}
    assert {p["id"] for p in products} <= stored
    per_product = db.query(
        database,
        "SELECT json_extract(payload, '$.product_id') AS pid, count(*) AS n FROM jobs"
        " WHERE kind = 'product_email' GROUP BY pid",
    )
    assert {row["pid"]: row["n"] for row in per_product} == dict.fromkeys(stored, 1)


async def test_a_deleted_database_is_saved_and_writes_are_refused(
    service_factory: ServiceFactory, tmp_path: Path
) -> None:
    database = tmp_path / "toko.db"
    svc = await started(service_factory, database)
    async with aiohttp.ClientSession() as session:
        made = [await create_product(session, svc.base_url, f"Kopi {n}", n) for n in range(3)]
        remove_database(tmp_path)

        line = await gone_line(svc)
        assert line["DATABASE"] == str(database)
        rescued = Path(line["RESCUED"])
        assert rescued.parent == tmp_path and rescued.name.startswith("toko.db.rescued-")
        assert not database.exists(), "nothing was written at the path"
        await assert_refusing(session, svc)
        async with session.get(f"{svc.base_url}/produk/1") as resp:
            assert resp.status == 200, "reads go on"
        assert not database.exists(), "nor did the reads create one"

    svc.terminate()
    assert await svc.async_wait_exit(timeout=30) == 0
    assert_whole(rescued, made)
    assert oct(rescued.stat().st_mode & 0o777) == oct(0o600), "it holds all the shop's data"  # noqa: ASYNC240

    # Put it back and start again: everything acknowledged is there.
    rescued.rename(database)  # noqa: ASYNC240
    again = await started(service_factory, database)
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{again.base_url}/produk") as resp:
            listed = await resp.json()
        assert [p["id"] for p in listed][: len(made)] == [p["id"] for p in made]
        await create_product(session, again.base_url, "Teh", 5)


async def test_a_database_replaced_by_another_file_is_not_written_to(
    service_factory: ServiceFactory, tmp_path: Path
) -> None:
    database = tmp_path / "toko.db"
    svc = await started(service_factory, database)
    async with aiohttp.ClientSession() as session:
        first = await create_product(session, svc.base_url, "Kopi", 1)
        # An admin restores an older copy with `mv` while toko-api still runs.
        copy = tmp_path / "restored.db"
        with closing(sqlite3.connect(database)) as src, closing(sqlite3.connect(copy)) as dst:
            src.backup(dst)
        made_after = await create_product(session, svc.base_url, "Teh", 2)
        copy.replace(database)

        line = await gone_line(svc)
        assert line["message"].startswith("database file replaced while running"), line
        await assert_refusing(session, svc)

    svc.terminate()
    assert await svc.async_wait_exit(timeout=30) == 0
    # The restored file is untouched; the rescued copy has what came after it.
    assert [r["id"] for r in db.query(database, "SELECT id FROM products")] == [first["id"]]
    assert_whole(Path(line["RESCUED"]), [first, made_after])

    again = await started(service_factory, database)
    async with aiohttp.ClientSession() as session:
        assert (await create_product(session, again.base_url, "Susu", 3))["id"] == 2


async def test_a_deleted_folder_leaves_a_copy_to_take_from_proc(
    service_factory: ServiceFactory, tmp_path: Path
) -> None:
    folder = tmp_path / "var"
    svc = await started(service_factory, folder / "toko.db")
    async with aiohttp.ClientSession() as session:
        made = [await create_product(session, svc.base_url, f"Kopi {n}", n) for n in range(3)]
        # rm -rf var/, with its end made one step: rmtree's unlinks, one by one,
        # may let a commit find the log gone before the database.
        folder.rename(tmp_path / "trash")
        shutil.rmtree(tmp_path / "trash")

        line = await gone_line(svc)
        assert "RESCUED" not in line
        match = re.search(r"they are in (/proc/\d+/fd/\d+) until toko-api stops", line["message"])
        assert match, line["message"]
        # What the line tells the admin to do, before stopping toko-api.
        saved = tmp_path / "saved.db"
        shutil.copyfile(match.group(1), saved)
        await assert_refusing(session, svc)

    svc.terminate()
    assert await svc.async_wait_exit(timeout=30) == 0
    assert_whole(saved, made)


@pytest.mark.parametrize("linked", [False, True], ids=["file", "symbolic-link"])
async def test_a_deleted_write_ahead_log_is_folded_into_the_database(
    service_factory: ServiceFactory, tmp_path: Path, linked: bool
) -> None:
    database = tmp_path / "toko.db"
    # Through a symbolic link, SQLite keeps its log beside the file linked to.
    real = tmp_path / "data" / "shop.db" if linked else database
    if linked:
        real.parent.mkdir()
        database.symlink_to(real)
    wal = Path(f"{real}-wal")
    env = {"TOKO_DATABASE": str(database)}
    svc = await started(service_factory, database)
    async with aiohttp.ClientSession() as session:
        made = [await create_product(session, svc.base_url, f"Kopi {n}", n) for n in range(3)]
        # What does not replace the log: another process that checkpoints,
        # truncates and closes it, and toko's commands opening and closing it.
        with closing(sqlite3.connect(database)) as other:
            other.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        assert (await run("toko-queue", "stats", env=env)).returncode == 0
        made.append(await create_product(session, svc.base_url, "Teh", 4))

        # Every commit since the last checkpoint is only in the log toko-api has open.
        remove_log(real)

        line = await gone_line(svc, "database write-ahead log ")
        assert line["message"].startswith("database write-ahead log deleted while running")
        assert (line["DATABASE"], line["WAL"]) == (str(database), str(wal))
    # It stops for systemd to restart it with a new log (Restart=on-failure).
    assert await svc.async_wait_exit(timeout=30) == 1
    assert_whole(database, made)
    assert not list(real.parent.glob("*.rescued-*")), "the database file itself is whole"

    again = await started(service_factory, database)
    async with aiohttp.ClientSession() as session:
        await create_product(session, again.base_url, "Susu", 5)
