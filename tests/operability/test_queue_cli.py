"""toko-queue against a real store while a real toko-api and SMTP server run."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from jobs import queue_admin
from service import __version__, env_file
from service.models import NewJob
from service.store.sqlite import SqliteStore
from service.store.sqlite.migrations import LATEST_VERSION
from tests.conftest import ServiceFactory
from tests.operability.cli import BIN, environment, run
from tests.support import db
from tests.support.api import create_products
from tests.support.old_schema import make_sqlite_at
from tests.support.smtp import SmtpServer


async def create_database(database: Path) -> None:
    """An empty, migrated database, as toko-api leaves it after its first start."""
    store = SqliteStore(str(database))
    await store.open()
    await store.close()


def logged(message: str, count: int) -> Any:
    def predicate(records: Sequence[dict[str, Any]]) -> bool:
        return sum(r.get("message") == message for r in records) >= count

    return predicate


async def test_retry_all_failed_gets_them_delivered(
    service_factory: ServiceFactory, smtp: SmtpServer
) -> None:
    smtp.refuse_subject("Gagal")
    svc = service_factory({"TOKO_SMTP_URL": smtp.url, "TOKO_JOB_MAX_ATTEMPTS": "2"}).start()
    await svc.async_wait_ready(timeout=20)
    env = {"TOKO_DATABASE": str(svc.database)}
    async with aiohttp.ClientSession() as session:
        await create_products(session, svc.base_url, ["Gagal 1", "Gagal 2", "Gagal 3", "Teh"])
    await svc.logs.async_wait_for(
        logged("job failed permanently", 3), timeout=30, what="3 failed jobs"
    )
    await smtp.async_wait_delivered(1, timeout=10)  # "Teh" went through

    stats = await run("toko-queue", "stats", "--json", env=env)
    assert stats.returncode == 0, stats
    assert stats.json()["queue"]["failed"] == 3
    assert stats.json()["by_kind"]["product_email"]["failed"] == 3

    listed = await run("toko-queue", "list", "--state", "failed", "--json", env=env)
    failed = listed.json()
    assert len(failed) == 3
    assert {job["payload"]["nama"] for job in failed} == {"Gagal 1", "Gagal 2", "Gagal 3"}
    assert all(job["attempts"] == 2 and "550" in job["last_error"] for job in failed)
    failed_ids = sorted(job["id"] for job in failed)

    table = await run("toko-queue", "list", "--state", "failed", env=env)
    assert table.returncode == 0
    header, *rows = table.stdout.splitlines()
    assert header.split()[:4] == ["ID", "KIND", "STATE", "ATTEMPTS"]
    assert len(rows) == 3 and all("SMTP 550" in row for row in rows), table.stdout

    shown = await run("toko-queue", "show", str(failed_ids[0]), env=env)
    assert shown.returncode == 0
    assert "state         failed" in shown.stdout and "Gagal" in shown.stdout

    smtp.reset()  # the mail server takes them now
    retried = await run("toko-queue", "retry", "--all-failed", "--json", env=env)
    assert retried.returncode == 0, retried
    assert retried.json() == {"retried": failed_ids}
    # The running toko-api picks them up at its next sweep (no wake-up across processes).
    delivered = await smtp.async_wait_delivered(4, timeout=15)
    refused = {m.message_id for m in smtp.messages("refused")}
    assert refused <= delivered  # the same Message-IDs, now delivered
    assert len(refused) == 3

    svc.terminate()  # the drain writes every pending ack before exit
    assert await svc.async_wait_exit(15) == 0
    for job in db.jobs(svc.database):
        assert job["state"] == "done", job
        if job["id"] in failed_ids:
            assert job["attempts"] == 1, job  # a fresh budget: one attempt since the retry

    again = await run("toko-queue", "retry", str(failed_ids[0]), env=env)
    assert again.returncode == 1
    assert f"job {failed_ids[0]} is" in again.stderr and "not failed" in again.stderr


async def test_retry_all_waiting_sends_now_what_waits_for_its_next_attempt(
    service_factory: ServiceFactory, smtp: SmtpServer
) -> None:
    smtp.fail_next(3)  # a short mail outage: each first attempt gets a 451
    svc = service_factory({"TOKO_SMTP_URL": smtp.url, "TOKO_JOB_BACKOFF": "600"}).start()
    await svc.async_wait_ready(timeout=20)
    env = {"TOKO_DATABASE": str(svc.database)}
    async with aiohttp.ClientSession() as session:
        await create_products(session, svc.base_url, ["Tunggu 1", "Tunggu 2", "Tunggu 3"])
    await svc.logs.async_wait_for(
        logged("job failed, will retry", 3), timeout=20, what="3 retries scheduled"
    )
    # Their next attempts are 5 to 10 minutes away; the server is back already.
    listed = await run("toko-queue", "list", "--state", "pending", "--json", env=env)
    assert [job["attempts"] for job in listed.json()] == [1, 1, 1], listed.json()
    waiting = sorted(job["id"] for job in listed.json())
    table = await run("toko-queue", "list", "--state", "pending", env=env)
    header, *rows = table.stdout.splitlines()
    assert header.split()[4:6] == ["UPDATED", "DUE"], header
    # DUE is the next attempt's time (ISO, UTC), after UPDATED: the backoff.
    assert all(row.split()[5] > row.split()[4] for row in rows), table.stdout

    retried = await run("toko-queue", "retry", "--all-waiting", "--json", env=env)
    assert retried.returncode == 0, retried
    assert retried.json() == {"retried": waiting}
    delivered = await smtp.async_wait_delivered(3, timeout=15)
    assert {m.message_id for m in smtp.messages("tempfailed")} == delivered
    assert db.job_states(svc.database).get("pending", 0) == 0


async def test_purge_keeps_recent_done_jobs(
    service_factory: ServiceFactory, smtp: SmtpServer
) -> None:
    svc = service_factory({"TOKO_SMTP_URL": smtp.url}).start()
    await svc.async_wait_ready(timeout=20)
    env = {"TOKO_DATABASE": str(svc.database)}
    async with aiohttp.ClientSession() as session:
        await create_products(session, svc.base_url, ["A", "B"])
    await smtp.async_wait_delivered(2, timeout=15)
    svc.terminate()  # so every ack is written before we count
    assert await svc.async_wait_exit(15) == 0
    assert db.job_states(svc.database) == {"done": 2}

    kept = await run("toko-queue", "purge", "--done-older-than", "7d", "--json", env=env)
    assert kept.returncode == 0 and kept.json()["purged"] == 0
    assert db.job_states(svc.database) == {"done": 2}
    purged = await run("toko-queue", "purge", "--done-older-than", "0s", env=env)
    assert purged.returncode == 0 and purged.stdout.startswith("purged 1 done job(s)")
    assert db.job_states(svc.database) == {"done": 1}  # the newest: its id is not reused
    assert db.product_count(svc.database) == 2  # products are never pruned


async def test_list_and_show_escape_control_characters(tmp_path: Path) -> None:
    # An error text as a mail server sent it, stored before toko escaped such
    # text (or by another toko): printed raw, it would retitle or clear the
    # admin's terminal.
    database = tmp_path / "toko.db"
    store = SqliteStore(str(database))
    await store.open()
    try:
        job_id = await store.enqueue(NewJob("email", {}, 1))
        (job,) = await store.claim(1, 60)
        await store.fail(job, "550 \x1b]0;pwned\x07\x1b[2J gone")
    finally:
        await store.close()
    env = {"TOKO_DATABASE": str(database)}
    for args in (("list", "--state", "failed"), ("show", str(job_id))):
        shown = await run("toko-queue", *args, env=env)
        assert shown.returncode == 0, shown
        assert "\x1b" not in shown.stdout and "\x07" not in shown.stdout
        assert "\\x1b]0;pwned\\x07" in shown.stdout, shown.stdout


def read_then_close(fd: int, lines: int) -> list[bytes]:
    with open(fd, "rb") as reader:
        return [reader.readline() for _ in range(lines)]


async def queue_into_closed_pipe(env: dict[str, str], *args: str, keep: int) -> tuple[int, str]:
    """``toko-queue args | head -<keep>``: the exit status and stderr.

    With ``keep=0`` the pipe has no reader from the start, as after a ``head``
    that read its lines before the command wrote.
    """
    read_end, write_end = os.pipe()
    if keep == 0:
        os.close(read_end)
    try:
        proc = await asyncio.create_subprocess_exec(
            str(BIN / "toko-queue"),
            *args,
            env=environment(env),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=write_end,
            stderr=asyncio.subprocess.PIPE,
        )
    finally:
        os.close(write_end)
    if keep:
        kept = await asyncio.to_thread(read_then_close, read_end, keep)
        assert kept[0].startswith(b"ID "), kept
    async with asyncio.timeout(30):
        _, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, err.decode()


async def test_output_into_a_pipe_closed_early_ends_quietly(tmp_path: Path) -> None:
    database = tmp_path / "toko.db"
    store = SqliteStore(str(database))
    await store.open()
    try:
        # More than a pipe holds (64 KiB), so the write fails while printing.
        await asyncio.gather(*(store.enqueue(NewJob("email", {}, 1)) for _ in range(2000)))
    finally:
        await store.close()
    env = {"TOKO_DATABASE": str(database)}
    listing = ("list", "--state", "pending", "--limit", "10000")
    # No traceback, no "Exception ignored": exit 1 as Python's own for EPIPE.
    assert await queue_into_closed_pipe(env, *listing, keep=2) == (1, "")
    assert await queue_into_closed_pipe(env, "stats", keep=0) == (1, "")


async def test_usage_errors_and_env_file(tmp_path: Path) -> None:
    version = await run("toko-queue", "--version")
    assert version.returncode == 0 and __version__ in version.stdout
    helped = await run("toko-queue", "--help")
    assert helped.returncode == 0
    for command in ("stats", "list", "show", "retry", "purge"):
        assert command in helped.stdout

    bad_age = await run("toko-queue", "purge", "--done-older-than", "7x")
    assert bad_age.returncode == 2 and "7x" in bad_age.stderr
    # Its cutoff would be before year 1: a traceback (date out of range) it was.
    too_old = await run("toko-queue", "purge", "--done-older-than", "99999999999999999999d")
    assert too_old.returncode == 2 and "Traceback" not in too_old.stderr, too_old
    assert too_old.stderr.splitlines()[-1].endswith(
        "'99999999999999999999d' must be a duration of at most 36500d (a century)"
    ), too_old.stderr
    for command in ("show", "retry"):
        huge = await run("toko-queue", command, "99999999999999999999999")
        assert huge.returncode == 2 and "not a job id" in huge.stderr, huge
    missing = await run("toko-queue", "stats", env={"TOKO_DATABASE": str(tmp_path / "no.db")})
    assert missing.returncode == 1 and "no database at" in missing.stderr
    assert not (tmp_path / "no.db").exists()  # looking must not create one

    # The installed service's settings come from its env file, as under systemd.
    database = tmp_path / "state" / "toko.db"
    env_file = tmp_path / "toko.env"
    env_file.write_text(f'# comment\n\nTOKO_DATABASE="{database}"\nTOKO_WORKERS=2\n')
    recap_env = {"TOKO_DATABASE": str(database)}
    await create_database(database)
    created = await run("toko-recap", "--period", "2026-01-01", env=recap_env)
    assert created.returncode == 0, created
    from_file = await run("toko-queue", "--env-file", str(env_file), "stats", "--json")
    assert from_file.returncode == 0, from_file
    assert from_file.json()["by_kind"] == {
        "recap_email": {"pending": 1, "running": 0, "done": 0, "failed": 0}
    }
    broken = tmp_path / "broken.env"
    broken.write_text("TOKO_DATABASE\n")
    refused = await run("toko-queue", "--env-file", str(broken), "stats")
    assert refused.returncode == 2 and "broken.env:1" in refused.stderr


async def test_an_env_file_that_is_not_utf8_is_bad_configuration(tmp_path: Path) -> None:
    # Saved by an editor in Latin-1: an é in the sender's address.
    env_file = tmp_path / "toko.env"
    env_file.write_bytes(b"TOKO_WORKERS=2\nTOKO_MAIL_FROM=caf\xe9@toko.test\n")
    refused = await run("toko-queue", "--env-file", str(env_file), "stats")
    assert refused.returncode == 2, refused
    assert refused.stderr.splitlines() == [
        f"toko-queue: {env_file}:2: not UTF-8 text (byte 33 of the file); save it as UTF-8"
    ]


def test_without_the_env_file_the_installed_database_is_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Installed, but /etc/toko/toko.env removed (the units read it only if it
    # is there): toko-api keeps its database in its state directory.
    state = tmp_path / "var-lib-toko"
    state.mkdir()

    async def queue_one() -> None:
        store = SqliteStore(str(state / "toko.db"))
        await store.open()
        try:
            await store.enqueue(NewJob("email", {}, 1))
        finally:
            await store.close()

    asyncio.run(queue_one())
    monkeypatch.setattr(env_file, "DEFAULT_ENV_FILE", tmp_path / "toko.env")
    monkeypatch.setattr(env_file, "INSTALLED_STATE_DIRECTORY", str(state))
    for name in [n for n in os.environ if n.startswith("TOKO_")] + ["STATE_DIRECTORY"]:
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # an admin's shell, in their home
    assert queue_admin.main(["stats", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["by_kind"]["email"]["pending"] == 1, stats

    # A development machine, with no installed state directory: ./var as before.
    monkeypatch.setattr(env_file, "INSTALLED_STATE_DIRECTORY", str(tmp_path / "not-installed"))
    assert queue_admin.main(["stats"]) == 1
    assert capsys.readouterr().err.startswith("toko-queue: no database at var/toko.db ")


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can hand a file to another user")
@pytest.mark.parametrize(
    "command",
    [
        ["toko-queue", "stats"],
        ["toko-recap", "--period", "2026-01-02"],
        ["toko-backup"],
        ["toko-alert", "toko-backup.service"],
    ],
)
async def test_root_is_refused_on_the_service_users_database(
    tmp_path: Path, command: list[str]
) -> None:
    # A file root leaves beside it (a -wal/-shm after a crash, the backup
    # folder or its lock) is one toko-api or the nightly backup cannot open.
    database = tmp_path / "toko.db"
    env = {"TOKO_DATABASE": str(database)}
    await create_database(database)
    created = await run("toko-recap", "--period", "2026-01-01", env=env)
    assert created.returncode == 0, created
    os.chown(database, 65534, 65534)  # as if toko-api's user owned it
    before = sorted(os.listdir(tmp_path))
    refused = await run(*command, env=env)
    assert refused.returncode == 1
    user = pwd.getpwuid(65534).pw_name
    if command[0] == "toko-queue":  # it reads toko.env itself, so sudo -u keeps the settings
        hint = f"run as the database's owner, not root: sudo -u {user} toko-queue ..."
    else:
        hint = (
            f"run as the database's owner ({user}) with the service's settings, not as root:"
            " through systemd-run, as the toko helper of"
            " /usr/share/doc/toko/docs/how-to/run-commands.md does"
        )
    assert refused.stderr == f"{command[0]}: {hint}\n"
    assert sorted(os.listdir(tmp_path)) == before  # no -wal, no backups/


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can hand a file to another user")
async def test_root_is_refused_a_restore_into_the_service_users_folder(tmp_path: Path) -> None:
    saved = tmp_path / "saved.db"
    await create_database(saved)
    folder = tmp_path / "state"
    folder.mkdir()
    os.chown(folder, 65534, 65534)  # StateDirectory=, before toko-api ever ran
    env = {"TOKO_DATABASE": str(folder / "toko.db")}
    refused = await run("toko-backup", "--restore", str(saved), env=env)
    assert refused.returncode == 1
    assert "run as the database's owner (" in refused.stderr
    assert os.listdir(folder) == []


def test_a_schema_upgrade_it_applies_is_said_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # toko-queue run after an upgrade, before toko-api restarts, migrates the
    # database itself: toko-api then finds nothing to migrate, and says nothing.
    database = tmp_path / "toko.db"
    make_sqlite_at(str(database), LATEST_VERSION - 1)
    monkeypatch.setenv("TOKO_DATABASE", str(database))
    assert queue_admin.main(["--no-env-file", "stats", "--json"]) == 0
    out, err = capsys.readouterr()
    assert err == (
        f"toko-queue: database schema upgraded from version {LATEST_VERSION - 1}"
        f" to {LATEST_VERSION}\n"
    )
    assert json.loads(out)["queue"]["pending"] == 0  # the answer alone on stdout
    assert queue_admin.main(["--no-env-file", "stats"]) == 0
    assert capsys.readouterr().err == ""


async def test_retrying_many_jobs_prints_a_few_ids_and_a_count(tmp_path: Path) -> None:
    # After a long mail outage --all-failed may retry hundreds of thousands.
    database = tmp_path / "toko.db"
    store = SqliteStore(str(database))
    await store.open()
    try:
        many = queue_admin.IDS_SHOWN + 5
        for _ in range(many):
            await store.enqueue(NewJob("email", {}, 1))
        for job in await store.claim(many, 60):
            await store.fail(job, "550 no such user")
    finally:
        await store.close()
    env = {"TOKO_DATABASE": str(database)}
    retried = await run("toko-queue", "retry", "--all-waiting", env=env)
    assert retried.stdout == "retried 0 waiting job(s)\n", retried
    retried = await run("toko-queue", "retry", "--all-failed", env=env)
    assert retried.returncode == 0, retried
    shown = ", ".join(str(n) for n in range(1, queue_admin.IDS_SHOWN + 1))
    assert retried.stdout == (
        f"retried {many} failed job(s): {shown} and 5 more (--json lists every id)\n"
    ), retried
    assert db.job_states(database) == {"pending": many}


async def test_a_typo_in_the_env_file_is_warned_about_on_stderr(tmp_path: Path) -> None:
    database = tmp_path / "toko.db"
    await create_database(database)
    settings = tmp_path / "toko.env"
    settings.write_text(f"TOKO_DATABASE={database}\nTOKO_WORKER=8\n")
    result = await run("toko-queue", "--env-file", str(settings), "stats", "--json")
    assert result.returncode == 0, result
    assert result.stderr.splitlines() == [
        "toko-queue: warning: unknown settings ignored: 'TOKO_WORKER' (meant TOKO_WORKERS?) "
        "(man toko.env lists the known ones)"
    ]
    assert result.json()["by_kind"] == {}
