"""toko-recap as an admin runs it: a wrong TOKO_DATABASE fails, it creates nothing."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from service.store.sqlite import SqliteStore
from tests.operability.cli import run, utc_today
from tests.support import db


async def test_recap_refuses_a_database_that_does_not_exist(tmp_path: Path) -> None:
    database = tmp_path / "var" / "toko.db"
    result = await run("toko-recap", env={"TOKO_DATABASE": str(database)})
    assert result.returncode == 1, result
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"toko-recap: no database at {database} ") and "TOKO_DATABASE" in line
    # Creating it would have recorded a recap of 0 products that toko-api never sends.
    assert not database.parent.exists()


async def test_bad_settings_are_logged_at_error_priority(tmp_path: Path) -> None:
    database = tmp_path / "toko.db"
    await new_database(database)
    env = {"TOKO_DATABASE": str(database), "TOKO_JOB_RETENTION": "30m"}
    result = await run("toko-recap", env=env)
    assert result.returncode == 2, result
    expected = "TOKO_JOB_RETENTION must be a duration of at least 1h, like 12h or 7d, got '30m'"
    assert result.stderr.splitlines() == [f"toko-recap: {expected}"]
    # Under systemd the stderr line is an info-priority entry: logged, so that
    # `journalctl -p err` shows it.
    (record,) = result.log_records()
    assert record["level"] == "ERROR", record
    assert record["message"] == f"toko-recap failed: {expected}", record


async def new_database(path: Path) -> None:
    store = SqliteStore(str(path))
    await store.open()
    await store.close()


async def test_recap_refuses_a_day_that_has_not_ended(tmp_path: Path) -> None:
    database = tmp_path / "toko.db"
    await new_database(database)
    today = await utc_today()
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


async def test_a_period_at_the_ends_of_the_calendar_is_a_usage_error(tmp_path: Path) -> None:
    # The first day has no local midnight before it to start from, the last
    # no day after it to end at: both ended in a traceback.
    database = tmp_path / "toko.db"
    await new_database(database)
    env = {"TOKO_DATABASE": str(database), "TZ": "UTC"}
    for day in ("0001-01-01", "9999-12-31"):
        result = await run("toko-recap", "--period", day, env=env)
        assert result.returncode == 2, result
        assert result.stderr.splitlines()[-1] == (
            f"toko-recap: error: argument --period: out of range: '{day}'"
        ), result.stderr
        assert "Traceback" not in result.stderr
    assert db.query(database, "SELECT * FROM recaps") == []


async def test_recap_catches_up_the_days_since_the_last_one_recorded(tmp_path: Path) -> None:
    database = tmp_path / "toko.db"
    await new_database(database)
    today = await utc_today()
    env = {"TOKO_DATABASE": str(database), "TZ": "UTC"}
    days = [(today - timedelta(days=n)).isoformat() for n in (4, 3, 2, 1)]
    assert (await run("toko-recap", "--period", days[0], env=env)).returncode == 0
    # The host was off for three days: the timer's one catch-up run.
    result = await run("toko-recap", env=env)
    assert result.returncode == 0, result
    said = [(r["message"], r.get("PERIOD")) for r in result.log_records() if "PERIOD" in r]
    assert said == [("recap recorded", day) for day in days[1:]], said
    recaps = db.query(database, "SELECT period FROM recaps ORDER BY period")
    assert [row["period"] for row in recaps] == days
    # The next run has nothing left to do.
    result = await run("toko-recap", env=env)
    said = [(r["message"], r.get("PERIOD")) for r in result.log_records() if "PERIOD" in r]
    assert said == [("recap already recorded for this period; nothing to do", days[-1])], said


async def test_an_unknown_setting_is_warned_about(tmp_path: Path) -> None:
    # toko.env is read by the timer jobs too: a typo there is named in their journal.
    database = tmp_path / "toko.db"
    await new_database(database)
    env = {"TOKO_DATABASE": str(database), "TOKO_JOB_RETENTON": "30d"}
    result = await run("toko-recap", env=env)
    assert result.returncode == 0, result
    warnings = [r for r in result.log_records() if r["level"] == "WARNING"]
    assert [r["message"] for r in warnings] == [
        "unknown settings ignored: 'TOKO_JOB_RETENTON' (meant TOKO_JOB_RETENTION?) "
        "(man toko.env lists the known ones)"
    ]
