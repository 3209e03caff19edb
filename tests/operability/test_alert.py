"""toko-alert: a failed unit leaves an error entry and an email that toko-api sends."""

from __future__ import annotations

import configparser
import re
import shlex
from pathlib import Path

from service.store.sqlite import SqliteStore
from tests.conftest import ServiceFactory
from tests.operability.cli import run
from tests.support import db
from tests.support.smtp import SmtpServer

UNITS = Path(__file__).resolve().parents[2] / "deploy" / "systemd"


async def test_alert_is_logged_and_mailed(
    service_factory: ServiceFactory, smtp: SmtpServer
) -> None:
    svc = service_factory({"TOKO_SMTP_URL": smtp.url, "TOKO_ADMIN_EMAIL": "bos@toko.test"}).start()
    await svc.async_wait_ready(timeout=20)
    result = await run(
        "toko-alert",
        "--result=exit-code",
        "--exit-code=exited",
        "--exit-status=1",
        "toko-backup.service",
        env={"TOKO_DATABASE": str(svc.database)},
    )
    assert result.returncode == 0, result
    (entry,) = [r for r in result.log_records() if r["level"] == "ERROR"]
    assert entry["UNIT"] == "toko-backup.service"
    assert entry["message"] == "toko-backup.service failed"
    assert entry["SERVICE_RESULT"] == "exit-code"

    # Queued by another process: the running toko-api finds it at its sweep.
    await smtp.async_wait_delivered(1, timeout=15)
    (mail,) = smtp.delivered()
    assert mail.subject == "toko: toko-backup.service failed"
    assert mail.to == ("bos@toko.test",)
    body = mail.headers.get_body(("plain",))
    assert body is not None
    text = body.get_content()
    assert "journalctl -u toko-backup.service" in text and "exit-code" in text
    (job,) = db.jobs(svc.database)
    assert job["kind"] == "alert_email"


async def test_alert_logs_even_when_the_store_is_unusable(tmp_path: Path) -> None:
    database = tmp_path / "toko.db"
    database.write_bytes(b"not a database " * 100)
    result = await run("toko-alert", "toko-recap.service", env={"TOKO_DATABASE": str(database)})
    assert result.returncode == 1
    errors = [r for r in result.log_records() if r["level"] == "ERROR"]
    assert errors[0]["UNIT"] == "toko-recap.service"  # the journal entry came first
    assert "could not queue the alert email" in result.stderr


async def test_alert_logs_even_when_the_settings_are_invalid(tmp_path: Path) -> None:
    # toko.env edited badly: toko-recap failed on it, and toko-alert reads it too.
    database = tmp_path / "toko.db"
    store = SqliteStore(str(database))
    await store.open()
    await store.close()
    result = await run(
        "toko-alert",
        "--result=exit-code",
        "--exit-code=exited",
        "--exit-status=2",
        "toko-recap.service",
        env={"TOKO_DATABASE": str(database), "TOKO_JOB_RETENTION": "30m"},
    )
    assert result.returncode == 2, result
    assert result.stderr.splitlines() == [
        "toko-alert: could not queue the alert email for toko-recap.service: "
        "TOKO_JOB_RETENTION must be a duration of at least 1h, like 12h or 7d, got '30m'"
    ]
    entry, failed = result.log_records()
    assert entry["level"] == "ERROR" and entry["message"] == "toko-recap.service failed"
    fields = {k: v for k, v in entry.items() if k.isupper()}
    assert fields == {
        "UNIT": "toko-recap.service",
        "SERVICE_RESULT": "exit-code",
        "EXIT_CODE": "exited",
        "EXIT_STATUS": "2",
    }
    assert failed["level"] == "ERROR" and "TOKO_JOB_RETENTION" in failed["message"], failed
    assert db.jobs(database) == []


async def test_alert_refuses_a_database_that_does_not_exist(tmp_path: Path) -> None:
    database = tmp_path / "var" / "toko.db"
    result = await run("toko-alert", "toko-recap.service", env={"TOKO_DATABASE": str(database)})
    assert result.returncode == 1, result
    (line,) = result.stderr.splitlines()
    assert line.startswith(
        f"toko-alert: could not queue the alert email for toko-recap.service: no database at "
        f"{database} "
    ), line
    records = result.log_records()
    assert [r["level"] for r in records] == ["ERROR", "ERROR"], records
    assert records[0]["UNIT"] == "toko-recap.service"  # the journal entry came first
    # Created, it would have taken an email that toko-api never sends.
    assert not database.parent.exists()


async def test_a_unit_named_with_a_leading_dash_reaches_the_alert(tmp_path: Path) -> None:
    # The command line toko-alert@.service runs for the root file system's
    # -.mount, MONITOR_* unset (as systemd before 251 leaves them).
    (exec_start,) = [
        line.removeprefix("ExecStart=")
        for line in (UNITS / "toko-alert@.service").read_text().splitlines()
        if line.startswith("ExecStart=")
    ]
    command, *args = shlex.split(re.sub(r"\$\{\w+\}", "", exec_start.replace("%i", "-.mount")))
    assert command == "/usr/bin/toko-alert"
    database = tmp_path / "toko.db"
    store = SqliteStore(str(database))
    await store.open()
    await store.close()
    result = await run("toko-alert", *args, env={"TOKO_DATABASE": str(database)})
    assert result.returncode == 0, result
    (entry,) = [r for r in result.log_records() if r["level"] == "ERROR"]
    assert entry["UNIT"] == "-.mount" and entry["message"] == "-.mount failed"
    (job,) = db.jobs(database)
    assert job["kind"] == "alert_email"


def test_alert_unit_matches_the_timer_jobs() -> None:
    def service_section(name: str) -> dict[str, list[str]]:
        options: dict[str, list[str]] = {}
        section = None
        for raw in (UNITS / name).read_text().splitlines():
            line = raw.strip()
            if line.startswith("["):
                section = line
            elif section == "[Service]" and line and not line.startswith("#"):
                key, _, value = line.partition("=")
                options.setdefault(key, []).append(value)
        return options

    alert = service_section("toko-alert@.service")
    backup = service_section("toko-backup.service")
    assert alert["Type"] == ["oneshot"]
    assert "%i" in alert["ExecStart"][0] and "toko-alert" in alert["ExecStart"][0]
    for key in ("User", "Group", "EnvironmentFile", "StateDirectory", "UMask"):
        assert alert[key] == backup[key], key
    not_hardening = {"ExecStart", "Type", "TimeoutStartSec", "Nice", "IOSchedulingClass"}
    not_hardening |= {"IOSchedulingPriority", "ReadWritePaths", "OnFailure"}
    hardening = {k: v for k, v in backup.items() if k not in not_hardening}
    assert {k: alert.get(k) for k in hardening} == hardening
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string((UNITS / "toko-alert@.service").read_text())
    assert "OnFailure" not in parser["Unit"]  # an alert about an alert would loop
