from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import stat
import threading
from collections.abc import Callable
from datetime import date, datetime, timedelta
from pathlib import Path

import pytest

from jobs import recap
from jobs import sqlite_backup as backup
from jobs.common import JobFailed
from service.models import Product
from service.settings import Settings, StoreSettings
from service.store.lock import InstanceLock, is_locked
from service.store.sqlite import SqliteStore
from service.store.sqlite.migrations import LATEST_VERSION
from service.tasks import product_email_job
from tests.support import db as db_files
from tests.support.backends import FakeClock
from tests.support.old_schema import make_sqlite_at


async def seed(path: str, count: int) -> None:
    store = SqliteStore(path)
    await store.open()
    try:
        await asyncio.gather(*(store.create_product(f"p{i}", i, _job) for i in range(count)))
    finally:
        await store.close()


def _job(product: Product) -> object:
    return product_email_job(product, 3)


def count(path: Path | str, table: str) -> int:
    conn = sqlite3.connect(path)
    try:
        return int(conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0])
    finally:
        conn.close()


async def test_recap_counts_the_period_and_runs_once(tmp_path: Path) -> None:
    db = str(tmp_path / "toko.db")
    await seed(db, 3)
    settings = Settings(store=StoreSettings(database=db))
    today = date.today()
    tomorrow = today + timedelta(days=1)
    assert (await recap.record(settings, today, tomorrow))[today] is not None
    assert await recap.record(settings, today, tomorrow) == {today: None}
    conn = sqlite3.connect(db)
    assert conn.execute("SELECT products_total, products_new FROM recaps").fetchall() == [(3, 3)]
    assert conn.execute("SELECT count(*) FROM jobs WHERE kind='recap_email'").fetchone() == (1,)
    conn.close()


async def test_late_runs_recap_every_day_they_missed(tmp_path: Path, clock: FakeClock) -> None:
    # Products on 11-26, 11-27 and 11-28 (noon, host time zone); the timer's
    # runs at 11-27 00:14, then (host off, Persistent=true catching up once)
    # 11-29 09:02, then 11-30 00:12. Each run's date is all that matters.
    db = str(tmp_path / "toko.db")
    store = SqliteStore(db, clock=clock)
    await store.open()
    try:
        for day in (26, 27, 28):
            clock.now = datetime(2026, 11, day, 12).astimezone().timestamp()
            await store.create_product(f"p{day}", day, _job)
    finally:
        await store.close()
    settings = Settings(store=StoreSettings(database=db))
    runs = {}
    for today in (date(2026, 11, 27), date(2026, 11, 29), date(2026, 11, 30)):
        runs[today.day] = [day.day for day in await recap.record(settings, None, today)]
    assert runs == {27: [26], 29: [27, 28], 30: [29]}
    conn = sqlite3.connect(db)
    rows = conn.execute("SELECT period, products_total, products_new FROM recaps ORDER BY 1")
    assert rows.fetchall() == [
        ("2026-11-26", 1, 1),
        ("2026-11-27", 2, 1),
        ("2026-11-28", 3, 1),
        ("2026-11-29", 3, 0),
    ]
    assert conn.execute("SELECT count(*) FROM jobs WHERE kind='recap_email'").fetchone() == (4,)
    conn.close()


def test_days_to_recap_start_after_the_last_recorded_day_within_the_cap() -> None:
    today = date(2026, 11, 30)
    days = recap.days_to_recap
    assert days(None, today) == [date(2026, 11, 29)]  # the first run ever: yesterday only
    assert days(date(2026, 11, 29), today) == [date(2026, 11, 29)]  # "already recorded"
    assert days(date(2026, 11, 27), today) == [date(2026, 11, 28), date(2026, 11, 29)]
    week = [date(2026, 11, 23) + timedelta(days=n) for n in range(recap.CATCH_UP_DAYS)]
    assert days(date(2026, 10, 1), today) == week
    assert days(date(2026, 12, 5), today) == [date(2026, 11, 29)]  # a clock that ran ahead


async def test_a_run_too_late_to_catch_up_says_which_days_it_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = str(tmp_path / "toko.db")
    await seed(db, 0)
    settings = Settings(store=StoreSettings(database=db))
    await recap.record(settings, date(2026, 10, 1), date(2026, 10, 2))
    recorded = await recap.record(settings, None, date(2026, 11, 30))
    assert list(recorded) == [date(2026, 11, 23) + timedelta(days=n) for n in range(7)]
    (warning,) = [r for r in caplog.records if r.levelname == "WARNING"]
    assert "no recap for 2026-10-02 to 2026-11-22" in warning.getMessage()


def test_period_bounds_cover_one_local_day() -> None:
    start, end = recap.period_bounds(date(2026, 11, 28))
    assert 23 * 3600 <= end - start <= 25 * 3600  # DST days are 23 or 25 hours


async def test_backup_while_writing_is_consistent_private_and_pruned(tmp_path: Path) -> None:
    db = str(tmp_path / "toko.db")
    await seed(db, 50)
    folder = tmp_path / "backups"
    stop = threading.Event()

    def writer() -> None:  # another process-like writer keeps committing meanwhile
        conn = sqlite3.connect(db, timeout=10)
        while not stop.is_set():
            conn.execute("INSERT INTO products (nama, harga, created_at) VALUES ('w', 1, 0)")
            conn.commit()
        conn.close()

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        made = []
        for second in range(3):
            path = backup.make_backup(db, folder, keep=2)
            # Names carry the second; make them distinct without sleeping.
            renamed = path.with_name(f"toko-2026010{second}T000000Z.db")
            path.rename(renamed)
            made.append(renamed)
    finally:
        stop.set()
        thread.join()
    backup.prune(folder, keep=2)
    kept = backup.list_backups(folder)
    assert kept == made[1:]
    for path in kept:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        backup.check_integrity(path)
        assert count(path, "products") >= 50
    assert not list(folder.glob(".*partial"))


async def test_a_database_emptied_or_not_tokos_is_not_backed_up_over_the_good_ones(
    tmp_path: Path,
) -> None:
    db = tmp_path / "toko.db"
    await seed(str(db), 2)
    folder = tmp_path / "backups"
    good = backup.make_backup(str(db), folder, keep=1)
    db.write_bytes(b"")  # emptied: still a SQLite database, and an intact one
    with pytest.raises(JobFailed, match=f"{db} is not a toko database"):
        backup.make_backup(str(db), folder, keep=1)
    db.unlink()
    with sqlite3.connect(db) as conn:  # another program's
        conn.execute("CREATE TABLE notes (body TEXT)")
    conn.close()
    with pytest.raises(JobFailed, match=f"{db} is not a toko database"):
        backup.make_backup(str(db), folder, keep=1)
    assert backup.list_backups(folder) == [good]  # the last good one, still there
    assert not list(folder.glob(".*partial*"))


def test_backup_without_a_database_fails_clearly(tmp_path: Path) -> None:
    with pytest.raises(JobFailed, match="no database"):
        backup.make_backup(str(tmp_path / "none.db"), tmp_path / "b", keep=1)


async def test_restore_refuses_while_the_api_holds_the_lock(tmp_path: Path) -> None:
    db = str(tmp_path / "toko.db")
    await seed(db, 2)
    saved = backup.make_backup(db, tmp_path / "b", keep=3)
    lock = InstanceLock(db)
    lock.acquire()
    try:
        assert is_locked(db)
        with pytest.raises(JobFailed, match="toko-api is running") as refused:
            backup.restore(db, saved)
        # The socket as well: left listening, it starts toko-api again at the
        # next connection, and the admin's next try is refused the same way.
        assert "(systemctl stop toko-api.socket toko-api)" in str(refused.value)
    finally:
        lock.release()
    await seed(db, 5)
    assert count(db, "products") == 7
    kept = backup.restore(db, saved)
    assert count(db, "products") == 2
    assert kept is not None and count(kept, "products") == 7


def test_restore_rejects_a_corrupt_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"not a database at all" * 100)
    with pytest.raises(JobFailed, match="not a usable SQLite database"):
        backup.restore(str(tmp_path / "toko.db"), bad)


def set_user_version(path: Path, version: int) -> None:
    conn = sqlite3.connect(path)
    try:
        conn.execute(f"PRAGMA user_version = {int(version)}")
        conn.commit()
    finally:
        conn.close()


def assert_untouched(db: Path, before: bytes) -> None:
    """A refused restore left the database as it was, and kept no copy of it."""
    assert db.read_bytes() == before
    assert sorted(path.name for path in db.parent.glob(f"*{db.name}*")) == [db.name]


async def test_restore_takes_an_older_tokos_backup_but_refuses_a_newer_ones(
    tmp_path: Path,
) -> None:
    db = tmp_path / "toko.db"
    await seed(str(db), 2)
    newer = backup.make_backup(str(db), tmp_path / "b", keep=3)
    set_user_version(newer, LATEST_VERSION + 6)
    before = db.read_bytes()
    with pytest.raises(JobFailed) as refused:
        backup.restore(str(db), newer)
    assert str(refused.value) == (
        f"{newer} was made by a newer toko (schema version {LATEST_VERSION + 6}; "
        f"this toko knows up to {LATEST_VERSION}): upgrade toko first"
    )
    assert_untouched(db, before)

    # An older toko's backup is restored as it is; the next open upgrades it.
    older = tmp_path / "older.db"
    make_sqlite_at(
        str(older), 1, "INSERT INTO products (nama, harga, created_at) VALUES ('Lama', 1, 0)"
    )
    assert backup.restore(str(db), older) is not None
    store = SqliteStore(str(db))
    await store.open()
    try:
        assert [p.nama for p in await store.list_products(0, 10)] == ["Lama"]
    finally:
        await store.close()


def _other_programs_database(path: Path) -> None:
    conn = sqlite3.connect(path)
    try:
        conn.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT)")
        conn.execute("INSERT INTO notes (body) VALUES ('not a shop')")
        conn.execute("PRAGMA user_version = 7")  # other programs number their schemas too
        conn.commit()
    finally:
        conn.close()


def _products_without_a_version(path: Path) -> None:
    make_sqlite_at(str(path), LATEST_VERSION)
    set_user_version(path, 0)  # toko-api would create its tables again, and fail to start


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (_other_programs_database, "no products or jobs table"),
        (lambda path: path.write_bytes(b""), "no products or jobs table"),  # an empty SQLite file
        (_products_without_a_version, "no toko schema version"),
    ],
    ids=["another-programs", "empty", "no-version"],
)
async def test_restore_refuses_a_file_that_is_not_a_toko_database(
    tmp_path: Path, make: Callable[[Path], None], why: str
) -> None:
    db = tmp_path / "toko.db"
    await seed(str(db), 2)
    source = tmp_path / "other.db"
    make(source)
    backup.check_integrity(source)  # a sound SQLite file: only what it holds is wrong
    before = db.read_bytes()
    with pytest.raises(JobFailed) as refused:
        backup.restore(str(db), source)
    assert str(refused.value) == f"{source} is not a toko database ({why})"
    assert_untouched(db, before)
    assert count(db, "products") == 2


async def test_backups_in_the_same_second_do_not_replace_each_other(tmp_path: Path) -> None:
    db = str(tmp_path / "toko.db")
    await seed(db, 1)
    folder = tmp_path / "backups"
    made = [backup.make_backup(db, folder, keep=5) for _ in range(3)]
    assert len(set(made)) == 3
    assert backup.list_backups(folder) == made  # later backups sort later


def _backups_of_three_nights(db: str, folder: Path) -> list[Path]:
    """Backups named as those of 2026-11-01 to 03 at 02:30, oldest first."""
    good = []
    for day in (1, 2, 3):
        path = backup.make_backup(db, folder, keep=3)
        good.append(path.rename(path.with_name(f"toko-2026110{day}T023000Z.db")))
    return good


async def test_prune_keeps_the_backup_just_written_when_the_clock_is_behind(
    tmp_path: Path,
) -> None:
    db = str(tmp_path / "toko.db")
    await seed(db, 2)
    folder = tmp_path / "backups"
    good = _backups_of_three_nights(db, folder)
    # A board without a battery-backed clock, before NTP: it is 2000-01-01.
    made = backup.make_backup(db, folder, keep=3, clock=lambda: 946684800.0)
    assert made.name == "toko-20000101T000000Z.db"
    # The new backup sorts oldest by name, yet it is the one with the latest data.
    assert backup.list_backups(folder) == [made, *good[1:]]
    backup.check_integrity(made)


async def test_rotation_leaves_an_admins_copies_alone_and_keeps_its_count_of_backups(
    tmp_path: Path,
) -> None:
    db = str(tmp_path / "toko.db")
    await seed(db, 2)
    folder = tmp_path / "backups"
    good = _backups_of_three_nights(db, folder)
    # Copies an admin made by hand, named like backups but not by toko-backup.
    mine = [folder / "toko-before-upgrade.db", folder / "toko-20261101T023000Z (copy).db"]
    for path in mine:
        path.write_bytes(good[0].read_bytes())
    made = backup.make_backup(db, folder, keep=3)
    assert backup.list_backups(folder) == [*good[1:], made]
    assert all(path.exists() for path in mine)
    backup.make_backup(db, folder, keep=1)
    assert all(path.exists() for path in mine)


async def test_restores_in_the_same_second_each_keep_the_database_they_replaced(
    tmp_path: Path,
) -> None:
    db = str(tmp_path / "toko.db")
    await seed(db, 1)
    saved = backup.make_backup(db, tmp_path / "b", keep=3)
    await seed(db, 2)  # the newest data, in the database alone
    second = lambda: 1796089751.0  # noqa: E731  # both restores within it
    first_kept = backup.restore(db, saved, clock=second)
    again_kept = backup.restore(db, saved, clock=second)
    assert first_kept is not None and again_kept is not None
    assert first_kept != again_kept
    assert count(first_kept, "products") == 3  # not copied over by the second
    assert count(again_kept, "products") == 1


async def test_a_restore_names_the_replaced_database_only_if_there_was_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = str(tmp_path / "toko.db")
    await seed(db, 1)
    saved = backup.make_backup(db, tmp_path / "b", keep=3)
    caplog.set_level(logging.INFO)
    kept = backup.restore(db, saved)
    fresh = str(tmp_path / "fresh.db")
    assert backup.restore(fresh, saved) is None  # nothing was there to keep
    first, second = [r for r in caplog.records if r.getMessage() == "backup restored"]
    assert first.__dict__["PREVIOUS"] == str(kept)
    # Not the string "None", as if a file by that name had been kept.
    assert "PREVIOUS" not in second.__dict__


async def test_a_restore_through_a_symbolic_link_replaces_the_file_it_points_to(
    tmp_path: Path,
) -> None:
    # The database on a disk of its own, named by a link where toko expects it.
    (tmp_path / "disk").mkdir()
    real = tmp_path / "disk" / "toko.db"
    link = tmp_path / "toko.db"
    link.symlink_to(real)
    await seed(str(link), 1)
    saved = backup.make_backup(str(link), tmp_path / "b", keep=3)
    await seed(str(link), 2)
    kept = backup.restore(str(link), saved)
    assert link.is_symlink() and link.resolve() == real
    assert count(real, "products") == 1
    assert kept is not None and kept.parent == real.parent
    assert count(kept, "products") == 3
    assert sorted(os.listdir(tmp_path)) == ["b", "disk", "toko.db"]


async def test_a_damaged_database_fails_the_backup_naming_it_and_keeps_the_good_ones(
    tmp_path: Path,
) -> None:
    db = str(tmp_path / "toko.db")
    folder = tmp_path / "b"
    await seed(db, 3)
    good = backup.make_backup(db, folder, keep=1)
    db_files.damage_products_table(db)
    with pytest.raises(JobFailed) as failed:
        backup.make_backup(db, folder, keep=1)
    # "it failed the integrity check: <what>", or, where the damage stops the
    # check itself, "it is not a usable SQLite database: <SQLite's error>".
    assert str(failed.value).startswith(f"the database {db} is damaged: it ")
    assert str(failed.value).endswith(
        ". No backup was written; the last good ones are kept"
        " (see /usr/share/doc/toko/docs/how-to/damaged-database.md)"
    )
    assert backup.list_backups(folder) == [good]
    assert sorted(os.listdir(folder)) == [".toko-backup.lock", good.name]
