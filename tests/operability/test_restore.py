"""After a restore from backup, new emails are new to the admin's mailbox.

A restore brings back a database from before some jobs existed, so their ids
are handed out again. A mailbox that has seen a Message-ID before may drop or
merge a second message with it, without any error: an email's Message-ID must
stay the same across the retries of its job, and differ for a job that merely
has the same id. The runs here are the real toko-api, toko-backup and SMTP
server, restored the way the README says (toko-api stopped first).

A file toko-api could not start on (a newer toko's backup, another program's
database) is refused before anything is replaced, with one line that says why.
A restore that runs out of disk (a real small tmpfs, root) leaves the database
as it was and no partial copy beside it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import closing
from pathlib import Path

import aiohttp
import pytest

from service.store.sqlite.migrations import LATEST_VERSION
from tests.conftest import ServiceFactory
from tests.operability.cli import mount_tmpfs, run
from tests.support.api import create_products
from tests.support.old_schema import make_sqlite_at
from tests.support.service import ServiceProcess
from tests.support.smtp import SmtpMessage, SmtpServer


async def _delivered(smtp: SmtpServer, count: int) -> list[SmtpMessage]:
    """The first ``count`` emails delivered, in order; Message-IDs alike or not."""

    def enough(items: Sequence[SmtpMessage]) -> list[SmtpMessage] | None:
        delivered = [m for m in items if m.outcome == "delivered"]
        return delivered[:count] if len(delivered) >= count else None

    return await smtp.log.async_wait_for(enough, timeout=20, what=f"{count} delivered emails")


async def _add_product(svc: ServiceProcess, nama: str) -> None:
    async with aiohttp.ClientSession() as session:
        await create_products(session, svc.base_url, [nama])


async def test_a_job_id_handed_out_again_after_a_restore_gets_a_message_id_of_its_own(
    service_factory: ServiceFactory, smtp: SmtpServer, tmp_path: Path
) -> None:
    env = {"TOKO_SMTP_URL": smtp.url, "TOKO_MAIL_FROM": "kasir@toko.test"}
    tools = {"TOKO_DATABASE": str(tmp_path / "toko.db"), "TOKO_BACKUP_DIR": str(tmp_path / "b")}
    svc = service_factory(env).start()
    await svc.async_wait_ready(timeout=20)
    await _add_product(svc, "Kopi")
    await _delivered(smtp, 1)
    backed_up = await run("toko-backup", env=tools)  # before the next job exists
    assert backed_up.returncode == 0, backed_up.stderr
    await _add_product(svc, "Teh")
    await _delivered(smtp, 2)
    svc.terminate()
    assert await svc.async_wait_exit(timeout=20) == 0

    (backup,) = (tmp_path / "b").glob("toko-*.db")
    restored = await run("toko-backup", "--restore", str(backup), env=tools)
    assert restored.returncode == 0, restored.stderr
    svc = service_factory(env).start()
    await svc.async_wait_ready(timeout=20)
    await _add_product(svc, "Susu")

    _, teh, susu = await _delivered(smtp, 3)
    assert "Teh" in teh.subject and "Susu" in susu.subject
    # The restore gave Teh's job id to Susu's job; not its Message-ID.
    assert teh.headers["X-Toko-Job-Id"] == susu.headers["X-Toko-Job-Id"]
    assert teh.message_id != susu.message_id
    assert smtp.duplicates() == {}


async def test_a_file_toko_api_could_not_start_on_is_refused_before_anything_is_replaced(
    tmp_path: Path,
) -> None:
    db = tmp_path / "toko.db"
    row = "INSERT INTO products (id, nama, harga, created_at) VALUES (1, 'Kopi', 1, 0)"
    make_sqlite_at(str(db), LATEST_VERSION, row)
    tools = {"TOKO_DATABASE": str(db), "TOKO_BACKUP_DIR": str(tmp_path / "b")}
    backed_up = await run("toko-backup", env=tools)
    assert backed_up.returncode == 0, backed_up.stderr
    (newer,) = (tmp_path / "b").glob("toko-*.db")
    with closing(sqlite3.connect(newer)) as conn:
        conn.execute(f"PRAGMA user_version = {LATEST_VERSION + 1}")  # as a newer toko leaves it
    other = tmp_path / "notes.db"
    with closing(sqlite3.connect(other)) as conn, conn:
        conn.execute("CREATE TABLE notes (body TEXT)")
    before = db.read_bytes()

    newer_refused = await run("toko-backup", "--restore", str(newer), env=tools)
    other_refused = await run("toko-backup", "--restore", str(other), env=tools)

    assert (newer_refused.returncode, other_refused.returncode) == (1, 1)
    assert newer_refused.stderr == (
        f"toko-backup: {newer} was made by a newer toko (schema version {LATEST_VERSION + 1}; "
        f"this toko knows up to {LATEST_VERSION}): upgrade toko first\n"
    )
    assert other_refused.stderr == (
        f"toko-backup: {other} is not a toko database (no products or jobs table)\n"
    )
    assert db.read_bytes() == before
    kept = await asyncio.to_thread(lambda: list(tmp_path.glob("toko.db.before-restore-*")))
    assert kept == []  # refused before the current database was even copied


@pytest.fixture
def small_disk(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    yield from mount_tmpfs(tmp_path / "disk", f"size={request.param}")


@pytest.mark.root
# The database is about 600 KiB: the copy kept of it fails halfway, or it
# fits and the copy of the backup fails.
@pytest.mark.parametrize("small_disk", ["1m", "1600k"], indirect=True)
async def test_a_restore_that_runs_out_of_disk_leaves_the_database_and_nothing_else(
    tmp_path: Path, small_disk: Path
) -> None:
    made = tmp_path / "made.db"  # made elsewhere: its WAL would not fit beside it
    make_sqlite_at(str(made), LATEST_VERSION, "CREATE TABLE pad (b BLOB)")
    with closing(sqlite3.connect(made)) as conn:
        conn.executemany("INSERT INTO pad VALUES (zeroblob(4000))", [()] * 150)
        conn.commit()
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # all of it in the one file
    db = small_disk / "toko.db"
    shutil.copyfile(made, db)
    tools = {"TOKO_DATABASE": str(db), "TOKO_BACKUP_DIR": str(tmp_path / "b")}
    backed_up = await run("toko-backup", env=tools)
    assert backed_up.returncode == 0, backed_up.stderr
    (backup,) = (tmp_path / "b").glob("toko-*.db")
    before = db.read_bytes()

    restored = await run("toko-backup", "--restore", str(backup), env=tools)

    assert restored.returncode == 1
    (line,) = restored.stderr.splitlines()
    assert "No space left on device" in line
    assert db.read_bytes() == before
    # No half copy named as the kept database, no temporary copy.
    left = await asyncio.to_thread(os.listdir, small_disk)
    assert sorted(name for name in left if not name.endswith(("-wal", "-shm"))) == [
        "toko.db",
        "toko.db.lock",
    ]
