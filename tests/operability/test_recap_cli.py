"""toko-recap as an admin runs it: a wrong TOKO_DATABASE fails, it creates nothing."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path

from service.store.sqlite import SqliteStore
from tests.operability.cli import run
from tests.support import db


async def test_recap_refuses_a_database_that_does_not_exist(tmp_path: Path) -> None:
    database = tmp_path / "var" / "toko.db"
    result = await run("toko-recap", env={"TOKO_DATABASE": str(database)})
    assert result.returncode == 1, result
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"toko-recap: no database at {database} ") and "TOKO_DATABASE" in line
    # Creating it would have recorded a recap of 0 products that toko-api never sends.
    assert not database.parent.exists()


async def test_recap_refuses_a_day_that_has_not_ended(tmp_path: Path) -> None:
    database = tmp_path / "toko.db"
    store = SqliteStore(str(database))
    await store.open()
    await store.close()
    now = datetime.now(UTC)
    to_midnight = datetime.combine(now.date() + timedelta(days=1), datetime.min.time(), UTC) - now
    if to_midnight < timedelta(seconds=10):  # "today" must stay today while the run starts
        await asyncio.sleep(to_midnight.total_seconds() + 0.5)
    today = datetime.now(UTC).date()
    env = {"TOKO_DATABASE": str(database), "TZ": "UTC"}
    for day in (today, today + timedelta(days=1)):
        result = await run("toko-recap", "--period", day.isoformat(), env=env)
        assert result.returncode == 1, result
        (line,) = result.stderr.splitlines()
        assert line == (
            f"toko-recap: {day} has not ended yet (today is {today} here);"
            f" recap it from {day + timedelta(days=1)} on"
        ), line
    # Partial figures recorded now would make the real run say "already recorded".
    assert db.query(database, "SELECT * FROM recaps") == []
