"""A database outside the folder the units may write in: one line, exit 2.

Under its units toko may write only in /var/lib/toko (ProtectSystem=strict).
A TOKO_DATABASE elsewhere, without a ReadWritePaths= drop-in, is a read-only
folder to toko; here a real read-only tmpfs stands in for it (root).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.store.sqlite import SqliteStore
from tests.operability.cli import mount_tmpfs, run

pytestmark = pytest.mark.root


@pytest.fixture
def read_only_folder(tmp_path: Path) -> Iterator[Path]:
    """A folder holding a toko database, read-only as the units make /srv."""
    yield from mount_tmpfs(tmp_path / "srv", "size=1m")


async def new_database(folder: Path) -> Path:
    """A toko database in ``folder``."""
    database = folder / "toko.db"
    store = SqliteStore(str(database))
    await store.open()
    await store.close()
    return database


async def remount_read_only(folder: Path) -> None:
    remount = await asyncio.create_subprocess_exec("mount", "-o", "remount,ro", str(folder))
    assert await remount.wait() == 0


async def moved_database(folder: Path) -> Path:
    database = await new_database(folder)
    await remount_read_only(folder)
    return database


def expected_line(folder: Path) -> str:
    return (
        f"TOKO_DATABASE names a file in {folder}, which is read-only here: toko's units "
        f"may write only in /var/lib/toko unless a drop-in adds ReadWritePaths={folder} "
        "(see /usr/share/doc/toko/docs/how-to/database-elsewhere.md)"
    )


async def test_toko_api_names_the_setting_and_the_drop_in_and_exits_2(
    read_only_folder: Path,
) -> None:
    # It said "cannot use ...: [Errno 30] Read-only file system: '....lock'" and
    # exited 1, which Restart=on-failure retried until systemd gave up.
    database = await moved_database(read_only_folder)
    result = await run("toko-api", env={"TOKO_DATABASE": str(database)})
    assert result.returncode == 2, result  # RestartPreventExitStatus=2: no retries
    assert result.stderr.splitlines() == [f"toko-api: {expected_line(read_only_folder)}"]
    # A folder not there yet, below a read-only one, is named the same way.
    below = read_only_folder / "shop"
    result = await run("toko-api", env={"TOKO_DATABASE": str(below / "toko.db")})
    assert result.returncode == 2, result
    assert result.stderr.splitlines() == [f"toko-api: {expected_line(below)}"]


async def test_the_timer_jobs_say_the_same_at_error_priority(read_only_folder: Path) -> None:
    database = await moved_database(read_only_folder)
    line = expected_line(read_only_folder)
    for job in ("toko-recap", "toko-backup"):
        result = await run(job, env={"TOKO_DATABASE": str(database)})
        assert result.returncode == 2, result
        assert result.stderr.splitlines() == [f"{job}: {line}"]
        (record,) = result.log_records()
        assert (record["level"], record["message"]) == ("ERROR", f"{job} failed: {line}")
    alert = await run(
        "toko-alert",
        "--result=exit-code",
        "--exit-code=exited",
        "--exit-status=2",
        "toko-recap.service",
        env={"TOKO_DATABASE": str(database)},
    )
    assert alert.returncode == 2, alert
    assert alert.stderr.splitlines() == [
        f"toko-alert: could not queue the alert email for toko-recap.service: {line}"
    ]


async def test_a_symbolic_link_in_a_read_only_folder_to_a_writable_database_is_used(
    read_only_folder: Path, tmp_path: Path
) -> None:
    # SQLite writes its -wal and -shm, and toko its lock file, beside the file
    # the link points to: that folder is the one that must be writable. Judged
    # by the link's folder, toko-api and the commands refused a set-up that
    # works (exit 2).
    (tmp_path / "data").mkdir()
    real = await new_database(tmp_path / "data")
    link = read_only_folder / "toko.db"
    link.symlink_to(real)
    await remount_read_only(read_only_folder)
    result = await run("toko-api", "--check-config", env={"TOKO_DATABASE": str(link)})
    assert result.returncode == 0, result
    stats = await run("toko-queue", "stats", env={"TOKO_DATABASE": str(link)})
    assert stats.returncode == 0, stats
